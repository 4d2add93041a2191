"""PTY handles against a real websocket server on loopback speaking the wire's frames."""

from __future__ import annotations

import base64
import contextlib
import json
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.server import Server, ServerConnection, serve

from orchard_env import errors
from orchard_env.sdk import AsyncSandboxClient, PtyProcess, SandboxClient
from tests.sdk.fakes import FakeService


@dataclass
class PtyServer:
    """Plays the orchestrator's PTY route with a scripted 'process'."""

    port: int = 0
    api_keys: list[str | None] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    inits: list[dict[str, object]] = field(default_factory=list)

    def handle(self, ws: ServerConnection) -> None:
        with contextlib.suppress(ConnectionClosed):  # a client may hang up at any point
            self._play(ws)

    def _play(self, ws: ServerConnection) -> None:
        assert ws.request is not None
        self.api_keys.append(ws.request.headers.get("X-API-Key"))
        self.paths.append(ws.request.path)
        if "/missing/" in ws.request.path:
            ws.close(4404, "sandbox missing not found")
            return
        init = json.loads(ws.recv())
        self.inits.append(init)
        cmd = init["cmd"]
        if cmd == ["broken"]:
            ws.send(json.dumps({"type": "error", "message": "exec format error"}))
            ws.close()
            return
        ws.send(json.dumps({"type": "ready", "pid": 4242}))
        if cmd[:1] == ["flood"]:
            for i in range(int(cmd[1])):
                ws.send(_out(f"{i:05d}" + "x" * 995))
            ws.send(json.dumps({"type": "exit", "code": 0}))
            ws.close()
            return
        if cmd[:1] == ["echo"]:
            ws.send(_out(" ".join(cmd[1:]) + "\r\n"))
            ws.send(json.dumps({"type": "exit", "code": 0}))
            ws.close()
            return
        for message in ws:
            frame = json.loads(message)
            if frame["type"] == "stdin":
                ws.send(_out(base64.b64decode(frame["data"]).decode()))
            elif frame["type"] == "resize":
                ws.send(_out(f"size {frame['rows']}x{frame['cols']}\r\n"))
            elif frame["type"] in ("signal", "close"):
                sig = frame.get("sig", "TERM")
                ws.send(json.dumps({"type": "exit", "code": -signal.Signals[f"SIG{sig}"].value}))
                ws.close()
                return


def _out(text: str) -> str:
    return json.dumps({"type": "stdout", "data": base64.b64encode(text.encode()).decode()})


