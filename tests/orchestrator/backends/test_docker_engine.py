"""DockerEngineBackend against the real engine (Podman here): lifecycle, labels, limits,
network isolation and errors, with the real agent bundle answering on its unix socket."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any
from uuid import uuid4

import docker
import pytest

from orchard_env import bench_host, errors
from orchard_env.agent.bundle import BUNDLE_MOUNT, RUN_DIR_MOUNT
from orchard_env.agent.client import AgentClient, Exit, Output
from orchard_env.config import ServiceSettings, service_settings
from orchard_env.orchestrator.backends import docker_engine
from orchard_env.orchestrator.backends import run_dir as run_dir_mount
from orchard_env.orchestrator.backends.base import (
    BackendSandbox,
    Capability,
    SandboxSpec,
    SandboxState,
)
from orchard_env.orchestrator.backends.docker_engine import DockerEngineBackend
from tests.orchestrator.backends.conftest import (
    MiB,
    emptied,
    sandbox_capability_mask,
    sandbox_status,
)

pytestmark = pytest.mark.engine


@pytest.fixture
def settings(tmp_path_factory: pytest.TempPathFactory, engine_instance: str) -> ServiceSettings:
    # A short state dir: the agent's socket path must fit a unix socket address (108 bytes).
    return service_settings(state_dir=tmp_path_factory.mktemp("st"), instance=engine_instance)


async def _open_backend(settings: ServiceSettings, bundle: Path) -> AsyncIterator[Any]:
    async with emptied(DockerEngineBackend(settings, bundle_dir=bundle)) as backend:
        yield backend


@pytest.fixture
async def backend(
    settings: ServiceSettings, agent_bundle: Path
) -> AsyncIterator[DockerEngineBackend]:
    async for opened in _open_backend(settings, agent_bundle):
        yield opened


def _agent(sandbox: BackendSandbox) -> AgentClient:
    assert sandbox.agent is not None and sandbox.agent.uds is not None
    return AgentClient(token=sandbox.agent.token, uds=sandbox.agent.uds)


async def _run(agent: AgentClient, command: str) -> tuple[str, Exit]:
    """Run ``command`` with the image's sh; (stdout+stderr, exit)."""
    output = b""
    async for event in agent.exec(uuid4().hex, command, timeout=60):
        if isinstance(event, Output):
            output += event.data
        else:
            return output.decode(), event
    raise AssertionError("the agent's stream ended without an exit event")


async def _ready(backend: DockerEngineBackend, spec: SandboxSpec) -> BackendSandbox:
    sandbox = await backend.create(spec)
    async with _agent(sandbox) as agent:
        await agent.wait_ready(30)
    return sandbox


def _container(client: docker.DockerClient, settings: ServiceSettings, sandbox_id: str) -> Any:
    return client.containers.get(f"orchard-{settings.instance}-{sandbox_id}")


def test_capabilities() -> None:
    assert DockerEngineBackend.capabilities == {
        Capability.NETWORK_ISOLATION,
        Capability.PTY,
        Capability.SNAPSHOT,
    }


