"""The `orchard` entry point and its one error boundary. The app itself (orchard_cli.app) is
imported here only when a command runs, so `orchard --version` starts no faster path than
the interpreter's own."""

from __future__ import annotations

import os
import sys
from typing import Any

from orchard_cli import CLI_ERROR, version_line


def __getattr__(name: str) -> Any:
    """``app`` (for tests and typer's doc generator) is built on first use."""
    if name == "app":
        from orchard_cli.app import app

        return app
    raise AttributeError(name)


def __dir__() -> list[str]:
    return [*globals(), "app"]


def _error(message: str, hint: str | None = None) -> None:
    from rich.text import Text

    from orchard_cli.console import err

    err.print(Text.assemble(("Error: ", "bold red"), message))
    if hint:
        err.print(Text.assemble(("Hint: ", "dim"), hint))


def main() -> None:
    """Entry point: user mistakes print a message and a hint, never a traceback; errors of
    the CLI itself exit 125 (docker's convention), so they never pass for a command's code."""
    if sys.argv[1:] == ["--version"]:  # the one answer that needs no command-line parser
        sys.stdout.write(version_line())
        sys.exit(0)
    completing = "_ORCHARD_COMPLETE" in os.environ
    if completing or sys.argv[1:3] == ["sandbox", "list"]:
        from orchard_cli import listing  # what TABs and scripts run most, without Typer

        if (
            listing.quick_completion(os.environ)
            if completing
            else listing.quick_sandbox_list(sys.argv[3:])
        ):
            sys.exit(0)
    import typer

    from orchard_cli.app import app
    from orchard_cli.console import err
    from orchard_env.errors import OrchardError

    debug = os.environ.get("ORCHARD_DEBUG") == "1"
    try:
        code = app(standalone_mode=False, prog_name="orchard")
    except OrchardError as exc:
        if debug:
            raise
        _error(exc.message, exc.hint)
        sys.exit(CLI_ERROR)
    except (typer.Abort, KeyboardInterrupt):
        err.print("Interrupted.")
        sys.exit(130)
    except typer.exceptions.TyperException as exc:  # usage errors (typer's vendored click)
        show = getattr(exc, "show", None)
        if callable(show):
            show()
        sys.exit(CLI_ERROR)
    except BrokenPipeError:  # stdout closed early (`| head`): stop quietly, like a pipe does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
    except OSError as exc:  # a local file or terminal the command needed
        if debug:
            raise
        where = f": {exc.filename}" if exc.filename else ""
        _error(f"{exc.strerror or exc}{where}", "check the path and its permissions")
        sys.exit(CLI_ERROR)
    except Exception as exc:  # a bug: still one line, the traceback on request
        if debug:
            raise
        _error(
            f"internal error: {type(exc).__name__}: {exc}",
            "rerun with ORCHARD_DEBUG=1 for the traceback, and report it",
        )
        sys.exit(CLI_ERROR)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
