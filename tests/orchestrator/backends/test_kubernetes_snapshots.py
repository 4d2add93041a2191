"""KubernetesBackend.snapshot / delete_snapshot: the fake API server holds the sandbox pod and
a snapshotter pod on its node; the snapshotter is the real HTTP server of
orchard_env.snapshotter (on 127.0.0.1) pushing to the fake registry."""

from __future__ import annotations

import contextlib
import hashlib
import json
import subprocess
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import docker
import pytest

from orchard_env import errors, http1
from orchard_env.agent import relay
from orchard_env.agent.peer import tampered_error
from orchard_env.config import ServiceSettings
from orchard_env.fake_model import FakeModel
from orchard_env.orchestrator.backends.base import Capability, SandboxState
from orchard_env.orchestrator.backends.docker_engine import LABEL_CREATED_BY, LABEL_INSTANCE
from orchard_env.orchestrator.backends.kube_objects import pod_name
from orchard_env.orchestrator.backends.kubernetes import SNAPSHOTTER_LABEL, KubernetesBackend
from orchard_env.orchestrator.gateway import harness
from orchard_env.snapshotter.server import SnapshotterServer, SnapshotterSettings
from tests.orchestrator.backends.conftest import NAMESPACE, Cluster, Start
from tests.orchestrator.backends.kube_fake import (
    NODE,
    SNAPSHOTTER_RBAC_FILE,
    fake_cluster,
    free_port,
)
from tests.orchestrator.backends.registry_fake import PASSWORD, USER, FakeRegistry
from tests.orchestrator.backends.test_kubernetes import make_spec
from tests.orchestrator.backends.test_kubernetes_gateway import call, request
from tests.orchestrator.backends.test_kubernetes_service import create_ready, run
from tests.orchestrator.conftest import eventually

SNAP_NAMESPACE = "orchard-snapshotter"
SNAP_TOKEN = "node-snapshotter-token"
CREDS = f"--creds={USER}:{PASSWORD}"


@pytest.fixture
def registry() -> Iterator[FakeRegistry]:
    server = FakeRegistry().start()
    yield server
    server.stop()


@pytest.fixture
def docker_config(tmp_path: Path, registry: FakeRegistry) -> Path:
    path = tmp_path / "registry.json"
    auths = {"auths": {registry.host: {"username": USER, "password": PASSWORD}}}
    path.write_text(json.dumps(auths))
    return path


@pytest.fixture
def snap_cluster(tmp_path: Path) -> Iterator[Cluster]:
    with fake_cluster(
        tmp_path,
        namespaces=(NAMESPACE, SNAP_NAMESPACE),
        namespace_rbac={SNAP_NAMESPACE: SNAPSHOTTER_RBAC_FILE},  # pods get/list only
    ) as parts:
        yield Cluster(*parts)


@pytest.fixture
def snapshotter(
    registry: FakeRegistry, docker_config: Path, tmp_path: Path
) -> Iterator[SnapshotterServer]:
    token_file = tmp_path / "snapshotter-token"
    token_file.write_text(SNAP_TOKEN)
    settings = SnapshotterSettings(
        token=SNAP_TOKEN,
        target_prefix=f"{registry.host}/orchard/snapshots:",
        credentials={registry.host: (USER, PASSWORD)},
        plain_http=frozenset({registry.host}),
        host="127.0.0.1",
        port=0,
    )
    server = SnapshotterServer(settings)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture
def snap_settings(
    snap_cluster: Cluster,
    tmp_path: Path,
    registry: FakeRegistry,
    docker_config: Path,
    snapshotter: SnapshotterServer,
) -> ServiceSettings:
    return snap_cluster.settings(
        tmp_path / "state",
        registry=f"{registry.host}/orchard/snapshots",
        snapshotter_token_file=tmp_path / "snapshotter-token",
        snapshotter_namespace=SNAP_NAMESPACE,
        snapshotter_port=snapshotter.server_address[1],
        registry_config=docker_config,
        registry_plain_http=True,
    )


