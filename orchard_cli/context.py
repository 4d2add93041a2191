"""`orchard context …`: named connections in ~/.config/orchard/config.toml."""

from __future__ import annotations

from typing import Annotated

import typer

from orchard_cli.console import JsonOpt, OutputOpt, QuietOpt, err
from orchard_cli.output import Column, emit_list, emit_one, output_format, print_json
from orchard_env import contexts
from orchard_env.errors import ConfigError

app = typer.Typer(
    help="Named connections to Orchard services (like kubectl contexts).", no_args_is_help=True
)


def _redacted(values: dict[str, object]) -> dict[str, object]:
    return {k: ("***" if k == "api_key" and v else v) for k, v in values.items()}


@app.command("list")
def list_(output: OutputOpt = None, quiet: QuietOpt = False, json_: JsonOpt = False) -> None:
    """List contexts; the current one is marked (the key is redacted)."""
    fmt = output_format(output, json_=json_, quiet=quiet)
    data = contexts.load_config_file()
    current = data.get("current_context")
    known = data.get("contexts", {})
    if fmt in ("json", "yaml"):
        shown = {"current": current, "contexts": {n: _redacted(v) for n, v in known.items()}}
        emit_one(shown, fmt, kind="context", key="")
        return
    columns: tuple[Column[str], ...] = (
        Column("CURRENT", lambda name: "*" if name == current else ""),
        Column("NAME", lambda name: name),
        Column("URL", lambda name: str(known[name].get("url", ""))),
        Column("TARGET", lambda name: str(known[name].get("target", ""))),
        Column("STATE DIR", lambda name: str(known[name].get("state_dir", "")), wide=True),
    )
    emit_list(sorted(known), columns, fmt, kind="context", key=lambda name: name)


@app.command()
def use(name: Annotated[str, typer.Argument(help="Context name.")]) -> None:
    """Make a context the current one."""
    data = contexts.load_config_file()
    if name not in data.get("contexts", {}):
        raise ConfigError(f"no context named {name!r}", hint="`orchard context list` shows them")
    data["current_context"] = name
    contexts.save_config_file(data)
    err.print(f"Current context: {name}")


@app.command()
def show(
    name: Annotated[str | None, typer.Argument(help="Context (default: current).")] = None,
) -> None:
    """Show a context (the key is redacted)."""
    chosen, values = contexts.active_context(contexts.load_config_file(), name)
    if chosen is None:
        raise ConfigError("no current context", hint="`orchard up` creates one")
    print_json({"name": chosen, **_redacted(values)})
