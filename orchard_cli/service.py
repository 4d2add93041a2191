"""`orchard up | down | status | serve`: the service's lifecycle, on this machine or a cluster."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from orchard_cli.console import JsonOpt, UseOpt, YesOpt, confirm, err, out
from orchard_cli.output import print_json
from orchard_env import config, contexts
from orchard_env.config import service_settings
from orchard_env.errors import ConfigError, InvalidRequest
from provision.base import STAGES, Change, ServiceStatus, check_target
from provision.local import DEFAULT_CONTEXT, LocalProvider
from provision.profile import DeploymentProfile, load_profile, parse_profile
from provision.stages import ClusterDeployment, DeploymentPlan, StageEvent

PANEL = "Service"
DEFAULT_PROFILE = Path("orchard.yaml")  # what `orchard init` writes

TargetOpt = Annotated[
    str | None,
    typer.Option(
        "--target",
        "-t",
        help="Where Orchard runs: local (this machine's engine), aks (a new AKS cluster) or "
        "kubeconfig (a cluster you have). Default: the profile's, else local.",
        show_default=False,
    ),
]
ProfileOpt = Annotated[
    Path | None,
    typer.Option(
        "--profile",
        "-p",
        help="Deployment profile (`orchard init` writes one). Default for aks and kubeconfig: "
        "./orchard.yaml if it exists, else the built-in defaults.",
        dir_okay=False,
        show_default=False,
    ),
]
PortOpt = Annotated[int | None, typer.Option("--port", help="Port of the local orchestrator.")]
StateDirOpt = Annotated[
    str | None,
    typer.Option(
        "--state-dir", help="State directory (database, logs, sandbox dirs, deployment state)."
    ),
]
ContextNameOpt = Annotated[
    str | None,
    typer.Option(
        "--context",
        help="The CLI context to act on (up: to write). Default: ORCHARD_CONTEXT, else the "
        "current context, else local (or the profile's name).",
        show_default=False,
    ),
]

_MARKS = {
    "create": "[green]+ create[/]",
    "update": "[yellow]~ update[/]",
    "keep": "[dim]= exists[/]",
    "drift": "[red]! drift [/]",
    "delete": "[red]- delete[/]",
}


@dataclasses.dataclass(frozen=True)
class _Target:
    """What up, down and status act on: a cluster deployment, or else the local service."""

    cluster: ClusterDeployment | None
    local: LocalProvider | None


def _target(
    target: str | None,
    profile_path: Path | None,
    state_dir: str | None,
    context: str | None,
    port: int | None = None,
    *,
    creating: bool = False,
    consent: bool = False,
    smoke: bool = True,
    use: bool = False,
) -> _Target:
    """Resolve the target once, for every service command, from one precedence: --context >
    ORCHARD_CONTEXT > the current context > the default (``local``, or the profile's name).
    A context's recorded target, state dir and port are used unless a flag says otherwise; a
    flag that contradicts a context named explicitly is refused."""
    choice = contexts.choose_context(contexts.load_config_file(), context, must_exist=not creating)
    recorded = str(choice.values.get("target", "local")) if choice.exists else None
    profile: DeploymentProfile | None = None
    if profile_path is not None:
        profile = load_profile(profile_path)
        if target is not None and check_target(target) != profile.target:
            raise ConfigError(
                f"--target {target} disagrees with profile {profile_path} (target: "
                f"{profile.target})",
                hint="drop --target, or set target in the profile",
            )
        target = profile.target
    if target is None and recorded is not None:
        target = recorded
    target = check_target(target or "local")
    if recorded is not None and recorded != target:
        if choice.source in ("--context", "ORCHARD_CONTEXT"):
            raise ConfigError(
                f"context {choice.name!r} (from {choice.source}) is a deployment on {recorded}, "
                f"not {target}",
                hint="drop --target/--profile, or name another context",
            )
        choice = contexts.ContextChoice(None, {}, "default")  # the current one is another kind
    if target == "local":
        if choice.name is None:
            choice = contexts.ContextChoice(DEFAULT_CONTEXT, {}, "default")
        provider = LocalProvider.for_context(
            choice, port=port, state_dir=state_dir, make_current=use
        )
        return _Target(None, provider)
    if profile is None and DEFAULT_PROFILE.is_file():
        profile_path = DEFAULT_PROFILE
        profile = load_profile(profile_path)
        if profile.target != target:
            raise ConfigError(
                f"--target {target} disagrees with profile {profile_path} (target: "
                f"{profile.target})",
                hint="pass --profile, or set target in the profile",
            )
        err.print(f"Using the profile {profile_path}.")
    if profile is None:
        if choice.exists:
            raise ConfigError(
                f"context {choice.name!r} is a deployment on {target} and no profile says which",
                hint="pass --profile FILE (the one `orchard up` used)",
            )
        err.print(
            f"No profile: using the defaults for {target} "
            f"(`orchard init --target {target}` writes them to {DEFAULT_PROFILE} to edit)."
        )
        profile = parse_profile({"target": target}, source="the default profile")
    name = choice.name
    if choice.source == "current context" and name != profile.name:
        name = None  # the current context names a deployment only if it is this profile's
    resume = ["orchard", "up"]
    resume += ["--profile", str(profile_path)] if profile_path else ["--target", target]
    if state_dir:
        resume += ["--state-dir", state_dir]
    if name:
        resume += ["--context", name]
    deployment = ClusterDeployment(
        profile,
        state_dir=Path(state_dir) if state_dir else config.state_dir(),
        context=name,
        resume_command=shlex.join(resume),
        consent=consent,
        smoke=smoke,
        make_current=use,
    )
    return _Target(deployment, None)


# --- up ----------------------------------------------------------------------------------------


class _StageDisplay:
    """A spinner per running stage on stderr; one line per finished, skipped or failed stage."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.tasks: dict[str, Any] = {}

    def __call__(self, event: StageEvent) -> None:
        name = f"[bold]{event.stage}[/]"
        text = escape(event.text)
        if event.kind == "start":
            self.tasks[event.stage] = self.progress.add_task(name, total=None)
        elif event.kind == "message":
            self.progress.update(self.tasks[event.stage], description=f"{name}: {text}")
        elif event.kind == "skip":
            self.progress.console.print(f"[dim]= {name}: {text} (done earlier)[/]")
        else:
            self.progress.remove_task(self.tasks.pop(event.stage))
            mark = "[green]✓[/]" if event.kind == "done" else "[red]✗[/]"
            self.progress.console.print(f"{mark} {name}: {text}")


def up(
    target: TargetOpt = None,
    profile: ProfileOpt = None,
    plan: Annotated[
        bool,
        typer.Option(
            "--plan",
            help="Print what up would create or change, and the hourly cost; change nothing.",
        ),
    ] = False,
    from_stage: Annotated[
        str | None,
        typer.Option(
            "--from",
            help=f"Run this stage and the ones after it even if done ({', '.join(STAGES)}).",
            show_default=False,
        ),
    ] = None,
    port: PortOpt = None,
    state_dir: StateDirOpt = None,
    context: ContextNameOpt = None,
    smoke: Annotated[
        bool, typer.Option("--smoke/--no-smoke", help="Finish with the smoke test.")
    ] = True,
    yes: Annotated[
        bool,
        typer.Option(
            "--yes", "-y", help="kubeconfig target: let Orchard label and taint sandbox nodes."
        ),
    ] = False,
    use: UseOpt = False,
    json_: JsonOpt = False,
) -> None:
    """Stand Orchard up: provision, images, deploy, smoke. Safe to re-run; resumes a failure.

    The service is the one --context names (else ORCHARD_CONTEXT, else the current context,
    else `local`). Its context is written with the URL and an admin key; it becomes the
    current context only with --use or when there is no current context yet (like
    `kubectl config set-context`), and up says which it is.
    """
    resolved = _target(
        target, profile, state_dir, context, port, creating=True, consent=yes, smoke=smoke, use=use
    )
    deployment = resolved.cluster
    if deployment is None:
        if plan or from_stage:
            raise InvalidRequest(
                "--plan and --from are for the aks and kubeconfig targets",
                hint="the local target creates nothing billable and checks every stage itself",
            )
        assert resolved.local is not None
        _up_local(resolved.local, smoke)
        return
    if plan:
        with err.status("reading what exists (nothing is changed)"):
            result = deployment.plan()
        if json_:
            print_json(_plan_json(result))
        else:
            _render_plan(result, deployment)
        return
    err.print(f"Log: {deployment.log_file}")
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    ) as progress:
        outcome = deployment.up(_StageDisplay(progress), rerun_from=from_stage)
    forward = deployment.state.outputs().get("deploy", {}).get("port_forward")
    err.print(f"\nOrchard is up at {outcome.url} (context {outcome.context!r}). Try:")
    if forward:
        err.print(f"  {forward} &   # the service is in-cluster only")
    err.print("  orchard sandbox create            # prints the new sandbox id")
    err.print("  orchard sandbox exec <id> -- uname -a")
    out.print(outcome.url)


