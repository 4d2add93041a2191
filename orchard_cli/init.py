"""`orchard init`: write a commented deployment profile with every key at its default."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from orchard_cli.console import err
from orchard_env.errors import ConfigError
from provision.profile import default_profile_yaml, parse_profile


class InitTarget(StrEnum):
    AKS = "aks"
    KUBECONFIG = "kubeconfig"


def init(
    target: Annotated[
        InitTarget,
        typer.Option(
            "--target", "-t", help="aks (a new AKS cluster) or kubeconfig (a cluster you have)."
        ),
    ] = InitTarget.AKS,
    name: Annotated[
        str,
        typer.Option("--name", help="The deployment's name (names its Azure resources)."),
    ] = "orchard",
    output: Annotated[
        Path,
        typer.Option("--output", "-o", help="File to write.", dir_okay=False),
    ] = Path("orchard.yaml"),
    print_: Annotated[
        bool, typer.Option("--print", help="Print the profile to stdout instead of writing it.")
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
) -> None:
    """Write a deployment profile to edit, then `orchard up --profile FILE --plan`."""
    parse_profile({"name": name, "target": target.value}, source="--name")  # names the problem
    text = default_profile_yaml(target.value, name)
    if print_:
        typer.echo(text, nl=False)
        return
    if output.exists() and not force:
        raise ConfigError(f"{output} exists", hint="choose another --output, or pass --force")
    output.write_text(text)
    err.print(f"Wrote {output}. Edit it, then see what it would do:")
    err.print(f"  orchard up --profile {output} --plan")


def register(app: typer.Typer) -> None:
    app.command(rich_help_panel="Service")(init)