@pytest.fixture
async def kube(snap_settings: ServiceSettings) -> AsyncIterator[KubernetesBackend]:
    backend = KubernetesBackend(snap_settings)
    yield backend
    await backend.close()


def add_snapshotter_pod(cluster: Cluster, node: str = NODE, *, running: bool = True) -> None:
    """A snapshotter DaemonSet pod bound to ``node``, reachable on 127.0.0.1."""
    name = f"orchard-snapshotter-{node}"
    cluster.api.create(
        "pods",
        SNAP_NAMESPACE,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": {SNAPSHOTTER_LABEL[0]: SNAPSHOTTER_LABEL[1]}},
            "spec": {"containers": [{"name": "snapshotter", "image": "orchard:1"}]},
        },
    )
    status = {"phase": "Running" if running else "Pending", "podIP": "127.0.0.1"}
    cluster.api.set_pod_status(SNAP_NAMESPACE, name, status, node=node)


async def running_sandbox(kube: KubernetesBackend, cluster: Cluster, **status: Any) -> str:
    """A running sandbox whose main container's status has ``status`` too."""
    spec = make_spec()
    cluster.kubelet.main_status[pod_name(spec.sandbox_id)] = status
    found = await kube.create(spec)
    await eventually(lambda: _running(kube, found.sandbox_id))
    return found.sandbox_id


async def _running(kube: KubernetesBackend, sandbox_id: str) -> bool:
    found = await kube.inspect(sandbox_id)
    return found is not None and found.state is SandboxState.RUNNING


def test_the_snapshot_capability_follows_the_settings(
    snap_settings: ServiceSettings, kube_settings: ServiceSettings
) -> None:
    assert Capability.SNAPSHOT in KubernetesBackend(snap_settings).capabilities
    assert Capability.SNAPSHOT not in KubernetesBackend(kube_settings).capabilities
    off = replace(snap_settings, snapshotter_token_file=None)
    assert Capability.SNAPSHOT not in KubernetesBackend(off).capabilities


async def test_a_node_without_a_running_snapshotter(
    kube: KubernetesBackend, snap_cluster: Cluster
) -> None:
    sandbox_id = await running_sandbox(kube, snap_cluster, containerID="containerd://" + "a" * 64)
    add_snapshotter_pod(snap_cluster, "another-node")
    add_snapshotter_pod(snap_cluster, NODE, running=False)
    with pytest.raises(errors.Unavailable, match=f"no running snapshotter on node {NODE}"):
        await kube.snapshot(sandbox_id, "snap-1")


async def test_the_snapshotters_refusal_reaches_the_caller(
    kube: KubernetesBackend, snap_cluster: Cluster, tmp_path: Path
) -> None:
    sandbox_id = await running_sandbox(
        kube,
        snap_cluster,
        containerID="containerd://" + "ab" * 32,
        imageID="r.io/x@sha256:" + "0" * 64,
    )
    add_snapshotter_pod(snap_cluster)
    with pytest.raises(errors.NotFound, match=f"the snapshotter on node {NODE}: no process"):
        await kube.snapshot(sandbox_id, "snap-1")
    (tmp_path / "snapshotter-token").write_text("a stale token")
    with pytest.raises(errors.AuthenticationRequired, match="snapshotter token"):
        await kube.snapshot(sandbox_id, "snap-1")
    with pytest.raises(errors.SandboxNotFound):
        await kube.snapshot("sb-gone", "snap-1")


async def test_a_sandbox_that_is_not_running_has_no_snapshot(
    kube: KubernetesBackend, snap_cluster: Cluster
) -> None:
    sandbox_id = await running_sandbox(kube, snap_cluster)  # the fake reports no containerID
    with pytest.raises(errors.SandboxNotReady, match="is not running"):
        await kube.snapshot(sandbox_id, "snap-1")


async def test_delete_snapshot_refuses_foreign_refs_and_reports_a_refusing_registry(
    kube: KubernetesBackend, registry: FakeRegistry
) -> None:
    with pytest.raises(errors.InvalidRequest, match="is not a snapshot image"):
        await kube.delete_snapshot("docker.io/library/busybox:1")
    gone = f"{registry.host}/orchard/snapshots:snap-x@sha256:" + "1" * 64
    assert await kube.delete_snapshot(gone) is True
    registry.state.allow_delete = False
    with pytest.raises(errors.NotSupported, match="refused to delete"):
        await kube.delete_snapshot(gone)


