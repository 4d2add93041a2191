"""The model gateway on the Kubernetes backend (fake API server, real agents as host
processes on TCP): the orchestrator parks connections at the agent, a harness's calls to
the agent's loopback port come back on them to the gateway; floods, stray requests and an
impostor on the agent's port stay harmless."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import Any

import pytest

from orchard_env.config import ServiceSettings
from orchard_env.fake_model import FakeModel
from orchard_env.orchestrator.gateway import harness
from orchard_env.orchestrator.gateway.parks import PARKED
from orchard_env.orchestrator.gateway.proxy import MAX_CONNECTIONS
from orchard_env.orchestrator.services import Orchard
from tests.orchestrator.backends.conftest import Cluster, Start
from tests.orchestrator.backends.test_kubernetes_service import create_ready, run
from tests.orchestrator.conftest import eventually

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {}}}]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}


@pytest.fixture
def settings(cluster: Cluster, tmp_path: Path, model_endpoints: Path) -> ServiceSettings:
    return cluster.settings(tmp_path / "state", model_endpoints_file=model_endpoints)


def request(path: str = "/v1/chat/completions", *, body: Any = CHAT) -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer sandbox-key\r\ncontent-length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


async def answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, Any]]:
    """One response off a harness connection: its status and JSON body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
    lines = head.decode("latin-1").split("\r\n")
    fields = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
    body = await reader.readexactly(int(fields["content-length"]))
    return int(lines[0].split(" ")[1]), json.loads(body)


