"""Pure helpers of the agent (imported in-process: it is stdlib-only)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest

from orchard_env.agent.daemon import files, http, procs, server, websocket


def test_parse_listen() -> None:
    assert server.parse_listen("unix:/run/orchard/agent.sock") == (
        "unix",
        "/run/orchard/agent.sock",
        0,
    )
    assert server.parse_listen("tcp:0.0.0.0:9090") == ("tcp", "0.0.0.0", 9090)
    assert server.parse_listen("tcp:[::]:9090") == ("tcp", "::", 9090)
    for bad in ("unix:relative.sock", "tcp:host", "tcp:host:0", "tcp:host:http", "udp:x:1"):
        with pytest.raises(ValueError, match=r"must be unix:/abs/path\.sock or tcp:HOST:PORT"):
            server.parse_listen(bad)


def test_a_bad_command_line_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([], ["--listen"], ["--port", "1"], ["--listen", "udp:x:1"], ["--listen=tcp:h"]):
        assert server.main(argv) == 2, argv
        assert "usage: orchard-agent --listen" in capsys.readouterr().err


QUERY_CASES = (
    "path=%2Fworkspace%2Fa%20b.txt&recursive=true",
    "path=caf%C3%A9+au+lait&mode=0644",
    "path=%zz%4&x=%&=empty&flag&&",
    "path=%C3&b=%E2%82",  # a cut UTF-8 sequence: replaced, as urllib does
    "a=1&a=2",  # the last one wins, as dict(parse_qsl(...)) keeps it
)


@pytest.mark.parametrize("query", QUERY_CASES)
def test_query_and_path_decoding_match_urllib(query: str) -> None:
    expected = dict(urllib.parse.parse_qsl(query, keep_blank_values=True))
    assert http.parse_query(query) == expected
    assert http.unquote(query) == urllib.parse.unquote(query)


def test_the_idle_agent_loads_no_module_it_needs_only_later(tmp_path: Path) -> None:
    # What only a PTY, a spill without O_TMPFILE, the first command or the command line
    # parser needs is not in an idle agent's memory (see docs/performance.md, memory). The
    # package runs alone, as the bundle ships it (orchard_agent, -I -S).
    shutil.copytree(Path(server.__file__).parent, tmp_path / "orchard_agent")
    probe = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
        "from orchard_agent import server\n"
        "server.Agent('/')\n"
        "print(' '.join(sorted(sys.modules)))\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-I", "-S", "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    # Nor asyncio, logging and inspect, which would cost every sandbox's start more CPU
    # than the rest of the agent together.
    later = ("argparse", "urllib.parse", "tempfile", "ctypes", "termios")
    for module in (*later, "asyncio", "logging", "inspect", "concurrent.futures"):
        assert module not in loaded, module
    assert "orchard_agent.pty" not in loaded and "orchard_agent.server" in loaded


def test_build_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    assert procs.build_argv(["ls", "-l"], False) == ["ls", "-l"]
    monkeypatch.setattr(os.path, "exists", lambda path: path == "/bin/bash")
    assert procs.build_argv("echo hi", False) == ["/bin/bash", "-c", "echo hi"]
    source = "if [ -f ~/.bashrc ]; then . ~/.bashrc; fi\n"
    assert procs.build_argv("echo hi", True) == [
        "/bin/bash",
        "--login",
        "-i",
        "-c",
        source + "echo hi",
    ]
    assert procs.build_argv(["ls", "a b"], True, 7) == [
        "/bin/bash",
        "--login",
        "-i",
        "-c",
        "exec 2>&7 7>&-\n" + source + 'exec "$@"',
        "/bin/bash",
        "ls",
        "a b",
    ]
    monkeypatch.setattr(os.path, "exists", lambda path: False)
    assert procs.build_argv("echo hi", True) == ["/bin/sh", "-l", "-c", "echo hi"]
    assert procs.build_argv("echo hi", False) == ["/bin/sh", "-c", "echo hi"]


def test_command_env_drops_only_the_agents_own_variables() -> None:
    environ = {
        "PATH": "/usr/bin",
        "ORCHARD_AGENT_TOKEN": "secret",
        "ORCHARD_AGENT_WORKDIR": "/workspace",
        "PYTHONHOME": "/opt/orchard-agent",
        "LD_LIBRARY_PATH": "/usr/local/cuda/lib64:/opt/orchard-agent/lib",
        "PYTHONPATH": "/app",
    }
    assert procs.command_env(environ, "/opt/orchard-agent") == {
        "PATH": "/usr/bin",
        "PYTHONPATH": "/app",
    }
    # an agent running from a system Python never mistakes the image's values for its own
    assert procs.command_env({"PYTHONHOME": "/usr"}, "/usr") == {"PYTHONHOME": "/usr"}


def test_websocket_unmask_matches_rfc6455_example() -> None:
    # RFC 6455 section 5.7: a masked "Hello"
    masked = bytes([0x7F, 0x9F, 0x4D, 0x51, 0x58])
    assert websocket.unmask(masked, bytes([0x37, 0xFA, 0x21, 0x3D])) == b"Hello"
    assert websocket.unmask(b"", b"abcd") == b""
    payload = bytes(range(256)) * 3 + b"x"
    mask = b"\x01\x02\x03\x04"
    assert websocket.unmask(websocket.unmask(payload, mask), mask) == payload


def test_iso_utc() -> None:
    assert files.iso_utc(0) == "1970-01-01T00:00:00.000000Z"
    assert files.iso_utc(1_700_000_000_123_456_789) == "2023-11-14T22:13:20.123456Z"


def test_exit_fields() -> None:
    assert procs.exit_fields(0) == (0, None)
    assert procs.exit_fields(3) == (3, None)
    assert procs.exit_fields(-9) == (None, 9)


@pytest.mark.parametrize(
    ("raw", "resolved"),
    [("/", "/"), ("//", "/"), ("///", "/"), ("//tmp/..", "/"), ("/./", "/"), ("a//b", "/w/a/b")],
)
def test_paths_are_normalised_so_the_root_has_one_spelling(raw: str, resolved: str) -> None:
    assert server.Agent("/w").resolve(raw) == resolved


def test_a_tcp_connection_sends_its_pieces_at_once() -> None:
    # An answer goes out as a head and then chunks: with Nagle's algorithm on, each piece
    # after the first waits for the peer's delayed ACK, 40 ms (the agent listens on TCP in a
    # pod, the model relay on loopback TCP).
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        conn = http.Conn(accepted)
        assert conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        conn.close()
        client.close()