@contextlib.contextmanager
def stand_in(
    registry: FakeRegistry,
    docker_client: docker.DockerClient,
    busybox_image: str,
    engine_instance: str,
    command: list[str],
) -> Iterator[tuple[Any, dict[str, str]]]:
    """A real Podman container standing in for a pod's main container (running ``command``
    in the busybox image, pushed to the registry as its base), removed at the end; and the
    container status fields a runtime would report for it (``containerID``, ``imageID``)."""
    base = f"{registry.host}/orchard/busybox:base"
    _podman("push", "--tls-verify=false", CREDS, busybox_image, f"docker://{base}")
    body, _ = registry.state.manifests[("orchard/busybox", "base")]
    base_id = f"{registry.host}/orchard/busybox@sha256:{hashlib.sha256(body).hexdigest()}"
    container = docker_client.containers.run(
        busybox_image,
        command,
        detach=True,
        labels={LABEL_CREATED_BY: "orchard", LABEL_INSTANCE: engine_instance},
    )
    try:
        yield container, {"containerID": f"containerd://{container.id}", "imageID": base_id}
    finally:
        container.remove(force=True)


def _podman(*args: str) -> str:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.engine
async def test_snapshot_pushes_the_sandbox_containers_layer(
    kube: KubernetesBackend,
    snap_cluster: Cluster,
    registry: FakeRegistry,
    docker_client: docker.DockerClient,
    busybox_image: str,
    engine_instance: str,
) -> None:
    """The pod's container is a real Podman container (its id as containerd would report
    it): the real snapshotter finds it through /proc and pushes its layer."""
    command = ["sh", "-c", "echo from-k8s > /workspace/made.txt && sleep 600"]
    with stand_in(registry, docker_client, busybox_image, engine_instance, command) as (
        container,
        status,
    ):
        sandbox_id = await running_sandbox(kube, snap_cluster, **status)
        add_snapshotter_pod(snap_cluster)

        async def written() -> bool:
            return bool(container.exec_run(["test", "-f", "/workspace/made.txt"]).exit_code == 0)

        await eventually(written)
        image = await kube.snapshot(sandbox_id, "snap-k8s")
    assert image.ref.startswith(f"{registry.host}/orchard/snapshots:snap-k8s@sha256:")
    assert 0 < image.size_bytes < 100_000

    _podman("pull", "--tls-verify=false", CREDS, image.ref)
    try:
        assert _podman("run", "--rm", image.ref, "cat", "/workspace/made.txt") == "from-k8s\n"
    finally:
        _podman("rmi", "-f", image.ref)
    assert await kube.delete_snapshot(image.ref) is True
    assert ("orchard/snapshots", "snap-k8s") not in registry.state.manifests