def _up_local(provider: LocalProvider, smoke: bool) -> None:
    with err.status("starting") as status:
        result = provider.up(lambda message: status.update(message), smoke=smoke)
    for stage in result.stages:
        mark = "[dim]=[/]" if stage.skipped else "[green]✓[/]"
        err.print(f"{mark} [bold]{stage.stage}[/]: {stage.summary}")
    err.print(f"\nOrchard is up at {result.url} (context {result.context!r}). Try:")
    err.print("  orchard sandbox create            # prints the new sandbox id")
    err.print("  orchard sandbox exec <id> -- uname -a")
    out.print(result.url)


def _change_lines(changes: list[Change]) -> list[str]:
    """One line per change, columns padded (no wrapping: a plan is read and piped whole)."""
    kind_width = max((len(c.kind) for c in changes), default=0)
    name_width = max((len(c.name) for c in changes), default=0)
    return [
        f"{_MARKS[c.action]}  {c.kind:<{kind_width}}  {escape(c.name.ljust(name_width))}  "
        f"{escape('; '.join(c.details))}".rstrip()
        for c in changes
    ]


def _render_plan(plan: DeploymentPlan, deployment: ClusterDeployment) -> None:
    out.print(f"[bold]Plan for {plan.name!r} on {plan.target}[/] (nothing has been changed)")
    out.print("\n[bold]Infrastructure[/]")
    for line in _change_lines(plan.changes) or ["  (nothing)"]:
        out.print(line)
    out.print("\n[bold]Images[/] (built here and pushed)")
    for name, ref in plan.images.items():
        out.print(f"  {name}: {escape(ref)}")
    out.print(f"\n[bold]Kubernetes objects[/] (server-side apply, {len(plan.objects)})")
    for obj in plan.objects:
        out.print(f"  {escape(obj)}")
    out.print("\n[bold]Stages[/] " + ", ".join(f"{k}: {v}" for k, v in plan.stages.items()))
    out.print(f"  state {deployment.state.path}")
    cost = plan.cost
    if cost is not None:
        sandbox = "spot" if cost.pricing == "spot" else "on-demand"
        out.print(
            f"\n[bold]Estimated cost[/] ${cost.min_usd:.2f}/h to ${cost.max_usd:.2f}/h "
            f"({cost.prices.mode} prices, {cost.region})"
        )
        out.print(
            f"  system pool {cost.system_nodes[0]}..{cost.system_nodes[1]} x "
            f"{cost.system_vm_size} (on-demand) at ${cost.system_node_usd:.4f}/h each"
        )
        out.print(
            f"  sandbox pool {cost.sandbox_nodes[0]}..{cost.sandbox_nodes[1]} x "
            f"{cost.sandbox_vm_size} ({sandbox}) at ${cost.sandbox_node_usd:.4f}/h each, "
            f"{cost.sandboxes_per_node} default-size sandboxes per node"
        )
        out.print(
            f"  control plane, load balancer, public IP, registry: ${cost.fixed_usd:.4f}/h; "
            "Log Analytics and egress by usage"
        )
        for warning in cost.warnings:
            out.print(f"  [dim]{escape(warning)}[/]")
    elif plan.target == "kubeconfig":
        out.print(
            "\n[bold]Estimated cost[/] not estimated for a cluster you already have "
            "(`orchard cost report --kubeconfig FILE` prices its nodes)"
        )
    if plan.warnings:
        out.print()
        for warning in plan.warnings:
            out.print(f"[yellow]! {escape(warning)}[/]")


