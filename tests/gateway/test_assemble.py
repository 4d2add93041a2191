"""Records without sockets: SSE parsed and reassembled for the three APIs (streams made by
the fake model), usage in one shape, the endpoints file and its errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchard_env import errors, fake_model
from orchard_env.orchestrator.gateway import assemble
from orchard_env.orchestrator.gateway.calls import redact
from orchard_env.orchestrator.gateway.endpoints import load_endpoints

TOOL_TURN = {"tool_name": "bash", "arguments": {"command": "echo hi > out.txt"}}
TEXT_TURN = {"text": "all done here"}


def sse(events: list[Any]) -> bytes:
    text = ""
    for name, data in events:
        text += (f"event: {name}\r\n" if name else "") + f"data: {fake_model._dump(data)}\r\n\r\n"
    return text.encode()


@pytest.mark.parametrize("turn", [TOOL_TURN, TEXT_TURN])
def test_chat_streams_reassemble_to_the_unstreamed_answer(turn: dict[str, Any]) -> None:
    body = {"stream": True, "stream_options": {"include_usage": True}}
    events = assemble.parse_sse(sse(fake_model.chat_events("m", turn, body)))
    assert events[-1] == {"data": "[DONE]"}
    whole = assemble.assemble(assemble.OPENAI_CHAT, events)
    expected = fake_model.chat_json("m", turn)
    assert whole["choices"] == expected["choices"]
    message = whole["choices"][0]["message"]
    if "tool_name" in turn:
        assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == turn["arguments"]
    else:
        assert message["content"] == "all done here"
    usage = assemble.usage_of(assemble.OPENAI_CHAT, whole)
    assert usage is not None and (usage["input_tokens"], usage["output_tokens"]) == (11, 7)


@pytest.mark.parametrize("turn", [TOOL_TURN, TEXT_TURN])
def test_anthropic_streams_reassemble(turn: dict[str, Any]) -> None:
    events = fake_model.messages_events("m", turn, {"stream": False})
    expected = events.pop()[1]
    whole = assemble.assemble(assemble.ANTHROPIC_MESSAGES, assemble.parse_sse(sse(events)))
    assert whole["content"] == expected["content"]
    assert whole["stop_reason"] == expected["stop_reason"]
    usage = assemble.usage_of(assemble.ANTHROPIC_MESSAGES, whole)
    assert usage is not None and (usage["input_tokens"], usage["output_tokens"]) == (11, 7)


@pytest.mark.parametrize("turn", [TOOL_TURN, TEXT_TURN])
def test_responses_streams_reassemble(turn: dict[str, Any]) -> None:
    events = fake_model.responses_events("m", turn, {})
    whole = assemble.assemble(assemble.OPENAI_RESPONSES, assemble.parse_sse(sse(events)))
    assert whole == events[-1][1]["response"]
    cut = assemble.assemble(assemble.OPENAI_RESPONSES, assemble.parse_sse(sse(events[:-1])))
    assert cut["status"] == "incomplete" and cut["output"] == whole["output"]
    usage = assemble.usage_of(assemble.OPENAI_RESPONSES, whole)
    assert usage is not None and usage["input_tokens"] == 11 and usage["raw"]["total_tokens"] == 18


def test_garbage_streams_assemble_to_what_can_be_said() -> None:
    events = assemble.parse_sse(b"data: {not json\n\n: comment\n\nevent: x\n\n\xff\xfe")
    assert events == [{"data": "{not json"}]
    assert assemble.assemble(assemble.ANTHROPIC_MESSAGES, events) is None
    assert assemble.assemble(assemble.OPENAI_CHAT, events)["choices"] == []
    assert assemble.usage_of(assemble.OPENAI_CHAT, {"usage": "lots"}) is None
    odd = assemble.usage_of(assemble.OPENAI_CHAT, {"usage": {"prompt_tokens": True}})
    assert odd is not None and odd["input_tokens"] == 0


def test_apis_by_path() -> None:
    assert assemble.api_of("POST", "/v1/messages/count_tokens") == assemble.ANTHROPIC_COUNT_TOKENS
    assert assemble.api_of("GET", "/v1/responses") == assemble.OTHER
    assert assemble.api_of("POST", "/v1/chat/completions") == assemble.OPENAI_CHAT


def test_credentials_are_redacted() -> None:
    headers = [("authorization", "Bearer x"), ("x-api-key", "k"), ("accept", "a"), ("accept", "b")]
    assert redact(headers) == {
        "authorization": "<redacted>",
        "x-api-key": "<redacted>",
        "accept": "a, b",
    }


def test_the_endpoints_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "endpoints.toml"
    key_file = tmp_path / "key"
    key_file.write_text("sk-file\n")
    monkeypatch.setenv("MY_KEY", "sk-env")
    path.write_text(
        'default_openai = "a"\n'
        '[endpoints.a]\napi = "openai"\nbase_url = "https://x.example/v1/"\nkey_env = "MY_KEY"\n'
        f'[endpoints.b]\napi = "anthropic"\nbase_url = "http://y:8000"\nkey_file = "{key_file}"\n'
    )
    loaded = load_endpoints(path)
    a = loaded.pick("openai", None)
    assert a is not None and a.base_url == "https://x.example/v1" and a.key() == "sk-env"
    assert loaded.pick("anthropic", None) is None  # no default
    b = loaded.pick("anthropic", "b")
    assert b is not None and b.key() == "sk-file"
    with pytest.raises(errors.InvalidRequest, match="no openai endpoint named 'b'"):
        loaded.pick("openai", "b")
    for bad, needle in [
        ('[endpoints.c]\napi = "grpc"\nbase_url = "http://x"\n', "api must be one of"),
        ('[endpoints.c]\napi = "openai"\nbase_url = "file:///etc"\n', "must be an http(s) URL"),
        ('default_anthropic = "none"\n', "default_anthropic = 'none' is no anthropic endpoint"),
        ("[[", "model_endpoints_file"),
    ]:
        path.write_text(bad)
        with pytest.raises(
            errors.ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")
        ):
            load_endpoints(path)
