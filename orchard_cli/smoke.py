"""`orchard smoke`: end-to-end check of a running service, CI-friendly."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from orchard_cli.console import ApiKeyOpt, ContextOpt, UrlOpt, connect, err, out
from orchard_env.smoke import DEFAULT_IMAGE, Step, run_smoke, write_junit


def smoke(
    image: Annotated[
        str, typer.Option("--image", help="Image to test with (needs sh, python3, git).")
    ] = DEFAULT_IMAGE,
    junit_xml: Annotated[
        Path | None, typer.Option("--junit-xml", help="Also write a JUnit XML report here.")
    ] = None,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """End-to-end check of a service; exits 1 if any check fails.

    Health, create, exec, timeout, files, patch, isolation, limits, delete.
    """

    def show(step: Step) -> None:
        mark = "[green]PASS[/]" if step.ok else "[red]FAIL[/]"
        err.print(f"{mark} {step.name} [dim]({step.seconds:.2f} s)[/]")
        if not step.ok:
            err.print(f"     {step.message}", markup=False)

    with connect(url, api_key, context) as client:
        err.print(f"Smoke test of {client.base_url} with {image}")
        report = run_smoke(client, image=image, on_step=show)
    if junit_xml is not None:
        write_junit(report, junit_xml)
    passed = len(report.steps) - len(report.failed)
    out.print(f"{passed} passed, {len(report.failed)} failed")
    if not report.ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command(rich_help_panel="Checks")(smoke)
