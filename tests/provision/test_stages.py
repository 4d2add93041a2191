"""The staged runner (state file, log file, resume) and a cluster deployment run through it."""

from __future__ import annotations

import json
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchard_env import contexts
from orchard_env.errors import ConfigError, EngineNotFound, OrchardError
from provision.base import Progress, StageResult
from provision.profile import parse_profile
from provision.stages import (
    ClusterDeployment,
    DeploymentState,
    Outputs,
    Stage,
    StageEvent,
    StageRunner,
    _digest,
)
from tests.images.conftest import FakeBuilders, fake_builders
from tests.manifests.kube_fake import RunningFake, start_fake
from tests.provision.test_kubeconfig import FakeCluster, add_daemonset, node, registry

__all__ = ["fake_builders"]  # the image tests' fixture, used here too


class Steps:
    """Synthetic stages that record their runs; ``fail_once`` names one that fails first."""

    def __init__(self, fail_once: str | None = None) -> None:
        self.fail_once = fail_once
        self.ran: list[str] = []
        self.inputs: dict[str, Any] = {"a": 1, "b": 1, "c": 1}

    def stage(self, name: str) -> Stage:
        def run(progress: Progress, outputs: Outputs) -> tuple[str, dict[str, Any]]:
            self.ran.append(name)
            progress(f"{name} working")
            if name == self.fail_once:
                self.fail_once = None
                raise OrchardError(f"{name} broke", hint="give it what it needs")
            seen = sorted(outputs)
            return f"{name} ok", {"value": f"{name}-out", "saw": seen}

        return Stage(name, lambda outputs: {"mine": self.inputs[name], "up": outputs}, run)

    def runner(self, tmp_path: Path, events: list[StageEvent] | None = None) -> StageRunner:
        return StageRunner(
            [self.stage(name) for name in ("a", "b", "c")],
            DeploymentState(tmp_path / "dep" / "state.json"),
            tmp_path / "dep" / "up.log",
            resume_command="orchard up --profile p.yaml",
            on_event=None if events is None else events.append,
        )


def test_a_failed_stage_names_itself_and_the_resume_command_then_resumes(
    tmp_path: Path,
) -> None:
    steps = Steps(fail_once="b")
    events: list[StageEvent] = []
    with pytest.raises(OrchardError) as caught:
        steps.runner(tmp_path, events).run()
    log = tmp_path / "dep" / "up.log"
    assert caught.value.message == "the b stage failed: b broke"
    assert caught.value.hint == (
        "give it what it needs; fix that, then `orchard up --profile p.yaml` resumes at the b "
        f"stage (log: {log})"
    )
    assert steps.ran == ["a", "b"]
    assert [(e.stage, e.kind) for e in events] == [
        ("a", "start"),
        ("a", "message"),
        ("a", "done"),
        ("b", "start"),
        ("b", "message"),
        ("b", "fail"),
    ]
    state = json.loads((tmp_path / "dep" / "state.json").read_text())
    assert (state["stages"]["a"]["status"], state["stages"]["b"]["status"]) == ("done", "failed")
    assert state["stages"]["b"]["error"] == "b broke"
    assert "Traceback" in log.read_text() and "b: b working" in log.read_text()
    assert stat.S_IMODE(log.stat().st_mode) == 0o600

    results = steps.runner(tmp_path).run()
    assert steps.ran == ["a", "b", "b", "c"]  # a skipped, b resumed, c after it
    assert results == [
        StageResult("a", "a ok", skipped=True),
        StageResult("b", "b ok"),
        StageResult("c", "c ok"),
    ]
    assert DeploymentState(tmp_path / "dep" / "state.json").outputs()["c"] == {
        "value": "c-out",
        "saw": ["a", "b"],
    }
    assert [r.skipped for r in steps.runner(tmp_path).run()] == [True, True, True]


def test_changed_inputs_rerun_a_stage_and_from_reruns_the_rest(tmp_path: Path) -> None:
    steps = Steps()
    steps.runner(tmp_path).run()
    steps.ran.clear()
    steps.inputs["b"] = 2  # e.g. a profile edit that concerns b only
    steps.runner(tmp_path).run()
    # c saw b's outputs, which did not change: only b ran again.
    assert steps.ran == ["b"]
    steps.ran.clear()
    steps.runner(tmp_path).run(rerun_from="b")
    assert steps.ran == ["b", "c"]
    with pytest.raises(ConfigError, match="no stage 'x'"):
        steps.runner(tmp_path).run(rerun_from="x")


def test_a_non_orchard_exception_becomes_one_line_with_the_log(tmp_path: Path) -> None:
    def explode(progress: Progress, outputs: Outputs) -> tuple[str, dict[str, Any]]:
        raise KeyError("cluster")

    runner = StageRunner(
        [Stage("provision", lambda _o: None, explode)],
        DeploymentState(tmp_path / "state.json"),
        tmp_path / "up.log",
        resume_command="orchard up",
    )
    with pytest.raises(OrchardError) as caught:
        runner.run()
    assert caught.value.message == "the provision stage failed: KeyError: 'cluster'"
    assert caught.value.hint == (
        f"fix that, then `orchard up` resumes at the provision stage (log: {tmp_path / 'up.log'})"
    )


def test_an_unreadable_state_file_says_how_to_start_over(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError) as caught:
        DeploymentState(path)
    assert caught.value.hint == f"remove {path} to start over (every stage is safe to run again)"
    path.write_text(json.dumps({"version": 99, "stages": {}}))
    with pytest.raises(ConfigError, match="from another version of Orchard"):
        DeploymentState(path)


# --- a kubeconfig deployment through the real stages --------------------------------------------


