"""`orchard up | down | status | serve`: the service's lifecycle."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from orchard_cli.console import JsonOpt, YesOpt, confirm, err, out, print_json
from orchard_env.config import service_settings
from provision.base import check_target
from provision.local import DEFAULT_CONTEXT, LocalProvider

PANEL = "Service"

TargetOpt = Annotated[
    str, typer.Option("--target", "-t", help="Where Orchard runs: local (this machine's engine).")
]
PortOpt = Annotated[int | None, typer.Option("--port", help="Port of the local orchestrator.")]
StateDirOpt = Annotated[
    str | None, typer.Option("--state-dir", help="State directory (database, logs, sandbox dirs).")
]
ContextNameOpt = Annotated[
    str, typer.Option("--context", help="Name of the CLI context to write or use.")
]


def _provider(target: str, port: int | None, state_dir: str | None, context: str) -> LocalProvider:
    check_target(target)
    return LocalProvider(service_settings(port=port, state_dir=state_dir), context=context)


def up(
    target: TargetOpt = "local",
    port: PortOpt = None,
    state_dir: StateDirOpt = None,
    context: ContextNameOpt = DEFAULT_CONTEXT,
    smoke: Annotated[
        bool, typer.Option("--smoke/--no-smoke", help="Finish with the smoke test.")
    ] = True,
) -> None:
    """Stand Orchard up: provision, images, deploy, smoke. Safe to re-run."""
    provider = _provider(target, port, state_dir, context)
    with err.status("starting") as status:
        result = provider.up(lambda message: status.update(message), smoke=smoke)
    for stage in result.stages:
        mark = "[dim]=[/]" if stage.skipped else "[green]✓[/]"
        err.print(f"{mark} [bold]{stage.stage}[/]: {stage.summary}")
    err.print(f"\nOrchard is up at {result.url} (context {result.context!r}). Try:")
    err.print("  orchard sandbox create            # prints the new sandbox id")
    err.print("  orchard sandbox exec <id> -- uname -a")
    out.print(result.url)


def down(
    target: TargetOpt = "local",
    port: PortOpt = None,
    state_dir: StateDirOpt = None,
    context: ContextNameOpt = DEFAULT_CONTEXT,
    yes: YesOpt = False,
) -> None:
    """Stop the service and delete all of its sandboxes (the records stay)."""
    provider = _provider(target, port, state_dir, context)
    confirm(f"Stop Orchard ({target}) and delete all of its sandboxes?", yes=yes)
    with err.status("stopping") as status:
        provider.down(lambda message: status.update(message))
    err.print("[green]✓[/] Orchard is down.")


def status(
    target: TargetOpt = "local",
    port: PortOpt = None,
    state_dir: StateDirOpt = None,
    context: ContextNameOpt = DEFAULT_CONTEXT,
    json_: JsonOpt = False,
) -> None:
    """Show whether the service runs, where, and how many sandboxes it has."""
    state = _provider(target, port, state_dir, context).status()
    if json_:
        print_json(
            {"target": state.target, "running": state.running, "url": state.url, **state.detail}
        )
    else:
        table = Table(show_header=False, box=None)
        table.add_row("target", state.target)
        table.add_row("running", "[green]yes[/]" if state.running else "[red]no[/]")
        table.add_row("url", state.url or "-")
        for key, value in state.detail.items():
            table.add_row(key, value)
        out.print(table)
    if not state.running:
        raise typer.Exit(3)


def serve(
    host: Annotated[str | None, typer.Option("--host", help="Address to listen on.")] = None,
    port: PortOpt = None,
    state_dir: StateDirOpt = None,
) -> None:
    """Run the orchestrator in the foreground (what `orchard up` starts in the background)."""
    from orchard_env.orchestrator.server import serve as run_server

    run_server(service_settings(host=host, port=port, state_dir=state_dir))


def register(app: typer.Typer) -> None:
    for command in (up, down, status, serve):
        app.command(rich_help_panel=PANEL)(command)
