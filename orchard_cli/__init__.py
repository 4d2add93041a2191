"""The `orchard` command line: Typer + Rich over the orchard_env, provision and images libraries."""

CLI_ERROR = 125  # an error of the CLI itself (docker's code): never a remote command's


def version_line() -> str:
    from orchard_env import __version__

    return f"orchard {__version__}\n"
