"""`orchard deploy`, `orchard smoke` and `orchard undeploy` against a real cluster, each run
as a user runs it (a command of its own).

By default the cluster is the local one of ``scripts/k8s/up.sh`` (the ``kube_real`` tier).
No registry is needed: the orchestrator and agent-injector images are built here by Podman
from ``images/`` (on the locally built Debian and busybox images) and imported into the
node's containerd as ``localhost/orchard/<name>:test-<pid>``, which the deployment's pods
run without pulling (``imagePullPolicy: IfNotPresent``); the smoke test's image is the Debian
sandbox image, imported likewise. The profile puts the orchestrator on the real node
(``service.node_selector``, ``service.tolerations``) and sends the sandboxes there
(``runtime_class``); a PersistentVolume is made for the orchestrator's state claim (the
cluster has no StorageClass). The service is reached through ``kubectl port-forward``.

With ``ORCHARD_TEST_CLUSTER=1`` and ``KUBECONFIG`` the cluster is that one instead (kind,
AKS, ...). It must be able to pull the images of ``ORCHARD_TEST_TAG`` (default: the
checkout's tag) from the profile's registry (``ORCHARD_TEST_PROFILE``, default: the defaults
for any cluster, local ``localhost/orchard/...`` images, which suits kind after `kind load`),
and the smoke test's image (``ORCHARD_TEST_SMOKE_IMAGE``, default: `orchard smoke`'s).

Either way the deployment's namespaces are deleted at the end. See docs/deployment.md.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import docker
import pytest
import yaml
from kubernetes import client as k8s

from images.build import IMAGES, detect_builder
from manifests.deploy import LOCAL_PORT, port_forward_command
from provision.profile import load_profile
from tests.images.builds import TEST_REPOSITORY, built_image, host_ca_bundle, remove_built
from tests.kube_local import LocalCluster, unique_name
from tests.orchestrator.backends.kube_node import (
    NODE,
    RUNTIME_CLASS,
    TAINT,
    import_image,
    remove_images,
)
from tests.orchestrator.backends.kube_real import state_volume

USER_CLUSTER = os.environ.get("ORCHARD_TEST_CLUSTER") == "1" and bool(os.environ.get("KUBECONFIG"))
pytestmark = [pytest.mark.cluster, pytest.mark.kube_real, pytest.mark.engine]
CONTEXT = "cluster-test"
ORCHESTRATOR_UID = 10001  # images/orchestrator/Dockerfile
REGISTRY = "10.200.0.2:5000"  # the local cluster's (scripts/k8s/registry.sh)


def _orchard(*args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from orchard_cli.main import main; main()", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


def _wait_for_port(port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    pytest.fail(f"nothing listens on 127.0.0.1:{port} (kubectl port-forward)")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class Deployment:
    """What the commands need: their environment (a config file of the test's own, and
    ``kubectl`` on PATH), the arguments naming the deployment, and where it lives."""

    env: dict[str, str]
    args: list[str]  # --context, and --profile when given
    tag: list[str]  # --tag TAG, when given (deploy only)
    namespace: str
    kubeconfig: str | None  # for the port-forward (None: KUBECONFIG)
    smoke_image: str | None  # None: `orchard smoke`'s default
    local: LocalCluster | None = None

    def orchard(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        return _orchard(*args, env=self.env, timeout=timeout)

    @contextlib.contextmanager
    def reachable(self, endpoint: str) -> Iterator[str]:
        """The service's URL: ``endpoint``, or without a load balancer a port-forward (on a
        free port: 8000 may be taken on a shared machine) for the duration."""
        if endpoint != f"http://127.0.0.1:{LOCAL_PORT}":
            yield endpoint
            return
        port = _free_port()
        command = port_forward_command(self.namespace, kubeconfig=self.kubeconfig, local_port=port)
        forward = subprocess.Popen(
            shlex.split(command),
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            _wait_for_port(port, time.monotonic() + 60)
            yield f"http://127.0.0.1:{port}"
        finally:
            forward.terminate()
            forward.wait(timeout=10)


@dataclass(frozen=True)
class NodeImages:
    tag: str  # of localhost/orchard/{orchestrator,agent-injector}
    smoke: str
    built: tuple[str, ...]  # the orchestrator's and the agent-injector's references


@pytest.fixture(scope="session")
def node_images(
    local_cluster: LocalCluster,
    docker_client: docker.DockerClient,
    sandbox_image: str,
    busybox_image: str,
) -> Iterator[NodeImages]:
    """The deployment's images, built by Podman and imported into the node's containerd."""
    tag = f"test-{os.getpid()}"
    builder = detect_builder("podman")
    build = contextlib.contextmanager(built_image)
    with (
        build(
            docker_client,
            builder,
            "orchestrator",
            f"localhost/orchard/orchestrator:{tag}",
            base_images={"BASE_IMAGE": sandbox_image},
            ca_bundle=host_ca_bundle(),
        ) as orchestrator,
        build(
            docker_client,
            builder,
            "agent-injector",
            f"localhost/orchard/agent-injector:{tag}",
            base_images={"BUILDER_IMAGE": sandbox_image, "FINAL_IMAGE": busybox_image},
        ) as injector,
    ):
        built = (import_image(docker_client, orchestrator), import_image(docker_client, injector))
        # Not :latest, which a pod without imagePullPolicy (a sandbox's) always pulls. Left in
        # containerd: a name removed from it can take the image out of its CRI plugin's cache
        # for every other name of it (docs/contributing/testing.md).
        smoke = import_image(docker_client, sandbox_image, f"{TEST_REPOSITORY}/sandbox:smoke")
    try:
        yield NodeImages(tag, smoke, built)
    finally:
        remove_images(*built)


@pytest.fixture
def deployment(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Deployment]:
    """The deployment under test, undeployed at the end: on the user's cluster or the local
    one (module docstring)."""
    env = {**os.environ, "ORCHARD_CONFIG": str(tmp_path / "config.toml")}
    if USER_CLUSTER:
        args = ["--context", CONTEXT]
        namespace = "orchard"
        if os.environ.get("ORCHARD_TEST_PROFILE"):
            args += ["--profile", os.environ["ORCHARD_TEST_PROFILE"]]
            namespace = load_profile(Path(os.environ["ORCHARD_TEST_PROFILE"])).service.namespace
        chosen = os.environ.get("ORCHARD_TEST_TAG")
        tag = ["--tag", chosen] if chosen else []
        smoke = os.environ.get("ORCHARD_TEST_SMOKE_IMAGE")
        found = Deployment(env, args, tag, namespace, None, smoke)
        yield found
        _undeploy(found)
        return
    local: LocalCluster = request.getfixturevalue("local_cluster")
    images: NodeImages = request.getfixturevalue("node_images")
    with local_deployment(local, images, tmp_path, unique_name("orchard")) as found:
        yield found


@contextlib.contextmanager
def local_deployment(
    local: LocalCluster, images: NodeImages, tmp_path: Path, namespace: str, **profile: object
) -> Iterator[Deployment]:
    """A deployment in ``namespace`` on the local cluster (:func:`_local_profile`, plus
    ``profile``) with a volume for its state, undeployed at the end."""
    env = {
        **os.environ,
        "ORCHARD_CONFIG": str(tmp_path / "config.toml"),
        "PATH": f"{local.bin}{os.pathsep}{os.environ.get('PATH', '')}",  # the cluster's kubectl
    }
    path = _local_profile(tmp_path, local, namespace, **profile)
    args = ["--context", CONTEXT, "--profile", str(path)]
    tag = ["--tag", images.tag]
    found = Deployment(env, args, tag, namespace, str(local.kubeconfig), images.smoke, local)
    with state_volume(local, namespace, owner=ORCHESTRATOR_UID):
        try:
            yield found
        finally:
            _undeploy(found)


def _local_profile(tmp_path: Path, local: LocalCluster, namespace: str, **extra: object) -> Path:
    """A profile for the local cluster: its orchestrator on the real node (the only node
    whose pods run; it is tainted), its sandboxes there through the RuntimeClass."""
    profile = {
        "name": namespace,
        "target": "kubeconfig",
        "kubeconfig": {"path": str(local.kubeconfig)},
        "runtime_class": RUNTIME_CLASS,
        "service": {
            "namespace": namespace,
            "sandbox_namespace": f"{namespace}-sb",
            "node_selector": {"kubernetes.io/hostname": NODE},
            "tolerations": [{"key": TAINT, "operator": "Exists", "effect": "NoSchedule"}],
        },
        **extra,
    }
    path = tmp_path / "orchard.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path


def _undeploy(deployment: Deployment) -> None:
    done = deployment.orchard("undeploy", "--yes", *deployment.args)
    assert done.returncode == 0, done.stderr


def test_deploy_smoke_undeploy(deployment: Deployment) -> None:
    deployed = deployment.orchard("deploy", *deployment.args, *deployment.tag)
    assert deployed.returncode == 0, deployed.stderr
    if deployment.local is not None:  # the orchestrator runs on the node, as the profile says
        with deployment.local.admin() as api:
            (pod,) = k8s.CoreV1Api(api).list_namespaced_pod(deployment.namespace).items
        assert pod.spec.node_name == NODE
        assert pod.status.container_statuses[0].ready
    endpoint = deployed.stdout.strip().splitlines()[-1]
    with deployment.reachable(endpoint) as url:
        image = ["--image", deployment.smoke_image] if deployment.smoke_image else []
        smoke = deployment.orchard("smoke", "--context", CONTEXT, "--url", url, *image)
        assert smoke.returncode == 0, smoke.stdout + smoke.stderr
    assert smoke.stdout.strip().endswith(" passed, 0 failed")
    again = deployment.orchard("deploy", *deployment.args, *deployment.tag)
    assert again.returncode == 0, again.stderr
    assert "0 changed" in again.stderr  # idempotent on a real API server


@pytest.mark.skipif(USER_CLUSTER, reason="the local cluster only (its registry)")
def test_up_on_the_local_cluster_through_its_registry_then_smoke_and_down(
    local_cluster: LocalCluster,
    docker_client: docker.DockerClient,
    sandbox_image: str,
    busybox_image: str,
    tmp_path: Path,
) -> None:
    """`orchard up --target kubeconfig` as a user of `make cluster` runs it: the provision
    checks, the three images built by Podman (on the local base images) and pushed to the
    cluster's registry over plain HTTP, from which containerd pulls them; the deploy; and the
    smoke stage (`orchard smoke` through a port-forward it starts). Then `orchard down`."""
    namespace = unique_name("orchard")
    tag = f"test-up-{os.getpid()}"
    ca_bundle = host_ca_bundle()
    bases = {"BASE_IMAGE": sandbox_image, "BUILDER_IMAGE": sandbox_image}
    path = _local_profile(
        tmp_path,
        local_cluster,
        namespace,
        registry={"server": REGISTRY, "plain_http": True},
        build={
            "base_images": {**bases, "FINAL_IMAGE": busybox_image},
            "ca_bundle": str(ca_bundle) if ca_bundle else None,
        },
        image_tag=tag,
    )
    env = {
        **os.environ,
        "ORCHARD_CONFIG": str(tmp_path / "config.toml"),
        "PATH": f"{local_cluster.bin}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    args = ["--target", "kubeconfig", "--profile", str(path), "--state-dir", str(tmp_path)]
    refs = {name: f"{REGISTRY}/orchard/{name}:{tag}" for name in IMAGES if name != "tools"}
    started = int(time.time()) - 1
    try:
        with state_volume(local_cluster, namespace, owner=ORCHESTRATOR_UID):
            try:
                up = _orchard("up", *args, env=env, timeout=1800)
                assert up.returncode == 0, up.stdout + up.stderr
                assert "smoke" in up.stderr and "checks passed" in up.stderr
                with local_cluster.admin() as api:
                    (pod,) = k8s.CoreV1Api(api).list_namespaced_pod(namespace).items
                assert pod.spec.containers[0].image == refs["orchestrator"]
                assert pod.status.container_statuses[0].image_id.startswith(
                    f"{REGISTRY}/orchard/orchestrator@sha256:"
                )
            finally:
                down = _orchard("down", *args, "--yes", env=env, timeout=900)
                assert down.returncode == 0, down.stdout + down.stderr
    finally:  # what the node pulled goes with the cluster (see node_images)
        remove_built(docker_client, refs, started)
