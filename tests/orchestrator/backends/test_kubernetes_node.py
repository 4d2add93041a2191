"""A pod on the local cluster's real node (containerd, runc, CNI, the kubelet and kube-proxy,
scripts/k8s/node.sh), from an image of the local engine imported into containerd: it runs,
with its memory limit in its cgroup and an address of the pod network, and reaches the API
server through the kubernetes Service's cluster IP."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import docker
import pytest
from kubernetes import client as k8s

from tests.kube_local import LocalCluster, unique_name
from tests.orchestrator.backends.kube_node import NODE, TAINT, import_image

pytestmark = [pytest.mark.kube_real, pytest.mark.engine]


@pytest.fixture
def namespace(local_cluster: LocalCluster) -> Iterator[str]:
    with local_cluster.admin() as api:
        core = k8s.CoreV1Api(api)
        name = unique_name("node-test")
        core.create_namespace({"metadata": {"name": name}})
        try:
            yield name
        finally:
            core.delete_namespace(name)


def _run_pod(
    local_cluster: LocalCluster, namespace: str, image: str, script: str, **container: Any
) -> str:
    """Run ``script`` (busybox sh) in a pod on the real node to its end; its log."""
    name = unique_name("pod")
    pod = {
        "metadata": {"name": name},
        "spec": {
            "nodeName": NODE,
            "restartPolicy": "Never",
            "tolerations": [{"key": TAINT, "operator": "Exists"}],
            "containers": [
                {
                    "name": "main",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "command": ["/bin/busybox", "sh", "-c", script],
                    **container,
                }
            ],
        },
    }
    with local_cluster.admin() as api:
        core = k8s.CoreV1Api(api)
        core.create_namespaced_pod(namespace, pod)
        deadline = time.monotonic() + 120
        phase = None
        while time.monotonic() < deadline:
            phase = core.read_namespaced_pod(name, namespace).status.phase
            if phase in ("Succeeded", "Failed"):
                break
            time.sleep(0.5)
        assert phase in ("Succeeded", "Failed"), f"pod {name} still {phase} after 120 s"
        log: str = core.read_namespaced_pod_log(name, namespace)
    assert phase == "Succeeded", log
    return log


def test_a_pod_runs_on_the_real_node_with_its_limits(
    local_cluster: LocalCluster,
    namespace: str,
    docker_client: docker.DockerClient,
    busybox_image: str,
) -> None:
    import_image(docker_client, busybox_image)
    script = "cat /sys/fs/cgroup/memory/memory.limit_in_bytes; ip -4 -o addr show eth0"
    limits = {"limits": {"cpu": "200m", "memory": "64Mi"}}
    log = _run_pod(local_cluster, namespace, busybox_image, script, resources=limits)
    assert log.splitlines()[0] == str(64 * 1024 * 1024)
    assert " inet 10.244.0." in log


def test_a_pod_reaches_the_api_server_through_the_kubernetes_service(
    local_cluster: LocalCluster,
    namespace: str,
    docker_client: docker.DockerClient,
    busybox_image: str,
) -> None:
    """kube-proxy's rules take the Service's cluster IP (what an in-cluster client such as
    the deployed orchestrator connects to) to the API server: plain HTTP sent there gets the
    answer of a Go TLS server. Without them the address has no route in the cluster."""
    import_image(docker_client, busybox_image)
    script = (
        'echo "$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT"; '
        "printf 'GET /version HTTP/1.0\\r\\n\\r\\n' | "
        'nc -w 5 "$KUBERNETES_SERVICE_HOST" "$KUBERNETES_SERVICE_PORT"'
    )
    log = _run_pod(local_cluster, namespace, busybox_image, script)
    address, answer = log.split("\n", 1)
    assert address == "10.96.0.1:443"
    assert answer.startswith("HTTP/1.0 400 Bad Request")
    assert "Client sent an HTTP request to an HTTPS server" in answer