async def call(port: int, data: bytes) -> tuple[int, dict[str, Any]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        return await answer(reader)
    finally:
        writer.close()


async def test_a_harness_call_in_a_pod_reaches_the_model_and_is_recorded(
    settings: ServiceSettings, model: FakeModel, port: int, start: Start
) -> None:
    orchard, http = await start(settings)
    info = await create_ready(http, sandbox_id="gw", model_gateway={"trajectory_id": "ep-0"})
    assert info["model_gateway"]["openai"] == "fake"
    curl = (
        "curl -sS -H 'content-type: application/json' -H \"authorization: Bearer "
        f"$OPENAI_API_KEY\" -d '{json.dumps(CHAT)}' http://127.0.0.1:{port}/v1/chat/completions"
    )
    job = await run(http, "gw", curl)
    assert job["exit_code"] == 0, job
    [tool_call] = json.loads(job["stdout"])["choices"][0]["message"]["tool_calls"]
    assert json.loads(tool_call["function"]["arguments"]) == {"command": "echo hi > out.txt"}
    seen = model.requests[-1]
    assert seen.headers["authorization"] == f"Bearer {model.key}"  # the real key, added here

    async def recorded() -> list[dict[str, Any]]:
        response = await http.get("/sandboxes/gw/model-calls")
        calls: list[dict[str, Any]] = response.json()["calls"]
        return calls

    await eventually(lambda: _nonempty(recorded()))
    [record] = await recorded()
    assert (record["sandbox_id"], record["trajectory_id"], record["status"]) == ("gw", "ep-0", 200)
    assert record["request"]["headers"]["authorization"] == "<redacted>"

    # The gateway is no proxy, and serves /v1/... only, as on the local engine.
    status, body = await call(
        port, b"GET http://169.254.169.254/latest HTTP/1.1\r\nhost: x\r\n\r\n"
    )
    assert status == 400
    assert body["error"]["message"] == (
        "the gateway is no proxy: send origin-form targets (/v1/...) only"
    )
    status, body = await call(port, request("/admin/keys"))
    assert (status, body["error"]["message"]) == (
        404,
        "no model API at '/admin/keys': the gateway serves /v1/...",
    )
    assert orchard.gateway.attached("gw")
    await http.delete("/sandboxes/gw")
    assert not orchard.gateway.attached("gw")


async def _nonempty(calls: Any) -> bool:
    return bool(await calls)


async def test_a_flood_of_harness_connections_gets_503s_and_opens_no_more_connections(
    settings: ServiceSettings, port: int, monkeypatch: pytest.MonkeyPatch, start: Start
) -> None:
    monkeypatch.setattr(harness, "PARKED_WAIT_SECONDS", 1.0)
    orchard, http = await start(settings)
    await create_ready(http, sandbox_id="flood", model_gateway={})
    extra = 16
    opened = [
        await asyncio.open_connection("127.0.0.1", port) for _ in range(MAX_CONNECTIONS + extra)
    ]
    for _, writer in opened:  # keep-alive requests: the connections stay open once answered
        writer.write(request())
    answers = await asyncio.gather(*(answer(reader) for reader, _ in opened))
    statuses = [status for status, _ in answers]
    assert statuses.count(200) == MAX_CONNECTIONS and statuses.count(503) == extra
    refused = next(body for status, body in answers if status == 503)
    assert refused["error"]["message"] == (
        "no connection to the model gateway came free within 1 s: too many model connections "
        "are open in this sandbox, or the gateway is unreachable"
    )
    assert _open(orchard, "flood") == (MAX_CONNECTIONS, 0)  # serving, free slots
    for _, writer in opened:
        writer.close()

    async def freed() -> bool:
        return _open(orchard, "flood")[0] == 0

    await eventually(freed)
    assert (await call(port, request()))[0] == 200  # parked again once the flood is gone


def _open(orchard: Orchard, sandbox_id: str) -> tuple[int, int]:
    """(connections the gateway serves, slots the sandbox's parks may still open)."""
    box = orchard.gateway._sandboxes[sandbox_id]
    assert box.parks is not None
    return box.connections, box.parks._slots._value


async def test_an_impostor_on_the_agents_port_gets_no_parked_connection_used(
    settings: ServiceSettings, cluster: Cluster, model: FakeModel, port: int, start: Start
) -> None:
    _, http = await start(settings)
    info = await create_ready(http, sandbox_id="victim", model_gateway={})
    running = cluster.kubelet._running["victim"]
    assert running.process is not None
    pod_ip = cluster.api.get("pods", "orchard-sandboxes", "victim")["status"]["podIP"]  # type: ignore[index]
    # Root in the pod kills its agent and listens in its place, without the sandbox's key.
    running.process.send_signal(signal.SIGKILL)
    running.process.wait()
    got: list[tuple[bytes, bytes]] = []  # per connection: the request head, what followed

    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: orchard-model-relay\r\n"
            b"Connection: Upgrade\r\nX-Orchard-Proof: 00\r\n\r\n+"
        )
        await writer.drain()
        got.append((head, await reader.read(65536)))  # closed, with nothing sent after it
        writer.close()

    server = await asyncio.start_server(impostor, pod_ip, cluster.kubelet.agent_port)
    async with server:

        async def failed() -> bool:
            return bool((await http.get("/sandboxes/victim")).json()["status"] == "failed")

        await eventually(failed)
    message = (await http.get("/sandboxes/victim")).json()["status_message"]
    assert message == (
        f"its agent failed an integrity check: agent at {pod_ip}:{cluster.kubelet.agent_port}: "
        "its answer to the model relay carries no valid proof of the sandbox's key: something "
        "other than the sandbox's agent answered"
    )
    assert got and all(head.startswith(b"POST /model/relay HTTP/1.1\r\n") for head, _ in got)
    assert all(after == b"" for _, after in got)
    assert info["sandbox_id"] == "victim" and model.requests == []


async def test_an_orchestrator_that_lost_its_state_parks_again_at_the_adopted_agents(
    settings: ServiceSettings, cluster: Cluster, port: int, tmp_path: Path, start: Start
) -> None:
    _, http = await start(settings)
    await create_ready(http, sandbox_id="kept", model_gateway={})
    lost = cluster.settings(
        tmp_path / "lost-state", model_endpoints_file=settings.model_endpoints_file
    )
    second, http2 = await start(lost)
    await second.reaper.run_pass()
    ready = await http2.get("/sandboxes/kept/wait", params={"timeout": 20})
    assert ready.json()["model_gateway"]["openai"] == "fake"

    async def parked() -> bool:
        return second.gateway.attached("kept") and _open(second, "kept") == (
            0,
            MAX_CONNECTIONS - PARKED,
        )

    await eventually(parked)
    assert (await call(port, request()))[0] == 200
