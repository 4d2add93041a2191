"""Engine tier: the Dockerfiles built for real with Podman, on the locally built base images
(no registry here), and what each image does when it runs.

The agent-injector image copies its bundle into a host directory, and the agent started from
that copy serves commands inside a busybox container with no network. The orchestrator image
runs as uid 10001 without compilers and serves /health. Test images are built and removed
by ``tests/images/builds.py``; the builder keeps the pip cache of the orchestrator build.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import docker.errors
import docker.types
import pytest

from images.build import detect_builder, source_info
from orchard_env import __version__, errors
from orchard_env.agent.bundle import (
    BUNDLE_MOUNT,
    MANIFEST,
    RUN_DIR_MOUNT,
    SOCKET_NAME,
    daemon_digest,
    launch_argv,
    loader_name,
)
from orchard_env.agent.client import AgentClient
from orchard_env.orchestrator.backends.docker_engine import (
    LABEL_CREATED_BY,
    LABEL_INSTANCE,
    find_engine,
)
from tests.agent.conftest import TOKEN, collect
from tests.images.builds import TEST_REPOSITORY, built_image, host_ca_bundle, image_ref

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def builder(docker_client: docker.DockerClient) -> str:
    """Podman's CLI: it builds into the storage the engine fixtures' socket serves."""
    return detect_builder("podman")


@pytest.fixture(scope="module")
def injector_image(
    docker_client: docker.DockerClient, builder: str, sandbox_image: str, busybox_image: str
) -> Iterator[str]:
    bases = {"BUILDER_IMAGE": sandbox_image, "FINAL_IMAGE": busybox_image}
    yield from built_image(docker_client, builder, "agent-injector", base_images=bases)


@pytest.fixture(scope="module")
def orchestrator_image(
    docker_client: docker.DockerClient, builder: str, sandbox_image: str
) -> Iterator[str]:
    yield from built_image(
        docker_client,
        builder,
        "orchestrator",
        base_images={"BASE_IMAGE": sandbox_image},
        ca_bundle=host_ca_bundle(),
    )


def _run(
    client: docker.DockerClient,
    image: str,
    command: list[str] | None = None,
    **kwargs: object,
) -> tuple[int, str, str]:
    """Run a container to its end: exit code, stdout, stderr (logs read after the wait: a
    followed stream can lose its end on Podman 4)."""
    container = client.containers.run(image, command, detach=True, network_mode="none", **kwargs)
    try:
        code = int(container.wait(timeout=120)["StatusCode"])
        stdout = bytes(container.logs(stdout=True, stderr=False)).decode()
        stderr = bytes(container.logs(stdout=False, stderr=True)).decode()
        return code, stdout, stderr
    finally:
        container.remove(force=True)


def _labels(client: docker.DockerClient, ref: str) -> dict[str, str]:
    return dict(client.images.get(ref).labels or {})


# --- agent-injector ------------------------------------------------------------------------


def test_the_injector_is_its_final_image_plus_the_bundle(
    docker_client: docker.DockerClient, injector_image: str, busybox_image: str
) -> None:
    injector = docker_client.images.get(injector_image)
    base = docker_client.images.get(busybox_image)
    assert injector.attrs["RootFS"]["Layers"][:-1] == base.attrs["RootFS"]["Layers"]
    listing = ["sh", "-c", "ls -A /"]
    _, injected_root, _ = _run(docker_client, injector_image, entrypoint=listing)
    _, base_root, _ = _run(docker_client, busybox_image, listing)
    assert set(injected_root.split()) - set(base_root.split()) == {"orchard-agent"}
    labels = _labels(docker_client, injector_image)
    assert labels["org.opencontainers.image.version"] == __version__
    assert labels.get("org.opencontainers.image.revision") == source_info().commit  # None: no git
    assert labels["org.opencontainers.image.title"] == "orchard-agent-injector"
    code, _, stderr = _run(docker_client, injector_image)
    assert code == 2
    assert stderr == "usage: agent-injector DEST (the directory to copy the agent bundle into)\n"


@pytest.fixture
def copied_bundle(docker_client: docker.DockerClient, injector_image: str) -> Iterator[Path]:
    """The bundle as the injector copies it into an (initially empty) pod volume, here a host
    directory, as an unprivileged user: no ownership to preserve, no warnings."""
    dest = Path(tempfile.mkdtemp(prefix="oa-injected-", dir="/tmp"))
    dest.chmod(0o777)
    try:
        code, stdout, stderr = _run(
            docker_client,
            injector_image,
            ["/injected"],
            user="65534:65534",
            mounts=[docker.types.Mount("/injected", str(dest), type="bind")],
        )
        assert (code, stdout, stderr) == (0, "agent bundle copied to /injected\n", "")
        yield dest
    finally:
        shutil.rmtree(dest, ignore_errors=True)


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """The sandbox's /run/orchard: where the agent makes its socket."""
    path = Path(tempfile.mkdtemp(prefix="oa-run-", dir="/tmp"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_injected_bundle_is_this_agent(copied_bundle: Path) -> None:
    manifest = json.loads((copied_bundle / MANIFEST).read_text())
    assert manifest["daemon_sha256"] == daemon_digest()
    assert (copied_bundle / "lib" / loader_name()).stat().st_mode & 0o777 == 0o755


async def test_the_agent_runs_from_the_injected_bundle_in_busybox(
    docker_client: docker.DockerClient,
    copied_bundle: Path,
    run_dir: Path,
    busybox_image: str,
    engine_instance: str,
) -> None:
    container = docker_client.containers.run(
        busybox_image,
        entrypoint=launch_argv(BUNDLE_MOUNT, f"unix:{RUN_DIR_MOUNT}/{SOCKET_NAME}"),
        command=[],
        name=f"orchard-injected-{uuid.uuid4().hex[:8]}",
        mounts=[
            docker.types.Mount(BUNDLE_MOUNT, str(copied_bundle), type="bind", read_only=True),
            docker.types.Mount(RUN_DIR_MOUNT, str(run_dir), type="bind"),
        ],
        network_mode="none",
        labels={LABEL_CREATED_BY: "orchard", LABEL_INSTANCE: engine_instance},
        detach=True,
    )
    try:
        async with AgentClient(token=TOKEN, uds=str(run_dir / SOCKET_NAME)) as agent:
            try:
                await agent.wait_ready(30)
            except errors.AgentUnavailable:
                logs = container.logs().decode(errors="replace")
                raise AssertionError(f"agent did not start; container logs:\n{logs}") from None
            result = await collect(
                agent.exec("j1", "echo hi; tr '\\0' ' ' </proc/1/cmdline; command -v python3")
            )
            init = result.stdout.decode().splitlines()
            assert init[0] == "hi"
            assert f"{BUNDLE_MOUNT}/agent --listen" in init[1]
            assert result.exit.exit_code == 127  # `command -v python3`: busybox has none
    finally:
        container.remove(force=True)


def test_the_injector_installs_python_when_its_builder_image_has_none(
    docker_client: docker.DockerClient,
    builder: str,
    sandbox_image: str,
    busybox_image: str,
    tmp_path: Path,
) -> None:
    """The path of the default builder image (debian:bookworm-slim has no Python): apt
    installs python3.11 from the Debian mirror, then the bundle is built from it."""
    bare = f"{TEST_REPOSITORY}/no-python:{os.getpid()}"
    (tmp_path / "Dockerfile").write_text(
        f"FROM {sandbox_image}\n"
        "RUN DEBIAN_FRONTEND=noninteractive apt-get purge -y --auto-remove python3.11-minimal "
        "libpython3.11-minimal && ! command -v python3.11\n"
    )
    subprocess.run([builder, "build", "-q", "-t", bare, str(tmp_path)], check=True, timeout=120)
    try:
        bases = {"BUILDER_IMAGE": bare, "FINAL_IMAGE": busybox_image}
        ref = f"{image_ref('agent-injector')}-apt"
        built = built_image(docker_client, builder, "agent-injector", ref, base_images=bases)
        next(built)
        try:
            cat = ["cat", "/orchard-agent/bundle.json"]
            code, stdout, stderr = _run(docker_client, ref, entrypoint=cat)
            assert code == 0, stderr
            assert json.loads(stdout)["python"] == "/usr/bin/python3.11"
        finally:
            built.close()
    finally:
        docker_client.images.remove(bare, force=True)


# --- orchestrator --------------------------------------------------------------------------


def test_the_orchestrator_image_runs_as_uid_10001_without_compilers(
    docker_client: docker.DockerClient, orchestrator_image: str
) -> None:
    config = docker_client.images.get(orchestrator_image).attrs["Config"]
    assert config["User"] == "10001:10001"
    assert "8000/tcp" in config["ExposedPorts"]
    assert config["Cmd"] == ["python", "-m", "orchard_env.orchestrator"]
    labels = _labels(docker_client, orchestrator_image)
    assert labels["org.opencontainers.image.title"] == "orchard-orchestrator"
    script = (
        "id -u; orchard --version; "
        "for c in gcc cc c++ clang make; do command -v $c || true; done; "
        "orchard keys create first --admin --local >/dev/null && ls /var/lib/orchard"
    )
    code, stdout, stderr = _run(docker_client, orchestrator_image, ["sh", "-c", script])
    assert code == 0, stderr
    lines = stdout.splitlines()
    assert lines[:2] == ["10001", f"orchard {__version__}"]
    assert "orchard.db" in lines[2:]  # the state directory is the non-root user's


def test_the_orchestrator_image_serves_health(
    docker_client: docker.DockerClient,
    orchestrator_image: str,
    agent_bundle: Path,
    engine_instance: str,
) -> None:
    engine = find_engine(None)
    if not engine.startswith("unix://"):
        pytest.skip(f"the engine at {engine} is not a unix socket to mount into the container")
    socket = engine.removeprefix("unix://")
    # root only to reach the engine's root-owned socket; the image's own user is tested above
    container = docker_client.containers.run(
        orchestrator_image,
        detach=True,
        user="0",
        network_mode="none",
        environment={
            "ORCHARD_DOCKER_HOST": "unix:///run/engine.sock",
            "ORCHARD_AGENT_BUNDLE_DIR": str(agent_bundle),
            "ORCHARD_INSTANCE": f"{engine_instance}-image",
        },
        mounts=[
            docker.types.Mount("/run/engine.sock", socket, type="bind"),
            docker.types.Mount(str(agent_bundle), str(agent_bundle), type="bind", read_only=True),
        ],
    )
    probe = (
        "import urllib.request; "
        "print(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).read().decode())"
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            code, output = container.exec_run(["python", "-c", probe])
            if code == 0:
                break
            container.reload()
            if container.status != "running" or time.monotonic() > deadline:
                logs = container.logs().decode(errors="replace")
                raise AssertionError(f"no /health answer ({output!r}); logs:\n{logs}")
            time.sleep(0.2)
        health = json.loads(output)
        assert (health["status"], health["backend"]) == ("healthy", "docker")
    finally:
        container.remove(force=True)


# --- sandbox -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sandbox_build(
    docker_client: docker.DockerClient, builder: str, sandbox_image: str
) -> Iterator[str]:
    """images/sandbox/Dockerfile on the local Debian image (apt needs the Debian mirror)."""
    yield from built_image(
        docker_client, builder, "sandbox", base_images={"BASE_IMAGE": sandbox_image}
    )


def test_the_sandbox_image_has_the_packages_of_packages_txt(
    docker_client: docker.DockerClient, sandbox_build: str
) -> None:
    script = "git --version; bash -c 'echo bash'; python3 -c 'print(3)'; ps -p 1 -o comm=; pwd"
    code, stdout, stderr = _run(docker_client, sandbox_build, ["sh", "-c", script])
    assert code == 0, stderr
    lines = stdout.splitlines()
    assert lines[0].startswith("git version 2.")
    assert lines[1:] == ["bash", "3", "sh", "/workspace"]
    assert _labels(docker_client, sandbox_build)["org.opencontainers.image.title"] == (
        "orchard-sandbox"
    )
