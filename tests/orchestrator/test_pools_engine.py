"""Warm pools on real containers (engine tier): a claimed sandbox is its owner's alone, with
its own agent secret; pooled containers are refilled, expired, found again after a restart,
and none is left behind."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import docker
import pytest

from orchard_env.config import ServiceSettings
from orchard_env.orchestrator.backends.docker_engine import (
    LABEL_AGENT_KEY,
    LABEL_INSTANCE,
    LABEL_SANDBOX_ID,
    DockerEngineBackend,
)
from tests.orchestrator.backends.test_docker_engine import _open_backend
from tests.orchestrator.conftest import FakeClock, StartService, make_settings
from tests.orchestrator.test_pools import members, wait_ready

pytestmark = pytest.mark.engine


@pytest.fixture
def settings(tmp_path_factory: pytest.TempPathFactory, engine_instance: str) -> ServiceSettings:
    # A short state dir: the agent's socket path must fit a unix socket address.
    return make_settings(tmp_path_factory.mktemp("pe"), instance=f"{engine_instance}-pools")


@pytest.fixture
async def backend(  # type: ignore[override]
    settings: ServiceSettings, agent_bundle: Path
) -> AsyncIterator[DockerEngineBackend]:
    async for engine in _open_backend(settings, agent_bundle):
        yield engine


def containers(client: docker.DockerClient, settings: ServiceSettings) -> dict[str, str]:
    """Sandbox id -> the agent key its container's labels hold (the engine's metadata)."""
    return {
        container.labels[LABEL_SANDBOX_ID]: container.labels[LABEL_AGENT_KEY]
        for container in client.containers.list(
            all=True, filters={"label": f"{LABEL_INSTANCE}={settings.instance}"}
        )
    }


async def test_pooled_containers_are_claimed_refilled_expired_and_survive_restarts(
    start_service: StartService,
    settings: ServiceSettings,
    busybox_image: str,
    docker_client: docker.DockerClient,
    clock: FakeClock,
) -> None:
    spec = {"image": busybox_image, "cpu": "0.5", "memory": "128Mi"}
    first = await start_service()
    made = await first.http.post(
        "/pools", json={"name": "bb", "size": 2, "ttl_seconds": 600, **spec}
    )
    assert made.status_code == 201, made.text
    await wait_ready(first, "bb", 2)
    waiting = await members(first, "bb")
    assert set(containers(docker_client, settings)) == waiting

    alice_key = await first.new_key("alice")
    alice = first.as_key(alice_key)
    created = await alice.post("/sandboxes", json={**spec, "labels": {"who": "alice"}})
    assert created.status_code == 201, created.text
    claimed = created.json()
    sandbox_id = claimed["sandbox_id"]
    assert sandbox_id in waiting and claimed["status"] == "ready"
    key = containers(docker_client, settings)[sandbox_id]
    job = await alice.post(
        f"/sandboxes/{sandbox_id}/exec",
        json={"command": f"hostname; env | grep -c {key} || true", "wait": True},
    )
    assert job.json()["stdout"] == f"{sandbox_id}\n0\n"  # its own; its agent key not visible
    # Handed to alice alone: another key is told it does not exist.
    bob = first.as_key(await first.new_key("bob"))
    assert (await bob.get(f"/sandboxes/{sandbox_id}")).status_code == 404
    stolen = await bob.post(f"/sandboxes/{sandbox_id}/exec", json={"command": "true"})
    assert stolen.status_code == 404
    await wait_ready(first, "bb", 2)

    # Every container its own agent secret, the one its record holds.
    secrets_by_id = containers(docker_client, settings)
    assert len(set(secrets_by_id.values())) == len(secrets_by_id) == 3
    record = await first.orchard.store.get_sandbox(sandbox_id)
    assert record is not None and record.agent is not None
    assert record.agent.token == secrets_by_id[sandbox_id]

    # A restart finds the same pooled containers (none replaced, none leaked).
    pooled = await members(first, "bb")
    await first.stop()
    second = await start_service()
    await wait_ready(second, "bb", 2)
    assert await members(second, "bb") == pooled
    assert set(containers(docker_client, settings)) == pooled | {sandbox_id}

    # Past the pool's TTL, waiting containers are replaced; the claimed one stays.
    clock.advance(601)
    await second.orchard.reaper.run_pass()
    await wait_ready(second, "bb", 2)
    fresh = await members(second, "bb")
    assert not fresh & pooled
    assert set(containers(docker_client, settings)) == fresh | {sandbox_id}

    removed = await second.http.delete("/pools/bb")
    assert removed.status_code == 200
    assert set(containers(docker_client, settings)) == {sandbox_id}
    ran = await second.as_key(alice_key).post(
        f"/sandboxes/{sandbox_id}/exec", json={"command": "true", "wait": True}
    )
    assert ran.json()["exit_code"] == 0
