"""The gateway in-process: a sandbox's socket in a temporary run dir, the fake model on
loopback, raw HTTP from the "sandbox" side (routing, the credential swap, streaming,
limits, hostile input, records, restarts)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from orchard_env.fake_model import FakeModel
from orchard_env.orchestrator.gateway.endpoints import Endpoint, Endpoints
from orchard_env.orchestrator.gateway.proxy import MAX_CONNECTIONS, ModelGateway
from orchard_env.orchestrator.gateway.readback import list_calls
from orchard_env.orchestrator.records import GatewayRecord
from orchard_env.orchestrator.store import SQLiteStore

SANDBOX = "sb-gw"
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {}}}]


@pytest.fixture
async def model() -> AsyncIterator[FakeModel]:
    fake = FakeModel()
    await fake.start()
    yield fake
    await fake.stop()


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteStore]:
    store = SQLiteStore(tmp_path / "orchard.db")
    await store.open()
    yield store
    await store.close()


def endpoints(model: FakeModel, monkeypatch: pytest.MonkeyPatch) -> Endpoints:
    monkeypatch.setenv("FAKE_KEY", model.key)
    return Endpoints(
        {
            "fake": Endpoint("fake", "openai", f"{model.url}/v1", "fake-model", key_env="FAKE_KEY"),
            "claude": Endpoint("claude", "anthropic", model.url, key_env="FAKE_KEY"),
            "down": Endpoint("down", "openai", "http://127.0.0.1:9/v1"),
        },
        {"openai": "fake", "anthropic": "claude"},
    )


class Gateway:
    def __init__(self, gateway: ModelGateway, socket: Path) -> None:
        self.gateway = gateway
        self.socket = socket
        self.http = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=str(socket)), base_url="http://127.0.0.1:4000"
        )

    async def calls(self, **options: Any) -> list[dict[str, Any]]:
        await self.settle()
        return await list_calls(self.gateway.store, SANDBOX, options.get("trajectory"), 0, 1000)

    async def settle(self) -> None:
        while self.gateway._pending:
            await asyncio.gather(*list(self.gateway._pending))

    async def raw(self, data: bytes) -> bytes:
        reader, writer = await asyncio.open_unix_connection(str(self.socket))
        writer.write(data)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(65536), 10)
        writer.close()
        return answer


@pytest.fixture
async def gw(
    tmp_path: Path, model: FakeModel, store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Gateway]:
    (tmp_path / SANDBOX).mkdir()
    gateway = ModelGateway(endpoints(model, monkeypatch), store, tmp_path)
    config = GatewayRecord(openai="fake", anthropic="claude", dummy_key="dummy", max_calls=40)
    await gateway.attach(SANDBOX, config)
    wrapper = Gateway(gateway, tmp_path / SANDBOX / "model.sock")
    yield wrapper
    await wrapper.http.aclose()
    await wrapper.gateway.close()  # a test may have replaced it


def chat(stream: bool = True) -> dict[str, Any]:
    return {
        "model": "m",
        "stream": stream,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": TOOLS,
    }


async def test_the_real_key_replaces_the_sandbox_credentials(gw: Gateway, model: FakeModel) -> None:
    answer = await gw.http.post(
        "/v1/chat/completions",
        json=chat(),
        headers={"authorization": "Bearer sandbox-key", "cookie": "c=1", "x-orchard-x": "1"},
    )
    assert answer.status_code == 200 and answer.text.endswith("data: [DONE]\n\n")
    seen = model.requests[-1]
    assert seen.headers["authorization"] == f"Bearer {model.key}"
    assert "cookie" not in seen.headers and "x-orchard-x" not in seen.headers
    assert seen.headers["accept-encoding"] == "identity"
    assert seen.body["stream_options"] == {"include_usage": True}  # added for the usage
    [call] = await gw.calls()
    assert call["request"]["headers"]["authorization"] == "<redacted>"
    assert call["request"]["headers"]["cookie"] == "<redacted>"
    assert "stream_options" not in call["request"]["body"]  # recorded as the harness sent it
    assert call["response"]["raw"] == answer.text
    assert call["usage"]["input_tokens"] == 11 and call["usage"]["output_tokens"] == 7
    assert call["kind"] == "main" and call["upstream"] == "fake" and call["status"] == 200
    assert call["latency_ms"] >= call["ttfb_ms"] > 0
    assert model.key not in json.dumps(call)


async def test_anthropic_and_responses_routes(gw: Gateway, model: FakeModel) -> None:
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    answer = await gw.http.post(
        "/t/ep-1/v1/messages?beta=true", json=body, headers={"x-api-key": "dummy"}
    )
    assert answer.json()["content"][0] == {"type": "text", "text": "no shell tool offered"}
    assert model.requests[-1].headers["x-api-key"] == model.key
    assert model.requests[-1].path == "/v1/messages?beta=true"
    responses = await gw.http.post("/v1/responses", json={"model": "m", "input": "x"})
    assert responses.json()["status"] == "completed"
    assert model.requests[-1].path == "/v1/responses"
    first, second = await gw.calls()
    assert (first["trajectory_id"], first["api"], first["kind"]) == (
        "ep-1",
        "anthropic.messages",
        "aux",
    )
    assert (second["trajectory_id"], second["api"]) == ("default", "openai.responses")


async def test_keep_alive_and_chunked_request_bodies(gw: Gateway) -> None:
    body = json.dumps(chat(stream=False)).encode()
    half = len(body) // 2
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        + b"%x\r\n%b\r\n%x\r\n%b\r\n0\r\n\r\n" % (half, body[:half], len(body) - half, body[half:])
    )
    reader, writer = await asyncio.open_unix_connection(str(gw.socket))
    for _ in range(2):  # twice on one connection
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        answer = json.loads(await reader.readexactly(length))
        assert answer["choices"][0]["finish_reason"] == "tool_calls"
    writer.close()
    assert [c["seq"] for c in await gw.calls()] == [1, 2]


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"\x00\xff garbage\r\n\r\n", b"400"),
        (b"CONNECT api.openai.com:443 HTTP/1.1\r\n\r\n", b"400"),
        (b"GET http://169.254.169.254/latest HTTP/1.1\r\nhost: x\r\n\r\n", b"400"),
        (b"GET /v1/models HTTP/1.1\r\n" + b"x-big: " + b"a" * 70000 + b"\r\n\r\n", b"431"),
        (b"GET /v1/models HTTP/2.0\r\n\r\n", b"505"),
        (b"POST /v1/x HTTP/1.1\r\ncontent-length: 99999999999\r\n\r\n", b"413"),
        (b"POST /v1/x HTTP/1.1\r\ntransfer-encoding: gzip\r\n\r\n", b"400"),
        (b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n", b"414"),
    ],
)
async def test_garbage_is_refused_clearly(gw: Gateway, data: bytes, status: bytes) -> None:
    answer = await gw.raw(data)
    assert answer.startswith(b"HTTP/1.1 " + status), answer[:200]
    assert b"orchard_gateway_error" in answer
    ok = await gw.http.get("/v1/models")  # and the gateway goes on serving
    assert ok.status_code == 200


async def test_no_way_out_but_the_configured_upstreams(gw: Gateway, model: FakeModel) -> None:
    upgrade = await gw.http.get(
        "/v1/responses", headers={"upgrade": "websocket", "connection": "upgrade"}
    )
    assert upgrade.status_code == 426
    for path in ("/api/show", "/v1/../admin", "/v1/%2e%2e/x", "/t/bad id/v1/models"):
        answer = await gw.raw(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        assert answer.split(b" ")[1] in (b"400", b"404"), (path, answer[:100])
    assert all(r.path.startswith("/v1/") for r in model.requests)
    statuses = [c["status"] for c in await gw.calls()]
    assert statuses == [426, 404, 404, 404]  # the bad trajectory id is no record


async def test_an_unreachable_endpoint_is_a_quick_502(gw: Gateway) -> None:
    gw.gateway.set_trajectory(SANDBOX, GatewayRecord(openai="down", dummy_key="d"))
    answer = await gw.http.post("/v1/chat/completions", json=chat(), timeout=10)
    assert answer.status_code == 502
    assert "the model endpoint 'down' is unreachable" in answer.json()["error"]["message"]
    [call] = await gw.calls()
    assert call["status"] == 502 and "unreachable" in call["error"]


async def test_upstream_errors_pass_through(gw: Gateway, model: FakeModel) -> None:
    model.script = [{"status": 500, "body": {"error": {"message": "overloaded"}}}]
    answer = await gw.http.post("/v1/chat/completions", json=chat())
    assert answer.status_code == 500 and answer.json()["error"]["message"] == "overloaded"
    [call] = await gw.calls()
    assert call["status"] == 500 and call["response"]["body"]["error"]["message"] == "overloaded"


async def test_budgets_refuse_with_a_clear_error(gw: Gateway) -> None:
    gw.gateway.set_trajectory(
        SANDBOX, GatewayRecord(openai="fake", anthropic="claude", dummy_key="d", max_calls=2)
    )
    for _ in range(2):
        assert (await gw.http.post("/v1/chat/completions", json=chat())).status_code == 200
    refused = await gw.http.post("/v1/chat/completions", json=chat())
    assert refused.status_code == 403
    assert "model call budget exceeded: 2 of max_calls 2" in refused.json()["error"]["message"]
    anthropic = await gw.http.post("/v1/messages", json={"messages": []})
    assert anthropic.json()["error"]["message"].startswith("model call budget exceeded")
    await gw.settle()
    gw.gateway.set_trajectory(SANDBOX, GatewayRecord(openai="fake", dummy_key="d", max_tokens=40))
    assert (await gw.http.post("/v1/chat/completions", json=chat())).status_code == 200
    await gw.settle()  # 3 x 18 tokens used now, over 40
    tokens = await gw.http.post("/v1/chat/completions", json=chat())
    assert tokens.status_code == 403 and "54 of max_tokens 40" in tokens.json()["error"]["message"]


async def test_sixteen_way_concurrency_keeps_seq_contiguous(gw: Gateway) -> None:
    async def one(i: int) -> int:
        path = "/t/par/v1/chat/completions" if i % 2 else "/v1/chat/completions"
        return (await gw.http.post(path, json=chat())).status_code

    assert set(await asyncio.gather(*(one(i) for i in range(32)))) == {200}
    calls = await gw.calls()
    for trajectory in ("par", "default"):
        seqs = sorted(c["seq"] for c in calls if c["trajectory_id"] == trajectory)
        assert seqs == list(range(1, 17))


async def test_too_many_connections_are_answered_503(gw: Gateway) -> None:
    held = [await asyncio.open_unix_connection(str(gw.socket)) for _ in range(MAX_CONNECTIONS)]
    await asyncio.sleep(0)
    answer = await gw.raw(b"GET /v1/models HTTP/1.1\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 503")
    for _, writer in held:
        writer.close()


async def test_a_restarted_gateway_continues_the_records(
    tmp_path: Path,
    gw: Gateway,
    model: FakeModel,
    store: SQLiteStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await gw.http.post("/v1/chat/completions", json=chat())
    await gw.settle()
    await gw.gateway.close()
    again = ModelGateway(endpoints(model, monkeypatch), store, tmp_path)
    await again.attach(SANDBOX, GatewayRecord(openai="fake", dummy_key="d", max_calls=2))
    async with httpx.AsyncClient(
        transport=httpx.AsyncHTTPTransport(uds=str(gw.socket)), base_url="http://x"
    ) as http:
        assert (await http.post("/v1/chat/completions", json=chat())).status_code == 200
        assert (await http.post("/v1/chat/completions", json=chat())).status_code == 403
    gw.gateway = again
    assert [c["seq"] for c in await gw.calls()] == [1, 2, 3]
