"""Snapshots end to end through the SDK, the orchestrator and real containers (engine tier):
files come back as they were, processes do not, forks are independent, and deleting
everything leaves no container and no image behind."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from orchard_env import errors
from orchard_env.config import ServiceSettings, service_settings
from orchard_env.orchestrator.backends.docker_engine import LABEL_INSTANCE
from orchard_env.sdk import SandboxClient
from tests.conftest import image_tags, remove_sandboxes
from tests.servers import Live, live_service

pytestmark = pytest.mark.engine

# Counts processes running `sleep 1000` (the shell's own command line has no such word pair).
COUNT_SLEEPERS = (
    "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ' | grep -o 'sleep [1]000' | wc -l"
)


@pytest.fixture
def settings(
    tmp_path_factory: pytest.TempPathFactory, engine_instance: str, agent_bundle: Path
) -> ServiceSettings:
    return service_settings(
        state_dir=tmp_path_factory.mktemp("ss"),
        instance=f"{engine_instance}-sdksnap",
        agent_bundle_dir=agent_bundle,
        reap_interval_seconds=1,  # the reaper removes unused snapshot images within a second
    )


@pytest.fixture
def cleanup(docker_client: docker.DockerClient, settings: ServiceSettings) -> Iterator[None]:
    """Whatever a failed test leaves on the engine for this instance is removed after it."""
    yield
    remove_sandboxes(docker_client, settings.instance)
    for tag in image_tags(docker_client, f"{LABEL_INSTANCE}={settings.instance}"):
        with contextlib.suppress(docker.errors.NotFound):
            docker_client.images.remove(tag)


def engine_leftovers(client: docker.DockerClient, instance: str) -> list[str]:
    label = f"{LABEL_INSTANCE}={instance}"
    containers = [c.name for c in client.containers.list(all=True, filters={"label": label})]
    return containers + image_tags(client, label)


@pytest.fixture
def orchard(settings: ServiceSettings, cleanup: None) -> Iterator[Live]:
    """The orchestrator under uvicorn on loopback with the real engine backend."""
    with live_service(settings, key_name="sdk-snapshots") as running:
        yield running


def test_snapshot_restore_fork_and_cleanup_in_real_containers(
    orchard: Live,
    sandbox_image: str,
    docker_client: docker.DockerClient,
    settings: ServiceSettings,
) -> None:
    url, key = orchard
    with SandboxClient(base_url=url, api_key=key) as client:
        source = client.create_sandbox(sandbox_image, memory="512Mi", env={"PHASE": "train"})
        source.exec("echo turn-1 > /workspace/state.txt && mkdir -p /opt/app", check=True)
        source.exec("nohup sleep 1000 >/dev/null 2>&1 &", check=True)
        assert source.exec(COUNT_SLEEPERS).stdout.strip() == "1"
        snap = source.snapshot(name="turn-1")
        assert snap.image.endswith(f":{snap.snapshot_id}")
        source.exec("echo turn-2 > /workspace/state.txt && rm -r /opt/app", check=True)

        restored = client.restore(snap.snapshot_id)
        assert restored.status.value == "ready"
        assert restored.exec("cat /workspace/state.txt; ls -d /opt/app").stdout == (
            "turn-1\n/opt/app\n"
        )
        assert restored.exec("echo $PHASE; pwd").stdout == "train\n/workspace\n"
        assert restored.info.memory == "512Mi"
        # Files are carried over; processes are not.
        assert restored.exec(COUNT_SLEEPERS).stdout.strip() == "0"
        assert source.exec("cat /workspace/state.txt").stdout == "turn-2\n"

        forks = restored.fork(3)
        for index, fork in enumerate(forks):
            fork.exec(f"echo fork-{index} >> /workspace/state.txt", check=True)
        for index, fork in enumerate(forks):
            assert fork.exec("cat /workspace/state.txt").stdout == f"turn-1\nfork-{index}\n"
        fork_snapshot = client.get_snapshot(str(forks[0].info.source_snapshot))
        assert fork_snapshot.parent_snapshot == snap.snapshot_id

        with pytest.raises(errors.Conflict, match=fork_snapshot.snapshot_id):
            client.delete_snapshot(snap.snapshot_id)
        assert client.delete_snapshot(snap.snapshot_id, recursive=True) == [
            fork_snapshot.snapshot_id,
            snap.snapshot_id,
        ]
        # The forks and the restored sandbox still run on the deleted snapshots' images.
        assert forks[1].exec("cat /workspace/state.txt").stdout == "turn-1\nfork-1\n"
        assert any(":snap-" in item for item in engine_leftovers(docker_client, settings.instance))
    # Leaving ``with`` deleted the sandboxes; the next reaper pass removes the images.
    deadline = time.monotonic() + 30
    while engine_leftovers(docker_client, settings.instance):
        assert time.monotonic() < deadline, engine_leftovers(docker_client, settings.instance)
        time.sleep(0.2)
