"""Fixtures for the agent tests: the real agent (``orchard_env.agent.daemon``) started as a
subprocess of the host Python on a unix socket, driven through :class:`AgentClient`."""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchard_env.agent.bundle import SUBREAPER_ENV, build_subreaper
from orchard_env.agent.client import AgentClient, AgentEvent, Exit, Output
from orchard_env.agent.daemon import proof
from tests.orchestrator.fakes import HOST_AGENT

TOKEN = "test-token-0123456789"


@dataclass
class RunningAgent:
    socket: str
    token: str
    workdir: Path
    process: subprocess.Popen[bytes]

    def client(self, token: str | None = None) -> AgentClient:
        return AgentClient(token=token or self.token, uds=self.socket, timeout=10.0)


def signed(token: str, method: str, target: str, body: bytes | None) -> dict[str, str]:
    """Headers of a request a raw HTTP client makes as the orchestrator would (``body``:
    None for a streamed one, whose bytes the MAC does not cover)."""
    nonce = os.urandom(16).hex()
    digest = proof.UNSIGNED_BODY if body is None else proof.digest(body)
    mac = proof.request_mac(token.encode(), nonce, method, target, digest)
    return {
        proof.NONCE_HEADER: nonce,
        proof.BODY_HEADER: digest,
        "Authorization": f"{proof.SCHEME} {mac}",
    }


@dataclass
class Result:
    stdout: bytes
    stderr: bytes
    exit: Exit
    events: list[AgentEvent]


async def collect(events: AsyncIterator[AgentEvent]) -> Result:
    """Drain an exec/attach stream: the output per stream, the exit, and every event."""
    seen: list[AgentEvent] = []
    out = {"stdout": b"", "stderr": b""}
    async for event in events:
        seen.append(event)
        if isinstance(event, Output):
            out[event.stream] += event.data
    final = seen[-1]
    assert isinstance(final, Exit)
    assert all(isinstance(e, Output) for e in seen[:-1])
    return Result(out["stdout"], out["stderr"], final, seen)


async def poll_until(check: Callable[[], bool], what: str, limit: float = 10.0) -> None:
    """Poll ``check`` every 20 ms until it holds; fail naming ``what`` after ``limit`` s."""
    deadline = time.monotonic() + limit
    for attempt in itertools.count():
        if check():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: still not true after {limit} s ({attempt} checks)")
        await asyncio.sleep(0.02)


def mapped_files(pid: int) -> str:
    """``/proc/<pid>/maps``: what the process has mapped."""
    with open(f"/proc/{pid}/maps") as maps:
        return maps.read()


def process_gone(pid: int) -> bool:
    """True once ``pid`` no longer runs (exited, or a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


class UnixProxy:
    """A unix-socket proxy in front of the agent that counts client connections and can cut
    the first one as soon as it carries output (to test re-attaching)."""

    def __init__(self, target: str, path: str, *, cut_first_stream: bool = False) -> None:
        self.target = target
        self.path = path
        self.cut_first_stream = cut_first_stream
        self.cut = False
        self.connections: list[asyncio.Future[tuple[None, None]]] = []
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> UnixProxy:
        self._server = await asyncio.start_unix_server(self._handle, self.path)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        await asyncio.wait_for(asyncio.gather(*self.connections), 10)
        await self._server.wait_closed()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        agent_r, agent_w = await asyncio.open_unix_connection(self.target)
        both = asyncio.gather(
            self._pipe(client_r, agent_w, False), self._pipe(agent_r, client_w, True)
        )
        self.connections.append(both)
        await both

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, from_agent: bool
    ) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
                if from_agent and self.cut_first_stream and not self.cut and b'"t":"o"' in data:
                    self.cut = True
                    raise ConnectionResetError
        except ConnectionError:
            pass
        finally:
            writer.close()


def start_agent(
    argv: list[str], listen: str, env: dict[str, str], workdir: Path
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [*argv, "--listen", listen],
        env={"PATH": os.environ["PATH"], "ORCHARD_AGENT_WORKDIR": str(workdir), **env},
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def stop_agent(process: subprocess.Popen[bytes]) -> int:
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=10)
    finally:
        if process.stderr is not None:
            process.stderr.close()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory for unix sockets (their paths are limited to 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="oa-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def subreaper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundle's ``orchard-subreaper``, built as a bundle build makes it."""
    return build_subreaper(tmp_path_factory.mktemp("subreaper") / "orchard-subreaper")


@pytest.fixture
def spawner_env(request: pytest.FixtureRequest, subreaper: Path) -> dict[str, str]:
    """How the agent starts commands: through the bundle's subreaper, as in a sandbox. A test
    parametrized with :data:`EVERY_SPAWNER` also gets the agent as run from source
    (``preexec_fn``) and one launched as if its bundle had no subreaper (an older bundle)."""
    how = getattr(request, "param", "subreaper")
    if how == "preexec_fn":
        return {}
    if how == "subreaper missing":
        return {SUBREAPER_ENV: str(subreaper.with_name("no-such-subreaper"))}
    return {SUBREAPER_ENV: str(subreaper)}


EVERY_SPAWNER = pytest.mark.parametrize(
    "spawner_env", ["subreaper", "preexec_fn", "subreaper missing"], indirect=True
)


@pytest.fixture
async def agent_server(
    tmp_path: Path, short_dir: Path, spawner_env: dict[str, str]
) -> AsyncIterator[RunningAgent]:
    workdir = tmp_path / "workspace"
    socket = str(short_dir / "agent.sock")
    process = start_agent([*HOST_AGENT], f"unix:{socket}", spawner_env, workdir)
    running = RunningAgent(socket, TOKEN, workdir, process)
    async with running.client() as client:
        await client.wait_ready(15)
    yield running
    assert stop_agent(process) == 0


@pytest.fixture
async def agent(agent_server: RunningAgent) -> AsyncIterator[AgentClient]:
    async with agent_server.client() as client:
        yield client
