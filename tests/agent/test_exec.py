"""Exec through AgentClient against the real agent process (service tier, no containers)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from orchard_env import errors
from orchard_env.agent.client import AgentClient, Exit, Output
from tests.agent.conftest import (
    EVERY_SPAWNER,
    TOKEN,
    RunningAgent,
    UnixProxy,
    collect,
    mapped_files,
    poll_until,
    process_gone,
    start_agent,
    stop_agent,
)
from tests.orchestrator.fakes import HOST_AGENT


async def test_string_command_runs_through_sh(agent: AgentClient) -> None:
    result = await collect(agent.exec("j1", "echo out; echo err >&2; exit 3"))
    assert result.stdout == b"out\n"
    assert result.stderr == b"err\n"
    assert result.exit.exit_code == 3
    assert result.exit.signal is None
    assert not (result.exit.timed_out or result.exit.cancelled or result.exit.truncated)
    assert result.exit.error is None
    assert 0 < result.exit.duration < 10


async def test_argv_command_is_not_split_by_a_shell(agent: AgentClient) -> None:
    result = await collect(agent.exec("j1", ["printf", "%s|", "a b", "$HOME", "*"]))
    assert result.stdout == b"a b|$HOME|*|"
    assert result.exit.exit_code == 0


async def test_events_keep_the_order_of_the_streams(agent: AgentClient) -> None:
    command = "echo a; sleep 0.05; echo b >&2; sleep 0.05; echo c; sleep 0.05; echo d >&2"
    result = await collect(agent.exec("j1", command))
    outputs = [(e.stream, e.data) for e in result.events if isinstance(e, Output)]
    assert outputs == [
        ("stdout", b"a\n"),
        ("stderr", b"b\n"),
        ("stdout", b"c\n"),
        ("stderr", b"d\n"),
    ]


async def test_output_streams_while_the_command_runs(agent: AgentClient) -> None:
    events = agent.exec("j1", "echo first; sleep 60", timeout=120)
    first = await asyncio.wait_for(anext(events), 10)
    assert first == Output("stdout", b"first\n")
    assert await agent.cancel("j1") is True
    final = await asyncio.wait_for(anext(events), 10)
    assert isinstance(final, Exit)
    assert final.cancelled and final.signal == 9 and final.exit_code is None
    assert not final.timed_out


async def test_environment_is_the_agents_minus_its_own_plus_the_requests(
    tmp_path: Path, short_dir: Path
) -> None:
    socket = str(short_dir / "a.sock")
    env = {
        "ORCHARD_AGENT_TOKEN": TOKEN,
        "ORCHARD_AGENT_EXTRA": "agent-only",
        "PYTHONHOME": sys.prefix,  # points into the agent's own interpreter: dropped
        "PYTHONPATH": "/image/lib",  # the image's own: kept
        "IMAGE_VAR": "from-image",
    }
    process = start_agent([*HOST_AGENT], f"unix:{socket}", env, tmp_path)
    try:
        async with AgentClient(token=TOKEN, uds=socket) as client:
            await client.wait_ready(15)
            result = await collect(client.exec("env", ["env"], env={"REQ": "1", "IMAGE_VAR": "x"}))
    finally:
        assert stop_agent(process) == 0
    lines = set(result.stdout.decode().splitlines())
    assert {"REQ=1", "IMAGE_VAR=x", "PYTHONPATH=/image/lib"} <= lines
    names = {line.split("=", 1)[0] for line in lines}
    assert not names & {"ORCHARD_AGENT_TOKEN", "ORCHARD_AGENT_EXTRA", "ORCHARD_AGENT_WORKDIR"}
    assert "PYTHONHOME" not in names
    assert "LC_CTYPE" not in names  # set by the interpreter's locale coercion, not by the user


async def test_cwd_defaults_to_the_workdir_and_resolves_relative_paths(
    agent: AgentClient, agent_server: RunningAgent
) -> None:
    (agent_server.workdir / "sub").mkdir()
    assert (await collect(agent.exec("a", "pwd"))).stdout.decode().strip() == str(
        agent_server.workdir
    )
    result = await collect(agent.exec("b", "pwd", cwd="sub"))
    assert result.stdout.decode().strip() == str(agent_server.workdir / "sub")
    assert (await collect(agent.exec("c", "pwd", cwd="/tmp"))).stdout == b"/tmp\n"


async def test_missing_cwd_is_an_error_not_a_fallback(agent: AgentClient) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        await collect(agent.exec("j1", "pwd", cwd="/no/such/dir"))
    assert caught.value.message == "cwd /no/such/dir does not exist"


@EVERY_SPAWNER
async def test_missing_binary_reports_its_name_with_exit_127(agent: AgentClient) -> None:
    result = await collect(agent.exec("argv", ["no-such-binary-xyz", "--flag"]))
    assert result.exit.exit_code == 127
    assert result.exit.error == "command not found: no-such-binary-xyz"
    shell = await collect(agent.exec("shell", "no-such-binary-xyz"))
    assert shell.exit.exit_code == 127
    assert b"no-such-binary-xyz" in shell.stderr


@pytest.mark.parametrize(
    ("spawner_env", "forks_the_agent"),
    [("subreaper", False), ("preexec_fn", True), ("subreaper missing", True)],
    indirect=["spawner_env"],
)
async def test_commands_start_through_the_subreaper_when_the_bundle_has_one(
    agent: AgentClient, agent_server: RunningAgent, forks_the_agent: bool
) -> None:
    """The ``preexec_fn`` that makes a command a subreaper without the bundle's subreaper
    needs ctypes (for ``prctl``): an agent that loaded it started a command that way."""
    assert (await collect(agent.exec("one", ["true"]))).exit.exit_code == 0
    assert ("_ctypes" in mapped_files(agent_server.process.pid)) is forks_the_agent


@EVERY_SPAWNER
async def test_a_command_holds_no_descriptor_of_the_agent(agent: AgentClient) -> None:
    """Only stdin, stdout and stderr: a command holding the subreaper's status pipe could keep
    the agent waiting for its end, and one holding the agent's sockets could speak for it."""
    listed = await collect(agent.exec("fds", ["/bin/sh", "-c", "ls /proc/$$/fd"]))
    assert listed.exit.exit_code == 0, listed.stderr
    assert sorted(listed.stdout.split()) == [b"0", b"1", b"2"]