@pytest.mark.engine
async def test_a_fork_and_a_restore_of_a_gateway_sandbox_relay_their_own_calls(
    snap_settings: ServiceSettings,
    snap_cluster: Cluster,
    registry: FakeRegistry,
    docker_client: docker.DockerClient,
    busybox_image: str,
    engine_instance: str,
    model_endpoints: Path,
    model: FakeModel,
    port: int,
    start: Start,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The parent's container is a real Podman container (for the snapshotter); its agent,
    the fork's and the restored sandbox's are the fake kubelet's host processes, each on a
    pod IP of its own. A pod's loopback is its own: here they share the host's, so each new
    sandbox's harness port is another one (``harness.LISTEN_PORT`` when it enrolls)."""
    with stand_in(registry, docker_client, busybox_image, engine_instance, ["sleep", "600"]) as (
        _,
        status,
    ):
        snap_cluster.kubelet.main_status[pod_name("parent")] = status
        add_snapshotter_pod(snap_cluster)
        orchard, http = await start(replace(snap_settings, model_endpoints_file=model_endpoints))
        gateway = {"trajectory_id": "ep-0", "max_calls": 2}
        await create_ready(http, sandbox_id="parent", model_gateway=gateway)
        assert (await call(port, request()))[0] == 200

        fork_port = free_port()
        monkeypatch.setattr(harness, "LISTEN_PORT", fork_port)
        forked = await http.post(
            "/sandboxes/parent/fork", json={"count": 1, "sandbox_ids": ["fork"]}
        )
    assert forked.status_code == 201, forked.text
    snapshot_id = forked.json()["snapshot"]["snapshot_id"]
    [fork] = forked.json()["sandboxes"]
    assert fork["model_gateway"]["trajectory_id"] == "ep-0"
    # Each counts its own budget: the parent's second call is its last, the fork's first
    # is its first. The fork's trajectory changes, not the parent's.
    assert (await call(port, request()))[0] == 200
    moved = await http.put("/sandboxes/fork/trajectory", json={"trajectory_id": "ep-0-b1"})
    assert moved.status_code == 200, moved.text
    assert (await call(fork_port, request()))[0] == 200
    status, answer = await call(port, request())
    assert status == 403, answer
    assert answer["error"]["message"].startswith("model call budget exceeded: 2 of max_calls 2")

    async def calls(sandbox_id: str) -> list[dict[str, Any]]:
        response = await http.get(f"/sandboxes/{sandbox_id}/model-calls")
        found: list[dict[str, Any]] = response.json()["calls"]
        return found

    async def recorded() -> bool:
        return len(await calls("parent")) == 3 and len(await calls("fork")) == 1

    await eventually(recorded)
    [fork_call] = await calls("fork")
    assert (fork_call["sandbox_id"], fork_call["trajectory_id"]) == ("fork", "ep-0-b1")
    parent_calls = await calls("parent")
    assert {(c["sandbox_id"], c["trajectory_id"]) for c in parent_calls} == {("parent", "ep-0")}
    assert fork_call["seq"] == parent_calls[0]["seq"]  # numbered afresh

    # Each has a dummy key and an agent key of its own: the parent's cannot park a relay
    # at the fork's agent.
    parent_record = await orchard.store.get_sandbox("parent")
    fork_record = await orchard.store.get_sandbox("fork")
    assert parent_record is not None and fork_record is not None
    assert parent_record.model_gateway is not None and fork_record.model_gateway is not None
    assert parent_record.model_gateway.dummy_key != fork_record.model_gateway.dummy_key
    job = await run(http, "fork", "echo $OPENAI_API_KEY")
    assert job["stdout"] == f"{fork_record.model_gateway.dummy_key}\n"
    assert parent_record.agent is not None and fork_record.agent is not None
    fork_agent = fork_record.agent
    assert fork_agent.host is not None and fork_agent.port is not None
    with pytest.raises(errors.AgentUnavailable, match="refused the model relay: HTTP 401"):
        await relay.park(
            fork_agent.host,
            fork_agent.port,
            parent_record.agent.token.encode(),
            lambda message: tampered_error("the fork's agent", message),
            limit=http1.MAX_HEAD,
        )

    # A restore of the snapshot the fork was made from (the parent's, on trajectory ep-0),
    # with the parent and the fork gone.
    for gone in ("parent", "fork"):
        assert (await http.delete(f"/sandboxes/{gone}")).status_code == 200
    restored_port = free_port()
    monkeypatch.setattr(harness, "LISTEN_PORT", restored_port)
    restored = await http.post(f"/snapshots/{snapshot_id}/restore", json={"sandbox_id": "restored"})
    assert restored.status_code == 201, restored.text
    assert restored.json()["model_gateway"]["max_calls"] == 2
    assert (await call(restored_port, request()))[0] == 200

    async def restored_recorded() -> bool:
        return len(await calls("restored")) == 1

    await eventually(restored_recorded)
    [restored_call] = await calls("restored")
    assert (restored_call["sandbox_id"], restored_call["trajectory_id"]) == ("restored", "ep-0")
    assert len(model.requests) == 4  # the call over the parent's budget never left
