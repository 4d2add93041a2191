"""`orchard trajectory …`: a sandbox's recorded model calls, by trajectory: list, show,
export as JSONL for SFT/RL pipelines."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from orchard_cli.console import (
    ApiKeyOpt,
    ContextOpt,
    JsonOpt,
    OutputOpt,
    QuietOpt,
    UrlOpt,
    complete_sandbox_ids,
    connect,
    err,
)
from orchard_cli.output import Column, emit_list, output_format, print_json

if TYPE_CHECKING:
    from orchard_env.protocol import TrajectorySummary

app = typer.Typer(
    help="Model calls a sandbox's harnesses made through its gateway, by trajectory.",
    no_args_is_help=True,
)

SandboxArg = Annotated[
    str, typer.Argument(help="Sandbox id.", show_default=False, autocompletion=complete_sandbox_ids)
]
TrajectoryArg = Annotated[
    str | None,
    typer.Argument(help="Trajectory id (default: every trajectory).", show_default=False),
]

TRAJECTORY_COLUMNS: tuple[Column[TrajectorySummary], ...] = (
    Column("TRAJECTORY", lambda t: t.trajectory_id),
    Column("CALLS", lambda t: str(t.calls)),
    Column("INPUT TOKENS", lambda t: str(t.input_tokens)),
    Column("OUTPUT TOKENS", lambda t: str(t.output_tokens)),
    Column("ERRORS", lambda t: str(t.errors)),
    Column("FIRST", lambda t: t.first_at, wide=True),
    Column("LAST", lambda t: t.last_at),
)


@app.command("list")
def list_(
    sandbox_id: SandboxArg,
    output: OutputOpt = None,
    quiet: QuietOpt = False,
    json_: JsonOpt = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """List a sandbox's trajectories: calls, tokens, errors."""
    fmt = output_format(output, json_=json_, quiet=quiet)
    with connect(url, api_key, context) as client:
        found = client.get_sandbox(sandbox_id).trajectories()
    emit_list(found, TRAJECTORY_COLUMNS, fmt, kind="trajectory", key=lambda t: t.trajectory_id)


def _summary(call: dict[str, Any]) -> str:
    usage = call.get("usage") or {}
    tokens = f"{usage.get('input_tokens', 0)}/{usage.get('output_tokens', 0)}"
    error = f"  {call['error']}" if call.get("error") else ""
    return (
        f"{call['trajectory_id']:<20} {call['seq']:>4} {call['kind']:<4} {call['api']:<24} "
        f"{call['status']!s:>4} {call['latency_ms']:>9.1f} ms {tokens:>12}{error}"
    )


@app.command()
def show(
    sandbox_id: SandboxArg,
    trajectory_id: TrajectoryArg = None,
    json_: JsonOpt = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """Show a sandbox's calls, one line each (--json: the whole records)."""
    with connect(url, api_key, context) as client:
        calls = client.get_sandbox(sandbox_id).model_calls(trajectory_id)
    if json_:
        print_json(calls)
        return
    for call in calls:
        sys.stdout.write(_summary(call) + "\n")


@app.command()
def export(
    sandbox_id: SandboxArg,
    trajectory_id: TrajectoryArg = None,
    out_file: Annotated[
        Path | None, typer.Option("-o", "--out", help="File to write (default: stdout).")
    ] = None,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """Export the calls as JSONL, one orchard.model_call/v1 record a line."""
    with connect(url, api_key, context) as client:
        calls = client.get_sandbox(sandbox_id).model_calls(trajectory_id)
    lines = "".join(json.dumps(call) + "\n" for call in calls)
    if out_file is None:
        sys.stdout.write(lines)
    else:
        out_file.write_text(lines)
        err.print(f"wrote {len(calls)} calls to {out_file}")