@EVERY_SPAWNER
async def test_a_file_that_cannot_be_executed_exits_126(
    agent: AgentClient, agent_server: RunningAgent
) -> None:
    script = agent_server.workdir / "not-executable"
    script.write_text("echo ran\n")  # no x bit: root cannot exec it either
    named = await collect(agent.exec("named", [str(script)]))
    assert (named.exit.exit_code, named.exit.error) == (126, f"permission denied: {script}")
    # looked up on PATH: a candidate that cannot run is passed over for a later one, and
    # when none runs, the first error other than "not found" is the one reported (as
    # CPython's own lookup does)
    (agent_server.workdir / "true").write_text("")
    path = f"/no/such:{agent_server.workdir}"
    none = await collect(agent.exec("none", ["true"], env={"PATH": f"{path}:/no/such/either"}))
    assert (none.exit.exit_code, none.exit.error) == (126, "permission denied: true")
    fine = await collect(agent.exec("fine", ["true"], env={"PATH": f"{path}:/bin"}))
    assert fine.exit.exit_code == 0 and fine.exit.error is None


async def test_stdin_is_fed_to_the_command(agent: AgentClient) -> None:
    data = bytes(range(256)) * 1024  # more than a pipe buffer
    result = await collect(agent.exec("j1", ["sha256sum"], stdin=data))
    assert result.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()
    no_stdin = await collect(agent.exec("j2", "cat"))
    assert no_stdin.stdout == b"" and no_stdin.exit.exit_code == 0


async def test_output_past_the_cap_keeps_the_head_and_the_tail(agent: AgentClient) -> None:
    command = "seq 1 100000; head -c 10 /dev/zero >&2; echo done >&2"
    full = "".join(f"{n}\n" for n in range(1, 100001)).encode()
    result = await collect(agent.exec("j1", command, max_output_bytes=1000))
    assert result.stdout == full[:500] + full[-500:]
    assert result.stderr == b"\0" * 10 + b"done\n"
    assert result.exit.truncated is True
    assert result.exit.dropped == (len(full) - 1000, 0)
    assert result.exit.exit_code == 0  # the command was not blocked: the pipe was drained
    small = await collect(agent.exec("j2", "echo ok", max_output_bytes=1000))
    assert small.exit.truncated is False


