"""A pod on the local cluster's real node (containerd, runc, CNI and the kubelet,
scripts/k8s/node.sh), from an image of the local engine imported into containerd: it runs,
with its memory limit in its cgroup and an address of the pod network."""

from __future__ import annotations

import time
from collections.abc import Iterator

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


def test_a_pod_runs_on_the_real_node_with_its_limits(
    local_cluster: LocalCluster,
    namespace: str,
    docker_client: docker.DockerClient,
    busybox_image: str,
) -> None:
    import_image(docker_client, busybox_image)
    script = "cat /sys/fs/cgroup/memory/memory.limit_in_bytes; ip -4 -o addr show eth0"
    pod = {
        "metadata": {"name": "limits"},
        "spec": {
            "nodeName": NODE,
            "restartPolicy": "Never",
            "tolerations": [{"key": TAINT, "operator": "Exists"}],
            "containers": [
                {
                    "name": "main",
                    "image": busybox_image,
                    "imagePullPolicy": "Never",
                    "command": ["/bin/busybox", "sh", "-c", script],
                    "resources": {"limits": {"cpu": "200m", "memory": "64Mi"}},
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
            phase = core.read_namespaced_pod("limits", namespace).status.phase
            if phase in ("Succeeded", "Failed"):
                break
            time.sleep(0.5)
        assert phase == "Succeeded"
        log = core.read_namespaced_pod_log("limits", namespace)
    assert log.splitlines()[0] == str(64 * 1024 * 1024)
    assert " inet 10.244.0." in log