async def test_busybox_sandbox_runs_the_agent_with_labels_and_limits(
    backend: DockerEngineBackend,
    spec: Callable[..., SandboxSpec],
    settings: ServiceSettings,
    docker_client: docker.DockerClient,
    agent_bundle: Path,
) -> None:
    record = json.dumps({"sandbox_id": "x", "image": "busybox"})
    wanted = spec(
        cpu=0.5,
        memory_bytes=128 * MiB,
        pids_limit=256,
        owner="key-1",
        labels={"team": "rl", "run": "42"},
        env={"GREETING": "hello"},
        record_annotation=record,
    )
    sandbox = await backend.create(wanted)
    assert sandbox.sandbox_id == wanted.sandbox_id
    assert sandbox.state is SandboxState.RUNNING
    assert sandbox.record_annotation == record
    assert sandbox.agent is not None
    assert sandbox.agent.token == wanted.agent_token
    run_dir = settings.sandboxes_dir / wanted.sandbox_id
    assert sandbox.agent.uds == str(run_dir / "agent.sock")

    # The env reaches commands through the agent's enrollment, never the container's env.
    key, socket_path = sandbox.agent.token, sandbox.agent.uds
    async with AgentClient(token=key, uds=socket_path, env=wanted.env) as agent:
        await agent.wait_ready(30)
        output, exit_ = await _run(agent, "echo $GREETING; pwd; hostname; cat /proc/1/cmdline")
        status, _ = await _run(agent, "cat /proc/self/status")
    assert exit_.exit_code == 0
    # Root in the sandbox has only the capabilities images need, and no new privileges.
    assert sandbox_status(status) == (sandbox_capability_mask(), "1")
    greeting, cwd, hostname, cmdline = output.split("\n", 3)
    assert (greeting, cwd, hostname) == ("hello", "/workspace", wanted.sandbox_id)
    assert f"{BUNDLE_MOUNT}/agent\0--listen" in cmdline  # the agent is PID 1

    async with AgentClient(token="not-the-token", uds=sandbox.agent.uds) as stranger:
        with pytest.raises(errors.AuthenticationRequired):
            await _run(stranger, "true")

    attrs = _container(docker_client, settings, wanted.sandbox_id).attrs
    assert {
        "orchard.created-by": "orchard",
        "orchard.instance": settings.instance,
        "orchard.sandbox-id": wanted.sandbox_id,
        "orchard.owner": "key-1",
        "orchard.record": record,
        "orchard.label.team": "rl",
        "orchard.label.run": "42",
    }.items() <= attrs["Config"]["Labels"].items()
    host = attrs["HostConfig"]
    assert host["NanoCpus"] == 500_000_000
    assert host["Memory"] == host["MemorySwap"] == 128 * MiB
    assert host["PidsLimit"] == 256
    assert host["NetworkMode"] == "none"
    assert host["RestartPolicy"]["Name"] in ("", "no")
    mounts = {m["Destination"]: (m["Source"], m["RW"]) for m in attrs["Mounts"]}
    assert mounts[BUNDLE_MOUNT] == (str(agent_bundle), False)
    assert mounts[RUN_DIR_MOUNT] == (str(run_dir), True)


async def test_debian_sandbox_has_git_and_bash(
    backend: DockerEngineBackend, spec: Callable[..., SandboxSpec], sandbox_image: str
) -> None:
    sandbox = await _ready(backend, spec(image=sandbox_image))
    async with _agent(sandbox) as agent:
        output, exit_ = await _run(agent, "git --version && bash -c 'echo bash $BASH_VERSINFO'")
    assert exit_.exit_code == 0, output
    assert output.startswith("git version 2.")
    assert output.endswith("bash 5\n")