@pytest.fixture
def cluster() -> Iterator[FakeCluster]:
    fake = FakeCluster(rollout_polls=0)
    running: RunningFake = start_fake(fake)
    for obj in (node("worker-a"), node("worker-b")):
        fake.objects[f"/api/v1/nodes/{obj['metadata']['name']}"] = obj
    add_daemonset(fake, "calico-system", "calico-node")
    try:
        yield fake
    finally:
        running.stop()


def deployment(
    fake: FakeCluster, tmp_path: Path, *, profile: dict[str, Any] | None = None, **kwargs: Any
) -> ClusterDeployment:
    from provision.kubeconfig import KubeconfigTarget

    lab = parse_profile(
        {
            "name": "lab",
            "target": "kubeconfig",
            "kubeconfig": {
                "path": str(fake.kubeconfig(tmp_path / "kubeconfig")),
                "context": "fake",
            },
            "registry": {"server": "registry.example:5000"},
            "image_tag": "1.0.0-test",
            **(profile or {}),
        },
        source="test",
    )
    scheme = "http" if lab.registry.plain_http else "https"
    return ClusterDeployment(
        lab,
        state_dir=tmp_path / "state",
        resume_command="orchard up --profile lab.yaml",
        infra=KubeconfigTarget(lab, registry_transport=registry(401, scheme)),
        **kwargs,
    )


def test_the_plan_of_a_kubeconfig_deployment_only_reads(
    cluster: FakeCluster, tmp_path: Path
) -> None:
    plan = deployment(cluster, tmp_path).plan()
    assert [(c.action, c.name) for c in plan.changes] == [
        ("update", "worker-a"),
        ("update", "worker-b"),
    ]
    assert plan.images["sandbox"] == "registry.example:5000/orchard/sandbox:1.0.0-test"
    assert "Deployment orchard/orchard-orchestrator" in plan.objects
    assert plan.stages == {
        "provision": "pending",
        "images": "pending",
        "deploy": "pending",
        "smoke": "pending",
    }
    assert plan.cost is None
    assert plan.warnings == ["labelling nodes needs consent: run `up` with --yes"]
    assert {r.method for r in cluster.requests} == {"GET"}


def test_the_images_stage_builds_as_the_profile_says_and_pushes_over_plain_http(
    cluster: FakeCluster,
    tmp_path: Path,
    fake_builders: FakeBuilders,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PATH", str(fake_builders.bin_dir))  # podman, and nothing else
    fake_builders.install("podman")
    ca = tmp_path / "proxy-ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    settings = {
        "registry": {"server": "registry.example:5000", "plain_http": True},
        "build": {"base_images": {"BASE_IMAGE": "localhost/debian:12"}, "ca_bundle": str(ca)},
    }
    lab = deployment(cluster, tmp_path, profile=settings, consent=True, smoke=False)
    lab.up()
    builds = {args[args.index("--tag") + 1]: args for args in fake_builders.args("build")}
    orchestrator = builds["registry.example:5000/orchard/orchestrator:1.0.0-test"]
    assert "BASE_IMAGE=localhost/debian:12" in orchestrator
    assert f"id=ca-bundle,src={ca}" in orchestrator
    injector = builds["registry.example:5000/orchard/agent-injector:1.0.0-test"]
    assert not [arg for arg in injector if arg.startswith("BASE_IMAGE=")]  # not its argument
    assert fake_builders.args("push") == [
        ["push", "--tls-verify=false", ref] for ref in lab.plan().images.values()
    ]


def test_up_fails_at_images_without_a_builder_then_resumes_to_deploy(
    cluster: FakeCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # no docker, podman or buildah
    lab = deployment(cluster, tmp_path, consent=True, smoke=False)
    with pytest.raises(EngineNotFound) as caught:
        lab.up()
    assert caught.value.message.startswith("the images stage failed: no image builder works here")
    assert caught.value.hint is not None
    assert caught.value.hint.endswith(
        "fix that, then `orchard up --profile lab.yaml` resumes at the images stage "
        f"(log: {lab.log_file})"
    )
    labels = cluster.objects["/api/v1/nodes/worker-b"]["metadata"]["labels"]
    assert labels == {"workload": "sandbox"}  # provision finished before images failed

    # The images were built and pushed elsewhere (say, by CI): record the stage as done.
    state = DeploymentState(lab.state.path)
    images = next(stage for stage in lab.stages() if stage.name == "images")
    refs = lab.plan().images
    state.update(
        "images",
        status="done",
        inputs=_digest(images.inputs(state.outputs())),
        summary="pushed by CI",
        outputs={"refs": refs},
    )
    events: list[StageEvent] = []
    cluster.requests.clear()
    result = deployment(cluster, tmp_path, consent=True, smoke=False).up(events.append)
    assert [(r.stage, r.skipped) for r in result.stages] == [
        ("provision", True),
        ("images", True),
        ("deploy", False),
    ]
    assert result.url == "http://127.0.0.1:8000"  # no load balancer: a port-forward
    deployed = cluster.get("/apis/apps/v1/namespaces/orchard/deployments/orchard-orchestrator")
    assert deployed is not None
    containers = deployed["spec"]["template"]["spec"]["containers"]
    assert containers[0]["image"] == refs["orchestrator"]
    context = contexts.load_config_file()["contexts"]["lab"]
    assert context["url"] == "http://127.0.0.1:8000" and context["api_key"].startswith("ork_")
    outputs = DeploymentState(lab.state.path).outputs()
    assert outputs["deploy"]["port_forward"].startswith("kubectl -n orchard port-forward")
    assert "api_key" not in json.dumps(outputs)  # the key lives only in the CLI context
