"""The snapshotter against a real running container (Podman): find it through /proc, read its
overlay upperdir frozen, push to the fake registry over HTTP, pull the result back into the
engine and run it."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from orchard_env.orchestrator.backends.docker_engine import LABEL_CREATED_BY, LABEL_INSTANCE
from orchard_env.snapshotter.layer import find_container_pid
from orchard_env.snapshotter.registry import RegistryClient, load_credentials
from orchard_env.snapshotter.snapshot import take_snapshot
from tests.orchestrator.backends.registry_fake import PASSWORD, USER, FakeRegistry

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
    docker_config: Path,
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
    target = f"{registry.host}/orchard/snapshots:snap-engine"
    with RegistryClient(
        credentials=load_credentials(docker_config), plain_http=frozenset({registry.host})
    ) as client:
        result = take_snapshot(client, container_id=container.id, base_image=base, target=target)
    assert result.frozen  # cgroup v1 freezer here; v2 cgroup.freeze on a pod's node
    assert result.ref == target
    assert 0 < result.size_bytes < 100_000
    assert container.exec_run(["true"]).exit_code == 0  # thawed again

    _podman("pull", "--tls-verify=false", CREDS, target)
    try:
        listing = _podman(
            "run", "--rm", target, "sh", "-c",
            "cat /workspace/data/file.txt; ls /usr/sbin; ls /linuxrc /bin/arch 2>&1; ls /bin/cat",
        )  # fmt: skip
    finally:
        _podman("rmi", target)
    lines = listing.splitlines()
    assert lines[0] == "kept"
    assert lines[1] == "only"  # opaque: none of the base's /usr/sbin shows through
    assert "No such file or directory" in lines[2]
    assert "No such file or directory" in lines[3]
    assert lines[4] == "/bin/cat"
