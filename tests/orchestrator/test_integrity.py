"""Engine tier: code in a sandbox, as root, attacks its agent's channel for real.

Each test runs the attack from inside a real container through the public API and checks
that the orchestrator believes nothing it did not get from the real agent, follows no path
the sandbox planted, and fails the sandbox with a reason that says what happened.
"""

from __future__ import annotations

import asyncio
import socket
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import docker
import pytest

from orchard_env.config import ServiceSettings, service_settings
from orchard_env.protocol import SandboxStatus
from orchard_env.sdk import AsyncSandbox, AsyncSandboxClient
from tests.servers import Live, live_service

pytestmark = pytest.mark.engine

SNOOP = r"""
import ctypes, os, sys

key = sys.argv[1][::-1].encode()  # reversed here, so the agent's copy of this command has no key
found = []
agents = 0
libc = ctypes.CDLL(None, use_errno=True)


def read(path):
    try:
        with open(path, "rb") as source:
            return source.read()
    except OSError:
        return b""


def memory_has_key(pid):
    try:
        maps = open(f"/proc/{pid}/maps").read().splitlines()
        mem = open(f"/proc/{pid}/mem", "rb", 0)
    except OSError:
        return False
    for line in maps:
        span, perms = line.split()[:2]
        lo, hi = (int(x, 16) for x in span.split("-"))
        if "r" not in perms or hi - lo > 1 << 28:
            continue
        try:
            mem.seek(lo)
            if key in mem.read(hi - lo):
                return True
        except (OSError, OverflowError, ValueError):
            continue
    return False


for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
    if pid == os.getpid():
        continue
    if key in read(f"/proc/{pid}/environ"):
        found.append(f"environ of {pid}")
    if memory_has_key(pid):
        found.append(f"memory of {pid}")
    if read(f"/proc/{pid}/cmdline").startswith(b"/opt/orchard-agent/"):  # the agent itself
        agents += 1
        if libc.ptrace(16, pid, 0, 0) == 0:  # PTRACE_ATTACH
            found.append(f"ptrace of {pid}")
            os.waitpid(pid, 0)
            libc.ptrace(17, pid, 0, 0)  # PTRACE_DETACH
print(", ".join(found) or "nothing", f"(agents tried: {agents})")
"""

SETTLE_SECONDS = 120  # a generous cap on detection; the reaper probes every second
AGENT_SOCKET = "/run/orchard/agent.sock"
IMPOSTOR = r"""
import base64, os, socket, sys, threading

mode = sys.argv[1]
EXIT = (b'{"t":"x","exit_code":0,"signal":null,"timed_out":false,"cancelled":false,'
        b'"truncated":false,"error":null,"duration":0.1}\n')
if mode == "huge":  # one 8 MiB line of valid output, then a clean exit
    BODY = b'{"t":"o","d":"' + b"QUFB" * (2 << 20) + b'"}\n' + EXIT
else:  # a forged success
    BODY = b'{"t":"o","d":"' + base64.b64encode(b"all tests passed\n") + b'"}\n' + EXIT

def answer(conn):
    with conn:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = conn.recv(65536)
            if not chunk:
                return
            head += chunk
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY)
        while conn.recv(65536):
            pass

os.unlink("/run/orchard/agent.sock")
server = socket.socket(socket.AF_UNIX)
server.bind("/run/orchard/agent.sock")
os.chmod("/run/orchard/agent.sock", 0o666)
server.listen(64)
open("/tmp/impostor.ready", "w").close()
while True:
    threading.Thread(target=answer, args=(server.accept()[0],), daemon=True).start()
"""


@pytest.fixture
def settings(
    tmp_path_factory: pytest.TempPathFactory, engine_instance: str, agent_bundle: Path
) -> ServiceSettings:
    return service_settings(
        state_dir=tmp_path_factory.mktemp("integ"),
        instance=f"{engine_instance}-integ",
        agent_bundle_dir=agent_bundle,
        reap_interval_seconds=1,
    )


@pytest.fixture
def orchard(settings: ServiceSettings) -> Iterator[Live]:
    with live_service(settings, key_name="integrity") as running:
        yield running


@pytest.fixture
async def sandbox(orchard: Live, sandbox_image: str) -> AsyncIterator[AsyncSandbox]:
    url, key = orchard
    async with (
        AsyncSandboxClient(base_url=url, api_key=key) as client,
        await client.create_sandbox(sandbox_image, memory="512Mi") as created,
    ):
        yield created


async def failed_reason(sandbox: AsyncSandbox) -> str:
    """The sandbox's status message once it is failed (the reaper probes every second)."""
    for _ in range(SETTLE_SECONDS * 10):
        info = await sandbox.refresh()
        if info.status == SandboxStatus.FAILED:
            return info.status_message or ""
        assert info.status == SandboxStatus.READY, info
        await asyncio.sleep(0.1)
    raise AssertionError(f"sandbox {sandbox.sandbox_id} is still ready")


