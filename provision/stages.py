"""`orchard up` on a cluster: four resumable stages, a state file, a log file, a plan.

The stages are provision (the AKS resources, or the checks of an existing cluster), images
(build and push the orchestrator, agent-injector and sandbox images), deploy (the Kubernetes
objects, an admin key, a CLI context) and smoke (`orchard smoke` against the new service).

Each deployment has a directory ``<state_dir>/deployments/<target>-<name>/`` holding
``state.json`` (each stage's status, a digest of its inputs, its outputs) and ``up.log``
(every progress line, the Azure SDK's request log, and the traceback of a failure). A stage
that finished with the same inputs is skipped; a failed one runs again; changed inputs (a
profile edit, a new image tag) re-run the stage and, through their outputs, what depends on
it. Every stage is idempotent on its own, so running one again is always safe.

:func:`plan_deployment` does only reads (Azure GETs, cluster reads) and says what ``up``
would create or change, and what the cluster costs per hour.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shlex
import shutil
import socket
import subprocess
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from orchard_env import contexts
from orchard_env.errors import ConfigError, OrchardError
from provision.aks import AksTarget
from provision.base import STAGES, Change, Progress, ServiceStatus, StageResult, UpResult
from provision.kubeconfig import KubeconfigTarget
from provision.profile import DeploymentProfile

if TYPE_CHECKING:
    from orchard_env.cost.profile import HourlyCost

STATE_VERSION = 1
PLATFORM = "linux/amd64"  # AKS and most clusters' nodes

Outputs = dict[str, dict[str, Any]]
EventKind = Literal["start", "message", "done", "skip", "fail"]


@dataclass(frozen=True)
class StageEvent:
    stage: str
    kind: EventKind
    text: str


OnEvent = Callable[[StageEvent], None]


@dataclass(frozen=True)
class Stage:
    """One step of ``up``: ``inputs`` decide whether a finished run is still current."""

    name: str
    inputs: Callable[[Outputs], Any]
    run: Callable[[Progress, Outputs], tuple[str, dict[str, Any]]]


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class DeploymentState:
    """``state.json``: one record per stage (status, inputs digest, summary, outputs)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"version": STATE_VERSION, "stages": {}}
        if path.exists():
            try:
                loaded = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise ConfigError(
                    f"deployment state {path} is unreadable: {exc}",
                    hint=f"remove {path} to start over (every stage is safe to run again)",
                ) from exc
            if not isinstance(loaded, dict) or loaded.get("version") != STATE_VERSION:
                raise ConfigError(
                    f"deployment state {path} is from another version of Orchard",
                    hint=f"remove {path} to start over (every stage is safe to run again)",
                )
            self.data = loaded

    def stage(self, name: str) -> dict[str, Any]:
        record: dict[str, Any] = self.data["stages"].get(name, {})
        return record

    def status(self, name: str) -> str:
        return str(self.stage(name).get("status", "pending"))

    def outputs(self) -> Outputs:
        return {
            name: dict(record.get("outputs") or {})
            for name, record in self.data["stages"].items()
            if record.get("status") == "done"
        }

    def update(self, name: str, **values: Any) -> None:
        self.data["stages"].setdefault(name, {}).update(values)
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(self.data, handle, indent=2, sort_keys=True, default=str)
        tmp.replace(self.path)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


