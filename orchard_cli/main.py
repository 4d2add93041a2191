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
    pool,
    sandbox,
    service,
    smoke,
    snapshot,
)
from orchard_cli.console import err
from orchard_env import __version__
from orchard_env.errors import OrchardError

app = typer.Typer(
    name="orchard",
    help="Sandboxes for training and evaluating AI agents.",
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
app.add_typer(pool.app, name="pool", rich_help_panel="Sandboxes")
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


def main() -> None:
    """Entry point: user mistakes print a message and a hint, never a traceback."""
    debug = os.environ.get("ORCHARD_DEBUG") == "1"
    try:
        code = app(standalone_mode=False)
    except OrchardError as exc:
        if debug:
            raise
        err.print(Text.assemble(("Error: ", "bold red"), exc.message))
        if exc.hint:
            err.print(Text.assemble(("Hint: ", "dim"), exc.hint))
        sys.exit(1)
    except (typer.Abort, KeyboardInterrupt):
        err.print("Interrupted.")
        sys.exit(130)
    except typer.exceptions.TyperException as exc:  # usage errors (typer's vendored click)
        show = getattr(exc, "show", None)
        if callable(show):
            show()
        sys.exit(int(getattr(exc, "exit_code", 2)))
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
