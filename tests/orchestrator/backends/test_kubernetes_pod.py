"""Engine tier: the backend's pod spec run for real by Podman's `podman kube play`.

No kubelet here, but Podman runs the same pod spec: the agent-injector image (built from
images/agent-injector with the local base images) as the init container, as nobody with no
capabilities, copying the bundle into the emptyDir; then a busybox image (no Python, no shell
of ours) running the agent from that bundle on TCP, under the spec's security context. The
one change made for Podman 4.3: the token comes as a literal env value, because its `kube
play` cannot read a key of a Secret.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import docker.errors
import pytest
import yaml

from images.build import build_images, detect_builder
from orchard_env import errors
from orchard_env.agent.bundle import BUNDLE_MOUNT
from orchard_env.agent.client import AgentClient, Exit, Output
from orchard_env.orchestrator.backends.base import SandboxSpec
from orchard_env.orchestrator.backends.kube_objects import pod_manifest
from tests.orchestrator.backends.conftest import sandbox_capability_mask, sandbox_status
from tests.orchestrator.conftest import make_settings

pytestmark = pytest.mark.engine

TOKEN = "pod-test-token"


@pytest.fixture(scope="module")
def injector_image(
    docker_client: docker.DockerClient, sandbox_image: str, busybox_image: str
) -> Iterator[str]:
    if shutil.which("podman") is None:
        pytest.skip("`podman kube play` needs Podman's CLI")
    ref = f"localhost/orchard-test/k8s-agent-injector:{os.getpid()}"
    bases = {"BUILDER_IMAGE": sandbox_image, "FINAL_IMAGE": busybox_image}
    started = int(time.time()) - 1
    try:
        build_images({"agent-injector": ref}, builder=detect_builder("podman"), base_images=bases)
        yield ref
    finally:
        with contextlib.suppress(docker.errors.ImageNotFound):
            docker_client.images.remove(ref, force=True)
        # The build stages it left behind (untagged, labelled like the image): ~300 MB a run.
        label = "org.opencontainers.image.title=orchard-agent-injector"
        for stage in docker_client.api.images(filters={"dangling": True, "label": label}):
            if int(stage["Created"]) >= started:
                with contextlib.suppress(docker.errors.APIError):
                    docker_client.images.remove(stage["Id"], force=True)


@pytest.fixture
def played(injector_image: str, busybox_image: str, tmp_path: Path) -> Iterator[str]:
    """The pod of a busybox sandbox, played by Podman: the agent's base URL."""
    name = f"kpod-{os.getpid()}"
    settings = make_settings(tmp_path, agent_image=injector_image, instance="pod-test")
    spec = SandboxSpec(
        sandbox_id=name,
        image=busybox_image,
        cpu=0.5,
        memory_bytes=256 * 1024**2,
        block_network=True,
        workdir="/tmp",
        agent_token=TOKEN,
        env={"GREETING": "hello"},
        ttl_seconds=600,
    )
    pod = pod_manifest(settings, spec)
    path = tmp_path / "pod.yaml"
    path.write_text(yaml.safe_dump(pod))
    subprocess.run(["podman", "pod", "rm", "-f", name], capture_output=True, check=False)
    try:
        subprocess.run(["podman", "kube", "play", str(path)], capture_output=True, check=True)
        infra = subprocess.run(
            ["podman", "pod", "inspect", name, "--format", "{{.InfraContainerID}}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        ip = subprocess.run(
            [
                "podman",
                "inspect",
                infra,
                "--format",
                "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        yield f"http://{ip}:{settings.agent_port}"
    finally:
        subprocess.run(["podman", "pod", "rm", "-f", name], capture_output=True, check=False)


async def run(agent: AgentClient, command: str) -> tuple[str, int | None]:
    output, code = b"", None
    async for event in agent.exec(uuid.uuid4().hex, command):
        if isinstance(event, Output):
            output += event.data
        elif isinstance(event, Exit):
            code = event.exit_code
    return output.decode(), code


async def test_the_pod_spec_runs_the_agent_in_a_busybox_image(played: str) -> None:
    async with AgentClient(token=TOKEN, base_url=played, env={"GREETING": "hello"}) as agent:
        await agent.wait_ready(30)  # enrolls it: the key and the env are not in the pod
        assert (await agent.health())["status"] == "ok"
        assert await run(agent, "pwd; echo $GREETING; env | grep -c ORCHARD_AGENT_") == (
            "/tmp\nhello\n0\n",
            1,  # grep -c found none: the agent's settings never reach commands
        )
        # The bundle the init container copied (as nobody) is read-only here.
        listing, _ = await run(agent, f"ls -ln {BUNDLE_MOUNT}/bin/python3")
        assert listing.split()[2:4] == ["65534", "65534"]
        denied, code = await run(agent, f"touch {BUNDLE_MOUNT}/x 2>&1")
        assert code == 1 and "Read-only file system" in denied
        status, _ = await run(agent, "cat /proc/self/status")
        # only the capabilities images need; allowPrivilegeEscalation: false
        assert sandbox_status(status) == (sandbox_capability_mask(), "1")
        assert "Seccomp:\t2\n" in status  # a filter: the runtime's default profile
    async with AgentClient(token="wrong", base_url=played) as intruder:
        with pytest.raises(errors.AuthenticationRequired):
            await intruder.list_dir("/")
