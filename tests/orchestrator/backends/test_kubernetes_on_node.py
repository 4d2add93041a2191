"""Orchard's sandboxes on the local cluster's real node (kube_real tier): the Kubernetes
backend, as the deployed orchestrator's ServiceAccount, makes its pods in a namespace that
`orchard deploy` made; the real kubelet runs them with containerd: the agent-injector image
(built from images/agent-injector with Podman, imported into containerd) copies the bundle in
an init container, and the agent answers on the pod's address, which this process reaches
over the cluster's veth pair. Exec, files and PTY sessions go to that agent, also after a
restarted backend adopted the pod; limits are in the pod's cgroups; the kubelet reports what
it could not do (an image it cannot pull, a deadline)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from kubernetes import client as k8s

from orchard_env import errors
from orchard_env.agent.client import AgentClient
from orchard_env.orchestrator.backends.base import SandboxState
from orchard_env.orchestrator.backends.kubernetes import KubernetesBackend, dependent_names
from tests.agent.test_pty import until_exit
from tests.images.builds import TEST_REPOSITORY
from tests.orchestrator.backends.kube_node import NODE, MiB, OnNode, make_spec, run
from tests.orchestrator.conftest import eventually

pytestmark = [pytest.mark.kube_real, pytest.mark.engine]


async def test_a_sandbox_runs_on_the_node_and_its_agent_answers_on_the_pod_address(
    node_kube: KubernetesBackend, on_node: OnNode
) -> None:
    spec = make_spec(on_node, "sb-run")
    found = await node_kube.create(spec)
    assert found.state == SandboxState.RUNNING, found.reason
    assert found.agent is not None and found.agent.host is not None
    assert found.agent.host.startswith("10.244.0.")
    pod = on_node.pod("sb-run")
    assert pod.spec.node_name == NODE
    assert pod.status.qos_class == "Guaranteed"
    assert pod.spec.active_deadline_seconds == 600 + 60
    # The kubelet ran the injector to completion before the sandbox container.
    (injector,) = pod.status.init_container_statuses
    assert injector.state.terminated.exit_code == 0
    assert injector.state.terminated.reason == "Completed"
    secret_name, _ = dependent_names(spec)
    with on_node.local.admin() as api:
        secrets = k8s.CoreV1Api(api).list_namespaced_secret(on_node.namespace).items
    assert [s.metadata.name for s in secrets] == [secret_name]

    # The agent (from the bundle the injector copied) runs commands in the busybox image,
    # inside the pod's cgroups: 256 MiB, half a CPU.
    limits = await run(
        found,
        "cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/cpu/cpu.cfs_quota_us "
        "/sys/fs/cgroup/cpu/cpu.cfs_period_us; pwd",
    )
    memory, quota, period, cwd = limits.split()
    assert int(memory) == 256 * MiB
    assert int(quota) / int(period) == 0.5
    assert cwd == "/workspace"
    assert found.agent is not None
    async with AgentClient(token=found.agent.token, base_url=found.agent.base_url()) as agent:
        await agent.write_file("/workspace/hello.txt", b"from the orchestrator\n")
        assert b"".join([c async for c in agent.read_file("/workspace/hello.txt")]) == (
            b"from the orchestrator\n"
        )
    assert await run(found, "cat /workspace/hello.txt") == "from the orchestrator\n"


async def test_delete_stops_the_pod_and_the_garbage_collector_takes_its_secret(
    node_kube: KubernetesBackend, on_node: OnNode
) -> None:
    found = await node_kube.create(make_spec(on_node, "sb-gone"))
    assert found.state == SandboxState.RUNNING, found.reason
    await node_kube.delete("sb-gone")
    assert await node_kube.inspect("sb-gone") is None

    async def all_gone() -> bool:
        with on_node.local.admin() as api:
            core = k8s.CoreV1Api(api)
            pods = core.list_namespaced_pod(on_node.namespace).items
            secrets = core.list_namespaced_secret(on_node.namespace).items
        return not pods and not secrets

    await eventually(all_gone, 60)


async def test_an_absent_image_fails_the_create_with_the_kubelets_reason(
    node_kube: KubernetesBackend, on_node: OnNode
) -> None:
    absent = f"{TEST_REPOSITORY}/absent:{os.getpid()}"
    with pytest.raises(errors.ImageNotFound) as raised:
        await node_kube.create(make_spec(on_node, "sb-absent", image=absent))
    message = raised.value.message
    assert message.startswith(f"image {absent!r} cannot be pulled on node {NODE}: ErrImagePull: ")
    assert "failed to resolve reference" in message


async def test_the_kubelet_ends_a_sandbox_past_its_active_deadline(
    node_kube: KubernetesBackend, on_node: OnNode
) -> None:
    found = await node_kube.create(make_spec(on_node, "sb-late"))
    assert found.state == SandboxState.RUNNING, found.reason
    # The deadline may be lowered on a running pod: the kubelet enforces it at once.
    with on_node.local.admin() as api:
        k8s.CoreV1Api(api).patch_namespaced_pod(
            "sb-late", on_node.namespace, {"spec": {"activeDeadlineSeconds": 1}}
        )

    async def ended() -> bool:
        sandbox = await node_kube.inspect("sb-late")
        return sandbox is not None and sandbox.state is not SandboxState.RUNNING

    await eventually(ended, 60)
    sandbox = await node_kube.inspect("sb-late")
    assert sandbox is not None
    assert sandbox.reason is not None
    assert sandbox.reason.startswith("DeadlineExceeded: Pod was active on the node longer than")


async def test_a_restarted_backend_adopts_the_sandbox_and_a_pty_reaches_its_agent(
    node_kube: KubernetesBackend, on_node: OnNode, tmp_path: Path
) -> None:
    spec = make_spec(on_node, "sb-pty")
    await node_kube.create(spec)
    restarted = KubernetesBackend(on_node.settings(tmp_path / "state"))
    try:
        found = {s.sandbox_id: s for s in await restarted.list()}["sb-pty"]
        assert found.state == SandboxState.RUNNING
        assert found.agent is not None and found.agent.token == spec.agent_token
        async with AgentClient(token=found.agent.token, base_url=found.agent.base_url()) as agent:
            await agent.wait_ready(30)
            async with await agent.open_pty() as pty:
                script = "tty -s && echo on-a-terminal && exit 7"
                await pty.send({"type": "init", "cmd": ["sh", "-c", script]})
                ready = await pty.recv()
                assert ready is not None and ready["type"] == "ready"
                output, exit_frame = await until_exit(pty)
        assert exit_frame == {"type": "exit", "code": 7}
        assert b"on-a-terminal" in output
    finally:
        await restarted.close()