async def test_timeout_kills_the_whole_process_tree(agent: AgentClient) -> None:
    result = await collect(agent.exec("j1", "sleep 300 & echo $!; wait", timeout=0.5))
    assert result.exit.timed_out is True
    assert result.exit.exit_code is None and result.exit.signal == 9
    assert not result.exit.cancelled
    grandchild = int(result.stdout)
    await poll_until(lambda: process_gone(grandchild), f"sleep {grandchild} is killed")
    # the agent itself is unharmed
    assert (await agent.health())["status"] == "ok"


# Three ways out of a command's process group: setsid, nohup, and a double fork whose middle
# process exits at once (its child is orphaned). Each prints its pid.
ESCAPEES = (
    "setsid sleep 300 >/dev/null 2>&1 & echo $!; "
    "nohup sleep 301 >/dev/null 2>&1 & echo $!; "
    "(setsid sleep 302 >/dev/null 2>&1 & echo $!); "
)


@EVERY_SPAWNER
async def test_cancel_and_timeout_kill_setsid_nohup_and_orphaned_descendants(
    agent: AgentClient,
) -> None:
    events = agent.exec("escape", ESCAPEES + "echo ready; sleep 300")
    printed = b""
    while b"ready" not in printed:
        event = await anext(events)
        assert isinstance(event, Output)
        printed += event.data
    pids = [int(line) for line in printed.split()[:3]]
    assert not any(process_gone(pid) for pid in pids)
    assert await agent.cancel("escape") is True
    assert (await collect(events)).exit.cancelled
    for pid in pids:
        await poll_until(lambda pid=pid: process_gone(pid), f"descendant {pid} is killed")

    timed = await collect(agent.exec("escape-timeout", ESCAPEES + "sleep 300", timeout=2))
    assert timed.exit.timed_out
    for pid in map(int, timed.stdout.split()):
        await poll_until(lambda pid=pid: process_gone(pid), f"descendant {pid} is killed")


@EVERY_SPAWNER
async def test_background_processes_of_a_command_that_exits_stay(agent: AgentClient) -> None:
    result = await collect(agent.exec("server", "setsid sleep 300 >/dev/null 2>&1 & echo $!"))
    assert result.exit.exit_code == 0
    server = int(result.stdout)
    try:
        assert not process_gone(server)  # e.g. a server the next turn talks to
    finally:
        os.kill(server, signal.SIGKILL)


def oom_score_adj(pid: int) -> int:
    with open(f"/proc/{pid}/oom_score_adj") as source:
        return int(source.read())


@EVERY_SPAWNER
async def test_commands_are_likelier_oom_victims_than_the_agent(agent: AgentClient) -> None:
    events = agent.exec("oom", "echo $$; exec sleep 60")
    first = await anext(events)
    assert isinstance(first, Output)
    agent_pid = (await agent.health())["pid"]
    agent_adj, command_adj = map(oom_score_adj, (agent_pid, int(first.data)))
    assert command_adj == min(1000, agent_adj + 500)
    await agent.cancel("oom")
    assert (await collect(events)).exit.cancelled


async def test_exit_124_is_not_a_timeout(agent: AgentClient) -> None:
    result = await collect(agent.exec("j1", "exit 124", timeout=30))
    assert result.exit.exit_code == 124
    assert result.exit.timed_out is False


async def test_cancel(agent: AgentClient) -> None:
    events = agent.exec("j1", "echo started; sleep 60")
    assert await anext(events) == Output("stdout", b"started\n")
    assert await agent.cancel("j1") is True
    final = await anext(events)
    assert isinstance(final, Exit) and final.cancelled and final.signal == 9
    assert await agent.cancel("j1") is False  # already finished


async def test_a_cancel_that_overtakes_its_exec_stops_it_from_running(agent: AgentClient) -> None:
    # The orchestrator's cancel and its exec travel on separate connections: the cancel may
    # arrive first. The exec that follows must not run its command, and says why.
    assert await agent.cancel("ahead") is True
    result = await collect(agent.exec("ahead", "touch ran; echo ran"))
    assert result.exit.cancelled and result.exit.exit_code is None
    assert result.exit.error == "cancelled before it started" and result.stdout == b""
    again = await collect(agent.exec("ahead", "touch ran; echo ran"))  # attaches: same end
    assert again.exit.cancelled and again.stdout == b""
    assert (await collect(agent.exec("after", "test -e ran"))).exit.exit_code == 1


