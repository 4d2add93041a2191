"""The Kubernetes backend against the real local control plane (kube_real tier): what
`orchard deploy` installs (namespaces with their Pod Security labels, the Role, the
ServiceAccount), the backend authenticated as that ServiceAccount with a real token, the real
scheduler binding its pods, the garbage collector, etcd compaction. The node is a Node object
whose pods a FakeKubelet runs (real agents on loopback addresses, status PATCHed to the real
API server)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from manifests.deploy import deploy, undeploy
from orchard_env.config import ServiceSettings
from orchard_env.orchestrator.backends.base import SandboxSpec, SandboxState
from orchard_env.orchestrator.backends.kubernetes import KubernetesBackend, dependent_names
from provision.profile import parse_profile
from tests.kube_local import LocalCluster, unique_name
from tests.orchestrator.backends.conftest import AGENT_IMAGE
from tests.orchestrator.backends.kube_fake import FakeKubelet, free_port
from tests.orchestrator.backends.kube_real import NODE, deployment_node
from tests.orchestrator.backends.test_kubernetes import answers, state_of
from tests.orchestrator.conftest import eventually, make_settings

pytestmark = pytest.mark.kube_real
IMAGE = "registry.example/sandbox:1"
REFS = {"orchestrator": "registry.example/orchard/orchestrator:1", "agent-injector": AGENT_IMAGE}


@dataclass
class Real:
    local: LocalCluster
    kubelet: FakeKubelet
    namespace: str  # the sandboxes'
    kubeconfig: Path  # the orchestrator ServiceAccount's

    def settings(self, state_dir: Path, **overrides: Any) -> ServiceSettings:
        values: dict[str, Any] = {
            "backend": "kubernetes",
            "agent_image": AGENT_IMAGE,
            "k8s_kubeconfig": str(self.kubeconfig),
            "k8s_namespace": self.namespace,
            "agent_port": self.kubelet.agent_port,
            **overrides,
        }
        return make_settings(state_dir, **values)

    def names(self, resource: str) -> list[str]:
        with self.local.admin() as api:
            core = k8s.CoreV1Api(api)
            listing = {
                "pods": core.list_namespaced_pod,
                "secrets": core.list_namespaced_secret,
                "networkpolicies": k8s.NetworkingV1Api(api).list_namespaced_network_policy,
            }[resource](self.namespace)
        return sorted(
            item.metadata.name
            for item in listing.items
            # the namespace's own: the deploy's default-deny and agent-ingress policies
            if not (resource == "networkpolicies" and not item.metadata.owner_references)
        )


@pytest.fixture
def real(local_cluster: LocalCluster, tmp_path: Path) -> Iterator[Real]:
    service = unique_name("orchard")
    sandboxes = f"{service}-sb"
    profile = parse_profile(
        {"target": "kubeconfig", "service": {"namespace": service, "sandbox_namespace": sandboxes}},
        source="test",
    )
    with deployment_node(local_cluster, service, sandboxes, run_agents=True) as pods:
        kubelet = FakeKubelet(
            pods, agent_port=free_port(), node_cpu=float("inf"), namespace=sandboxes
        )
        try:
            deploy(profile, REFS, kubeconfig=local_cluster.kubeconfig, interval=0.2)
            kubeconfig = local_cluster.service_account_kubeconfig(
                tmp_path / "orchestrator.kubeconfig", service, "orchard-orchestrator"
            )
            yield Real(local_cluster, kubelet, sandboxes, kubeconfig)
        finally:
            try:
                undeploy(profile, kubeconfig=local_cluster.kubeconfig, interval=0.2)
            finally:
                kubelet.close()


@pytest.fixture
async def kube(real: Real, tmp_path: Path) -> AsyncIterator[KubernetesBackend]:
    backend = KubernetesBackend(real.settings(tmp_path / "state"))
    yield backend
    await backend.close()


def make_spec(sandbox_id: str = "sb-one", **changes: Any) -> SandboxSpec:
    spec = SandboxSpec(
        sandbox_id=sandbox_id,
        image=IMAGE,
        cpu=1.0,
        memory_bytes=2 * 1024**3,
        block_network=True,
        workdir="/workspace",
        agent_token=f"token-of-{sandbox_id}",
        owner="k1",
        ttl_seconds=600,
        record_annotation=json.dumps({"sandbox_id": sandbox_id, "ttl_seconds": 600}),
    )
    return replace(spec, **changes)


async def test_create_is_admitted_scheduled_and_its_agent_answers(
    kube: KubernetesBackend, real: Real
) -> None:
    found = await kube.create(make_spec(block_network=False))
    assert found.state == SandboxState.RUNNING
    assert (await answers(found))["status"] == "ok"
    with real.local.admin() as api:
        pod = k8s.CoreV1Api(api).read_namespaced_pod("sb-one", real.namespace)
    assert pod.spec.node_name == NODE  # bound by the real scheduler
    assert pod.spec.active_deadline_seconds is not None
    limits = pod.spec.containers[0].resources.limits
    assert limits["cpu"] == "1" and limits["memory"] == str(2 * 1024**3)
    # The real API server defaulted and kept what the backend sent, under baseline admission.
    assert pod.spec.init_containers[0].image == AGENT_IMAGE
    secret_name, policy_name = dependent_names(make_spec())
    assert real.names("secrets") == [secret_name]
    assert real.names("networkpolicies") == [policy_name]


async def test_delete_and_the_garbage_collector_remove_every_dependent(
    kube: KubernetesBackend, real: Real
) -> None:
    await kube.create(make_spec("sb-a", block_network=False))
    await kube.create(make_spec("sb-b", block_network=False))
    await kube.delete("sb-a")
    assert await kube.inspect("sb-a") is None
    # sb-b deleted by someone else (kubectl delete pod): the real garbage collector follows
    # the ownerReferences to its Secret and NetworkPolicy.
    with real.local.admin() as api:
        k8s.CoreV1Api(api).delete_namespaced_pod("sb-b", real.namespace)

    async def all_gone() -> bool:
        return all(not real.names(kind) for kind in ("pods", "secrets", "networkpolicies"))

    await eventually(all_gone, 60)

    async def forgotten() -> bool:
        return await kube.inspect("sb-b") is None

    await eventually(forgotten)


async def test_an_unschedulable_pod_reports_the_real_schedulers_reason(
    kube: KubernetesBackend,
) -> None:
    found = await kube.create(make_spec(cpu=16.0))
    assert found.state == SandboxState.UNSCHEDULABLE
    assert found.agent is None
    assert found.reason is not None
    # (With a real node up too, it also says that node's taint is not tolerated.)
    assert found.reason.startswith("0/")
    assert "nodes are available: 1 Insufficient cpu" in found.reason


async def test_a_restarted_backend_adopts_the_pods_with_their_tokens(
    kube: KubernetesBackend, real: Real, tmp_path: Path
) -> None:
    await kube.create(make_spec("sb-a"))
    await kube.create(make_spec("sb-b", block_network=False))
    await kube.close()
    restarted = KubernetesBackend(real.settings(tmp_path / "state"))
    try:
        found = {s.sandbox_id: s for s in await restarted.list()}
        assert sorted(found) == ["sb-a", "sb-b"]
        for sandbox_id, sandbox in found.items():
            assert sandbox.state == SandboxState.RUNNING
            assert sandbox.agent is not None and sandbox.agent.token == f"token-of-{sandbox_id}"
            assert (await answers(sandbox))["status"] == "ok"
    finally:
        await restarted.close()


async def test_the_watch_survives_410_gone_after_an_etcd_compaction(
    real: Real, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "orchard_env.orchestrator.backends.kube_watch")
    kube = KubernetesBackend(real.settings(tmp_path / "state"), watch_timeout=1)
    try:
        await kube.create(make_spec())
        # History moves on elsewhere (two revisions: a watch from revision r needs r + 1),
        # and etcd forgets everything before it: the watch's next reconnection (its timeout
        # is 1 s) asks for a compacted resourceVersion, and the API server answers 410.
        with real.local.admin() as api:
            core = k8s.CoreV1Api(api)
            core.create_namespaced_config_map(real.namespace, {"metadata": {"name": "bump"}})
            core.delete_namespaced_config_map("bump", real.namespace)
        await asyncio.to_thread(real.local.compact_etcd)

        async def relisted() -> bool:
            return "pod watch expired (410 Gone); listing again" in caplog.messages

        await eventually(relisted, 30)
        real.kubelet.terminate("sb-one")  # seen through the watch after the relist

        async def exited() -> bool:
            return await state_of(kube, "sb-one") == SandboxState.EXITED

        await eventually(exited, 30)
    finally:
        await kube.close()
