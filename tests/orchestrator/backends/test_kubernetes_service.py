"""The orchestrator (create_app, in-process) on the Kubernetes backend and a fake cluster: the
readiness probe, exec and files really talk to the agent at the pod's IP; reconciliation after
a restart that lost every record adopts the pods and deletes none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from orchard_env.config import ServiceSettings
from orchard_env.orchestrator.keys import create_key
from tests.orchestrator.backends.conftest import NAMESPACE, Cluster, Start
from tests.orchestrator.backends.kube_fake import MISSING_IMAGE, node
from tests.orchestrator.conftest import eventually

IMAGE = "registry.example/sandbox:1"


async def create_ready(http: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    response = await http.post("/sandboxes", json={"image": IMAGE, **body})
    assert response.status_code == 201, response.text
    sandbox_id = response.json()["sandbox_id"]
    ready = await http.get(f"/sandboxes/{sandbox_id}/wait", params={"timeout": 20})
    assert ready.status_code == 200, ready.text
    info: dict[str, Any] = ready.json()
    assert info["status"] == "ready", info
    return info


async def run(http: httpx.AsyncClient, sandbox_id: str, command: str) -> dict[str, Any]:
    response = await http.post(
        f"/sandboxes/{sandbox_id}/exec", json={"command": command, "wait": True}
    )
    assert response.status_code == 200, response.text
    job: dict[str, Any] = response.json()
    return job


async def test_a_sandbox_on_kubernetes_from_create_to_delete(
    start: Start, cluster: Cluster, kube_settings: ServiceSettings
) -> None:
    orchard, http = await start(kube_settings)
    assert orchard.backend.name == "kubernetes"
    info = await create_ready(http, sandbox_id="box", labels={"team": "rl"}, block_network=False)
    assert info["backend"] == "kubernetes" and info["pod_name"] == "box"
    job = await run(http, "box", "echo hello from the pod")
    assert (job["status"], job["stdout"]) == ("succeeded", "hello from the pod\n")
    pod = cluster.api.get("pods", NAMESPACE, "box")
    assert pod is not None and pod["metadata"]["labels"]["orchard.label/team"] == "rl"

    deleted = await http.delete("/sandboxes/box")
    assert deleted.status_code == 200
    assert cluster.names("pods") == []
    assert cluster.names("secrets") == [] and cluster.names("networkpolicies") == []


async def test_an_unpullable_image_is_422_at_once_and_leaves_nothing(
    start: Start, cluster: Cluster, kube_settings: ServiceSettings
) -> None:
    _, http = await start(kube_settings)
    response = await http.post("/sandboxes", json={"image": MISSING_IMAGE, "sandbox_id": "nope"})
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert detail["code"] == "image_not_found"
    assert detail["message"].startswith(
        "image 'registry.example/missing:1' cannot be pulled on node aks-sandbox-0: ErrImagePull: "
    )
    assert cluster.names("pods") == [] and cluster.names("secrets") == []
    assert (await http.get("/sandboxes/nope")).status_code == 404


async def test_unschedulable_is_shown_with_the_reason_until_a_node_joins(
    start: Start, cluster: Cluster, kube_settings: ServiceSettings
) -> None:
    _, http = await start(kube_settings)
    response = await http.post("/sandboxes", json={"image": IMAGE, "sandbox_id": "big", "cpu": 12})
    assert response.status_code == 201

    async def unschedulable() -> bool:
        info = (await http.get("/sandboxes/big")).json()
        return bool(info["status"] == "unschedulable")

    await eventually(unschedulable)
    info = (await http.get("/sandboxes/big")).json()
    assert info["status_message"].startswith("0/1 nodes are available: 1 Insufficient cpu.")
    cluster.kubelet.grow(8.0)
    ready = await http.get("/sandboxes/big/wait", params={"timeout": 20})
    assert ready.json()["status"] == "ready"
    assert (await run(http, "big", "echo up"))["stdout"] == "up\n"


async def test_a_restart_that_lost_its_state_adopts_the_pods_and_deletes_none(
    start: Start, cluster: Cluster, kube_settings: ServiceSettings, tmp_path: Path
) -> None:
    first, http = await start(kube_settings)
    await create_ready(http, sandbox_id="keeper", labels={"k": "v"})
    await run(http, "keeper", "echo kept > note.txt")
    uid = cluster.api.get("pods", NAMESPACE, "keeper")["metadata"]["uid"]  # type: ignore[index]

    # Another orchestrator process with an empty database (lost state), same cluster.
    lost = cluster.settings(tmp_path / "lost-state")
    second, http2 = await start(lost)
    for _ in range(3):  # reconciliation runs at start and on every reaper pass
        await second.reaper.run_pass()
    ready = await http2.get("/sandboxes/keeper/wait", params={"timeout": 20})
    info = ready.json()
    assert (info["status"], info["image"], info["labels"]) == ("ready", IMAGE, {"k": "v"})
    job = await run(http2, "keeper", "cat note.txt")
    assert job["stdout"] == "kept\n"
    pod = cluster.api.get("pods", NAMESPACE, "keeper")
    assert pod is not None and pod["metadata"]["uid"] == uid  # the same pod, never re-made
    assert cluster.api.calls("DELETE", "pods") == []
    assert first.backend is not second.backend


async def test_a_pod_that_dies_fails_its_sandbox_with_the_reason(
    start: Start, cluster: Cluster, kube_settings: ServiceSettings
) -> None:
    orchard, http = await start(kube_settings)
    await create_ready(http, sandbox_id="fragile")
    cluster.kubelet.terminate("fragile", exit_code=137, reason="OOMKilled")

    async def seen() -> bool:
        found = await orchard.backend.inspect("fragile")
        return found is not None and found.exit_code == 137

    await eventually(seen)
    await orchard.reaper.run_pass()
    info = (await http.get("/sandboxes/fragile")).json()
    assert info["status"] == "failed"
    assert info["status_message"] == (
        "OOMKilled: its container was killed for using more than its memory limit of 2Gi, "
        "exit code 137; give it more with `memory` at create"
    )
    assert cluster.names("pods") == []


async def test_a_warm_pool_on_kubernetes_keeps_scheduled_pods_and_hands_them_out(
    start: Start, cluster: Cluster, kube_settings: ServiceSettings
) -> None:
    orchard, http = await start(kube_settings)
    made = await http.post("/pools", json={"name": "warm", "image": IMAGE, "size": 2})
    assert made.status_code == 201, made.text

    async def full() -> bool:
        info = (await http.get("/pools/warm")).json()
        return bool(info["ready"] == 2)

    await eventually(full, 20)
    waiting = set(cluster.names("pods"))
    assert len(waiting) == 2
    for name in waiting:  # already scheduled and running: a burst waits on neither
        pod = cluster.api.get("pods", NAMESPACE, name)
        assert (
            pod is not None and pod["spec"].get("nodeName") and pod["status"]["phase"] == "Running"
        )
        # No deadline of its own: a claim starts its lifetime again (the reaper ends it).
        assert "activeDeadlineSeconds" not in pod["spec"]
    secrets = cluster.names("secrets")  # each its own agent secret
    assert len(secrets) == 2 and all(any(n in s for s in secrets) for n in waiting)

    created = await http.post("/sandboxes", json={"image": IMAGE, "labels": {"team": "rl"}})
    claimed = created.json()
    assert claimed["sandbox_id"] in waiting and claimed["status"] == "ready"
    assert (await run(http, claimed["sandbox_id"], "echo from the pool"))["stdout"] == (
        "from the pool\n"
    )
    await eventually(full, 20)
    assert len(cluster.names("pods")) == 3

    # A restart on the same state finds the same pods: nothing re-made, nothing deleted.
    pods_before = set(cluster.names("pods"))
    await orchard.pools.close()
    second, http2 = await start(kube_settings)
    for _ in range(2):
        await second.reaper.run_pass()
    assert set(cluster.names("pods")) == pods_before
    assert cluster.api.calls("DELETE", "pods") == []

    removed = await http2.delete("/pools/warm")
    assert removed.status_code == 200
    assert cluster.names("pods") == [claimed["sandbox_id"]]
    [secret] = cluster.names("secrets")
    assert claimed["sandbox_id"] in secret


async def test_resources_come_from_the_sandbox_nodes_and_the_namespace_pods(
    start: Start, cluster: Cluster, kube_settings: ServiceSettings
) -> None:
    sandbox_labels = {"workload": "sandbox", "kubernetes.io/arch": "amd64"}
    cluster.api.nodes = {
        "aks-sbx-0": node(
            "aks-sbx-0",
            sandbox_labels,
            capacity={"cpu": "8", "memory": "32Gi"},
            allocatable={"cpu": "7820m", "memory": "28000000Ki"},
        ),
        "aks-sbx-1": node(
            "aks-sbx-1",
            sandbox_labels,
            capacity={"cpu": "4", "memory": "16Gi"},
            allocatable={"cpu": "3860m", "memory": "14Gi"},
        ),
        # A system node: sandboxes never run there, so it is no capacity of theirs.
        "aks-sys-0": node(
            "aks-sys-0",
            {"kubernetes.io/arch": "amd64"},
            capacity={"cpu": "8", "memory": "32Gi"},
            allocatable={"cpu": "8", "memory": "32Gi"},
        ),
    }
    orchard, http = await start(kube_settings)
    await create_ready(http, sandbox_id="mine", cpu="500m", memory="256Mi")
    # Another tenant's sandbox, and a pod of some other service in the namespace.
    stranger = await create_key(orchard.store, "stranger")
    theirs = {"X-API-Key": stranger.api_key}
    created = await http.post(
        "/sandboxes",
        json={"image": IMAGE, "sandbox_id": "theirs", "cpu": "2", "memory": "1Gi"},
        headers=theirs,
    )
    assert created.status_code == 201, created.text
    waited = await http.get("/sandboxes/theirs/wait", params={"timeout": 20}, headers=theirs)
    assert waited.json()["status"] == "ready"
    cluster.api.create(
        "pods",
        NAMESPACE,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "unrelated", "namespace": NAMESPACE},
            "spec": {
                "containers": [
                    {"name": "a", "resources": {"requests": {"cpu": "250m", "memory": "64Mi"}}},
                    {"name": "b", "resources": {"requests": {"memory": "64Mi"}}},
                ]
            },
            "status": {"phase": "Running"},
        },
    )

    report = (await http.get("/resources")).json()
    assert report["status"] == "ok" and report["scope"] == "service"
    assert [n["name"] for n in report["nodes"]] == ["aks-sbx-0", "aks-sbx-1"]
    assert report["total_capacity"] == {"cpu": 12.0, "memory_bytes": 48 * 1024**3}
    allocatable = {"cpu": 11.68, "memory_bytes": 28000000 * 1024 + 14 * 1024**3}
    assert report["total_allocatable"]["cpu"] == pytest.approx(allocatable["cpu"])
    assert report["total_allocatable"]["memory_bytes"] == allocatable["memory_bytes"]
    pods = {p["name"]: p for p in report["sandbox_pods"]}
    assert set(pods) == {"mine", "theirs", "unrelated"}
    assert pods["mine"] == {
        "name": "mine",
        "namespace": NAMESPACE,
        "phase": "Running",
        "cpu_request": 0.5,
        "memory_request_bytes": 256 * 1024**2,
        "sandbox_id": "mine",
    }
    assert pods["unrelated"]["sandbox_id"] is None
    assert pods["unrelated"]["memory_request_bytes"] == 128 * 1024**2
    assert report["total_requested"]["cpu"] == pytest.approx(2.75)
    assert report["available"]["cpu"] == pytest.approx(11.68 - 2.75)
    assert report["sandboxes"] == 2

    # A non-admin key sees the nodes, and only its own sandbox among the requests.
    own = (await http.get("/resources", headers=theirs)).json()
    assert own["scope"] == "key" and own["total_allocatable"] == report["total_allocatable"]
    assert [p["name"] for p in own["sandbox_pods"]] == ["theirs"]
    assert own["total_requested"] == {"cpu": 2.0, "memory_bytes": 1024**3}
    assert own["sandboxes"] == 1

    # Finished pods hold nothing; an orchestrator without the node right says what is missing.
    cluster.api.set_pod_status(NAMESPACE, "unrelated", {"phase": "Succeeded"})
    report = (await http.get("/resources")).json()
    assert {p["name"] for p in report["sandbox_pods"]} == {"mine", "theirs"}
    cluster.api.cluster_rules["nodes"].discard("list")
    refused = await http.get("/resources")
    assert refused.status_code == 500
    assert refused.json()["detail"]["message"].startswith(
        "the orchestrator may not list the cluster's nodes: nodes is forbidden"
    )
    assert "ClusterRole orchard-nodes-<namespace>" in refused.json()["detail"]["hint"]
