"""Assembles the `orchard` app and owns the one error boundary."""

from __future__ import annotations

import os
import sys

import typer
from rich.text import Text

from orchard_cli import (
    bench,
    context,
    cost,
    deploy,
    images,
    init,
    keys,
    sandbox,
    service,
    smoke,
    snapshot,
)
from orchard_cli.console import CLI_ERROR, err
from orchard_env import __version__
from orchard_env.errors import OrchardError

EPILOG = "\n\n".join(
    (
        "Which service: every command acts on one context, chosen once: --context, else "
        "ORCHARD_CONTEXT, else the current context (`orchard context use`), else `local`; "
        "--url and --api-key (ORCHARD_URL, ORCHARD_API_KEY) override its parts. `up` writes "
        "a context but makes it the current one only with --use or when there is none yet.",
        "Exit codes: 0 success; `sandbox exec` and `shell` pass the remote command's code "
        "through, 124 when it timed out, 128+n when signal n killed it (137: SIGKILL); 125 an "
        "error of orchard itself (bad flag or value, unreachable service, unknown sandbox, "
        "refused confirmation), never a command's; 130 interrupted (Ctrl-C); 3 `status` of a "
        "service that is not running; 1 a check that failed (`smoke`, `sandbox patch`, a "
        "partial `fork`).",
        "Output: data on stdout, everything else on stderr; list and get commands take -o "
        "json|yaml|wide|name (and --json), list commands -q for ids only; tables are never "
        "truncated. NO_COLOR turns colours off.",
    )
)

app = typer.Typer(
    name="orchard",
    help="Sandboxes for training and evaluating AI agents.",
    epilog=EPILOG,
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
service.register(app)
deploy.register(app)
init.register(app)
app.add_typer(sandbox.app, name="sandbox", rich_help_panel="Sandboxes")
app.add_typer(snapshot.app, name="snapshot", rich_help_panel="Sandboxes")
app.add_typer(keys.app, name="keys", rich_help_panel="Service")
app.add_typer(context.app, name="context", rich_help_panel="Service")
app.add_typer(images.app, name="images", rich_help_panel="Service")
smoke.register(app)
app.add_typer(bench.app, name="bench", rich_help_panel="Checks")
app.add_typer(cost.app, name="cost", rich_help_panel="Cost")


def _version(value: bool) -> None:
    if value:
        sys.stdout.write(f"orchard {__version__}\n")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Sandboxes for training and evaluating AI agents."""


def _error(message: str, hint: str | None = None) -> None:
    err.print(Text.assemble(("Error: ", "bold red"), message))
    if hint:
        err.print(Text.assemble(("Hint: ", "dim"), hint))


def main() -> None:
    """Entry point: user mistakes print a message and a hint, never a traceback; errors of
    the CLI itself exit 125 (docker's convention), so they never pass for a command's code."""
    debug = os.environ.get("ORCHARD_DEBUG") == "1"
    try:
        code = app(standalone_mode=False)
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