async def test_a_cancel_racing_a_natural_exit_reports_one_consistent_end(
    agent: AgentClient,
) -> None:
    # The command exits right after printing, while a background child keeps its pipes open
    # (the agent then drains for a moment): a cancel in that moment must neither signal the
    # reaped pid (it may be another process's by now) nor report the command cancelled.
    for n in range(5):
        events = agent.exec(f"race{n}", "sleep 2 & echo done", timeout=30)
        assert await anext(events) == Output("stdout", b"done\n")
        await asyncio.sleep(0.05 * n)
        cancelled = await agent.cancel(f"race{n}")
        final = (await collect(events)).exit
        if cancelled:
            assert final.cancelled and final.signal == 9 and final.exit_code is None
        else:
            assert not final.cancelled and final.exit_code == 0 and final.signal is None


async def test_same_job_id_never_runs_twice(agent: AgentClient, agent_server: RunningAgent) -> None:
    command = "echo run >> runs.txt; echo done"
    first = await collect(agent.exec("once", command))
    second = await collect(agent.exec("once", command))
    assert first.stdout == second.stdout == b"done\n"
    assert first.exit == second.exit
    assert (agent_server.workdir / "runs.txt").read_text() == "run\n"
    with pytest.raises(errors.Conflict) as caught:
        await collect(agent.exec("once", "echo something else"))
    assert caught.value.message == "job_id once is already used by a different command"


async def test_attach_after_disconnect_replays_then_follows(agent: AgentClient) -> None:
    events = agent.exec("j1", "echo one; read go < fifo; echo two", timeout=60)
    # the command blocks on a fifo we open later, so "two" comes after we reattached
    await collect(agent.exec("mk", "mkfifo fifo"))
    assert await anext(events) == Output("stdout", b"one\n")
    await events.aclose()  # the connection goes away; the job keeps running
    attached = agent.attach("j1")
    assert await anext(attached) == Output("stdout", b"one\n")
    await collect(agent.exec("go", "echo go > fifo"))
    rest = await collect(attached)
    assert rest.stdout == b"two\n" and rest.exit.exit_code == 0
    with pytest.raises(errors.JobNotFound):
        await collect(agent.attach("unknown-job"))


async def test_a_dropped_stream_is_resumed_without_rerunning(
    agent_server: RunningAgent, short_dir: Path
) -> None:
    """A proxy cuts the first connection mid-stream: the client re-attaches by job_id, skips
    what it already delivered, and the command still ran once."""
    command = "echo run >> runs.txt; echo first; sleep 0.3; echo second"
    path = str(short_dir / "proxy.sock")
    async with (
        UnixProxy(agent_server.socket, path, cut_first_stream=True) as proxy,
        AgentClient(token=agent_server.token, uds=path) as client,
    ):
        result = await collect(client.exec("resumed", command))
    assert proxy.cut
    assert len(proxy.connections) == 2
    assert result.stdout == b"first\nsecond\n"
    assert result.exit.exit_code == 0
    assert (agent_server.workdir / "runs.txt").read_text() == "run\n"


async def test_calls_reuse_one_connection(agent_server: RunningAgent, short_dir: Path) -> None:
    path = str(short_dir / "proxy.sock")
    async with (
        UnixProxy(agent_server.socket, path) as proxy,
        AgentClient(token=agent_server.token, uds=path) as client,
    ):
        for i in range(10):
            assert (await collect(client.exec(f"j{i}", "echo x"))).stdout == b"x\n"
        await client.write_file("f", b"data")
        assert b"".join([c async for c in client.read_file("f")]) == b"data"
        await client.list_dir(".")
        await collect(client.exec("j0", "echo x"))  # attached, replayed
    assert len(proxy.connections) == 1


