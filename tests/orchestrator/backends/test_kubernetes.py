"""The Kubernetes backend against a stateful fake API server over real HTTP (the real
``kubernetes`` client, configured from a kubeconfig), with a fake kubelet running real agents."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from orchard_env import errors
from orchard_env.agent.client import AgentClient
from orchard_env.config import ServiceSettings
from orchard_env.orchestrator.backends import make_backend
from orchard_env.orchestrator.backends.base import (
    Backend,
    BackendSandbox,
    Capability,
    SandboxSpec,
    SandboxState,
)
from orchard_env.orchestrator.backends.kube_objects import ANNOTATION_RECORD, dependent_names
from orchard_env.orchestrator.backends.kubernetes import KubernetesBackend, load_api_client
from tests.orchestrator.backends.conftest import NAMESPACE, Cluster
from tests.orchestrator.backends.kube_fake import (
    CRASH_IMAGE,
    MISSING_IMAGE,
    TOKEN,
    ApiError,
    Obj,
)
from tests.orchestrator.conftest import eventually

IMAGE = "registry.example/sandbox:1"


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


async def answers(found: BackendSandbox) -> dict[str, Any]:
    """The agent's /health through the endpoint the backend reported, once it also accepted
    the token (listing a directory needs it)."""
    assert found.agent is not None
    async with AgentClient(token=found.agent.token, base_url=found.agent.base_url()) as agent:
        await agent.wait_ready(10)
        await agent.list_dir("/")
        return await agent.health()


async def state_of(kube: KubernetesBackend, sandbox_id: str) -> SandboxState | None:
    found = await kube.inspect(sandbox_id)
    return None if found is None else found.state


# --- create ------------------------------------------------------------------------------------


async def test_create_runs_a_pod_whose_agent_answers(
    kube: KubernetesBackend, cluster: Cluster
) -> None:
    assert isinstance(kube, Backend)
    assert kube.capabilities == {Capability.NETWORK_ISOLATION, Capability.PTY}
    found = await kube.create(make_spec())
    assert found.state == SandboxState.RUNNING
    assert found.agent is not None
    assert found.agent.host is not None and found.agent.host.startswith("127.0.0.")
    assert found.agent.port == cluster.kubelet.agent_port
    assert found.agent.token == "token-of-sb-one"
    assert found.record_annotation == make_spec().record_annotation
    assert (await answers(found))["status"] == "ok"
    # The agent runs with the token from the Secret (the kubelet resolved the secretKeyRef).
    wrong = replace(found, agent=replace(found.agent, token="wrong"))
    with pytest.raises(errors.AuthenticationRequired):
        await answers(wrong)

    pod = cluster.api.get("pods", NAMESPACE, "sb-one")
    secret_name = dependent_names(make_spec())[0]
    assert secret_name.startswith("orchard-agent-sb-one-")
    secret = cluster.api.get("secrets", NAMESPACE, secret_name)
    assert pod is not None and secret is not None
    owner = {"apiVersion": "v1", "kind": "Pod", "name": "sb-one", "uid": pod["metadata"]["uid"]}
    assert secret["metadata"]["ownerReferences"] == [owner]
    assert base64.b64decode(secret["data"]["token"]) == b"token-of-sb-one"
    # No network: no egress policy (the namespace's default deny applies) and no open label.
    assert cluster.names("networkpolicies") == []
    assert "orchard.network" not in pod["metadata"]["labels"]
    assert await kube.inspect("sb-one") == found


async def test_a_sandbox_with_network_gets_its_egress_policy(
    kube: KubernetesBackend, cluster: Cluster
) -> None:
    await kube.create(make_spec(block_network=False))
    pod = cluster.api.get("pods", NAMESPACE, "sb-one")
    policy_name = dependent_names(make_spec())[1]
    assert policy_name.startswith("orchard-egress-sb-one-")
    policy = cluster.api.get("networkpolicies", NAMESPACE, policy_name)
    assert pod is not None and policy is not None
    assert pod["metadata"]["labels"]["orchard.network"] == "open"
    assert policy["metadata"]["ownerReferences"][0]["uid"] == pod["metadata"]["uid"]
    selected = policy["spec"]["podSelector"]["matchLabels"].items()
    assert selected <= pod["metadata"]["labels"].items()


async def test_the_same_id_twice_is_sandbox_exists(
    kube: KubernetesBackend, cluster: Cluster
) -> None:
    await kube.create(make_spec())
    with pytest.raises(errors.SandboxExists) as raised:
        await kube.create(make_spec(agent_token="another"))
    assert raised.value.message == (
        "sandbox 'sb-one' already exists (a pod of that name runs in namespace orchard-sandboxes)"
    )
    found = await kube.inspect("sb-one")  # the first one is untouched
    assert found is not None and found.agent is not None
    assert found.agent.token == "token-of-sb-one"


async def test_an_unpullable_image_fails_the_create_within_seconds(
    kube: KubernetesBackend, cluster: Cluster
) -> None:
    started = time.monotonic()
    with pytest.raises(errors.ImageNotFound) as raised:
        await kube.create(make_spec(image=MISSING_IMAGE))
    assert time.monotonic() - started < 5
    assert raised.value.message == (
        "image 'registry.example/missing:1' cannot be pulled on node aks-sandbox-0: "
        'ErrImagePull: Failed to pull image "registry.example/missing:1": rpc error: code = '
        'NotFound desc = failed to pull and unpack image "registry.example/missing:1": failed to '
        'resolve reference "registry.example/missing:1": registry.example/missing:1: not found'
    )
    assert cluster.names("pods") == [] and cluster.names("secrets") == []


async def test_an_unpullable_agent_image_is_a_configuration_error(
    cluster: Cluster, tmp_path: Path
) -> None:
    kube = KubernetesBackend(cluster.settings(tmp_path, agent_image=MISSING_IMAGE))
    try:
        with pytest.raises(errors.ConfigError) as raised:
            await kube.create(make_spec())
    finally:
        await kube.close()
    assert raised.value.message.startswith(
        "the agent-injector image 'registry.example/missing:1' cannot be pulled on node "
        "aks-sandbox-0: ErrImagePull: "
    )
    assert raised.value.hint is not None and "ORCHARD_AGENT_IMAGE" in raised.value.hint


async def test_an_unschedulable_pod_says_why_and_runs_once_a_node_joins(
    kube: KubernetesBackend, cluster: Cluster
) -> None:
    found = await kube.create(make_spec(cpu=12.0))
    assert found.state == SandboxState.UNSCHEDULABLE
    assert found.agent is None
    assert found.reason == (
        "0/1 nodes are available: 1 Insufficient cpu. preemption: 0/1 nodes are available: "
        "1 No preemption victims found for incoming pod."
    )
    cluster.kubelet.grow(8.0)  # the cluster autoscaler adds a node

    async def running() -> bool:
        return await state_of(kube, "sb-one") == SandboxState.RUNNING

    await eventually(running)
    found = await kube.inspect("sb-one")
    assert found is not None
    assert (await answers(found))["status"] == "ok"


async def test_a_container_that_exits_at_once_is_reported_with_its_message(
    kube: KubernetesBackend,
) -> None:
    found = await kube.create(make_spec(image=CRASH_IMAGE))
    assert found.state == SandboxState.EXITED
    assert found.exit_code == 1
    assert found.reason == "Error: agent: cannot start: exec format error"
    assert found.agent is None


async def test_a_pod_that_dies_later_is_seen_through_the_watch(
    kube: KubernetesBackend, cluster: Cluster
) -> None:
    await kube.create(make_spec())
    gets_before = len(cluster.api.calls("GET", "pods/sb-one"))
    cluster.kubelet.terminate("sb-one", exit_code=137, reason="OOMKilled")

    async def exited() -> bool:
        return await state_of(kube, "sb-one") == SandboxState.EXITED

    await eventually(exited)
    found = await kube.inspect("sb-one")
    assert found is not None
    assert (found.exit_code, found.reason) == (137, "OOMKilled")
    assert len(cluster.api.calls("GET", "pods/sb-one")) == gets_before  # from the cache


# --- delete, list, restart ---------------------------------------------------------------------


async def test_delete_removes_pod_secret_and_policy_and_is_quiet_twice(
    kube: KubernetesBackend, cluster: Cluster
) -> None:
    found = await kube.create(make_spec(block_network=False))
    await kube.delete("sb-one")
    assert cluster.names("pods") == []
    assert cluster.names("secrets") == []
    assert cluster.names("networkpolicies") == []
    deletes = cluster.api.calls("DELETE", "pods/sb-one")
    assert len(deletes) == 1 and deletes[0].query["gracePeriodSeconds"] == "0"
    assert await kube.inspect("sb-one") is None
    await kube.delete("sb-one")
    await kube.delete("never-was")
    assert found.agent is not None

    async def agent_stopped() -> bool:  # by the kubelet, once it learnt of the delete
        async with AgentClient(token=found.agent.token, base_url=found.agent.base_url()) as a:
            try:
                await a.health()
            except errors.AgentUnavailable:
                return True
            return False

    await eventually(agent_stopped)


async def test_a_pod_deleted_by_someone_else_takes_its_secret_along(
    kube: KubernetesBackend, cluster: Cluster
) -> None:
    await kube.create(make_spec(block_network=False))
    cluster.api.delete("pods", NAMESPACE, "sb-one")  # e.g. kubectl delete pod
    assert cluster.names("secrets") == [] and cluster.names("networkpolicies") == []

    async def gone() -> bool:
        return await kube.inspect("sb-one") is None

    await eventually(gone)
    await kube.delete("sb-one")


async def test_list_and_a_restarted_backend_find_every_pod_of_the_instance(
    kube: KubernetesBackend, cluster: Cluster, kube_settings: ServiceSettings
) -> None:
    await kube.create(make_spec("sb-a"))
    await kube.create(make_spec("sb-b", block_network=False))
    other = KubernetesBackend(replace(kube_settings, instance="other"))
    try:
        await other.create(make_spec("sb-c"))
        assert [s.sandbox_id for s in await other.list()] == ["sb-c"]
        assert await other.inspect("sb-a") is None  # another instance's pod is not its own
        await other.delete("sb-a")  # ... and never deleted by it
        assert cluster.names("pods") == ["sb-a", "sb-b", "sb-c"]
    finally:
        await other.close()
    await kube.close()

    # A new process: no tokens in memory; they come from the Secrets.
    restarted = KubernetesBackend(kube_settings)
    try:
        found = {s.sandbox_id: s for s in await restarted.list()}
        assert sorted(found) == ["sb-a", "sb-b"]
        for sandbox_id, sandbox in found.items():
            assert sandbox.state == SandboxState.RUNNING
            assert sandbox.agent is not None and sandbox.agent.token == f"token-of-{sandbox_id}"
            assert sandbox.record_annotation == make_spec(sandbox_id).record_annotation
            assert (await answers(sandbox))["status"] == "ok"
    finally:
        await restarted.close()


# --- the watch ------------------------------------------------------------------------------


def pod_lists(cluster: Cluster) -> int:
    return len(
        [r for r in cluster.api.calls("GET", "pods", watch=False) if r.path.endswith("/pods")]
    )


def pod_watches(cluster: Cluster) -> list[dict[str, str]]:
    return [r.query for r in cluster.api.calls("GET", "pods", watch=True)]


async def watched(cluster: Cluster, watches: int = 1) -> None:
    """Wait until ``watches`` pod watches of the backend have been streaming."""

    async def opened() -> bool:
        return cluster.api.watches_streaming >= watches

    await eventually(opened)


async def test_410_gone_on_an_open_watch_lists_again(
    kube: KubernetesBackend, cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "orchard_env.orchestrator.backends.kube_watch")
    await kube.create(make_spec())
    await watched(cluster)
    lists = pod_lists(cluster)
    cluster.api.expire_watches()
    await watched(cluster, 2)
    assert pod_lists(cluster) == lists + 1
    assert "pod watch expired (410 Gone); listing again" in caplog.messages
    cluster.kubelet.terminate("sb-one")

    async def exited() -> bool:
        return await state_of(kube, "sb-one") == SandboxState.EXITED

    await eventually(exited)


async def test_410_gone_after_a_gap_lists_again_and_sees_what_changed_meanwhile(
    kube: KubernetesBackend, cluster: Cluster
) -> None:
    await kube.create(make_spec("sb-a"))
    await watched(cluster)
    lists = pod_lists(cluster)
    cluster.api.watch_gate.clear()  # the reconnection waits
    cluster.api.drop_watches()
    # Meanwhile: a pod dies, a pod is deleted, and history is compacted past both.
    await kube.create(make_spec("sb-b"))
    cluster.kubelet.terminate("sb-a")
    cluster.api.delete("pods", NAMESPACE, "sb-b")
    cluster.api.expire_watches()
    cluster.api.watch_gate.set()
    await watched(cluster, 2)  # the one after the relist (the one in between was refused)
    assert pod_lists(cluster) == lists + 1
    assert await state_of(kube, "sb-a") == SandboxState.EXITED
    assert await state_of(kube, "sb-b") is None


async def test_a_dropped_watch_resumes_from_where_it_was_without_listing(
    kube: KubernetesBackend, cluster: Cluster
) -> None:
    await kube.create(make_spec())
    await watched(cluster)
    lists = pod_lists(cluster)
    last_seen = cluster.api.get("pods", NAMESPACE, "sb-one")
    assert last_seen is not None
    cluster.api.drop_watches()
    await watched(cluster, 2)
    assert pod_watches(cluster)[1]["resourceVersion"] == last_seen["metadata"]["resourceVersion"]
    assert pod_lists(cluster) == lists
    cluster.kubelet.terminate("sb-one")

    async def exited() -> bool:
        return await state_of(kube, "sb-one") == SandboxState.EXITED

    await eventually(exited)


async def test_a_watch_that_times_out_continues_from_its_bookmark(
    cluster: Cluster, kube_settings: ServiceSettings
) -> None:
    kube = KubernetesBackend(kube_settings, watch_timeout=1)
    try:
        await kube.list()
        await watched(cluster)
        cluster.api.create("pods", "elsewhere-ns", {"metadata": {"name": "unrelated"}})
        await watched(cluster, 2)
        first, second = pod_watches(cluster)[:2]
        assert first["timeoutSeconds"] == "1" and first["allowWatchBookmarks"] == "true"
        # The bookmark carried the revision of the unrelated pod, newer than any of ours.
        assert int(second["resourceVersion"]) > int(first["resourceVersion"])
        assert pod_lists(cluster) == 2  # the backend's list() and the watch's first list
    finally:
        await kube.close()


async def test_close_cuts_an_open_watch_at_once(cluster: Cluster, kube: KubernetesBackend) -> None:
    await kube.list()
    await watched(cluster)
    started = time.monotonic()
    await kube.close()
    assert time.monotonic() - started < 2


# --- errors -------------------------------------------------------------------------------------


async def test_without_the_watch_right_it_still_works_from_direct_reads(
    cluster: Cluster, kube: KubernetesBackend, caplog: pytest.LogCaptureFixture
) -> None:
    cluster.api.rules["pods"].discard("watch")
    found = await kube.create(make_spec())
    assert found.state == SandboxState.RUNNING
    cluster.kubelet.terminate("sb-one")
    assert await state_of(kube, "sb-one") == SandboxState.EXITED
    assert any(r.message == "pod watch failed; retrying" for r in caplog.records)


async def test_a_missing_permission_is_named(cluster: Cluster, kube: KubernetesBackend) -> None:
    cluster.api.rules["networkpolicies"].discard("create")
    with pytest.raises(errors.OrchardError) as raised:
        await kube.create(make_spec(block_network=False))
    assert raised.value.message == (
        "the orchestrator may not create the token Secret or NetworkPolicy of sandbox sb-one in "
        "namespace orchard-sandboxes: networkpolicies is forbidden: User "
        '"system:serviceaccount:orchard:orchard-orchestrator" cannot create resource '
        '"networkpolicies" in API group "networking.k8s.io" in the namespace "orchard-sandboxes"'
    )
    assert raised.value.hint == (
        "grant it in the orchard-orchestrator Role (`orchard deploy` installs it)"
    )
    assert cluster.names("pods") == [] and cluster.names("secrets") == []


async def test_left_overs_of_an_earlier_pod_of_the_same_id_do_not_matter(
    kube: KubernetesBackend, cluster: Cluster
) -> None:
    """A pod deleted behind the orchestrator's back whose dependents the garbage collector has
    not removed yet: the new pod of that id gets Secret and policy names of its own."""
    earlier = make_spec(agent_token="earlier-token", block_network=False)
    dead = {"apiVersion": "v1", "kind": "Pod", "name": "sb-one", "uid": "gone"}
    kinds = ("secrets", "networkpolicies")
    for resource, name in zip(kinds, dependent_names(earlier), strict=True):
        left = {"metadata": {"name": name, "ownerReferences": [dead]}, "data": {"token": "eA=="}}
        cluster.api.create(resource, NAMESPACE, left)
    found = await kube.create(make_spec(block_network=False))
    assert (await answers(found))["status"] == "ok"
    assert len(cluster.names("secrets")) == len(cluster.names("networkpolicies")) == 2


async def test_a_missing_namespace_is_named(cluster: Cluster, tmp_path: Path) -> None:
    kube = KubernetesBackend(cluster.settings(tmp_path, k8s_namespace="nowhere"))
    try:
        with pytest.raises(errors.OrchardError) as raised:
            await kube.create(make_spec())
    finally:
        await kube.close()
    assert raised.value.message == 'could not create pod sb-one: namespaces "nowhere" not found'
    assert raised.value.hint is not None and "does namespace nowhere exist?" in raised.value.hint


async def test_an_api_server_that_is_gone_is_backend_unavailable(
    cluster: Cluster, kube: KubernetesBackend
) -> None:
    cluster.api.close()
    with pytest.raises(errors.BackendUnavailable) as raised:
        await kube.inspect("sb-one")
    assert raised.value.message.startswith(
        f"the Kubernetes API at {cluster.api.url} did not answer: "
    )


async def test_a_rejected_token_is_named(cluster: Cluster, tmp_path: Path) -> None:
    config = cluster.kubeconfig.read_text().replace(TOKEN, "expired")
    (tmp_path / "expired").write_text(config)
    kube = KubernetesBackend(cluster.settings(tmp_path, k8s_kubeconfig=str(tmp_path / "expired")))
    try:
        with pytest.raises(errors.OrchardError) as raised:
            await kube.list()
    finally:
        await kube.close()
    assert raised.value.message == (
        f"the Kubernetes API at {cluster.api.url} rejected the orchestrator's credentials while "
        "it tried to list the sandbox pods: Unauthorized"
    )


async def test_bad_ids_are_invalid_requests(kube: KubernetesBackend) -> None:
    with pytest.raises(errors.InvalidRequest):
        await kube.inspect("Not_A_Label")
    with pytest.raises(errors.InvalidRequest):
        await kube.create(make_spec("Not_A_Label"))


async def test_snapshots_are_not_supported(kube: KubernetesBackend) -> None:
    with pytest.raises(errors.NotSupported):
        await kube.snapshot("sb-one", "snap")
    with pytest.raises(errors.NotSupported):
        await kube.delete_snapshot("ref")


# --- configuration ------------------------------------------------------------------------------


def test_make_backend_builds_it_from_the_settings(kube_settings: ServiceSettings) -> None:
    backend = make_backend(kube_settings)
    assert isinstance(backend, KubernetesBackend)
    asyncio.run(backend.close())


def test_the_agent_image_is_required(kube_settings: ServiceSettings) -> None:
    with pytest.raises(errors.ConfigError) as raised:
        KubernetesBackend(replace(kube_settings, agent_image=None))
    assert raised.value.message == (
        "the kubernetes backend needs the agent-injector image, and agent_image is not set"
    )


def test_the_instance_must_be_a_label_value(kube_settings: ServiceSettings) -> None:
    with pytest.raises(errors.ConfigError) as raised:
        KubernetesBackend(replace(kube_settings, instance="a/b"))
    assert raised.value.message == "instance 'a/b' cannot be a Kubernetes label value"


def test_the_kubeconfig_context_is_honoured(cluster: Cluster, tmp_path: Path) -> None:
    config = json.loads(json.dumps(__import__("yaml").safe_load(cluster.kubeconfig.read_text())))
    config["clusters"].append({"name": "dead", "cluster": {"server": "http://127.0.0.1:9"}})
    config["contexts"].append(
        {"name": "dead", "context": {"cluster": "dead", "user": "orchestrator"}}
    )
    config["current-context"] = "dead"
    path = tmp_path / "two-contexts"
    path.write_text(json.dumps(config))
    settings = cluster.settings(tmp_path, k8s_kubeconfig=str(path))
    assert load_api_client(settings).configuration.host == "http://127.0.0.1:9"
    chosen = load_api_client(replace(settings, k8s_context="fake"))
    assert chosen.configuration.host == cluster.api.url
    chosen.close()


def test_kubeconfig_from_the_environment(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    client = load_api_client(cluster.settings(tmp_path, k8s_kubeconfig=None))
    assert client.configuration.host == cluster.api.url
    client.close()


def test_bad_credentials_are_config_errors(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "missing"
    with pytest.raises(errors.ConfigError) as raised:
        load_api_client(cluster.settings(tmp_path, k8s_kubeconfig=str(missing)))
    assert raised.value.message.startswith(
        f"cannot load the Kubernetes credentials from kubeconfig {missing}: "
    )
    with pytest.raises(errors.ConfigError) as raised:
        load_api_client(cluster.settings(tmp_path, k8s_context="nope"))
    assert raised.value.message.startswith(
        f"cannot load the Kubernetes credentials from kubeconfig {cluster.kubeconfig} "
        "(context nope): "
    )
    # In a pod without a mounted service-account token:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    assert not Path("/var/run/secrets/kubernetes.io/serviceaccount/token").exists()
    with pytest.raises(errors.ConfigError) as raised:
        load_api_client(cluster.settings(tmp_path, k8s_kubeconfig=None))
    assert raised.value.message.startswith(
        "cannot load the Kubernetes credentials from the in-cluster service account: "
    )


async def test_the_record_annotation_travels_on_the_pod(
    kube: KubernetesBackend, cluster: Cluster
) -> None:
    await kube.create(make_spec())
    pod = cluster.api.get("pods", NAMESPACE, "sb-one")
    assert pod is not None
    assert pod["metadata"]["annotations"][ANNOTATION_RECORD] == make_spec().record_annotation


async def test_dependents_that_cannot_be_made_leave_nothing_behind(
    kube: KubernetesBackend, cluster: Cluster
) -> None:
    def refuse(_body: Obj) -> None:
        raise ApiError(500, "InternalError", "etcdserver: request timed out")

    cluster.api.before_create["secrets"] = refuse
    with pytest.raises(errors.BackendUnavailable) as raised:
        await kube.create(make_spec())
    assert raised.value.message == (
        f"the Kubernetes API at {cluster.api.url} is overloaded or failing: "
        "etcdserver: request timed out"
    )
    assert cluster.names("pods") == []
