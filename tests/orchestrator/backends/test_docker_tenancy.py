"""Tenants and deployments on one real engine (Podman here): the attacks of one key on
another's snapshots, job ids and sessions, and of one deployment on another's snapshot
images, performed through the orchestrator over HTTP with real containers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest
import uvicorn
from websockets.asyncio.client import unix_connect
from websockets.exceptions import ConnectionClosed

from orchard_env.config import ServiceSettings, service_settings
from orchard_env.errors import ConfigError
from orchard_env.orchestrator.app import create_app
from orchard_env.orchestrator.backends.docker_engine import LABEL_INSTANCE, DockerEngineBackend
from orchard_env.orchestrator.keys import create_key, revoke_key
from orchard_env.orchestrator.services import Orchard
from provision.local import LocalProvider
from tests.orchestrator.backends.conftest import emptied
from tests.orchestrator.backends.test_docker_snapshots import remove_snapshot_images
from tests.servers import asgi_service

pytestmark = pytest.mark.engine


@dataclass
class Deployment:
    """One orchestrator on the engine, with an admin client and a way to make keys."""

    transport: httpx.ASGITransport
    admin: httpx.AsyncClient
    settings: ServiceSettings

    @property
    def orchard(self) -> Orchard:
        orchard: Orchard = self.transport.app.state.orchard  # type: ignore[attr-defined]
        return orchard

    async def client(self, name: str) -> httpx.AsyncClient:
        key = await create_key(self.orchard.store, name)
        return httpx.AsyncClient(
            transport=self.transport,
            base_url="http://orchard",
            headers={"X-API-Key": key.api_key},
            timeout=120,
        )

    @contextlib.asynccontextmanager
    async def on_socket(self, path: Path) -> AsyncIterator[None]:
        """The same app also served on a unix socket (for WebSockets and streamed bodies)."""
        app = self.transport.app  # type: ignore[attr-defined]
        server = uvicorn.Server(uvicorn.Config(app, uds=str(path), lifespan="off", log_config=None))
        task = asyncio.create_task(server.serve())
        try:
            while not server.started:
                assert not task.done(), "uvicorn did not start"
                await asyncio.sleep(0.02)
            yield
        finally:
            server.should_exit = True
            await task


@pytest.fixture
def deploy(
    tmp_path_factory: pytest.TempPathFactory,
    engine_instance: str,
    agent_bundle: Path,
    docker_client: docker.DockerClient,
    busybox_image: str,
) -> AsyncIterator[Callable[[str], Any]]:
    """Start deployments ``f"{engine_instance}-<suffix>"``, each with a state dir of its own;
    their containers and snapshot images are removed at the end."""

    @contextlib.asynccontextmanager
    async def start(suffix: str) -> AsyncIterator[Deployment]:
        settings = service_settings(
            state_dir=tmp_path_factory.mktemp("tn"),
            instance=f"{engine_instance}-{suffix}",
            agent_bundle_dir=agent_bundle,
            ready_timeout_seconds=60,
        )
        backend = DockerEngineBackend(settings, bundle_dir=agent_bundle)
        try:
            async with (
                emptied(backend),
                asgi_service(settings, backend, key_name="admin") as (transport, key),
            ):
                admin = httpx.AsyncClient(
                    transport=transport,
                    base_url="http://orchard",
                    headers={"X-API-Key": key},
                    timeout=120,
                )
                yield Deployment(transport, admin, settings)
        finally:
            remove_snapshot_images(docker_client, settings.instance)

    return start  # type: ignore[return-value]


async def ready(client: httpx.AsyncClient, image: str, **body: Any) -> dict[str, Any]:
    created = await client.post("/sandboxes", json={"image": image, **body})
    assert created.status_code == 201, created.text
    sandbox_id = created.json()["sandbox_id"]
    waited = await client.get(f"/sandboxes/{sandbox_id}/wait", params={"timeout": 60})
    info: dict[str, Any] = waited.json()
    assert info["status"] == "ready", info
    return info


async def run(client: httpx.AsyncClient, sandbox_id: str, command: str) -> dict[str, Any]:
    response = await client.post(
        f"/sandboxes/{sandbox_id}/exec", json={"command": command, "wait": True}
    )
    assert response.status_code == 200, response.text
    job: dict[str, Any] = response.json()
    return job


async def test_another_key_or_deployment_cannot_start_a_snapshot_image_by_name(
    deploy: Callable[[str], Any], busybox_image: str, docker_client: docker.DockerClient
) -> None:
    async with deploy("a") as first, deploy("b") as second:
        alice, bob = await first.client("alice"), await first.client("bob")
        source = await ready(alice, busybox_image)
        await run(alice, source["sandbox_id"], "echo alices-secret > /workspace/s")
        taken = await alice.post(f"/sandboxes/{source['sandbox_id']}/snapshot", json={})
        snap = taken.json()
        image = snap["image"]
        assert image.startswith(f"localhost/orchard/snapshots/{first.settings.instance}:")
        image_id = docker_client.images.get(image).id
        short = image.removeprefix("localhost/")
        attempts = [
            (bob, image),
            (bob, short),
            (bob, image_id),
            (await second.client("carol"), image),
        ]
        for client, name in attempts:
            refused = await client.post("/sandboxes", json={"image": name})
            assert refused.status_code == 404, (name, refused.text)
            assert refused.json()["detail"]["code"] == "snapshot_not_found"
            assert (
                refused.json()["detail"]["message"] == f"image {name!r} is not a snapshot of yours"
            )
        # Not even the other deployment's admin, and a made-up id answers the same.
        for name in (image, f"localhost/orchard/snapshots/{first.settings.instance}:snap-0"):
            other = await second.admin.post("/sandboxes", json={"image": name})
            assert other.status_code == 404 and other.json()["detail"]["message"] == (
                f"image {name!r} is not a snapshot of yours"
            )
        assert (await bob.get("/sandboxes")).json()["sandboxes"] == []
        containers = docker_client.containers.list(
            all=True, filters={"label": f"{LABEL_INSTANCE}={second.settings.instance}"}
        )
        assert containers == []
        # The owner may: it is a restore of that snapshot, with its files.
        own = await ready(alice, image)
        assert own["source_snapshot"] == snap["snapshot_id"]
        assert (await run(alice, own["sandbox_id"], "cat /workspace/s"))["stdout"] == (
            "alices-secret\n"
        )


async def test_a_job_id_of_another_key_is_neither_squatted_nor_revealed(
    deploy: Callable[[str], Any], busybox_image: str
) -> None:
    async with deploy("j") as service:
        alice, bob = await service.client("alice"), await service.client("bob")
        alices, bobs = await ready(alice, busybox_image), await ready(bob, busybox_image)
        squat = await bob.post(
            f"/sandboxes/{bobs['sandbox_id']}/exec",
            json={"command": "echo bob", "job_id": "x", "wait": True},
        )
        assert squat.status_code == 200 and squat.json()["stdout"] == "bob\n"
        # Alice's probe of x: nothing there; her submit of x runs her command.
        probe = await alice.get("/jobs/x")
        assert probe.status_code == 404 and probe.json()["detail"]["code"] == "job_not_found"
        body = {"command": "echo alice; echo run >> /workspace/count", "job_id": "x"}
        mine = await alice.post(
            f"/sandboxes/{alices['sandbox_id']}/exec", json={**body, "wait": True}
        )
        assert mine.status_code == 200, mine.text
        assert mine.json()["stdout"] == "alice\n"
        assert mine.json()["sandbox_id"] == alices["sandbox_id"]
        # A retry with the same id is the same job: it does not run again.
        again = await alice.post(f"/sandboxes/{alices['sandbox_id']}/exec", json=body)
        assert again.json()["stdout"] == "alice\n"
        count = await run(alice, alices["sandbox_id"], "cat /workspace/count")
        assert count["stdout"] == "run\n"
        assert (await alice.get("/jobs/x")).json()["stdout"] == "alice\n"
        assert (await bob.get("/jobs/x")).json()["stdout"] == "bob\n"
        assert (await bob.get("/jobs/x/wait")).json()["sandbox_id"] == bobs["sandbox_id"]


async def test_revoking_a_key_ends_its_open_terminal_and_streamed_execs(
    deploy: Callable[[str], Any], busybox_image: str, tmp_path: Path
) -> None:
    async with deploy("r") as service:
        orchard = service.orchard
        alice_key = await create_key(orchard.store, "alice")
        bob_key = await create_key(orchard.store, "bob")  # revoked by another process
        socket = tmp_path / "o.sock"
        async with service.on_socket(socket), contextlib.AsyncExitStack() as opened:
            clients = {
                key.key_id: await opened.enter_async_context(
                    httpx.AsyncClient(
                        transport=httpx.AsyncHTTPTransport(uds=str(socket)),
                        base_url="http://orchard",
                        headers={"X-API-Key": key.api_key},
                        timeout=120,
                    )
                )
                for key in (alice_key, bob_key)
            }
            boxes = {
                key_id: (await ready(client, busybox_image))["sandbox_id"]
                for key_id, client in clients.items()
            }
            headers = {"X-API-Key": alice_key.api_key}
            path = f"/sandboxes/{boxes[alice_key.key_id]}/exec/pty"
            async with (
                unix_connect(
                    str(socket), uri=f"ws://orchard{path}", additional_headers=headers
                ) as terminal,
                contextlib.AsyncExitStack() as streams,
            ):
                await terminal.send(json.dumps({"type": "init", "cmd": ["cat"]}))
                assert json.loads(await terminal.recv())["type"] == "ready"
                lines = {}
                for key_id, client in clients.items():
                    response = await streams.enter_async_context(
                        client.stream(
                            "POST",
                            f"/sandboxes/{boxes[key_id]}/exec/stream",
                            json={"command": "echo first; sleep 600", "job_id": "long"},
                        )
                    )
                    lines[key_id] = response.aiter_lines()
                    for expected in ("started", "stdout"):
                        assert json.loads(await anext(lines[key_id]))["event"] == expected

                revoked = await service.admin.delete(f"/keys/{alice_key.key_id}")
                assert revoked.status_code == 200
                frames = []
                with pytest.raises(ConnectionClosed) as closed:
                    while True:
                        frames.append(json.loads(await terminal.recv()))
                assert closed.value.rcvd is not None and closed.value.rcvd.code == 4403
                assert frames[-1] == {
                    "type": "error",
                    "message": "the API key of this session was revoked",
                }
                # Another process (an orchestrator on the same database) writes the store.
                await revoke_key(orchard.store, bob_key.key_id)
                for key in (alice_key, bob_key):
                    rest = [json.loads(line) async for line in lines[key.key_id]]
                    assert rest == [
                        {
                            "event": "error",
                            "job_id": "long",
                            "code": "forbidden",
                            "message": f"the API key {key.key_id} was revoked",
                        }
                    ]
            # The key opens nothing new either.
            again = await clients[alice_key.key_id].get("/sandboxes")
            assert again.status_code == 403


@contextlib.asynccontextmanager
async def running(settings: ServiceSettings) -> AsyncIterator[httpx.AsyncClient]:
    """The service as `orchard up` runs it (its own backend and lease), with an admin client."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        key = await create_key(app.state.orchard.store, "admin", admin=True)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://orchard",
            headers={"X-API-Key": key.api_key},
            timeout=120,
        ) as client:
            yield client


