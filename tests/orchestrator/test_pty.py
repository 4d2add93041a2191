"""The PTY WebSocket, end to end over a unix socket: auth modes, close codes, relaying."""

from __future__ import annotations

import base64
import json
import logging
from typing import Any, cast

import pytest
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed
from websockets.typing import Subprotocol

from orchard_env.orchestrator.logs import JsonFormatter
from tests.orchestrator.conftest import Connect, Service, eventually


async def frames_until_close(ws: ClientConnection) -> list[dict[str, Any]]:
    frames = []
    try:
        while True:
            frames.append(json.loads(await ws.recv()))
    except ConnectionClosed:
        return frames


def stdout_of(frames: list[dict[str, Any]]) -> bytes:
    return b"".join(base64.b64decode(f["data"]) for f in frames if f["type"] == "stdout")


async def test_runs_a_command_and_reports_its_exit(service: Service, ws_connect: Connect) -> None:
    sandbox_id = (await service.create())["sandbox_id"]
    assert service.admin is not None
    headers = {"X-API-Key": service.admin.api_key}
    async with ws_connect(f"/sandboxes/{sandbox_id}/exec/pty", additional_headers=headers) as ws:
        await ws.send(json.dumps({"type": "init", "cmd": ["/bin/sh", "-c", "tty; exit 3"]}))
        frames = await frames_until_close(ws)
        assert ws.close_code == 1000
    assert frames[0]["type"] == "ready" and frames[0]["pid"] > 0
    assert frames[-1] == {"type": "exit", "code": 3}
    assert stdout_of(frames).startswith(b"/dev/pts/")


async def test_interactive_session_with_subprotocol_auth(
    service: Service, ws_connect: Connect
) -> None:
    sandbox_id = (await service.create())["sandbox_id"]
    assert service.admin is not None
    protocol = Subprotocol(f"api_key.{service.admin.api_key}")
    async with ws_connect(f"/sandboxes/{sandbox_id}/exec/pty", subprotocols=[protocol]) as ws:
        assert ws.subprotocol == protocol
        await ws.send(json.dumps({"type": "init", "cmd": ["cat"], "rows": 30, "cols": 100}))
        assert json.loads(await ws.recv())["type"] == "ready"
        await ws.send(json.dumps({"type": "stdin", "data": base64.b64encode(b"ping\n").decode()}))
        seen = b""
        while b"ping" not in seen:
            frame = json.loads(await ws.recv())
            seen += base64.b64decode(frame["data"])
        await ws.send(json.dumps({"type": "signal", "sig": "KILL"}))
        frames = await frames_until_close(ws)
    assert frames[-1] == {"type": "exit", "code": -9}


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.setFormatter(JsonFormatter())

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


