"""The gateway on real containers (engine tier): calls from inside a ``--network none``
sandbox to 127.0.0.1:4000 reach the fake model through the agent's relay and the
orchestrator's gateway, with the real key swapped in, and are recorded."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from orchard_env.config import ServiceSettings, service_settings
from tests.gateway.fake_model import FakeModel, running
from tests.servers import live_service

pytestmark = pytest.mark.engine


@pytest.fixture
def model() -> Iterator[FakeModel]:
    with running() as fake:
        yield fake


@pytest.fixture
def settings(
    tmp_path_factory: pytest.TempPathFactory,
    engine_instance: str,
    agent_bundle: Path,
    model: FakeModel,
    monkeypatch: pytest.MonkeyPatch,
) -> ServiceSettings:
    state = tmp_path_factory.mktemp("gw")
    endpoints = state / "endpoints.toml"
    endpoints.write_text(
        'default_openai = "fake"\ndefault_anthropic = "fake-anthropic"\n'
        f'[endpoints.fake]\napi = "openai"\nbase_url = "{model.url}/v1"\n'
        'key_env = "FAKE_MODEL_KEY"\nmodel = "fake-model"\n'
        f'[endpoints.fake-anthropic]\napi = "anthropic"\nbase_url = "{model.url}"\n'
        'key_env = "FAKE_MODEL_KEY"\n'
    )
    monkeypatch.setenv("FAKE_MODEL_KEY", model.key)
    return service_settings(
        state_dir=state,
        instance=f"{engine_instance}-gw",
        agent_bundle_dir=agent_bundle,
        model_endpoints_file=endpoints,
    )


@pytest.fixture
def http(settings: ServiceSettings) -> Iterator[httpx.Client]:
    with (
        live_service(settings, key_name="gateway") as (url, key),
        httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=120) as client,
    ):
        yield client


def create(http: httpx.Client, image: str, **gateway: Any) -> str:
    response = http.post("/sandboxes", json={"image": image, "model_gateway": gateway})
    assert response.status_code == 201, response.text
    sandbox_id: str = response.json()["sandbox_id"]
    ready = http.get(f"/sandboxes/{sandbox_id}/wait", params={"timeout": 60})
    assert ready.json()["status"] == "ready", ready.text
    return sandbox_id


def run(http: httpx.Client, sandbox_id: str, command: str) -> dict[str, Any]:
    response = http.post(f"/sandboxes/{sandbox_id}/exec", json={"command": command, "wait": True})
    assert response.status_code == 200, response.text
    job: dict[str, Any] = response.json()
    return job


def curl(path: str, body: dict[str, Any], *headers: str) -> str:
    parts = ["curl -sS -N", *(f"-H {shlex.quote(h)}" for h in headers)]
    parts += ["-H 'content-type: application/json'", f"-d {shlex.quote(json.dumps(body))}"]
    return " ".join([*parts, f"http://127.0.0.1:4000{path}"])


def calls(http: httpx.Client, sandbox_id: str, **params: Any) -> list[dict[str, Any]]:
    response = http.get(f"/sandboxes/{sandbox_id}/model-calls", params=params)
    assert response.status_code == 200, response.text
    found: list[dict[str, Any]] = response.json()["calls"]
    return found


TOOLS_CHAT = [{"type": "function", "function": {"name": "bash", "parameters": {}}}]


def test_three_apis_through_the_gateway(
    http: httpx.Client, sandbox_image: str, model: FakeModel
) -> None:
    sandbox_id = create(http, sandbox_image)
    env = run(http, sandbox_id, "env")["stdout"]
    assert model.key not in env and "OPENAI_BASE_URL=http://127.0.0.1:4000/v1" in env
    chat = curl(
        "/v1/chat/completions",
        {
            "model": "m",
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": TOOLS_CHAT,
        },
        "authorization: Bearer $OPENAI_API_KEY",
    )
    out = run(
        http,
        sandbox_id,
        chat.replace(
            "'authorization: Bearer $OPENAI_API_KEY'", '"authorization: Bearer $OPENAI_API_KEY"'
        ),
    )
    assert out["exit_code"] == 0, out
    assert "data: [DONE]" in out["stdout"]
    responses = curl("/t/episode-1/v1/responses", {"model": "m", "input": "hi"})
    out = run(http, sandbox_id, responses)
    assert json.loads(out["stdout"])["status"] == "completed"
    messages = curl(
        "/v1/messages?beta=true",
        {
            "model": "m",
            "stream": True,
            "max_tokens": 10,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "Bash", "input_schema": {}}],
        },
        "x-api-key: dummy",
        "anthropic-version: 2023-06-01",
    )
    out = run(http, sandbox_id, messages)
    assert "message_stop" in out["stdout"], out
    records = calls(http, sandbox_id)
    assert [(r["trajectory_id"], r["seq"], r["api"]) for r in records] == [
        ("default", 1, "openai.chat_completions"),
        ("episode-1", 1, "openai.responses"),
        ("default", 2, "anthropic.messages"),
    ]
    chat_record, _, anthropic_record = records
    message = chat_record["response"]["body"]["choices"][0]["message"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {
        "command": "echo hi > out.txt"
    }
    assert chat_record["usage"]["input_tokens"] == 11
    assert chat_record["request"]["headers"]["authorization"] == "<redacted>"
    assert anthropic_record["response"]["body"]["content"][0]["input"] == {
        "command": "echo hi > out.txt"
    }
    assert anthropic_record["response"]["body"]["stop_reason"] == "tool_use"
    assert all(model.key not in json.dumps(r) for r in records)
    assert {
        s.headers.get("authorization") or s.headers.get("x-api-key") for s in model.requests
    } <= {f"Bearer {model.key}", model.key}
