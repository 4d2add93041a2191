"""The console layer: data to stdout, everything else to stderr, shared option aliases."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from orchard_cli import CLI_ERROR as CLI_ERROR

if TYPE_CHECKING:
    from orchard_env.sdk import SandboxClient

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

ContextOpt = Annotated[
    str | None,
    typer.Option(
        "--context", help="Config context to use (default: the current one).", show_default=False
    ),
]
UrlOpt = Annotated[
    str | None,
    typer.Option(
        "--url",
        help="Orchestrator URL (overrides ORCHARD_URL and the context).",
        show_default=False,
    ),
]
ApiKeyOpt = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        help="API key (overrides ORCHARD_API_KEY and the context); prefer the env var.",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON to stdout instead of a table.")]
UseOpt = Annotated[
    bool,
    typer.Option(
        "--use",
        help="Make the context written the current one (`orchard context use`). Without it "
        "the current context changes only when there is none yet.",
    ),
]
OutputOpt = Annotated[
    str | None,
    typer.Option(
        "--output",
        "-o",
        help="Output format: json, yaml, wide (more columns) or name (KIND/ID per line).",
        show_default=False,
    ),
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Print only ids, one per line.")]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]
CpuOpt = Annotated[str | None, typer.Option("--cpu", help="CPU cores, e.g. 2 or 500m.")]
MemoryOpt = Annotated[str | None, typer.Option("--memory", help="Memory, e.g. 2Gi.")]


def confirm(question: str, *, yes: bool) -> None:
    """Ask before a destructive step; without a TTY, demand --yes instead of hanging."""
    if yes:
        return
    if not sys.stdin.isatty():
        err.print(f"{question} Rerun with --yes to confirm (no terminal to ask on).")
        raise typer.Exit(CLI_ERROR)
    if not typer.confirm(question, err=True):
        raise typer.Exit(CLI_ERROR)


def _ids(ctx: typer.Context, incomplete: str, kind: str) -> list[str]:
    """Ids for shell completion, from the service the command line names so far; quietly
    none when it cannot be asked (completion must never print mid-line)."""
    from orchard_env.errors import OrchardError
    from orchard_env.sdk import SandboxClient

    params = ctx.params
    try:
        with SandboxClient(
            base_url=params.get("url"),
            api_key=params.get("api_key"),
            context=params.get("context"),
            auto_cleanup=False,
            timeout=5,  # a TAB must not hang
            retries=0,
        ) as client:
            if kind == "snapshot":
                ids = [snap.snapshot_id for snap in client.list_snapshots()]
            else:
                ids = [sb.sandbox_id for sb in client.list_sandboxes()]
    except OrchardError:
        return []
    return [i for i in ids if i.startswith(incomplete)]


def complete_sandbox_ids(ctx: typer.Context, incomplete: str) -> list[str]:
    return _ids(ctx, incomplete, "sandbox")


def complete_snapshot_ids(ctx: typer.Context, incomplete: str) -> list[str]:
    return _ids(ctx, incomplete, "snapshot")


def connect(url: str | None, api_key: str | None, context: str | None) -> SandboxClient:
    """An SDK client for the resolved service. Sandboxes the CLI creates are kept on exit."""
    from orchard_env.sdk import SandboxClient

    return SandboxClient(base_url=url, api_key=api_key, context=context, auto_cleanup=False)
