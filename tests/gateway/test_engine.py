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
from orchard_env.fake_model import FakeModel, running
from orchard_env.sdk import SandboxClient
from tests.servers import Live, live_service

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
        '[endpoints.down]\napi = "openai"\nbase_url = "http://127.0.0.1:9/v1"\n'
    )
    monkeypatch.setenv("FAKE_MODEL_KEY", model.key)
    return service_settings(
        state_dir=state,
        instance=f"{engine_instance}-gw",
        agent_bundle_dir=agent_bundle,
        model_endpoints_file=endpoints,
    )


@pytest.fixture
def live(settings: ServiceSettings) -> Iterator[Live]:
    with live_service(settings, key_name="gateway") as service:
        yield service


@pytest.fixture
def http(live: Live) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, headers={"X-API-Key": live.api_key}, timeout=120) as c:
        yield c


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


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS_CHAT}


def test_no_network_and_no_real_key_in_the_sandbox(
    http: httpx.Client, sandbox_image: str, model: FakeModel
) -> None:
    sandbox_id = create(http, sandbox_image, max_calls=3)
    assert run(http, sandbox_id, "ls /sys/class/net")["stdout"].split() == ["lo"]
    looked = run(
        http,
        sandbox_id,
        "cat /proc/*/environ /tmp/orchard-harness/*/* /run/orchard/* 2>/dev/null | tr '\\0' '\\n';"
        "cat /tmp/orchard-harness/codex/config.toml",
    )["stdout"]
    assert model.key not in looked
    assert 'base_url = "http://127.0.0.1:4000/v1"' in looked
    outside = run(http, sandbox_id, "curl -sS -m 5 http://1.1.1.1/ 2>&1; echo rc=$?")
    assert "rc=0" not in outside["stdout"]
    # The budget: 3 calls, then a clear 403 to the harness.
    out = run(
        http,
        sandbox_id,
        "for i in 1 2 3 4; do "
        + curl("/v1/chat/completions", CHAT)
        + " -o /dev/null -w '%{http_code} '; done",
    )
    assert out["stdout"].split() == ["200", "200", "200", "403"]


def test_sixteen_concurrent_calls_and_hostile_clients(
    http: httpx.Client, sandbox_image: str
) -> None:
    sandbox_id = create(http, sandbox_image)
    hostile = """
import socket
def send(data):
    s = socket.create_connection(("127.0.0.1", 4000))
    s.sendall(data)
    s.settimeout(20)
    answer = s.recv(100)
    s.close()
    return answer.split(b" ")[1].decode() if answer else "closed"
held = [socket.create_connection(("127.0.0.1", 4000)) for _ in range(300)]
print(send(b"GET /v1/models HTTP/1.1\\r\\n\\r\\n"))
for s in held:
    s.close()
print(send(bytes(range(256)) * 40))
print(send(b"GET /v1/models HTTP/1.1\\r\\nx: " + b"a" * 200000 + b"\\r\\n\\r\\n"))
print(send(b"GET http://169.254.169.254/ HTTP/1.1\\r\\n\\r\\n"))
"""
    out = run(http, sandbox_id, f"python3 -c {shlex.quote(hostile)}")
    assert out["stdout"].split() == ["503", "400", "431", "400"], out
    calls_16 = " ".join(
        f"({curl('/t/par/v1/chat/completions', {**CHAT, 'stream': True})} > out{i}.txt) &"
        for i in range(16)
    )
    out = run(http, sandbox_id, calls_16 + " wait; cat out*.txt | grep -c 'data: \\[DONE\\]'")
    assert out["stdout"].strip() == "16", out
    seqs = sorted(c["seq"] for c in calls(http, sandbox_id, trajectory_id="par"))
    assert seqs == list(range(1, 17))


def test_trajectories_change_and_survive_a_restart(
    settings: ServiceSettings, sandbox_image: str, model: FakeModel
) -> None:
    with live_service(settings, key_name="first") as (url, key):
        with httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=120) as http:
            sandbox_id = create(http, sandbox_image, trajectory_id="ep-1")
            run(http, sandbox_id, curl("/v1/responses", {"model": "m", "input": "x"}))
        with SandboxClient(base_url=url, api_key=key) as client:
            sandbox = client.get_sandbox(sandbox_id)
            sandbox.set_trajectory("ep-2")
            assert sandbox.info.model_gateway is not None
            assert sandbox.info.model_gateway.trajectory_id == "ep-2"
    with live_service(settings, key_name="second") as (url, key):
        with httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=120) as http:
            run(http, sandbox_id, curl("/v1/responses", {"model": "m", "input": "x"}))
            run(http, sandbox_id, curl("/v1/responses", {"model": "m", "input": "x"}))
            lines = http.get(f"/sandboxes/{sandbox_id}/model-calls/stream").text.splitlines()
            assert [
                (json.loads(line)["trajectory_id"], json.loads(line)["seq"]) for line in lines
            ] == [("ep-1", 1), ("ep-2", 1), ("ep-2", 2)]
        with SandboxClient(base_url=url, api_key=key) as client:
            sandbox = client.get_sandbox(sandbox_id)
            summary = {t.trajectory_id: t.calls for t in sandbox.trajectories()}
            assert summary == {"ep-1": 1, "ep-2": 2}
            assert [c["seq"] for c in sandbox.model_calls("ep-2")] == [1, 2]
            client.delete_sandbox(sandbox_id)


def test_an_unreachable_endpoint_is_a_clear_502(http: httpx.Client, sandbox_image: str) -> None:
    sandbox_id = create(http, sandbox_image, openai="down")
    out = run(http, sandbox_id, curl("/v1/chat/completions", CHAT) + " -w ' %{http_code}'")
    assert out["stdout"].endswith(" 502"), out
    assert "the model endpoint 'down' is unreachable" in out["stdout"]
    [record] = calls(http, sandbox_id)
    assert record["status"] == 502 and record["upstream"] == "down"


def test_forks_relay_their_own_calls_with_keys_of_their_own(
    http: httpx.Client, sandbox_image: str
) -> None:
    """Each fork's calls are its own (id, numbering, budget), and so is its dummy key, in
    its environment and in the harness files its snapshot holds from the parent."""
    parent = create(http, sandbox_image, trajectory_id="ep-0", max_calls=1)
    assert run(http, parent, curl("/v1/chat/completions", CHAT))["exit_code"] == 0
    forked = http.post(f"/sandboxes/{parent}/fork", json={"count": 2})
    assert forked.status_code == 201, forked.text
    keys = {run(http, parent, "echo $OPENAI_API_KEY")["stdout"].strip()}
    for fork in (s["sandbox_id"] for s in forked.json()["sandboxes"]):
        out = run(
            http,
            fork,
            curl("/v1/chat/completions", CHAT) + " -o /dev/null -w '%{http_code}\\n';"
            "echo $OPENAI_API_KEY; grep api_key /tmp/orchard-harness/hermes/config.yaml",
        )
        status, key, hermes = out["stdout"].splitlines()
        assert status == "200", out  # the parent's budget is spent, the fork's is its own
        assert hermes == f'  api_key: "{key}"'
        keys.add(key)
        records = calls(http, fork)
        assert [(r["sandbox_id"], r["trajectory_id"], r["seq"]) for r in records] == [
            (fork, "ep-0", 1)
        ]
    assert len(keys) == 3
    assert [r["sandbox_id"] for r in calls(http, parent)] == [parent]
