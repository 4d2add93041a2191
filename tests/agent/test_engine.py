"""Engine tier: the bundled agent in a busybox container (no Python, no bash, no libc),
reached over the unix socket in a bind-mounted directory, with no network at all."""

from __future__ import annotations

import asyncio
import base64
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import docker
import docker.types
import pytest

from orchard_env import errors
from orchard_env.agent.bundle import (
    BUNDLE_MOUNT,
    RUN_DIR_MOUNT,
    SOCKET_NAME,
    launch_argv,
    launch_env,
)
from orchard_env.agent.client import AgentClient
from orchard_env.orchestrator.backends.docker_engine import LABEL_CREATED_BY, LABEL_INSTANCE
from tests.agent.conftest import TOKEN, collect, mapped_files
from tests.agent.test_pty import read_until, session, until_exit

pytestmark = pytest.mark.engine


@dataclass
class Sandbox:
    container: docker.models.containers.Container
    socket: str


@pytest.fixture
def user() -> str | None:
    """The user the container (and so the agent) runs as; None: the image's (root)."""
    return None


@pytest.fixture
def sandbox(
    docker_client: docker.DockerClient,
    busybox_image: str,
    agent_bundle: Path,
    engine_instance: str,
    user: str | None,
) -> Iterator[Sandbox]:
    run_dir = Path(tempfile.mkdtemp(prefix="oa-run-", dir="/tmp"))
    run_dir.chmod(0o777)
    workdir = "/workspace" if user is None else "/tmp/work"
    container = docker_client.containers.run(
        busybox_image,
        entrypoint=launch_argv(BUNDLE_MOUNT, f"unix:{RUN_DIR_MOUNT}/{SOCKET_NAME}"),
        command=[],
        name=f"orchard-agent-test-{uuid.uuid4().hex[:8]}",
        user=user,
        environment={
            **launch_env(BUNDLE_MOUNT),
            "ORCHARD_AGENT_TOKEN": TOKEN,
            "ORCHARD_AGENT_WORKDIR": workdir,
        },
        mounts=[
            docker.types.Mount(BUNDLE_MOUNT, str(agent_bundle), type="bind", read_only=True),
            docker.types.Mount(RUN_DIR_MOUNT, str(run_dir), type="bind"),
        ],
        network_mode="none",
        labels={LABEL_CREATED_BY: "orchard", LABEL_INSTANCE: engine_instance},
        detach=True,
    )
    try:
        yield Sandbox(container, str(run_dir / SOCKET_NAME))
    finally:
        container.remove(force=True)
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
async def agent_in_busybox(sandbox: Sandbox) -> AsyncIterator[AgentClient]:
    async with AgentClient(token=TOKEN, uds=sandbox.socket) as client:
        try:
            await client.wait_ready(30)
        except errors.AgentUnavailable:
            logs = sandbox.container.logs().decode(errors="replace")
            raise AssertionError(f"agent did not start; container logs:\n{logs}") from None
        yield client


async def test_exec_in_an_image_without_python_or_bash(agent_in_busybox: AgentClient) -> None:
    agent = agent_in_busybox
    result = await collect(agent.exec("j1", "echo hi; pwd; ls /bin/bash /usr/bin/python3"))
    assert result.stdout.splitlines()[:2] == [b"hi", b"/workspace"]
    assert b"bash" in result.stderr and b"python3" in result.stderr  # neither exists here
    assert result.exit.exit_code != 0
    env = await collect(agent.exec("env", ["env"], env={"REQ": "1"}))
    names = {line.split("=", 1)[0] for line in env.stdout.decode().splitlines()}
    assert "REQ" in names and "PATH" in names
    assert not {n for n in names if n.startswith(("ORCHARD_AGENT_", "PYTHON", "LD_", "LC_"))}
    login = await collect(agent.exec("login", "echo $0", login_shell=True))
    assert login.stdout == b"/bin/sh\n"  # no bash: sh -l


async def test_timeout_kills_the_tree_and_the_agent_reaps_as_pid_1(
    agent_in_busybox: AgentClient,
) -> None:
    agent = agent_in_busybox
    result = await collect(agent.exec("t", "sleep 300 & echo $!; wait", timeout=0.5))
    assert result.exit.timed_out and result.exit.signal == 9
    grandchild = int(result.stdout)
    # an orphan whose parent exited is reparented to PID 1 (the agent's init half)
    await collect(agent.exec("orphan", "(sleep 0.1 &) ; true"))
    states = ""
    for _ in range(200):
        probe = await collect(agent.exec(f"ps-{time.monotonic_ns()}", "cat /proc/[0-9]*/stat"))
        states = probe.stdout.decode()
        lines = states.splitlines()
        gone = not any(line.startswith(f"{grandchild} ") for line in lines)
        zombies = [line for line in lines if line.rsplit(")", 1)[1].split()[0] == "Z"]
        if gone and not zombies:
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError(f"leftover processes or zombies:\n{states}")
    init = await collect(agent.exec("init", ["cat", "/proc/1/cmdline"]))
    assert b"/agent\0--listen" in init.stdout


# A double-forked ``setsid`` process: a session (and process group) of its own, its pid printed
# (as ``escaped:<pid>:done``, which a terminal's echo of the typed line does not contain).
ESCAPE = "(setsid sleep 300 >/dev/null 2>&1 & printf 'escaped:%s:done\\n' $!)"


def escaped_pid(output: bytes) -> int:
    found = re.search(rb"escaped:(\d+):done", output)
    assert found is not None, output
    return int(found[1])


async def assert_gone(agent: AgentClient, pid: int, what: str) -> None:
    for _ in range(200):
        alive = await collect(agent.exec(f"ps-{time.monotonic_ns()}", f"test -e /proc/{pid}"))
        if alive.exit.exit_code != 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the setsid orphan {pid} survived {what}")