@contextlib.contextmanager
def _log_to(path: Path) -> Iterator[logging.Logger]:
    """A logger writing to ``path``, with the Azure SDK's request log (no secrets: the SDK
    redacts headers) going there too for the duration."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.close(fd)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    log = logging.getLogger("orchard.up")
    azure = logging.getLogger("azure")
    saved = (log.level, log.propagate, azure.level)
    log.setLevel(logging.INFO)
    log.propagate = False
    azure.setLevel(logging.INFO)
    log.addHandler(handler)
    azure.addHandler(handler)
    try:
        yield log
    finally:
        log.removeHandler(handler)
        azure.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]
        azure.setLevel(saved[2])
        handler.close()


class StageRunner:
    """Runs stages in order, skipping the current ones, recording each in the state file."""

    def __init__(
        self,
        stages: list[Stage],
        state: DeploymentState,
        log_file: Path,
        *,
        resume_command: str,
        on_event: OnEvent | None = None,
    ) -> None:
        self.stages = stages
        self.state = state
        self.log_file = log_file
        self.resume_command = resume_command
        self.on_event = on_event or (lambda _event: None)

    def run(self, *, rerun_from: str | None = None) -> list[StageResult]:
        """Run what is not current; ``rerun_from`` runs that stage and the later ones anyway."""
        names = [stage.name for stage in self.stages]
        if rerun_from is not None and rerun_from not in names:
            raise ConfigError(f"no stage {rerun_from!r}", hint=f"the stages are {', '.join(names)}")
        results: list[StageResult] = []
        forced = False
        with _log_to(self.log_file) as log:
            log.info("up: stages %s", ", ".join(names))
            for index, stage in enumerate(self.stages):
                forced = forced or stage.name == rerun_from
                earlier = names[:index]
                outputs = {k: v for k, v in self.state.outputs().items() if k in earlier}
                digest = _digest(stage.inputs(outputs))
                record = self.state.stage(stage.name)
                if not forced and record.get("status") == "done" and record.get("inputs") == digest:
                    summary = str(record.get("summary", "done"))
                    log.info("%s: skipped (done at %s)", stage.name, record.get("finished_at"))
                    self.on_event(StageEvent(stage.name, "skip", summary))
                    results.append(StageResult(stage.name, summary, skipped=True))
                    continue
                results.append(self._run_one(stage, digest, outputs, log))
        return results

    def _run_one(
        self, stage: Stage, digest: str, outputs: Outputs, log: logging.Logger
    ) -> StageResult:
        name = stage.name

        def progress(message: str) -> None:
            log.info("%s: %s", name, message)
            self.on_event(StageEvent(name, "message", message))

        self.state.update(name, status="running", started_at=_now(), error=None)
        log.info("%s: started", name)
        self.on_event(StageEvent(name, "start", ""))
        try:
            summary, produced = stage.run(progress, outputs)
        except KeyboardInterrupt:
            self.state.update(name, status="failed", error="interrupted", finished_at=_now())
            log.info("%s: interrupted", name)
            raise
        except Exception as exc:
            detail = exc.message if isinstance(exc, OrchardError) else _first_line(exc)
            log.error("%s: failed: %s\n%s", name, detail, traceback.format_exc())
            self.state.update(name, status="failed", error=detail, finished_at=_now())
            self.on_event(StageEvent(name, "fail", detail))
            raise self._failure(name, exc, detail) from exc
        self.state.update(
            name,
            status="done",
            inputs=digest,
            summary=summary,
            outputs=produced,
            finished_at=_now(),
            error=None,
        )
        log.info("%s: done: %s", name, summary)
        self.on_event(StageEvent(name, "done", summary))
        return StageResult(name, summary)

    def _failure(self, name: str, exc: Exception, detail: str) -> OrchardError:
        hint = exc.hint if isinstance(exc, OrchardError) and exc.hint else None
        resume = (
            f"fix that, then `{self.resume_command}` resumes at the {name} stage "
            f"(log: {self.log_file})"
        )
        message = f"the {name} stage failed: {detail}"
        cls = type(exc) if isinstance(exc, OrchardError) else OrchardError
        try:
            return cls(message, hint=f"{hint}; {resume}" if hint else resume)
        except TypeError:  # a subclass with a constructor of its own
            return OrchardError(message, hint=f"{hint}; {resume}" if hint else resume)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


# --- a cluster deployment ----------------------------------------------------------------------


def deployment_dir(state_dir: Path, profile: DeploymentProfile) -> Path:
    return state_dir / "deployments" / f"{profile.target}-{profile.name}"


@dataclass
class DeploymentPlan:
    """What ``up`` would do, from reads only."""

    target: str
    name: str
    changes: list[Change]
    images: dict[str, str]
    objects: list[str]
    stages: dict[str, str]
    cost: HourlyCost | None
    warnings: list[str] = field(default_factory=list)


class ClusterDeployment:
    """`orchard up|down|status` for the ``aks`` and ``kubeconfig`` targets.

    ``infra`` is the target's provider (:class:`~provision.aks.AksTarget` or
    :class:`~provision.kubeconfig.KubeconfigTarget`); tests pass one with fake transports.
    """

    def __init__(
        self,
        profile: DeploymentProfile,
        *,
        state_dir: Path,
        context: str | None = None,
        resume_command: str = "orchard up",
        consent: bool = False,
        smoke: bool = True,
        make_current: bool = False,
        infra: AksTarget | KubeconfigTarget | None = None,
    ) -> None:
        if profile.target == "local":
            raise ConfigError("the profile's target is local, not a cluster")
        self.profile = profile
        self.directory = deployment_dir(state_dir, profile)
        self.state = DeploymentState(self.directory / "state.json")
        self.log_file = self.directory / "up.log"
        self.context = context or profile.name
        self.resume_command = resume_command
        self.consent = consent
        self.smoke_enabled = smoke
        self.make_current = make_current
        self._infra = infra

    @property
    def target(self) -> str:
        return self.profile.target

    @property
    def infra(self) -> AksTarget | KubeconfigTarget:
        if self._infra is None:
            if self.profile.target == "aks":
                self._infra = AksTarget(self.profile)
            else:
                self._infra = KubeconfigTarget(self.profile)
        return self._infra

    # --- stages -------------------------------------------------------------------------

    def stages(self) -> list[Stage]:
        profile = self.profile
        stages = [
            Stage(
                "provision",
                lambda _o: {
                    "profile": profile.model_dump(
                        include={
                            "name",
                            "target",
                            "azure",
                            "kubeconfig",
                            "system_pool",
                            "sandbox_pool",
                            "registry",
                            "runtime_class",
                            "limits",
                        }
                    ),
                    "context": self.context,
                },
                self._provision,
            ),
            Stage("images", self._image_inputs, self._images),
            Stage(
                "deploy",
                lambda o: {
                    "profile": profile.model_dump(),
                    "images": o.get("images", {}).get("refs"),
                    "cluster": {
                        k: o.get("provision", {}).get(k) for k in ("kubeconfig", "context")
                    },
                    "context": self.context,
                },
                self._deploy,
            ),
        ]
        if self.smoke_enabled:
            stages.append(Stage("smoke", lambda o: o.get("deploy"), self._smoke))
        return stages

    def _provision(self, progress: Progress, _outputs: Outputs) -> tuple[str, dict[str, Any]]:
        infra = self.infra
        if isinstance(infra, AksTarget):
            outputs = infra.provision(progress)
            changed = len(outputs["changes"])
            summary = (
                f"cluster {outputs['cluster']} in {outputs['resource_group']}, registry "
                f"{outputs['registry']}; {changed} change(s); kubeconfig context "
                f"{outputs['context']!r}"
            )
        else:
            outputs = infra.provision(progress, consent=self.consent)
            engines = ", ".join(outputs["network_policy"]) or "no engine found"
            summary = (
                f"Kubernetes {outputs['kubernetes_version']} at {outputs['server']}; network "
                f"policy: {engines}; sandbox nodes: {', '.join(outputs['sandbox_nodes']) or '-'}"
            )
        if outputs["warnings"]:
            summary += "; WARNING: " + "; ".join(outputs["warnings"])
        return summary, outputs

    def _registry(self, outputs: Outputs) -> str | None:
        from images.build import registry_for_profile

        registry = outputs.get("provision", {}).get("registry")
        return str(registry) if registry else registry_for_profile(self.profile)

    def _refs(self, outputs: Outputs) -> dict[str, str]:
        from images.build import default_tag, deployment_refs

        tag = self.profile.image_tag or default_tag()
        return deployment_refs(self.profile, self._registry(outputs), tag)

    def _image_inputs(self, outputs: Outputs) -> Any:
        return {"refs": self._refs(outputs), "build": self.profile.build.model_dump()}

    def _images(self, progress: Progress, outputs: Outputs) -> tuple[str, dict[str, Any]]:
        from images.build import build_images, detect_builder, push_images

        refs = self._refs(outputs)
        builder = detect_builder()
        options = self.profile.build
        progress(f"building {len(refs)} images with {builder} for {PLATFORM}")
        build_images(
            refs,
            builder=builder,
            platform=PLATFORM,
            base_images=options.base_images,
            ca_bundle=Path(options.ca_bundle).expanduser() if options.ca_bundle else None,
            progress=progress,
        )
        credential = self.infra.credential if isinstance(self.infra, AksTarget) else None
        push_images(
            refs,
            builder=builder,
            progress=progress,
            credential=credential,
            plain_http=self.profile.registry.plain_http,
        )
        return f"built and pushed {', '.join(refs.values())}", {"refs": refs}

    def _deploy(self, progress: Progress, outputs: Outputs) -> tuple[str, dict[str, Any]]:
        from manifests.deploy import deploy

        cluster = outputs["provision"]
        refs = outputs["images"]["refs"]
        result = deploy(
            self.profile,
            refs,
            kubeconfig=cluster["kubeconfig"],
            context=cluster["context"],
            progress=progress,
        )
        api_key = result.api_key or self._known_key()
        if api_key is None:
            raise OrchardError(
                f"the deployment keeps its admin key in a Secret in {result.namespace}, and "
                f"this machine has no CLI context {self.context!r} holding it",
                hint=f"create a key in the cluster with `kubectl -n {result.namespace} exec "
                "deploy/orchard-orchestrator -- orchard keys create admin --admin --local`, "
                f"then `orchard context add {self.context} --url {result.endpoint} --api-key ...`",
            )
        current = contexts.write_context(
            self.context,
            {"url": result.endpoint, "api_key": api_key, "target": self.target},
            make_current=self.make_current,
        )
        summary = (
            f"Orchard at {result.endpoint} (namespace {result.namespace}); context "
            f"{self.context!r} ({'the current one' if current else 'not the current one'})"
        )
        return summary, {
            "endpoint": result.endpoint,
            "namespace": result.namespace,
            "context": self.context,
            "port_forward": result.port_forward,
            "deployed_at": _now(),
        }

    def _known_key(self) -> str | None:
        with contextlib.suppress(OrchardError):
            known = contexts.load_config_file().get("contexts", {})
            key = known.get(self.context, {}).get("api_key")
            return str(key) if key else None
        return None

    def _smoke(self, progress: Progress, outputs: Outputs) -> tuple[str, dict[str, Any]]:
        from orchard_env.sdk import SandboxClient
        from orchard_env.smoke import run_smoke

        image = outputs["images"]["refs"]["sandbox"]
        with self._reachable(outputs, progress) as url:
            progress(f"running the smoke test with {image}")
            with SandboxClient(base_url=url, context=self.context, auto_cleanup=False) as client:
                report = run_smoke(
                    client,
                    image=image,
                    on_step=lambda step: progress(f"{'PASS' if step.ok else 'FAIL'} {step.name}"),
                )
        if not report.ok:
            failed = "; ".join(f"{s.name}: {s.message}" for s in report.failed)
            raise OrchardError(
                f"smoke test failed: {failed}",
                hint=f"`orchard smoke --context {self.context} --image {image}` shows each check",
            )
        return f"{len(report.steps)} checks passed in {report.seconds:.1f} s", {}

    def _serves(self, url: str | None) -> bool:
        """Whether the service at ``url`` (None: the context's URL) answers and takes the
        context's key: an authenticated read, since another service may answer there (a local
        Orchard on 127.0.0.1:8000, where a cluster's port-forward would go)."""
        from orchard_env.sdk import SandboxClient

        try:
            with SandboxClient(
                base_url=url, context=self.context, retries=0, auto_cleanup=False
            ) as client:
                client.list_sandboxes(labels={"orchard-up": "probe"}, chunk_size=1)
        except OrchardError:
            return False
        return True

    @contextlib.contextmanager
    def _reachable(self, outputs: Outputs, progress: Progress) -> Iterator[str | None]:
        """The URL to smoke-test: None (the context's) when the service serves there, else a
        ``kubectl port-forward`` to a free local port, for the duration."""
        namespace = outputs["deploy"]["namespace"]
        if outputs["deploy"].get("port_forward") is None or self._serves(None):
            yield None
            return
        kubectl = shutil.which("kubectl")
        if kubectl is None:
            raise OrchardError(
                "the service is reachable only through a port-forward, and kubectl is not "
                "installed",
                hint=f"run `{outputs['deploy']['port_forward']}` in another terminal (or set "
                "service.load_balancer)",
            )
        from manifests.deploy import port_forward_command

        with socket.socket() as probe:  # a free port: 8000 may be taken (a local Orchard)
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        cluster = outputs["provision"]
        command = port_forward_command(
            namespace, kubeconfig=cluster["kubeconfig"], context=cluster["context"], local_port=port
        )
        progress(f"starting {command}")
        with self.log_file.open("ab") as log:
            forward = subprocess.Popen([kubectl, *shlex.split(command)[1:]], stdout=log, stderr=log)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while not self._serves(url):
                if forward.poll() is not None or time.monotonic() > deadline:
                    raise OrchardError(
                        f"`{command}` did not make the service reachable",
                        hint=f"its output is in {self.log_file}",
                    )
                time.sleep(0.5)
            yield url
        finally:
            forward.terminate()
            forward.wait(timeout=10)

    # --- up / down / status / plan --------------------------------------------------------

    @contextlib.contextmanager
    def _session(self) -> Iterator[None]:
        """Close the cluster connection the kubeconfig target opened, whatever happens."""
        try:
            yield
        finally:
            if isinstance(self._infra, KubeconfigTarget):
                self._infra.close()

    def up(self, on_event: OnEvent | None = None, *, rerun_from: str | None = None) -> UpResult:
        runner = StageRunner(
            self.stages(),
            self.state,
            self.log_file,
            resume_command=self.resume_command,
            on_event=on_event,
        )
        with self._session():
            results = runner.run(rerun_from=rerun_from)
        endpoint = str(self.state.outputs().get("deploy", {}).get("endpoint", ""))
        return UpResult(url=endpoint, context=self.context, stages=results)

    def plan(self) -> DeploymentPlan:
        """Reads only: the infrastructure diff, the images and objects, the hourly cost."""
        from manifests.render import render, values_from_profile

        warnings: list[str] = []
        infra = self.infra
        if isinstance(infra, AksTarget):
            aks_plan = infra.plan()
            changes, warnings = aks_plan.changes, list(aks_plan.warnings)
        else:
            with self._session():
                report = infra.check()
            changes = infra.changes(report)
            warnings = list(report.warnings)
            problem = infra.registry_problem(report)
            if problem:
                warnings.append(problem)
            if report.to_label and not self.consent:
                warnings.append("labelling nodes needs consent: run `up` with --yes")
        outputs = self.state.outputs()
        refs = self._refs(outputs)
        objects = [_object_name(obj) for obj in render(values_from_profile(self.profile, refs))]
        cost = None
        if self.target == "aks":
            from orchard_env.cost.profile import hourly_cost

            try:
                cost = hourly_cost(self.profile)
            except ConfigError as exc:
                warnings.append(f"cost: {exc.message}")
        stages = {stage.name: self.state.status(stage.name) for stage in self.stages()}
        return DeploymentPlan(
            target=self.target,
            name=self.profile.name,
            changes=changes,
            images=refs,
            objects=objects,
            stages=stages,
            cost=cost,
            warnings=warnings,
        )

    def deletion_plan(self) -> list[Change]:
        infra = self.infra
        if isinstance(infra, AksTarget):
            return infra.deletion_plan()
        provision = self.state.outputs().get("provision", {})
        service = self.profile.service
        changes = [
            Change("delete", "namespace", ns)
            for ns in (service.namespace, service.sandbox_namespace)
        ]
        changes += [
            Change("update", "node", node, ("remove the workload=sandbox label and taint",))
            for node in provision.get("labelled_nodes", [])
        ]
        return changes

    def down(self, progress: Progress, changes: list[Change] | None = None) -> None:
        """Delete what ``up`` created; what is already gone is skipped quietly."""
        infra = self.infra
        if isinstance(infra, AksTarget):
            infra.delete(progress, changes)
        else:
            from manifests.deploy import undeploy

            provision = self.state.outputs().get("provision", {})
            undeploy(
                self.profile,
                kubeconfig=str(infra.path),
                context=infra.context,
                progress=progress,
            )
            with self._session():
                infra.unlabel(list(provision.get("labelled_nodes", [])), progress)
        contexts.remove_context(self.context)
        self.state.clear()

    def status(self) -> ServiceStatus:
        detail = {stage: self.state.status(stage) for stage in STAGES}
        detail["state"] = str(self.state.path)
        detail["log"] = str(self.log_file)
        endpoint = self.state.outputs().get("deploy", {}).get("endpoint")
        if not endpoint:
            return ServiceStatus(self.target, False, None, detail)
        from orchard_env.sdk import SandboxClient

        try:
            with SandboxClient(context=self.context, retries=0, auto_cleanup=False) as client:
                health = client.health()
        except OrchardError as exc:
            detail["error"] = exc.message
            return ServiceStatus(self.target, False, str(endpoint), detail)
        detail["backend"] = health.backend
        detail["version"] = health.version
        return ServiceStatus(self.target, True, str(endpoint), detail)


def _object_name(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata", {})
    namespace = meta.get("namespace")
    return f"{obj.get('kind')} {namespace + '/' if namespace else ''}{meta.get('name')}"