async def test_every_request_needs_the_keys_mac_except_for_health(
    agent_server: RunningAgent,
) -> None:
    async with agent_server.client(token="wrong-key-0123456789") as bad:
        with pytest.raises(errors.AuthenticationRequired) as caught:
            await collect(bad.exec("j1", "true"))
        assert caught.value.message == "invalid request MAC"
        for call in (bad.health(), bad.list_dir("/"), bad.open_pty()):
            with pytest.raises(errors.AuthenticationRequired):
                await call
        with pytest.raises(errors.AgentTampered) as enrolled:
            await bad.enroll()  # someone else's key is in place already
        assert enrolled.value.message.endswith("the agent was enrolled with another key")
    transport = httpx.AsyncHTTPTransport(uds=agent_server.socket, verify=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://agent") as raw:
        health = await raw.get("/health")
        response = await raw.post("/exec", json={"command": "true"})
        again = await raw.post("/enroll", json={"key": "k" * 32, "env": {}})
    assert health.json()["enrolled"] is True and "X-Orchard-Proof" not in health.headers
    assert response.status_code == 401
    assert response.json() == {
        "code": "unauthenticated",
        "message": "missing 'Authorization: Orchard-HMAC <mac>' and nonce",
    }
    assert again.status_code == 401  # only the key it holds may even ask


async def test_connections_left_half_sent_do_not_hold_up_the_orchestrators(
    agent: AgentClient, agent_server: RunningAgent
) -> None:
    # A process in the sandbox may open the agent's socket (anyone there can) and leave
    # requests unfinished: heads cut mid-line, a body announced and never sent. Each is
    # served apart (a thread of its own), so the orchestrator's requests still go through.
    stalled = []
    for n in range(50):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(agent_server.socket)
        if n % 2:
            sock.sendall(b"POST /exec HTTP/1.1\r\nHost: agent\r\nX-Half")
        else:
            sock.sendall(b"PUT /files?path=x HTTP/1.1\r\nContent-Length: 1000000\r\n\r\nab")
        stalled.append(sock)
    try:
        async with asyncio.timeout(30):  # a hang guard, not a speed target
            result = await collect(agent.exec("through", "echo through"))
            await agent.write_file("written", b"data")
        assert result.stdout == b"through\n" and result.exit.exit_code == 0
        assert (agent_server.workdir / "written").read_bytes() == b"data"
    finally:
        for sock in stalled:
            sock.close()


async def test_unreachable_agent_is_agent_unavailable(short_dir: Path) -> None:
    async with AgentClient(token="t", uds=str(short_dir / "none.sock")) as client:
        with pytest.raises(errors.AgentUnavailable):
            await client.health()
        started = time.monotonic()
        with pytest.raises(errors.AgentUnavailable) as caught:
            await client.wait_ready(0.3)
        assert time.monotonic() - started < 3
        assert "did not answer within 0.3 s" in caught.value.message


def test_client_needs_exactly_one_address() -> None:
    with pytest.raises(errors.InvalidRequest):
        AgentClient(token="t")
    with pytest.raises(errors.InvalidRequest):
        AgentClient(token="t", uds="/x.sock", base_url="http://x:1")
    with pytest.raises(errors.InvalidRequest, match="needs the sandbox's agent token"):
        AgentClient(token="", uds="/x.sock")


@pytest.fixture
def tcp_port(tmp_path: Path) -> Iterator[int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    argv = [*HOST_AGENT]
    process = start_agent(argv, f"tcp:127.0.0.1:{port}", {}, tmp_path)
    yield port
    assert stop_agent(process) == 0


async def test_agent_over_tcp(tcp_port: int) -> None:
    async with AgentClient(token=TOKEN, base_url=f"http://127.0.0.1:{tcp_port}") as client:
        await client.wait_ready(15)
        result = await collect(client.exec("j1", "echo tcp"))
        assert result.stdout == b"tcp\n"
        async with await client.open_pty() as pty:
            await pty.send({"type": "init", "cmd": ["sh", "-c", "exit 5"]})
            assert (await pty.recv() or {}).get("type") == "ready"
            assert await pty.recv() == {"type": "exit", "code": 5}


async def test_a_token_in_the_environment_is_worthless(short_dir: Path, tmp_path: Path) -> None:
    """The agent takes its key only from its enrollment: a launcher's old token variable
    (readable in /proc/<pid>/environ) opens nothing."""
    socket_path = str(short_dir / "env.sock")
    process = start_agent(
        HOST_AGENT, f"unix:{socket_path}", {"ORCHARD_AGENT_TOKEN": TOKEN}, tmp_path
    )
    try:
        transport = httpx.AsyncHTTPTransport(uds=socket_path, verify=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://agent") as raw:
            await poll_until(lambda: Path(socket_path).exists(), "the agent listens")
            response = await raw.post(
                "/exec", json={"command": "true"}, headers={"Authorization": f"Bearer {TOKEN}"}
            )
            assert (await raw.get("/health")).json()["enrolled"] is False
        assert response.status_code == 401
        assert response.json()["message"] == "the agent is not enrolled yet"
    finally:
        assert stop_agent(process) == 0


GUARDED_BASHRC = """\
[ -z "$PS1" ] && return
case $- in *i*) ;; *) return;; esac
export CONDA_DEFAULT_ENV=testbed
export PATH="$HOME/conda/bin:$PATH"
"""


def fake_conda_home(home: Path) -> Path:
    """A home whose ~/.bashrc, guarded against non-interactive shells as Debian's and
    SWE-bench images' are, activates a fake conda (its own ``python`` first on PATH)."""
    (home / "conda" / "bin").mkdir(parents=True)
    python = home / "conda" / "bin" / "python"
    python.write_text("#!/bin/sh\necho conda-python\n")
    python.chmod(0o755)
    (home / ".bashrc").write_text(GUARDED_BASHRC)
    return home


async def test_login_shell_sources_a_guarded_bashrc_without_tty_noise(
    agent: AgentClient, tmp_path: Path
) -> None:
    env = {"HOME": str(fake_conda_home(tmp_path / "home"))}
    login = await collect(
        agent.exec(
            "l1", "echo $CONDA_DEFAULT_ENV; python; echo oops >&2", env=env, login_shell=True
        )
    )
    assert (login.stdout, login.stderr) == (b"testbed\nconda-python\n", b"oops\n")
    assert login.exit.exit_code == 0
    argv = await collect(
        agent.exec("l2", ["printf", "%s|", "a b", "$CONDA_DEFAULT_ENV"], env=env, login_shell=True)
    )
    assert (argv.stdout, argv.stderr) == (b"a b|$CONDA_DEFAULT_ENV|", b"")
    plain = await collect(agent.exec("l3", "echo ${CONDA_DEFAULT_ENV:-none}", env=env))
    assert plain.stdout == b"none\n"


async def test_big_outputs_spill_to_the_spool_not_the_agents_memory(
    agent: AgentClient, agent_server: RunningAgent
) -> None:
    """Eight jobs of 40 MiB each under a 16 MiB cap: the agent's memory stays flat (the log
    past a small budget and every tail live in unlinked spool files), and replays match."""
    pid = agent_server.process.pid
    before = status_kb(pid, "VmRSS")
    command = "yes abcdefghijklmnopqrstuvwxyz | head -c 41943040"
    results = await asyncio.gather(
        *(collect(agent.exec(f"big{i}", command, max_output_bytes=16 << 20)) for i in range(8))
    )
    peak = status_kb(pid, "VmHWM")  # the agent's peak resident memory so far
    for result in results:
        assert len(result.stdout) == 16 << 20 and result.exit.dropped == ((40 - 16) << 20, 0)
    assert peak - before < 48 * 1024, f"agent RSS grew from {before} kB to {peak} kB"
    again = await collect(agent.attach("big3", max_output_bytes=16 << 20))
    assert again.stdout == results[3].stdout
    files = open_files(pid)
    spooled = [path for path in files if path.startswith("/var/tmp/")]
    assert spooled and all(path.endswith("(deleted)") for path in spooled), files


def open_files(pid: int) -> list[str]:
    """What the descriptors of ``pid`` point at."""
    return [str(fd.readlink()) for fd in Path(f"/proc/{pid}/fd").iterdir()]


def status_kb(pid: int, field: str) -> int:
    """A kB figure (VmRSS, VmHWM) of /proc/<pid>/status."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1])


async def test_term_kills_the_commands_and_exits_with_a_kept_alive_connection_open(
    agent_server: RunningAgent,
) -> None:
    """What a backend's stop does (``docker stop``, a pod deleted): the orchestrator's
    kept-alive connection stays open, and the agent must neither wait for it (as ``async with
    server`` does from Python 3.12.1) nor leave its commands running."""
    async with agent_server.client() as client:
        events = client.exec("long", "echo $$; sleep 300")
        first = await anext(events)
        assert isinstance(first, Output)
        command = int(first.data)
        assert (await client.health())["status"] == "ok"  # the connection is kept alive
        agent_server.process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(agent_server.process.wait, 3) == 0
        await poll_until(lambda: process_gone(command), f"command {command} is killed")