async def test_timeout_kills_setsid_descendants_in_busybox(
    sandbox: Sandbox, agent_in_busybox: AgentClient
) -> None:
    """The bundle's static ``orchard-subreaper`` makes each command a subreaper in any image,
    even one without a libc: a double-forked ``setsid`` orphan is still killed with its
    command (and the agent never needed ctypes, which only its ``preexec_fn`` fallback loads)."""
    agent = agent_in_busybox
    result = await collect(agent.exec("escape", f"{ESCAPE}; sleep 300", timeout=2))
    assert result.exit.timed_out
    await assert_gone(agent, escaped_pid(result.stdout), "its command's timeout")
    sandbox.container.reload()
    agent_pid = sandbox.container.attrs["State"]["Pid"]  # the agent is the container's PID 1
    assert "_ctypes" not in mapped_files(agent_pid)


@pytest.mark.parametrize("end", ["kill", "close", "disconnect"])
async def test_ending_a_pty_session_kills_its_setsid_descendants(
    agent_in_busybox: AgentClient, end: str
) -> None:
    """A process a terminal's shell started with ``setsid`` is outside the session's process
    group; killing the session (``KILL``, the grace after ``close``, a disconnect) kills it
    too, as a job's timeout does."""
    agent = agent_in_busybox
    async with session(agent, cmd=["/bin/sh"]) as pty:
        await pty.send(
            {"type": "stdin", "data": base64.b64encode(ESCAPE.encode() + b"\n").decode()}
        )
        orphan = escaped_pid(await read_until(pty, b":done\r\n"))
        for attempt in range(100):  # $! is printed before the child has called setsid()
            stat = await collect(agent.exec(f"stat-{attempt}", ["cat", f"/proc/{orphan}/stat"]))
            pgid = int(stat.stdout.rsplit(b")", 1)[1].split()[2])
            if pgid == orphan:
                break
            await asyncio.sleep(0.05)
        assert pgid == orphan  # its own group: a signal to the shell's group misses it
        if end == "kill":
            await pty.send({"type": "signal", "sig": "KILL"})
            _, exit_frame = await until_exit(pty)
            assert exit_frame["code"] == -9
        elif end == "close":
            await pty.send({"type": "close"})  # the interactive shell ignores TERM
            _, exit_frame = await until_exit(pty, limit=30)
            assert exit_frame["code"] == -9
    await assert_gone(agent, orphan, f"its PTY session's end ({end})")


@pytest.mark.parametrize("user", ["65534:65534"])
async def test_agent_as_an_unprivileged_user(agent_in_busybox: AgentClient) -> None:
    agent = agent_in_busybox
    whoami = await collect(agent.exec("id", "id -u; pwd"))
    assert whoami.stdout == b"65534\n/tmp/work\n"  # the workdir was created by the agent
    await agent.mkdir("/tmp/work/locked")
    await collect(agent.exec("lock", "touch locked/x && chmod 000 locked"))
    with pytest.raises(errors.InvalidRequest) as denied:
        await agent.list_dir("locked")
    assert denied.value.message == "permission denied listing /tmp/work/locked"
    with pytest.raises(errors.InvalidRequest) as denied_write:
        await agent.write_file("/etc/passwd", b"x")
    assert denied_write.value.message == "permission denied writing /etc/passwd"


async def test_files_and_the_read_only_bundle(agent_in_busybox: AgentClient) -> None:
    agent = agent_in_busybox
    data = bytes(range(256)) * 4096
    assert await agent.write_file("/workspace/a/b.bin", data, mode=0o640) == len(data)
    assert b"".join([c async for c in agent.read_file("a/b.bin")]) == data
    entries = await agent.list_dir("/workspace/a")
    assert [(e.name, e.type, e.size) for e in entries] == [("b.bin", "file", len(data))]
    with pytest.raises(errors.InvalidRequest) as read_only:
        await agent.write_file(f"{BUNDLE_MOUNT}/agent/evil.py", b"x")
    assert read_only.value.message == (
        f"writing {BUNDLE_MOUNT}/agent/evil.py failed: Read-only file system"
    )
    assert await agent.delete_path("/workspace/a", recursive=True) == "/workspace/a"


async def test_pty_in_busybox(agent_in_busybox: AgentClient) -> None:
    agent = agent_in_busybox
    async with session(agent, cmd=["sh", "-c", "tty -s && stty size && exit 7"]) as pty:
        output, exit_frame = await until_exit(pty)
    assert exit_frame["code"] == 7
    assert b"24 80" in output
    async with session(agent, cmd=["sleep", "60"]) as pty:
        await pty.send({"type": "signal", "sig": "KILL"})
        assert (await until_exit(pty))[1]["code"] == -9
    async with session(agent, cmd=["cat"]) as pty:
        await pty.send({"type": "stdin", "data": base64.b64encode(b"ping\n").decode()})
        await pty.send({"type": "stdin", "data": base64.b64encode(b"\x04").decode()})
        output, exit_frame = await until_exit(pty)
    assert output.count(b"ping") == 2 and exit_frame["code"] == 0


def test_stop_forwards_sigterm_and_exits_cleanly(sandbox: Sandbox) -> None:
    deadline = time.monotonic() + 30
    while not Path(sandbox.socket).exists():
        assert time.monotonic() < deadline, sandbox.container.logs()
        time.sleep(0.02)
    started = time.monotonic()
    sandbox.container.stop(timeout=10)
    assert time.monotonic() - started < 5  # not the 10 s kill
    sandbox.container.reload()
    assert sandbox.container.attrs["State"]["ExitCode"] == 0
    assert not Path(sandbox.socket).exists()  # the agent removed its socket