async def test_two_services_on_one_engine_keep_to_their_own_sandboxes(
    tmp_path_factory: pytest.TempPathFactory,
    agent_bundle: Path,
    busybox_image: str,
    docker_client: docker.DockerClient,
) -> None:
    def settings(**overrides: Any) -> ServiceSettings:
        state = tmp_path_factory.mktemp("two")
        return service_settings(state_dir=state, agent_bundle_dir=agent_bundle, **overrides)

    first, second = settings(), settings()  # no instance set: each state dir has its own
    assert first.instance != second.instance
    same_name = settings(instance=first.instance)  # set explicitly to the first's
    try:
        async with running(first) as one:
            box = await ready(one, busybox_image)
            async with running(second) as two:
                assert (await two.get("/sandboxes")).json()["sandboxes"] == []
                assert await LocalProvider(second)._remove_sandboxes() == 0
            with pytest.raises(ConfigError) as refused:
                async with running(same_name):
                    pass
            assert refused.value.message == (
                f"instance {first.instance!r} is already served by another Orchard service on "
                f"this machine (state dir {first.state_dir}, pid {os.getpid()}, port "
                f"{first.port}); a second one would adopt and remove its sandboxes"
            )
            assert (await run(one, box["sandbox_id"], "echo alive"))["stdout"] == "alive\n"
        # The first is stopped (its sandbox runs on): the same name from another state dir
        # neither adopts nor removes it.
        async with running(same_name) as other:
            assert (await other.get("/sandboxes")).json()["sandboxes"] == []
        assert await LocalProvider(same_name)._remove_sandboxes() == 0
        container = docker_client.containers.get(f"orchard-{first.instance}-{box['sandbox_id']}")
        assert container.status == "running"
        async with running(first) as one:  # and its own service still has it
            assert (await run(one, box["sandbox_id"], "echo back"))["stdout"] == "back\n"
    finally:
        assert await LocalProvider(first)._remove_sandboxes() <= 1


