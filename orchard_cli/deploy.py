"""`orchard deploy | undeploy`: the Orchard service on a Kubernetes cluster you already have."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from manifests.deploy import deploy as deploy_service
from manifests.deploy import dry_run
from manifests.deploy import undeploy as undeploy_service
from manifests.render import render, to_yaml, values_from_profile
from orchard_cli.console import UseOpt, YesOpt, confirm, err, out
from orchard_env import contexts
from orchard_env.errors import BackendUnavailable
from provision.profile import DeploymentProfile, load_profile

PANEL = "Service"
DEFAULT_PROFILE = Path("orchard.yaml")

ProfileOpt = Annotated[
    Path | None,
    typer.Option(
        "--profile",
        "-p",
        help="Deployment profile (default: ./orchard.yaml if it exists, else the defaults "
        "for any cluster, target kubeconfig).",
        show_default=False,
    ),
]
KubeconfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--kubeconfig",
        help="Kubeconfig file (default: the profile's, then KUBECONFIG, then ~/.kube/config).",
        show_default=False,
    ),
]
KubeContextOpt = Annotated[
    str | None,
    typer.Option(
        "--kube-context",
        help="Kubeconfig context (default: the profile's, then the current one).",
        show_default=False,
    ),
]
ContextNameOpt = Annotated[
    str | None,
    typer.Option(
        "--context",
        help="Name of the Orchard CLI context to write or remove (default: the profile's name).",
        show_default=False,
    ),
]


def _profile(path: Path | None) -> DeploymentProfile:
    if path is not None:
        return load_profile(path)
    if DEFAULT_PROFILE.is_file():
        return load_profile(DEFAULT_PROFILE)
    return DeploymentProfile(target="kubeconfig")


def _refs(profile: DeploymentProfile, tag: str | None) -> dict[str, str]:
    from images.build import default_tag, deployment_refs, registry_for_profile

    chosen = tag or profile.image_tag or default_tag()
    return deployment_refs(profile, registry_for_profile(profile), chosen)


def deploy(
    profile_path: ProfileOpt = None,
    kubeconfig: KubeconfigOpt = None,
    kube_context: KubeContextOpt = None,
    context: ContextNameOpt = None,
    tag: Annotated[
        str | None,
        typer.Option("--tag", help="Image tag (default: the profile's, else <version>-<commit>)."),
    ] = None,
    render_only: Annotated[
        bool,
        typer.Option(
            "--render", help="Print the objects as YAML (secrets masked) and touch nothing."
        ),
    ] = False,
    dry_run_: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Print the objects, and have the cluster (if reachable) check them without "
            "storing anything.",
        ),
    ] = False,
    timeout: Annotated[
        float, typer.Option("--timeout", help="Seconds to wait for the rollout.")
    ] = 300,
    use: UseOpt = False,
) -> None:
    """Deploy Orchard to a Kubernetes cluster, or update it: server-side apply, then wait.

    Safe to re-run. Writes a CLI context for the service (its URL and admin key).
    """
    profile = _profile(profile_path)
    refs = _refs(profile, tag)
    if render_only or dry_run_:
        out.print(to_yaml(render(values_from_profile(profile, refs))), end="", markup=False)
    if render_only:
        return
    if dry_run_:
        try:
            with err.status("server-side dry run") as status:
                planned = dry_run(
                    profile,
                    refs,
                    kubeconfig=kubeconfig,
                    context=kube_context,
                    progress=lambda message: status.update(message),
                )
        except BackendUnavailable as exc:
            err.print(f"[yellow]No server-side dry run:[/] {escape(exc.message)}")
            return
        for applied in planned:
            err.print(f"  {applied}", markup=False)
        err.print("[green]✓[/] the cluster accepts every object (nothing was stored)")
        return
    with err.status("deploying") as status:
        result = deploy_service(
            profile,
            refs,
            kubeconfig=kubeconfig,
            context=kube_context,
            progress=lambda message: status.update(message),
            timeout=timeout,
        )
    for applied in result.applied:
        if applied.action != "unchanged":
            err.print(f"  {applied}", markup=False)
    changed = sum(applied.action != "unchanged" for applied in result.applied)
    err.print(f"[green]✓[/] {changed} changed, {len(result.applied) - changed} unchanged")
    name = context or profile.name
    if result.api_key is not None:
        current = contexts.write_context(
            name, {"url": result.endpoint, "api_key": result.api_key}, make_current=use
        )
        made = "a new admin key" if result.key_created else "the deployment's admin key"
        which = "now the current one" if current else f"`orchard context use {name}` selects it"
        err.print(f"[green]✓[/] context {name!r} written with {made} ({which})")
    if result.port_forward:
        err.print("The service has no public address. In another terminal, run:")
        err.print(f"  {result.port_forward}", markup=False)
        err.print("then: orchard smoke")
    out.print(result.endpoint, markup=False)


def undeploy(
    profile_path: ProfileOpt = None,
    kubeconfig: KubeconfigOpt = None,
    kube_context: KubeContextOpt = None,
    context: ContextNameOpt = None,
    yes: YesOpt = False,
) -> None:
    """Delete the deployment's namespaces: the service, its state and every sandbox."""
    profile = _profile(profile_path)
    namespaces = f"{profile.service.namespace} and {profile.service.sandbox_namespace}"
    confirm(
        f"Delete namespaces {namespaces}: the Orchard service, its state and every sandbox?",
        yes=yes,
    )
    with err.status("undeploying") as status:
        deleted = undeploy_service(
            profile,
            kubeconfig=kubeconfig,
            context=kube_context,
            progress=lambda message: status.update(message),
        )
    if deleted:
        err.print(f"[green]✓[/] deleted namespaces {', '.join(deleted)}")
    else:
        err.print("Nothing to delete: the namespaces do not exist.")
    name = context or profile.name
    if contexts.remove_context(name):
        err.print(f"[green]✓[/] context {name!r} removed")


def register(app: typer.Typer) -> None:
    app.command(rich_help_panel=PANEL)(deploy)
    app.command(rich_help_panel=PANEL)(undeploy)
