"""The `orchard` Typer app, assembled lazily: a command group's module (and the SDK, cost,
bench or provisioning code it needs) is imported only when that command runs, or when
help or completion lists it. `orchard --version` imports none of them."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import typer
from typer._click.core import Command, Context  # typer vendors click
from typer.core import TyperGroup

from orchard_cli import version_line

# name: (module, what it exports, help panel). A module exports either a Typer app (a
# command group) or a register(app) function adding top-level commands.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "up": ("orchard_cli.service", "register", "Service"),
    "down": ("orchard_cli.service", "register", "Service"),
    "status": ("orchard_cli.service", "register", "Service"),
    "serve": ("orchard_cli.service", "register", "Service"),
    "deploy": ("orchard_cli.deploy", "register", "Service"),
    "undeploy": ("orchard_cli.deploy", "register", "Service"),
    "init": ("orchard_cli.init", "register", "Service"),
    "sandbox": ("orchard_cli.sandbox", "app", "Sandboxes"),
    "snapshot": ("orchard_cli.snapshot", "app", "Sandboxes"),
    "pool": ("orchard_cli.pool", "app", "Sandboxes"),
    "trajectory": ("orchard_cli.trajectory", "app", "Sandboxes"),
    "keys": ("orchard_cli.keys", "app", "Service"),
    "context": ("orchard_cli.context", "app", "Service"),
    "images": ("orchard_cli.images", "app", "Service"),
    "smoke": ("orchard_cli.smoke", "register", "Checks"),
    "bench": ("orchard_cli.bench", "app", "Checks"),
    "cost": ("orchard_cli.cost", "app", "Cost"),
}

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


def _load(name: str) -> Command | None:
    spec = COMMANDS.get(name)
    if spec is None:
        return None
    module_name, export, panel = spec
    exported: Any = getattr(importlib.import_module(module_name), export)
    if isinstance(exported, typer.Typer):
        command: Command = typer.main.get_group(exported)
    else:
        holder = typer.Typer()
        exported(holder)
        command = typer.main.get_group(holder).commands[name]
    command.name = name
    setattr(command, "rich_help_panel", panel)  # noqa: B010 (click's Command has no such field)
    return command


class LazyGroup(TyperGroup):
    """The root group: lists every command without importing it; loads one when used."""

    def list_commands(self, ctx: Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: Context, cmd_name: str) -> Command | None:
        return _load(cmd_name)


app = typer.Typer(
    name="orchard",
    cls=LazyGroup,
    help="Sandboxes for training and evaluating AI agents.",
    epilog=EPILOG,
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        sys.stdout.write(version_line())
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Sandboxes for training and evaluating AI agents."""
