"""Snapshot and restore through the node snapshotter on a real cluster: a sandbox in which a
file was written and one deleted is snapshotted, restored, and both are checked.

By default on the local cluster of ``scripts/k8s/up.sh`` (the ``kube_real`` tier), with the
profile of ``test_cluster.py`` plus ``snapshots: true``, its registry
(``registry.plain_http``), the node's containerd root and taint (``snapshotter``). The
sandbox's image, busybox, is pushed to that registry first (the snapshot mounts its layers
from there),
the deployment's own images are given the registry's names in containerd (nothing pulled);
the snapshotter pushes the snapshot there and the restored pod pulls it over HTTP.

With ``ORCHARD_TEST_CLUSTER=1`` and ``KUBECONFIG``: that cluster, and ``ORCHARD_TEST_PROFILE``
must name a profile with ``snapshots: true`` whose ``registry.server`` the nodes pull from and
the snapshotter can push to (an ``orchard-registry`` Secret in the service and snapshotter
namespaces, see docs/deployment.md).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from manifests import snapshotter_namespace
from orchard_env.sdk.client import SandboxClient
from provision.profile import load_profile
from tests.kube_local import STATE, LocalCluster, unique_name
from tests.manifests.test_cluster import (
    CONTEXT,
    REGISTRY,
    USER_CLUSTER,
    Deployment,
    NodeImages,
    deployment,
    local_deployment,
    node_images,
)
from tests.orchestrator.backends.kube_node import TAINT, tag_image
from tests.orchestrator.backends.kube_real import NodePods

_PROFILE = os.environ.get("ORCHARD_TEST_PROFILE")
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.kube_real,
    pytest.mark.engine,
    pytest.mark.skipif(
        USER_CLUSTER and (not _PROFILE or not load_profile(Path(_PROFILE)).snapshots),
        reason="ORCHARD_TEST_CLUSTER=1 needs ORCHARD_TEST_PROFILE (a profile with snapshots: true)",
    ),
]
__all__ = ["deployment", "node_images"]  # test_cluster's fixtures
CONTAINERD_ROOT = STATE / "node" / "containerd" / "root"  # scripts/k8s/node.sh


@dataclass(frozen=True)
class Case:
    deployment: Deployment
    image: str  # the sandbox's
    base_file: str  # a file of that image, which the sandbox deletes


@pytest.fixture
def case(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Case]:
    if USER_CLUSTER:
        found: Deployment = request.getfixturevalue("deployment")
        yield Case(found, found.smoke_image or "debian:bookworm-slim", "/etc/debian_version")
        return
    local: LocalCluster = request.getfixturevalue("local_cluster")
    images: NodeImages = request.getfixturevalue("node_images")
    busybox_image: str = request.getfixturevalue("busybox_image")  # 2 MB to push
    base = f"{REGISTRY}/orchard-test/busybox:{os.getpid()}"
    subprocess.run(
        ["podman", "push", "--tls-verify=false", busybox_image, f"docker://{base}"],
        capture_output=True,
        check=True,
        timeout=600,
    )
    # The deploy names the images by the registry; containerd has them under these names too.
    for ref in images.built:
        tag_image(ref, f"{REGISTRY}/{ref.split('/', 1)[1]}")
    settings = {
        "snapshots": True,
        "registry": {"server": REGISTRY, "plain_http": True},
        "snapshotter": {
            "containerd_root": str(CONTAINERD_ROOT),
            "tolerations": [{"key": TAINT, "operator": "Exists", "effect": "NoSchedule"}],
        },
    }
    namespace = unique_name("orchard")
    # The DaemonSet also has a pod on the tier's stand-in node (labelled like a sandbox node)
    # when one exists: NodePods is its kubelet there, so that it goes when it is deleted.
    stand_in = NodePods(local, [], [snapshotter_namespace(namespace)])
    try:
        with local_deployment(local, images, tmp_path, namespace, **settings) as deployed:
            yield Case(deployed, base, "/linuxrc")
    finally:  # the names given and pulled stay (see test_cluster.node_images)
        stand_in.close()


@pytest.mark.timeout(900)
def test_snapshot_and_restore_on_a_cluster(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    deployment = case.deployment
    deployed = deployment.orchard("deploy", *deployment.args, *deployment.tag)
    assert deployed.returncode == 0, deployed.stderr
    monkeypatch.setenv("ORCHARD_CONFIG", deployment.env["ORCHARD_CONFIG"])  # the deploy's
    with (
        deployment.reachable(deployed.stdout.strip().splitlines()[-1]) as url,
        SandboxClient(base_url=url, context=CONTEXT) as client,
    ):
        # Small: the local node has two CPUs, and the restored sandbox runs beside this one.
        source = client.create_sandbox(case.image, cpu=0.5, memory="512Mi", timeout=600)
        made = source.exec(f"echo kept > /workspace/kept.txt && rm {case.base_file}")
        assert made.exit_code == 0, made.stderr
        snapshot = source.snapshot()
        restored = client.restore(snapshot.snapshot_id, timeout=600)
        gone = f"[ -e {case.base_file} ] || [ -L {case.base_file} ]; echo $?"  # 1: gone
        seen = restored.exec(f"cat /workspace/kept.txt; {gone}")
        assert seen.stdout.split() == ["kept", "1"]
        untouched = restored.exec("test -x /bin/busybox || test -e /etc/os-release; echo $?")
        assert untouched.stdout.split() == ["0"]  # the base image's other files are there
        client.delete_snapshot(snapshot.snapshot_id, recursive=True)