async def test_query_parameter_key_is_accepted_and_never_logged(
    service: Service, ws_connect: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    # uvicorn logs WebSocket paths with their query string on "uvicorn.error".
    collect = Collect()
    uvicorn_log = logging.getLogger("uvicorn.error")
    monkeypatch.setattr(uvicorn_log, "disabled", False)  # other tests configure logging
    level = uvicorn_log.level
    uvicorn_log.setLevel(logging.INFO)
    uvicorn_log.addHandler(collect)
    try:
        sandbox_id = (await service.create())["sandbox_id"]
        assert service.admin is not None
        path = f"/sandboxes/{sandbox_id}/exec/pty?api_key={service.admin.api_key}"
        async with ws_connect(path) as ws:
            await ws.send(json.dumps({"type": "init", "cmd": ["true"]}))
            frames = await frames_until_close(ws)
    finally:
        uvicorn_log.removeHandler(collect)
        uvicorn_log.setLevel(level)
    assert frames[-1] == {"type": "exit", "code": 0}
    assert any("api_key=***" in line for line in collect.lines)
    assert not any(service.admin.api_key in line for line in collect.lines)


@pytest.mark.parametrize(
    ("key", "sandbox", "code", "message"),
    [
        (None, "real", 4401, "missing API key: send it in the X-API-Key header"),
        ("ork_0123456789_" + "x" * 43, "real", 4403, "the API key is not valid"),
        ("admin", "missing", 4404, "sandbox missing does not exist"),
    ],
)
async def test_refusals_close_after_accept_with_a_code(
    service: Service,
    ws_connect: Connect,
    key: str | None,
    sandbox: str,
    code: int,
    message: str,
) -> None:
    sandbox_id = (await service.create())["sandbox_id"] if sandbox == "real" else sandbox
    assert service.admin is not None
    headers = {}
    if key is not None:
        headers["X-API-Key"] = service.admin.api_key if key == "admin" else key
    async with ws_connect(f"/sandboxes/{sandbox_id}/exec/pty", additional_headers=headers) as ws:
        frames = await frames_until_close(ws)
        assert ws.close_code == code
    assert frames == [{"type": "error", "message": message}]


async def test_bad_init_closes_4400(service: Service, ws_connect: Connect) -> None:
    sandbox_id = (await service.create())["sandbox_id"]
    assert service.admin is not None
    headers = {"X-API-Key": service.admin.api_key}
    async with ws_connect(f"/sandboxes/{sandbox_id}/exec/pty", additional_headers=headers) as ws:
        await ws.send(json.dumps({"type": "init", "rows": 0}))
        frames = await frames_until_close(ws)
        assert ws.close_code == 4400
    assert len(frames) == 1
    assert cast(str, frames[0]["message"]).startswith("bad init frame: rows: ")


async def test_an_open_terminal_keeps_the_sandbox_busy(
    service: Service, ws_connect: Connect
) -> None:
    sandbox_id = (await service.create())["sandbox_id"]
    assert service.admin is not None
    headers = {"X-API-Key": service.admin.api_key}
    sandboxes = service.orchard.sandboxes
    async with ws_connect(f"/sandboxes/{sandbox_id}/exec/pty", additional_headers=headers) as ws:
        await ws.send(json.dumps({"type": "init", "cmd": ["cat"]}))
        assert json.loads(await ws.recv())["type"] == "ready"
        assert sandboxes.busy(sandbox_id)
        await ws.send(json.dumps({"type": "close"}))
        await frames_until_close(ws)

    async def idle() -> bool:
        return not sandboxes.busy(sandbox_id)

    await eventually(idle)


async def test_agent_close_codes_reach_the_client(service: Service, ws_connect: Connect) -> None:
    sandbox_id = (await service.create())["sandbox_id"]
    assert service.admin is not None
    headers = {"X-API-Key": service.admin.api_key}
    async with ws_connect(f"/sandboxes/{sandbox_id}/exec/pty", additional_headers=headers) as ws:
        await ws.send(json.dumps({"type": "init", "cmd": ["no-such-program"]}))
        frames = await frames_until_close(ws)
        assert ws.close_code == 4500
    assert frames == [{"type": "error", "message": "command not found: no-such-program"}]


@pytest.mark.parametrize(
    "init",
    [
        '{"type": "init", "rows": 100000}',
        '{"type": "init", "cols": 1001}',
        '{"type": "init", "cmd": ["/bin/sh", "\\ud800"]}',
        '{"type": "init", "cmd": ["/bin/sh\\u0000"]}',
        '{"type": "init", "cmd": []}',
        '{"type": "init", "env": {"": "x"}}',
        '{"type": "init", "env": {"A=B": "x"}}',
        '{"type": "init", "cwd": "/tmp\\u0000"}',
    ],
)
async def test_out_of_range_init_closes_4400_and_the_agent_lives(
    service: Service, ws_connect: Connect, init: str
) -> None:
    sandbox_id = (await service.create())["sandbox_id"]
    assert service.admin is not None
    headers = {"X-API-Key": service.admin.api_key}
    async with ws_connect(f"/sandboxes/{sandbox_id}/exec/pty", additional_headers=headers) as ws:
        await ws.send(init)
        frames = await frames_until_close(ws)
        assert ws.close_code == 4400
    assert frames[-1]["type"] == "error"
    assert (await service.exec(sandbox_id, "echo ok"))["stdout"] == "ok\n"