@pytest.fixture
def pty_server() -> Iterator[PtyServer]:
    state = PtyServer()
    server: Server = serve(state.handle, "127.0.0.1", 0)
    state.port = server.socket.getsockname()[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    thread.join(timeout=5)


@pytest.fixture
def pty_client(pty_server: PtyServer, service: FakeService) -> Iterator[SandboxClient]:
    with SandboxClient(
        base_url=f"http://127.0.0.1:{pty_server.port}",
        api_key="ork_k_s",
        transport=service.transport(),
    ) as client:
        yield client


def test_interactive_session(pty_client: SandboxClient, pty_server: PtyServer) -> None:
    sandbox = pty_client.create_sandbox("python:3.11-slim")
    with sandbox.pty(["bash"], rows=30, cols=100, env={"A": "1"}, cwd="/tmp") as proc:
        assert proc.pid == 4242 and proc.poll() is None and proc.returncode is None
        proc.write_stdin(b"ping\n")
        assert proc.read(timeout=5) == b"ping\n"
        proc.resize(50, 200)
        assert proc.read(timeout=5) == b"size 50x200\r\n"
        assert proc.read(timeout=0.01) == b""  # nothing more yet: empty, not an error
        proc.kill("SIGKILL")
        assert proc.wait(timeout=5) == -9
        assert proc.poll() == -9 and proc.returncode == -9
        assert proc.read(timeout=1) == b""
        with pytest.raises(errors.Conflict, match="the PTY session has ended"):
            proc.write_stdin("late")
    assert pty_server.inits == [
        {
            "type": "init",
            "cmd": ["bash"],
            "env": {"A": "1"},
            "cwd": "/tmp",
            "rows": 30,
            "cols": 100,
            "login_shell": False,
        }
    ]
    assert pty_server.api_keys == ["ork_k_s"]
    assert pty_server.paths == [f"/sandboxes/{sandbox.sandbox_id}/exec/pty"]  # no key in the URL


def test_string_command_and_upstream_exec_pty(
    pty_client: SandboxClient, pty_server: PtyServer
) -> None:
    sandbox = pty_client.create_sandbox("python:3.11-slim")
    proc = sandbox.exec(["echo", "hi"], pty=True, rows=10, cols=20)
    assert isinstance(proc, PtyProcess)
    assert proc.read_all(timeout=5) == b"hi\r\n"
    assert proc.wait(timeout=5) == 0
    proc.close()
    with sandbox.pty("ls -l") as shell:
        shell.close()
    assert pty_server.inits[1]["cmd"] == ["/bin/sh", "-c", "ls -l"]
    assert (pty_server.inits[0]["rows"], pty_server.inits[0]["cols"]) == (10, 20)


def test_close_sends_close(pty_client: SandboxClient, pty_server: PtyServer) -> None:
    sandbox = pty_client.create_sandbox("python:3.11-slim")
    proc = sandbox.pty()
    proc.close()
    assert proc.wait(timeout=5) == -15
    proc.close()  # idempotent
    assert pty_server.inits[0]["cmd"] == ["/bin/sh"]


def test_backpressure_loses_nothing(pty_server: PtyServer) -> None:
    url = f"ws://127.0.0.1:{pty_server.port}/sandboxes/sb/exec/pty"
    init = json.dumps({"type": "init", "cmd": ["flood", "300"]})
    with PtyProcess(url, None, init, max_buffer=4096) as proc:
        data = proc.read_all(timeout=10)
    assert len(data) == 300 * 1000
    assert [data[i * 1000 : i * 1000 + 5] for i in (0, 150, 299)] == [b"00000", b"00150", b"00299"]
    assert pty_server.api_keys == [None]


def test_refusals_become_errors(pty_client: SandboxClient, pty_server: PtyServer) -> None:
    url = f"ws://127.0.0.1:{pty_server.port}/sandboxes/missing/exec/pty"
    with pytest.raises(errors.SandboxNotFound, match="sandbox missing not found"):
        PtyProcess(url, "k", json.dumps({"type": "init", "cmd": ["sh"]}))
    url = f"ws://127.0.0.1:{pty_server.port}/sandboxes/sb/exec/pty"
    with pytest.raises(errors.OrchardError, match="PTY session error: exec format error"):
        PtyProcess(url, "k", json.dumps({"type": "init", "cmd": ["broken"]}))


def test_nothing_listening() -> None:
    with pytest.raises(
        errors.ServiceUnreachable, match=r"cannot open a PTY session at ws://127\.0\.0\.1:9/"
    ):
        PtyProcess("ws://127.0.0.1:9/sandboxes/sb/exec/pty", None, "{}", open_timeout=2)


def test_bad_signal_and_size(pty_client: SandboxClient) -> None:
    sandbox = pty_client.create_sandbox("python:3.11-slim")
    with sandbox.pty(["bash"]) as proc:
        with pytest.raises(errors.InvalidRequest, match="signal 'USR1' cannot be sent"):
            proc.kill("USR1")
        with pytest.raises(errors.InvalidRequest, match="terminal size 0x80 is out of range"):
            proc.resize(0, 80)
    with pytest.raises(errors.InvalidRequest, match="bad PTY session request"):
        sandbox.pty(rows=5000)


async def test_async_session(pty_server: PtyServer, service: FakeService) -> None:
    async with AsyncSandboxClient(
        base_url=f"http://127.0.0.1:{pty_server.port}",
        api_key="ork_a_b",
        transport=service.async_transport(),
    ) as client:
        sandbox = await client.create_sandbox("python:3.11-slim")
        async with await sandbox.pty(["bash"]) as proc:
            assert proc.pid == 4242
            await proc.write_stdin("hello\n")
            assert await proc.read(timeout=5) == b"hello\n"
            await proc.resize(40, 120)
            assert await proc.read(timeout=5) == b"size 40x120\r\n"
            assert await proc.read(timeout=0.01) == b""
            await proc.kill("INT")
            assert await proc.wait(timeout=5) == -2
            assert proc.poll() == -2
        proc = await sandbox.exec(["echo", "async"], pty=True)
        assert await proc.read_all(timeout=5) == b"async\r\n"
        assert await proc.wait(timeout=5) == 0
        await proc.close()
    assert pty_server.api_keys == ["ork_a_b", "ork_a_b"]


async def test_async_refusal(pty_server: PtyServer) -> None:
    from orchard_env.sdk import AsyncPtyProcess

    url = f"ws://127.0.0.1:{pty_server.port}/sandboxes/missing/exec/pty"
    with pytest.raises(errors.SandboxNotFound):
        await AsyncPtyProcess.connect(url, None, json.dumps({"type": "init", "cmd": ["sh"]}))


def test_wait_timeout(pty_client: SandboxClient) -> None:
    sandbox = pty_client.create_sandbox("python:3.11-slim")
    with sandbox.pty(["bash"]) as proc:
        with pytest.raises(TimeoutError, match=r"did not exit within 0\.05s"):
            proc.wait(timeout=0.05)
        proc.write_stdin("partial")
        with pytest.raises(errors.Timeout):
            proc.read_all(timeout=0.2)
        assert proc.read(timeout=5) == b"partial"  # kept for the next read