def _plan_json(plan: DeploymentPlan) -> dict[str, Any]:
    return {
        "target": plan.target,
        "name": plan.name,
        "changes": [dataclasses.asdict(change) for change in plan.changes],
        "images": plan.images,
        "objects": plan.objects,
        "stages": plan.stages,
        "cost": plan.cost,
        "warnings": plan.warnings,
    }


# --- down / status / serve ---------------------------------------------------------------------


def down(
    target: TargetOpt = None,
    profile: ProfileOpt = None,
    port: PortOpt = None,
    state_dir: StateDirOpt = None,
    context: ContextNameOpt = None,
    yes: YesOpt = False,
) -> None:
    """Take Orchard down: locally, stop it and delete its sandboxes (the records stay); on
    AKS, delete what `up` created; on a cluster, delete its namespaces.

    It acts on the context --context names (else ORCHARD_CONTEXT, else the current one), says
    what it will stop and delete (URL, state dir, pid, sandboxes, context) and asks first. A
    process is stopped only if it is the orchestrator of that context's state dir.
    """
    resolved = _target(target, profile, state_dir, context, port)
    deployment = resolved.cluster
    if deployment is None:
        assert resolved.local is not None
        provider = resolved.local
        with err.status("reading what exists"):
            plan = provider.down_plan()
        err.print(f"Orchard (local, context {plan.context!r}): {plan.describe()}.", soft_wrap=True)
        confirm("Take it down?", yes=yes)
        with err.status("stopping") as status:
            provider.down(lambda message: status.update(message))
        err.print("[green]✓[/] Orchard is down.")
        return
    with err.status("reading what exists"):
        changes = deployment.deletion_plan()
    if not changes:
        err.print(f"Nothing of {deployment.profile.name!r} exists on {deployment.target}.")
    for line in _change_lines(changes):
        err.print(line, soft_wrap=True)
    err.print(f"The context {deployment.context!r} is removed too.", soft_wrap=True)
    confirm(f"Delete Orchard {deployment.profile.name!r} ({deployment.target})?", yes=yes)
    with err.status("deleting") as status:
        deployment.down(lambda message: status.update(escape(message)), changes)
    err.print("[green]✓[/] Orchard is down.")


def status(
    target: TargetOpt = None,
    profile: ProfileOpt = None,
    port: PortOpt = None,
    state_dir: StateDirOpt = None,
    context: ContextNameOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Show whether the service runs, where, and (locally) how many sandboxes it has.

    The service is the one --context names (else ORCHARD_CONTEXT, else the current context,
    else `local`); its key is sent to that service only. Exits 3 when it is not running.
    """
    resolved = _target(target, profile, state_dir, context, port)
    provider = resolved.cluster or resolved.local
    assert provider is not None
    state: ServiceStatus = provider.status()
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
            table.add_row(key, escape(value))
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
