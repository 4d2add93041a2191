"""The console layer: data to stdout, everything else to stderr, shared option aliases."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

if TYPE_CHECKING:
    from orchard_env.sdk import SandboxClient

CLI_ERROR = 125  # an error of the CLI itself (docker's code): never a remote command's

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
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]


def encode(value: Any) -> Any:
    """Plain data from pydantic models (and lists and dicts of them), JSON's types only."""
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if isinstance(value, list | tuple):
        return [encode(item) for item in value]
    if isinstance(value, dict):
        return {key: encode(item) for key, item in value.items()}
    return value


def print_json(data: Any) -> None:
    """Write JSON to stdout (pydantic models and lists of them included)."""
    sys.stdout.write(json.dumps(encode(data), indent=2, default=str) + "\n")


def confirm(question: str, *, yes: bool) -> None:
    """Ask before a destructive step; without a TTY, demand --yes instead of hanging."""
    if yes:
        return
    if not sys.stdin.isatty():
        err.print(f"{question} Rerun with --yes to confirm (no terminal to ask on).")
        raise typer.Exit(CLI_ERROR)
    if not typer.confirm(question, err=True):
        raise typer.Exit(1)


def connect(url: str | None, api_key: str | None, context: str | None) -> SandboxClient:
    """An SDK client for the resolved service. Sandboxes the CLI creates are kept on exit."""
    from orchard_env.sdk import SandboxClient

    return SandboxClient(base_url=url, api_key=api_key, context=context, auto_cleanup=False)
