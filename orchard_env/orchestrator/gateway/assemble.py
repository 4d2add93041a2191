"""What a call's answer was: SSE parsed into events, a streamed answer reassembled into the
body the API would have sent unstreamed, and token usage in one shape for the three APIs."""

from __future__ import annotations

import json
from typing import Any

OPENAI_RESPONSES = "openai.responses"
OPENAI_CHAT = "openai.chat_completions"
ANTHROPIC_MESSAGES = "anthropic.messages"
ANTHROPIC_COUNT_TOKENS = "anthropic.count_tokens"
OTHER = "other"


def api_of(method: str, path: str) -> str:
    """The API a request path speaks (the path after ``/t/<traj>``, without its query)."""
    if method == "POST" and path.endswith("/responses"):
        return OPENAI_RESPONSES
    if method == "POST" and path.endswith("/chat/completions"):
        return OPENAI_CHAT
    if method == "POST" and path.endswith("/messages/count_tokens"):
        return ANTHROPIC_COUNT_TOKENS
    if method == "POST" and path.endswith("/messages"):
        return ANTHROPIC_MESSAGES
    return OTHER


def parse_sse(raw: bytes) -> list[dict[str, Any]]:
    """``[{"event"?: name, "data": parsed JSON or the text}]``, one per SSE event."""
    events: list[dict[str, Any]] = []
    text = raw.decode("utf-8", "replace").replace("\r\n", "\n")
    for block in text.split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
        if not data:
            continue
        joined = "\n".join(data)
        try:
            value: Any = json.loads(joined)
        except ValueError:
            value = joined
        events.append({"event": name, "data": value} if name else {"data": value})
    return events


def assemble(api: str, events: list[dict[str, Any]]) -> Any:
    """The unstreamed body of a streamed answer (None for APIs not understood)."""
    datas = [e["data"] for e in events if isinstance(e.get("data"), dict)]
    if api == OPENAI_RESPONSES:
        return _responses(datas)
    if api == OPENAI_CHAT:
        return _chat(datas)
    if api == ANTHROPIC_MESSAGES:
        return _messages(datas)
    return None


def _responses(datas: list[dict[str, Any]]) -> Any:
    final = None
    for data in datas:
        if data.get("type") in ("response.completed", "response.failed", "response.incomplete"):
            final = data.get("response")
    if final is None:  # cut off: what the items done so far say
        items = [d["item"] for d in datas if d.get("type") == "response.output_item.done"]
        final = {"status": "incomplete", "output": items} if items else None
    return final


def _chat(datas: list[dict[str, Any]]) -> Any:
    head: dict[str, Any] = {}
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for data in datas:
        head = head or {k: data[k] for k in ("id", "model", "created") if k in data}
        usage = data.get("usage") or usage
        for choice in data.get("choices") or []:
            index = int(choice.get("index", 0))
            into = choices.setdefault(
                index, {"index": index, "message": {"role": "assistant", "content": None}}
            )
            _chat_delta(into, choice.get("delta") or {})
            if choice.get("finish_reason"):
                into["finish_reason"] = choice["finish_reason"]
    body = {**head, "object": "chat.completion", "choices": [choices[i] for i in sorted(choices)]}
    if usage is not None:
        body["usage"] = usage
    return body


def _chat_delta(choice: dict[str, Any], delta: dict[str, Any]) -> None:
    message = choice["message"]
    for key in ("content", "reasoning_content", "refusal"):
        if delta.get(key):
            message[key] = (message.get(key) or "") + delta[key]
    for call in delta.get("tool_calls") or []:
        calls = message.setdefault("tool_calls", [])
        index = int(call.get("index", len(calls)))
        while len(calls) <= index:
            calls.append(
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
        into = calls[index]
        if call.get("id"):
            into["id"] = call["id"]
        function = call.get("function") or {}
        into["function"]["name"] += function.get("name") or ""
        into["function"]["arguments"] += function.get("arguments") or ""


def _messages(datas: list[dict[str, Any]]) -> Any:
    message: dict[str, Any] | None = None
    partial: dict[int, str] = {}
    for data in datas:
        kind = data.get("type")
        if kind == "message_start":
            message = dict(data.get("message") or {})
            message["content"] = []
        elif message is None:
            continue
        elif kind == "content_block_start":
            message["content"].append(dict(data.get("content_block") or {}))
        elif kind == "content_block_delta" and message["content"]:
            index = int(data.get("index", len(message["content"]) - 1))
            block = message["content"][min(index, len(message["content"]) - 1)]
            delta = data.get("delta") or {}
            if delta.get("type") == "text_delta":
                block["text"] = block.get("text", "") + delta.get("text", "")
            elif delta.get("type") == "thinking_delta":
                block["thinking"] = block.get("thinking", "") + delta.get("thinking", "")
            elif delta.get("type") == "input_json_delta":
                partial[index] = partial.get(index, "") + delta.get("partial_json", "")
            elif delta.get("type") == "signature_delta":
                block["signature"] = delta.get("signature")
        elif kind == "message_delta":
            message.update(data.get("delta") or {})
            message["usage"] = {**(message.get("usage") or {}), **(data.get("usage") or {})}
    if message is not None:
        for index, text in partial.items():
            try:
                message["content"][index]["input"] = json.loads(text) if text else {}
            except (ValueError, IndexError):
                message["content"][index]["input_json"] = text
    return message


def usage_of(api: str, body: Any) -> dict[str, Any] | None:
    """``{input_tokens, output_tokens, cached_input_tokens, cache_write_tokens,
    reasoning_tokens, raw}`` of an answer's body (assembled or not); None without usage."""
    if not isinstance(body, dict):
        return None
    raw = body.get("usage")
    if not isinstance(raw, dict):
        return None
    if api == OPENAI_CHAT:
        prompt = raw.get("prompt_tokens_details") or {}
        completion = raw.get("completion_tokens_details") or {}
        return _usage(
            raw,
            raw.get("prompt_tokens"),
            raw.get("completion_tokens"),
            prompt.get("cached_tokens"),
            None,
            completion.get("reasoning_tokens"),
        )
    if api in (ANTHROPIC_MESSAGES, ANTHROPIC_COUNT_TOKENS):
        return _usage(
            raw,
            raw.get("input_tokens"),
            raw.get("output_tokens"),
            raw.get("cache_read_input_tokens"),
            raw.get("cache_creation_input_tokens"),
            None,
        )
    inputs = raw.get("input_tokens_details") or {}
    outputs = raw.get("output_tokens_details") or {}
    return _usage(
        raw,
        raw.get("input_tokens"),
        raw.get("output_tokens"),
        inputs.get("cached_tokens"),
        None,
        outputs.get("reasoning_tokens"),
    )


def _usage(raw: dict[str, Any], *values: Any) -> dict[str, Any]:
    names = (
        "input_tokens",
        "output_tokens",
        "cached_input_tokens",
        "cache_write_tokens",
        "reasoning_tokens",
    )
    usage: dict[str, Any] = {
        name: int(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0
        for name, v in zip(names, values, strict=True)
    }
    usage["raw"] = raw
    return usage
