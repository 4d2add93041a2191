"""The snapshotter against a real running container (Podman), through its HTTP API: it finds
the container through /proc, reads its overlay upperdir frozen, pushes to the fake registry over
HTTP; then the engine pulls the result and runs it."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import docker
import httpx
import pytest

from orchard_env.orchestrator.backends.docker_engine import LABEL_CREATED_BY, LABEL_INSTANCE
from orchard_env.snapshotter.layer import find_container_pid
from orchard_env.snapshotter.server import SnapshotterServer
from orchard_env.snapshotter.snapshot import SnapshotResult
from tests.orchestrator.backends.registry_fake import PASSWORD, USER, FakeRegistry
from tests.snapshotter.conftest import TOKEN, snapshotter_url

pytestmark = pytest.mark.engine

CREDS = f"--creds={USER}:{PASSWORD}"


def _podman(*args: str) -> str:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def container(
    docker_client: docker.DockerClient, busybox_image: str, engine_instance: str
) -> Iterator[docker.models.containers.Container]:
    running = docker_client.containers.run(
        busybox_image,
        ["sleep", "600"],
        detach=True,
        labels={LABEL_CREATED_BY: "orchard", LABEL_INSTANCE: engine_instance},
    )
    yield running
    running.remove(force=True)


def test_snapshot_of_a_running_container_restores_its_files(
    container: docker.models.containers.Container,
    busybox_image: str,
    registry: FakeRegistry,
    snapshotter: SnapshotterServer,
) -> None:
    base = f"{registry.host}/orchard/busybox:base"
    _podman("push", "--tls-verify=false", CREDS, busybox_image, f"docker://{base}")
    script = (
        "mkdir -p /workspace/data && echo kept > /workspace/data/file.txt"
        " && rm /linuxrc /bin/arch"
        " && rm -rf /usr/sbin && mkdir /usr/sbin && echo only > /usr/sbin/only"
    )
    exit_code, output = container.exec_run(["sh", "-c", script])
    assert exit_code == 0, output
    container.reload()

    pid = find_container_pid(container.id)
    assert pid == container.attrs["State"]["Pid"]
    target = f"{snapshotter.settings.target_prefix}snap-engine"
    response = httpx.post(
        f"{snapshotter_url(snapshotter)}/snapshot",
        json={"container_id": f"docker://{container.id}", "base_image": base, "target": target},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    result = SnapshotResult(**response.json())
    assert result.frozen  # cgroup v1 freezer here; v2 cgroup.freeze on a pod's node
    assert result.ref == target
    assert 0 < result.size_bytes < 100_000
    assert container.exec_run(["true"]).exit_code == 0  # thawed again

    _podman("pull", "--tls-verify=false", CREDS, target)
    try:
        listing = _podman(
            "run",
            "--rm",
            target,
            "sh",
            "-c",
            "cat /workspace/data/file.txt; ls /usr/sbin; ls /linuxrc /bin/arch 2>&1; ls /bin/cat",
        )
    finally:
        _podman("rmi", target)
    lines = listing.splitlines()
    assert lines[0] == "kept"
    assert lines[1] == "only"  # opaque: none of the base's /usr/sbin shows through
    assert "No such file or directory" in lines[2]
    assert "No such file or directory" in lines[3]
    assert lines[4] == "/bin/cat"
