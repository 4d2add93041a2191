"""PTY sessions over the agent's WebSocket endpoint, through AgentClient.open_pty()."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from orchard_env.agent.client import AgentClient, AgentPty
from tests.agent.conftest import EVERY_SPAWNER, RunningAgent, poll_until, process_gone
from tests.agent.test_exec import fake_conda_home


async def until_exit(pty: AgentPty, limit: float = 15) -> tuple[bytes, dict[str, Any]]:
    """Read frames until the exit frame: (terminal output, exit frame)."""
    output = b""
    async with asyncio.timeout(limit):
        while (frame := await pty.recv()) is not None:
            if frame["type"] == "stdout":
                output += base64.b64decode(frame["data"])
            elif frame["type"] == "exit":
                return output, frame
            else:
                raise AssertionError(f"unexpected frame {frame}")
    raise AssertionError(f"closed without an exit frame; output {output!r}")


@asynccontextmanager
async def session(agent: AgentClient, **init: Any) -> AsyncIterator[AgentPty]:
    """A started PTY session (init sent, ready received), closed on exit."""
    async with await agent.open_pty() as pty:
        await pty.send({"type": "init", **init})
        ready = await pty.recv()
        assert ready is not None and ready["type"] == "ready" and ready["pid"] > 0
        yield pty


async def read_until(pty: AgentPty, marker: bytes) -> bytes:
    output = b""
    async with asyncio.timeout(15):
        while marker not in output:
            frame = await pty.recv()
            assert frame is not None and frame["type"] == "stdout", frame
            output += base64.b64decode(frame["data"])
    return output


async def test_command_has_a_terminal(agent: AgentClient) -> None:
    async with session(agent, cmd=["sh", "-c", "tty -s && echo $TERM && exit 7"]) as pty:
        output, exit_frame = await until_exit(pty)
        assert exit_frame == {"type": "exit", "code": 7}
        assert b"xterm-256color" in output
        assert await pty.recv() is None
        assert pty.close_code == 1000


@EVERY_SPAWNER
async def test_the_terminal_is_the_sessions_controlling_terminal(agent: AgentClient) -> None:
    # /dev/tty opens only with a controlling terminal, and only through one does ^C reach
    # the command (the terminal signals its foreground process group).
    cmd = ["sh", "-c", "exec 3</dev/tty && echo controlling && exec sleep 60"]
    async with session(agent, cmd=cmd) as pty:
        await read_until(pty, b"controlling")
        await pty.send({"type": "stdin", "data": base64.b64encode(b"\x03").decode()})
        _, exit_frame = await until_exit(pty, limit=5)
        assert exit_frame["code"] == -2


async def test_stdin_is_echoed_by_cat(agent: AgentClient) -> None:
    async with session(agent, cmd=["cat"]) as pty:
        await pty.send({"type": "stdin", "data": base64.b64encode(b"hello pty\n").decode()})
        output = await read_until(pty, b"hello pty\r\nhello pty\r\n")  # tty echo, then cat
        assert output.count(b"hello pty") == 2
        await pty.send({"type": "stdin", "data": base64.b64encode(b"\x04").decode()})  # EOF
        _, exit_frame = await until_exit(pty)
        assert exit_frame["code"] == 0


async def test_resize_is_seen_by_stty(agent: AgentClient) -> None:
    async with session(
        agent, cmd=["sh", "-c", "stty size; read x; stty size"], rows=24, cols=80
    ) as pty:
        assert b"24 80" in await read_until(pty, b"24 80")
        await pty.send({"type": "resize", "rows": 50, "cols": 200})
        await pty.send({"type": "stdin", "data": base64.b64encode(b"\n").decode()})
        output, exit_frame = await until_exit(pty)
        assert b"50 200" in output
        assert exit_frame["code"] == 0


async def test_kill_signal_gives_a_negative_exit_code(agent: AgentClient) -> None:
    async with session(agent, cmd=["sleep", "60"]) as pty:
        await pty.send({"type": "signal", "sig": "KILL"})
        _, exit_frame = await until_exit(pty, limit=5)
        assert exit_frame["code"] == -9


async def test_close_frame_terminates_the_command(agent: AgentClient) -> None:
    async with session(agent, cmd=["sleep", "60"]) as pty:
        await pty.send({"type": "close"})
        _, exit_frame = await until_exit(pty, limit=5)
        assert exit_frame["code"] == -15


@EVERY_SPAWNER
async def test_disconnect_kills_the_session(agent: AgentClient, agent_server: RunningAgent) -> None:
    marker = agent_server.workdir / "pid"
    async with session(agent, cmd=["sh", "-c", f"sleep 300 & echo $! > {marker}; wait"]) as pty:
        await poll_until(lambda: marker.is_file() and marker.read_text().endswith("\n"), "pid file")
        pid = int(marker.read_text())
        assert not process_gone(pid)
        await pty.close()
        await poll_until(lambda: process_gone(pid), f"sleep {pid} is killed with its session")


async def test_bad_init_closes_with_4400(agent: AgentClient) -> None:
    async with await agent.open_pty() as pty:
        await pty.send({"type": "stdin", "data": ""})
        frame = await pty.recv()
        assert frame == {
            "type": "error",
            "message": 'the first frame must be {"type": "init", ...}',
        }
        assert await pty.recv() is None
        assert pty.close_code == 4400


@EVERY_SPAWNER
async def test_missing_binary_closes_with_4500(agent: AgentClient) -> None:
    async with await agent.open_pty() as pty:
        await pty.send({"type": "init", "cmd": ["no-such-binary-xyz"]})
        frame = await pty.recv()
        assert frame == {"type": "error", "message": "command not found: no-such-binary-xyz"}
        assert await pty.recv() is None
        assert pty.close_code == 4500


async def test_unknown_frames_get_an_error_and_the_session_goes_on(agent: AgentClient) -> None:
    async with session(agent, cmd=["cat"]) as pty:
        await pty.send({"type": "signal", "sig": "USR9"})
        assert await pty.recv() == {"type": "error", "message": "unknown signal 'USR9'"}
        await pty.send({"type": "bogus"})
        assert await pty.recv() == {"type": "error", "message": "unknown frame type 'bogus'"}
        await pty.send({"type": "signal", "sig": "TERM"})
        _, exit_frame = await until_exit(pty)
        assert exit_frame["code"] == -15


async def test_login_shell_pty_sources_a_guarded_bashrc(agent: AgentClient, tmp_path: Path) -> None:
    home = fake_conda_home(tmp_path / "home")
    cmd = ["sh", "-c", "echo env=$CONDA_DEFAULT_ENV; python"]
    async with session(agent, cmd=cmd, env={"HOME": str(home)}, login_shell=True) as pty:
        output, exit_frame = await until_exit(pty)
    assert exit_frame == {"type": "exit", "code": 0}
    assert b"env=testbed\r\nconda-python\r\n" in output