async def concurrent_execs(sandbox: AsyncSandbox, count: int = 4) -> list[str]:
    """Run ``count`` commands at once, so the orchestrator opens new agent connections (its
    pooled one was made to the real agent before the attack). Each exits 3 for real."""
    results = await asyncio.gather(
        *(sandbox.exec("sleep 1; exit 3", timeout=60) for _ in range(count)),
        return_exceptions=True,
    )
    outcomes = []
    for result in results:
        if isinstance(result, BaseException):
            outcomes.append(f"raised {result!r}")
        else:
            assert not result.succeeded, f"a forged result was believed: {result!r}"
            outcomes.append(f"{result.status.value} {result.exit_code} {result.error}")
    return outcomes


class Bait:
    """A unix socket on the host that counts the connections it is offered."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.accepted = 0
        self._server = socket.socket(socket.AF_UNIX)
        self._server.bind(str(path))
        self._server.listen(16)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            self.accepted += 1
            with conn:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")

    def close(self) -> None:
        self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()


@pytest.fixture
def bait() -> Iterator[Bait]:
    with tempfile.TemporaryDirectory(prefix="bait-", dir="/tmp") as folder:
        trap = Bait(Path(folder) / "host.sock")
        try:
            yield trap
        finally:
            trap.close()


async def test_a_symlink_at_the_socket_is_never_followed(sandbox: AsyncSandbox, bait: Bait) -> None:
    planted = await sandbox.exec(f"rm {AGENT_SOCKET} && ln -s {bait.path} {AGENT_SOCKET}")
    assert planted.succeeded, planted
    outcomes = await concurrent_execs(sandbox)
    assert bait.accepted == 0, outcomes
    reason = await failed_reason(sandbox)
    assert reason.startswith("its agent failed an integrity check: agent at "), reason
    assert reason.endswith(
        "agent.sock is a symlink, not the agent's socket: something in the sandbox replaced it"
    )


async def test_an_impostor_with_a_huge_line_is_cut_off(sandbox: AsyncSandbox) -> None:
    await sandbox.upload_content(IMPOSTOR, "/tmp/impostor.py")
    started = await sandbox.exec(
        "python3 /tmp/impostor.py huge >/dev/null 2>&1 &"
        " while [ ! -e /tmp/impostor.ready ]; do sleep 0.05; done"
    )
    assert started.succeeded, started
    await concurrent_execs(sandbox)
    # Whichever reached the impostor first (an exec, or the reaper's probe) says why.
    reason = await failed_reason(sandbox)
    assert reason.startswith("its agent failed an integrity check: agent at "), reason


def engine_key(docker_client: docker.DockerClient, sandbox_id: str) -> str:
    """The sandbox's agent key as the engine holds it (its container's label)."""
    (container,) = docker_client.containers.list(
        filters={"label": f"orchard.sandbox-id={sandbox_id}"}, ignore_removed=True
    )
    labels = container.attrs["Config"]["Labels"]
    if "orchard.agent-key" in labels:
        return str(labels["orchard.agent-key"])
    env = dict(item.split("=", 1) for item in container.attrs["Config"]["Env"])
    return env["ORCHARD_AGENT_TOKEN"]  # where it was kept before it left the environment


async def test_root_in_the_sandbox_cannot_read_the_agents_key(
    sandbox: AsyncSandbox, docker_client: docker.DockerClient
) -> None:
    """Every process's environ and readable memory, and ptrace of the agent, as root."""
    key = engine_key(docker_client, sandbox.sandbox_id)
    await sandbox.upload_content(SNOOP, "/tmp/snoop.py")
    snooped = await sandbox.exec(["python3", "/tmp/snoop.py", key[::-1]])
    assert snooped.succeeded, snooped
    assert snooped.stdout == "nothing (agents tried: 1)\n"


async def test_an_impostor_that_binds_the_socket_cannot_forge_a_result(
    sandbox: AsyncSandbox,
) -> None:
    await sandbox.upload_content(IMPOSTOR, "/tmp/impostor.py")
    started = await sandbox.exec(
        "python3 /tmp/impostor.py forge >/dev/null 2>&1 &"
        " while [ ! -e /tmp/impostor.ready ]; do sleep 0.05; done"
    )
    assert started.succeeded, started
    await concurrent_execs(sandbox)  # none of them may come back a (forged) success
    reason = await failed_reason(sandbox)
    assert reason.startswith("its agent failed an integrity check: agent at "), reason
    assert reason.endswith(
        "its answer carries no valid proof of the sandbox's key: "
        "something other than the sandbox's agent answered"
    )


async def test_a_deleted_agent_socket_fails_the_sandbox(sandbox: AsyncSandbox) -> None:
    removed = await sandbox.exec(f"rm {AGENT_SOCKET}")
    assert removed.succeeded, removed
    reason = await failed_reason(sandbox)
    assert reason.startswith("its agent is gone (no agent socket at "), reason
    assert reason.endswith("): its socket was removed or the agent died"), reason