async def test_a_key_cannot_flood_the_engine_past_its_quota(
    deploy: Callable[[str], Any], busybox_image: str, docker_client: docker.DockerClient
) -> None:
    async with deploy("q") as service:
        created = await service.admin.post("/keys", json={"name": "fuzzer", "max_sandboxes": 2})
        fuzzer = httpx.AsyncClient(
            transport=service.transport,
            base_url="http://orchard",
            headers={"X-API-Key": created.json()["api_key"]},
            timeout=120,
        )
        body = {"image": busybox_image, "cpu": 0.1, "memory": "64Mi"}
        answers = await asyncio.gather(*(fuzzer.post("/sandboxes", json=body) for _ in range(8)))
        assert sorted(a.status_code for a in answers) == [201] * 2 + [429] * 6
        containers = docker_client.containers.list(
            all=True, filters={"label": f"{LABEL_INSTANCE}={service.settings.instance}"}
        )
        assert len(containers) == 2
        # Memory beyond the machine's (within the service's cap) is refused, with its size.
        host = docker_client.info()["MemTotal"]
        more = host // 2**30 + 1
        assert more * 2**30 <= service.settings.max_memory, "a machine this large: raise the cap"
        huge = await service.admin.post(
            "/sandboxes", json={"image": busybox_image, "memory": f"{more}Gi"}
        )
        assert huge.status_code == 400
        assert huge.json()["detail"]["message"] == (
            f"memory: {more:.1f}Gi is more than this machine has ({host / 2**30:.1f}Gi)"
        )
