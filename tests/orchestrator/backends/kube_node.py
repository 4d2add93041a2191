"""The local cluster's real node (scripts/k8s/node.sh) for the ``kube_real`` tier: images of
the local engine imported into its containerd (the agent-injector built from
images/agent-injector with Podman, and busybox), and a deployment whose sandboxes it runs.

Pods reach the node through its RuntimeClass (:data:`RUNTIME_CLASS`, made by node.sh: the
RuntimeClass admission plugin adds its node selector and the toleration of the node's
taint), which the backend sets on sandbox pods from its ``runtime_class`` setting; pods
without it go to the tier's stand-in node (:mod:`tests.orchestrator.backends.kube_real`).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import docker
from kubernetes import client as k8s

from images.build import detect_builder
from manifests.deploy import deploy, undeploy
from orchard_env.agent.client import AgentClient
from orchard_env.config import ServiceSettings
from orchard_env.orchestrator.backends.base import BackendSandbox, SandboxSpec
from provision.profile import parse_profile
from tests.agent.conftest import collect
from tests.images.builds import TEST_REPOSITORY, built_image
from tests.kube_local import LocalCluster, unique_name
from tests.orchestrator.backends.kube_real import deployment_node
from tests.orchestrator.conftest import make_settings

NODE = "orchard-node"
CONTAINERD = "/run/orchard-k8s-containerd/containerd.sock"
TAINT = "orchard.local/real-node"
RUNTIME_CLASS = "orchard-local-node"
MiB = 1024 * 1024
AGENT_PORT = 9090  # the deploy's agent-ingress policy's port
HOST = "10.200.0.1"  # this machine's end of the cluster's veth pair (scripts/k8s/common.sh)
_CTR = ["ctr", "--address", CONTAINERD, "-n", "k8s.io", "images"]


def _ctr(*args: str, data: bytes | None = None) -> None:
    subprocess.run([*_CTR, *args], input=data, capture_output=True, check=True, timeout=300)


def import_image(client: docker.DockerClient, image: str, name: str | None = None) -> str:
    """The engine's ``image`` into the node's containerd (``podman save | ctr images import``),
    also tagged ``name`` if given; returns the name the node knows it by."""
    _ctr("import", "-", data=b"".join(client.images.get(image).save(named=True)))
    return image if name is None else tag_image(image, name)


def tag_image(image: str, name: str) -> str:
    """Give an image the node's containerd holds a further name; returns it."""
    _ctr("tag", "--force", image, name)
    return name


def remove_images(*names: str) -> None:
    """Remove these names from the node's containerd (its layers go with the last name)."""
    _ctr("rm", *names)


def admit_host(api: k8s.ApiClient, namespace: str) -> None:
    """Let :data:`HOST` reach the agents in ``namespace``: the tests' orchestrator is this
    process, on the host, where a deployment's is a pod of the service namespace (which the
    deploy's orchard-agent-ingress policy admits)."""
    policy = {
        "metadata": {"name": "orchard-test-orchestrator-on-host"},
        "spec": {
            "podSelector": {},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"ipBlock": {"cidr": f"{HOST}/32"}}],
                    "ports": [{"port": AGENT_PORT, "protocol": "TCP"}],
                }
            ],
        },
    }
    k8s.NetworkingV1Api(api).create_namespaced_network_policy(namespace, policy)


@dataclass(frozen=True)
class NodeImages:
    injector: str
    sandbox: str  # busybox, under a tag the kubelet does not pull (not :latest)


@contextlib.contextmanager
def node_images(
    docker_client: docker.DockerClient, sandbox_image: str, busybox_image: str
) -> Iterator[NodeImages]:
    bases = {"BUILDER_IMAGE": sandbox_image, "FINAL_IMAGE": busybox_image}
    build = contextlib.contextmanager(built_image)
    with build(docker_client, detect_builder("podman"), "agent-injector", base_images=bases) as ref:
        images = NodeImages(
            import_image(docker_client, ref),
            import_image(docker_client, busybox_image, f"{TEST_REPOSITORY}/busybox:{os.getpid()}"),
        )
    try:
        yield images
    finally:
        remove_images(images.injector, images.sandbox)


@dataclass
class OnNode:
    local: LocalCluster
    images: NodeImages
    namespace: str  # the sandboxes'
    service: str  # the orchestrator's namespace
    kubeconfig: Path  # the orchestrator ServiceAccount's

    def settings(self, state_dir: Path) -> ServiceSettings:
        return make_settings(
            state_dir,
            backend="kubernetes",
            agent_image=self.images.injector,
            k8s_kubeconfig=str(self.kubeconfig),
            k8s_namespace=self.namespace,
            agent_port=AGENT_PORT,
            runtime_class=RUNTIME_CLASS,
        )

    def pod(self, name: str) -> k8s.V1Pod:
        with self.local.admin() as api:
            return k8s.CoreV1Api(api).read_namespaced_pod(name, self.namespace)


@contextlib.contextmanager
def deployed_on_node(
    local_cluster: LocalCluster, images: NodeImages, tmp: Path
) -> Iterator[OnNode]:
    """`orchard deploy` of namespaces of their own, and a kubeconfig of the deployed
    orchestrator's ServiceAccount."""
    service = unique_name("orchard")
    sandboxes = f"{service}-sb"
    profile = parse_profile(
        {
            "target": "kubeconfig",
            "service": {"namespace": service, "sandbox_namespace": sandboxes},
        },
        source="test",
    )
    refs = {
        "orchestrator": "registry.example/orchard/orchestrator:1",
        "agent-injector": images.injector,
    }
    # The orchestrator's own pod goes to the stand-in node (reported ready, never run): the
    # orchestrator under test is this process.
    with deployment_node(local_cluster, service, sandboxes, run_agents=False):
        try:
            deploy(profile, refs, kubeconfig=local_cluster.kubeconfig, interval=0.2)
            kubeconfig = local_cluster.service_account_kubeconfig(
                tmp / "orchestrator.kubeconfig",
                service,
                "orchard-orchestrator",
            )
            with local_cluster.admin() as api:
                admit_host(api, sandboxes)
            yield OnNode(local_cluster, images, sandboxes, service, kubeconfig)
        finally:
            undeploy(profile, kubeconfig=local_cluster.kubeconfig, interval=0.2)


def make_spec(on_node: OnNode, sandbox_id: str, **changes: Any) -> SandboxSpec:
    spec = SandboxSpec(
        sandbox_id=sandbox_id,
        image=on_node.images.sandbox,
        cpu=0.5,
        memory_bytes=256 * MiB,
        block_network=True,
        workdir="/workspace",
        agent_token=f"token-of-{sandbox_id}-{os.getpid()}",
        ttl_seconds=600,
    )
    return replace(spec, **changes)


async def run(found: BackendSandbox, command: str) -> str:
    """``command``'s stdout, run by the sandbox's agent (exit code 0 asserted)."""
    assert found.agent is not None
    async with AgentClient(token=found.agent.token, base_url=found.agent.base_url()) as agent:
        await agent.wait_ready(30)
        result = await collect(agent.exec("job-" + os.urandom(4).hex(), command))
    assert result.exit.exit_code == 0, result.stderr
    return result.stdout.decode()