async def test_blocked_network_has_only_loopback_and_cannot_connect(
    backend: DockerEngineBackend,
    spec: Callable[..., SandboxSpec],
    settings: ServiceSettings,
    docker_client: docker.DockerClient,
) -> None:
    connections: list[str] = []

    async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer.get_extra_info("peername")[0])
        writer.close()

    # On all addresses: the sandbox reaches the host through the engine's bridge.
    server = await asyncio.start_server(greet, "0.0.0.0", 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        blocked, open_ = await asyncio.gather(
            _ready(backend, spec(block_network=True)), _ready(backend, spec(block_network=False))
        )
        networks = _container(docker_client, settings, open_.sandbox_id).attrs["NetworkSettings"]
        gateway = next(n["Gateway"] for n in networks["Networks"].values() if n["Gateway"])
        probe = f"ls /sys/class/net; nc -w 3 {gateway} {port} </dev/null && echo connected"

        async with _agent(blocked) as agent:
            output, _ = await _run(agent, probe)
        assert output.splitlines()[0] == "lo"
        assert "connected" not in output
        assert "unreachable" in output.lower()
        assert connections == []

        async with _agent(open_) as agent:
            output, exit_ = await _run(agent, probe)
        assert exit_.exit_code == 0, output
        assert set(output.split()) - {"lo", "connected"}  # an interface besides loopback
        assert output.endswith("connected\n")
        assert len(connections) == 1  # the connection really came through


async def test_memory_limit_is_enforced(
    backend: DockerEngineBackend,
    spec: Callable[..., SandboxSpec],
    settings: ServiceSettings,
    docker_client: docker.DockerClient,
) -> None:
    sandbox = await _ready(backend, spec(memory_bytes=64 * MiB))
    async with _agent(sandbox) as agent:
        limit, _ = await _run(
            agent,
            "cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null"
            " || cat /sys/fs/cgroup/memory.max",
        )
        # The shell keeps 200 MB of 'a' in a variable: far beyond the limit.
        hog = "x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo kept"
        output, exit_ = await _run(agent, hog)
        assert exit_.signal == 9 or exit_.exit_code == 137, (output, exit_)
        assert exit_.oom_killed, exit_
        assert "kept" not in output
        await agent.health()  # the agent itself survived
        # A SIGKILL that is not the OOM killer's is not taken for one (the counter is
        # compared before and after, not read as "any kill so far").
        _, killed = await _run(agent, "kill -9 $$")
        assert (killed.signal, killed.oom_killed) == (9, False)
    assert int(limit) == 64 * MiB
    inspected = await backend.inspect(sandbox.sandbox_id)
    assert inspected is not None and inspected.state is SandboxState.RUNNING


async def test_missing_image_fails_fast_with_the_engine_reason(
    backend: DockerEngineBackend, spec: Callable[..., SandboxSpec], settings: ServiceSettings
) -> None:
    image = "registry.invalid/orchard/missing:1"
    wanted = spec(image=image)
    started = time.monotonic()
    with pytest.raises(errors.ImageNotFound) as caught:
        await backend.create(wanted)
    assert time.monotonic() - started < 5
    prefix = f"image {image!r} is not on this machine's engine and could not be pulled: "
    assert caught.value.message.startswith(prefix)
    assert "registry.invalid" in caught.value.message.removeprefix(prefix)  # the engine's words
    assert caught.value.hint is not None and "orchard images build-local" in caught.value.hint
    assert await backend.inspect(wanted.sandbox_id) is None
    assert not (settings.sandboxes_dir / wanted.sandbox_id).exists()


async def test_an_id_too_long_for_the_socket_path_is_refused_before_anything_is_made(
    backend: DockerEngineBackend, spec: Callable[..., SandboxSpec], settings: ServiceSettings
) -> None:
    room = 107 - len(f"{settings.sandboxes_dir}/") - len("/agent.sock")
    too_long = spec(sandbox_id="x" * (room + 1))
    with pytest.raises(errors.InvalidRequest) as caught:
        await backend.create(too_long)
    assert caught.value.message == (
        f"the agent socket path for sandbox {too_long.sandbox_id!r} would be 108 bytes, "
        "over the 107 a unix socket allows"
    )
    assert not settings.sandboxes_dir.exists()
    fits = await _ready(backend, spec(sandbox_id="x" * room))
    assert fits.agent is not None and len(fits.agent.uds or "") == 107


async def test_the_sandboxes_env_reaches_commands_but_not_the_agent(
    backend: DockerEngineBackend,
    spec: Callable[..., SandboxSpec],
    settings: ServiceSettings,
    docker_client: docker.DockerClient,
) -> None:
    """An LD_PRELOAD of the sandbox (a file that is no library: the loader complains, on stderr,
    in every process it applies to) and a marker are its commands', never the agent's."""
    wanted = spec(env={"LD_PRELOAD": "/etc/hostname", "MARK": "sandbox-env"})
    sandbox = await backend.create(wanted)
    assert sandbox.agent is not None
    key, socket_path = sandbox.agent.token, sandbox.agent.uds
    async with AgentClient(token=key, uds=socket_path, env=wanted.env) as agent:
        await agent.wait_ready(30)
        seen, exit_ = await _run(agent, 'echo "$MARK" "$LD_PRELOAD"')
        init, _ = await _run(agent, "tr '\\0' '\\n' < /proc/1/environ 2>/dev/null")
    assert exit_.exit_code == 0 and seen.splitlines()[-1] == "sandbox-env /etc/hostname"
    assert "ORCHARD_AGENT_WORKDIR=" in init  # the container's own environment, which PID 1 has
    assert "MARK=" not in init and "LD_PRELOAD=" not in init
    assert wanted.agent_token not in init
    logs = _container(docker_client, settings, wanted.sandbox_id).logs().decode()
    assert "LD_PRELOAD" not in logs and "preloaded" not in logs, logs


async def test_an_image_whose_user_is_not_root_gets_its_agent(
    backend: DockerEngineBackend,
    spec: Callable[..., SandboxSpec],
    busybox_image: str,
    docker_client: docker.DockerClient,
) -> None:
    base = docker_client.containers.create(busybox_image, ["true"])
    nobody = f"localhost/orchard/test-nobody:{uuid4().hex[:8]}"
    try:
        base.commit(*nobody.rsplit(":", 1), changes=["USER 65534"])
    finally:
        base.remove()
    try:
        sandbox = await _ready(backend, spec(image=nobody, workdir="/tmp"))
        async with _agent(sandbox) as agent:
            output, _ = await _run(agent, "id -u")
        assert output == "65534\n"
    finally:  # the image can go once no container uses it
        for leftover in await backend.list():
            await backend.delete(leftover.sandbox_id)
        docker_client.images.remove(nobody)


async def test_duplicate_id_is_refused_and_the_first_keeps_working(
    backend: DockerEngineBackend, spec: Callable[..., SandboxSpec]
) -> None:
    first = spec()
    sandbox = await _ready(backend, first)
    with pytest.raises(errors.SandboxExists) as caught:
        await backend.create(dataclasses.replace(first, agent_token="another"))
    assert caught.value.message == f"sandbox {first.sandbox_id!r} already exists"
    async with _agent(sandbox) as agent:  # its socket and token are untouched
        output, _ = await _run(agent, "echo still here")
    assert output == "still here\n"


async def test_delete_removes_container_and_dir_and_is_quiet_when_gone(
    backend: DockerEngineBackend,
    spec: Callable[..., SandboxSpec],
    settings: ServiceSettings,
    docker_client: docker.DockerClient,
) -> None:
    sandbox = await _ready(backend, spec())
    run_dir = settings.sandboxes_dir / sandbox.sandbox_id
    assert (run_dir / "agent.sock").exists()
    await backend.delete(sandbox.sandbox_id)
    with pytest.raises(docker.errors.NotFound):
        _container(docker_client, settings, sandbox.sandbox_id)
    assert not run_dir.exists()
    assert await backend.inspect(sandbox.sandbox_id) is None
    await backend.delete(sandbox.sandbox_id)  # already gone: quiet
    await backend.delete("never-existed")


def _bytes_under(folder: Path) -> int:
    """What the files under ``folder`` take on its disk."""
    return sum(path.lstat().st_blocks * 512 for path in folder.rglob("*"))


async def test_writes_into_the_agent_directory_are_bounded_and_the_agent_survives_them(
    backend: DockerEngineBackend, spec: Callable[..., SandboxSpec], settings: ServiceSettings
) -> None:
    sandbox = await _ready(backend, spec())
    run_dir = settings.sandboxes_dir / sandbox.sandbox_id
    # Root in the sandbox fills /run/orchard (the host directory of its agent's socket) with
    # 64 MiB, then with as many empty files as it can make (up to 1,000), then one more.
    fill = (
        f"cd {RUN_DIR_MOUNT}; head -c {64 * MiB} /dev/zero > fill 2>/dev/null; "
        "echo wrote $? $(wc -c < fill); "
        "i=0; while [ $i -lt 1000 ] && true 2>/dev/null >f$i; do i=$((i + 1)); done; "
        "echo files $i; touch more"
    )
    async with _agent(sandbox) as agent:
        output, _ = await _run(agent, fill)
    assert output.count("\n") == 3, output
    wrote, files, refused = output.strip().splitlines()
    status, size = wrote.removeprefix("wrote ").split()
    assert status != "0" and int(size) <= run_dir_mount.SIZE_BYTES, output
    assert int(files.removeprefix("files ")) < run_dir_mount.INODES, output
    assert refused.endswith("No space left on device"), output
    assert _bytes_under(run_dir) <= run_dir_mount.SIZE_BYTES
    # Its agent still answers, on a new connection, and deleting the sandbox removes it all.
    async with _agent(sandbox) as agent:
        output, _ = await _run(agent, f"rm {RUN_DIR_MOUNT}/fill; echo still here")
    assert output == "still here\n"
    await backend.delete(sandbox.sandbox_id)
    assert not run_dir.exists()


async def test_list_sees_only_this_instance(
    backend: DockerEngineBackend,
    spec: Callable[..., SandboxSpec],
    settings: ServiceSettings,
    agent_bundle: Path,
    docker_client: docker.DockerClient,
) -> None:
    other_settings = dataclasses.replace(
        settings, instance=f"{settings.instance}-other", state_dir=settings.state_dir / "other"
    )
    mine = await backend.create(spec(record_annotation='{"n": 1}'))
    async for other in _open_backend(other_settings, agent_bundle):
        theirs = await other.create(spec())
        assert [s.sandbox_id for s in await backend.list()] == [mine.sandbox_id]
        assert [s.sandbox_id for s in await other.list()] == [theirs.sandbox_id]
        assert await backend.inspect(theirs.sandbox_id) is None
        await backend.delete(theirs.sandbox_id)  # not ours: nothing happens to it
        assert await other.inspect(theirs.sandbox_id) is not None
    (listed,) = await backend.list()
    assert listed.record_annotation == '{"n": 1}'
    # The engine's list gives its creation time in whole seconds.
    container = _container(docker_client, settings, mine.sandbox_id)
    created = datetime.fromisoformat(container.attrs["Created"])
    assert listed.created_at == created.replace(microsecond=0)


@contextlib.contextmanager
def _engine_requests(
    backend: DockerEngineBackend, monkeypatch: pytest.MonkeyPatch
) -> Iterator[list[str]]:
    """The requests the backend sends the engine meanwhile: ``"METHOD /path"``, the API
    version and container ids left out."""
    api = backend._client.api
    sent: list[str] = []
    real = api.request

    def counting(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        path = re.sub(r"/[0-9a-f]{64}", "/<id>", url.split("/v1.41", 1)[-1].split("?")[0])
        sent.append(f"{method} {path}")
        return real(method, url, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(api, "request", counting)
        yield sent


async def test_a_create_is_two_engine_round_trips_and_a_listing_one(
    backend: DockerEngineBackend,
    spec: Callable[..., SandboxSpec],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once the image has been seen: create and start, nothing else (no image lookup, no
    inspect); a listing is one request for all the running sandboxes, not one each."""
    first = await backend.create(spec())
    with _engine_requests(backend, monkeypatch) as sent:
        second = await backend.create(spec())
    assert sent == ["POST /containers/create", "POST /containers/<id>/start"]
    assert (second.state, second.agent is not None) == (SandboxState.RUNNING, True)
    with _engine_requests(backend, monkeypatch) as sent:
        listed = await backend.list()
    assert sent == ["GET /containers/json"]
    assert sorted(s.sandbox_id for s in listed) == sorted([first.sandbox_id, second.sandbox_id])
    assert {s.state for s in listed} == {SandboxState.RUNNING}
    assert [s.agent for s in listed if s.sandbox_id == second.sandbox_id] == [second.agent]


def _storage_can_limit_disk(client: docker.DockerClient) -> tuple[bool, str]:
    """What the engine's storage is, and whether ``--storage-opt size`` works on it."""
    info = client.info()
    status = {str(k): str(v) for k, v in info.get("DriverStatus") or []}
    driver, backing = str(info.get("Driver")), status.get("Backing Filesystem", "")
    capable = driver in ("btrfs", "zfs") or (driver.startswith("overlay") and backing == "xfs")
    return capable, f"storage driver {driver} on {backing}"


async def test_a_disk_limit_is_enforced_or_refused_never_ignored(
    backend: DockerEngineBackend,
    spec: Callable[..., SandboxSpec],
    docker_client: docker.DockerClient,
    settings: ServiceSettings,
    agent_bundle: Path,
) -> None:
    capable, storage = _storage_can_limit_disk(docker_client)
    wanted = spec(disk_bytes=64 * MiB)
    if not capable:  # this machine (overlay on ext4): refused before anything is made
        with pytest.raises(errors.InvalidRequest) as caught:
            await backend.create(wanted)
        assert caught.value.message.startswith("disk cannot be limited on this engine: its ")
        assert storage in caught.value.message
        assert caught.value.hint is not None and "xfs" in caught.value.hint
        assert await backend.inspect(wanted.sandbox_id) is None
        return
    sandbox = await _ready(backend, wanted)
    async with _agent(sandbox) as agent:
        output, _ = await _run(agent, "head -c 200000000 /dev/zero > /big; echo $?")
    assert output.strip().splitlines()[-1] != "0", output
    # Without disk, a sandbox gets ephemeral_storage.
    small_default = dataclasses.replace(settings, ephemeral_storage=64 * MiB)
    async for other in _open_backend(small_default, agent_bundle):
        sandbox = await _ready(other, spec())
        async with _agent(sandbox) as agent:
            output, _ = await _run(agent, "head -c 200000000 /dev/zero > /big; echo $?")
        assert output.strip().splitlines()[-1] != "0", output


async def test_a_workdir_that_is_a_file_is_a_clear_error(
    backend: DockerEngineBackend, spec: Callable[..., SandboxSpec], settings: ServiceSettings
) -> None:
    wanted = spec(workdir="/etc/passwd")
    with pytest.raises(errors.InvalidRequest) as caught:
        await backend.create(wanted)
    assert caught.value.message.startswith("workdir '/etc/passwd' is not a directory in image ")
    assert await backend.inspect(wanted.sandbox_id) is None
    assert not (settings.sandboxes_dir / wanted.sandbox_id).exists()


async def test_a_killed_sandbox_is_reported_exited_with_its_code(
    backend: DockerEngineBackend,
    spec: Callable[..., SandboxSpec],
    settings: ServiceSettings,
    docker_client: docker.DockerClient,
) -> None:
    sandbox = await _ready(backend, spec())
    container = _container(docker_client, settings, sandbox.sandbox_id)
    container.kill()
    container.wait(timeout=30)
    inspected = await backend.inspect(sandbox.sandbox_id)
    (listed,) = await backend.list()  # a stopped container is inspected for its reason
    for exited in (inspected, listed):
        assert exited is not None
        assert (exited.state, exited.exit_code, exited.agent) == (SandboxState.EXITED, 137, None)
        assert exited.reason == (
            "exited with code 137: killed by SIGKILL (e.g. the out-of-memory killer)"
        )


async def test_a_stopped_sandbox_removed_while_it_is_listed_is_left_out(
    backend: DockerEngineBackend,
    spec: Callable[..., SandboxSpec],
    settings: ServiceSettings,
    docker_client: docker.DockerClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stopped container is inspected after the listing (for its exit code); one removed in
    between (a delete in flight) is gone, not an error that skips the reconciliation."""
    stopped = await backend.create(spec())
    running = await backend.create(spec())
    _container(docker_client, settings, stopped.sandbox_id).kill()
    _container(docker_client, settings, stopped.sandbox_id).wait(timeout=30)
    real_reload = docker.models.containers.Container.reload

    def removed_first(container: Any) -> None:
        docker_client.api.remove_container(container.id, force=True)
        run_dir_mount.unmount(settings.sandboxes_dir / stopped.sandbox_id)  # as a delete does
        real_reload(container)

    monkeypatch.setattr(docker.models.containers.Container, "reload", removed_first)
    assert [s.sandbox_id for s in await backend.list()] == [running.sandbox_id]


async def test_capacity_is_the_engine_machine(backend: DockerEngineBackend) -> None:
    """What the engine reports as its machine (it may be remote): cores and memory."""
    info = await asyncio.to_thread(backend._client.info)
    capacity = await backend.capacity()
    (node,) = capacity.nodes
    assert node.name == info["Name"] and capacity.pods is None
    assert node.capacity.cpu == float(info["NCPU"]) >= 1
    assert node.capacity.memory_bytes == info["MemTotal"] > 0
    assert node.allocatable == node.capacity


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


async def test_the_benchmark_finds_a_sandboxs_processes_on_this_host(
    backend: DockerEngineBackend, spec: Callable[..., SandboxSpec], sandbox_image: str
) -> None:
    """What `orchard bench exec` reads the agent's CPU and the sandbox's memory from: the
    engine's monitor, the container's init, the agent (one more command's process is an
    ``other``)."""
    sandbox = await _ready(backend, spec(image=sandbox_image))
    async with _agent(sandbox) as agent:
        events = agent.exec(uuid4().hex, "echo started; exec sleep 60", timeout=60)
        assert isinstance(await anext(events), Output)
        container = bench_host.engine_container(backend._engine, sandbox.sandbox_id, "docker")
        assert not isinstance(container, str), container
        roles = await asyncio.to_thread(bench_host.sandbox_processes, container.pid)
        await events.aclose()
    (monitor,) = roles["monitor"]
    (init,) = roles["init"]
    assert _comm(monitor) == "conmon" and _comm(init) == "podman-init"  # catatonit
    assert roles["agent"] and [_comm(pid) for pid in roles["other"]] == ["sleep"]
    listing = bench_host.memory_listing(roles["agent"]).splitlines()
    assert [int(line.split()[0]) for line in listing] == roles["agent"]
    assert all(int(field) > 0 for line in listing for field in line.split())


async def test_a_create_waits_for_a_delete_of_the_same_id(
    backend: DockerEngineBackend,
    spec: Callable[..., SandboxSpec],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A delete of an expired sandbox and a new create of its id (schemathesis found them
    interleaved: the delete removed the directory the create had just made, a 500)."""
    old = await _ready(backend, spec())
    removing, release = threading.Event(), threading.Event()
    remove = docker_engine._remove_run_dir

    def slow_remove(run_dir: Path) -> None:
        removing.set()
        release.wait(30)
        remove(run_dir)

    monkeypatch.setattr(docker_engine, "_remove_run_dir", slow_remove)
    deleting = asyncio.create_task(backend.delete(old.sandbox_id))
    assert await asyncio.to_thread(removing.wait, 30)  # the container is gone, its dir not yet
    creating = asyncio.create_task(_ready(backend, spec(sandbox_id=old.sandbox_id)))
    await asyncio.sleep(0.5)  # the create's head start, were it not to wait
    release.set()
    await deleting
    new = await creating
    async with _agent(new) as agent:
        assert (await _run(agent, "echo alive"))[0] == "alive\n"
