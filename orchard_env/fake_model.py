"""A scripted fake model server (on loopback unless told otherwise): OpenAI Responses, OpenAI
Chat Completions and Anthropic Messages, streamed (SSE) or not, for tests that run harnesses
or the gateway and for ``orchard bench harness``.

Start it from a test with the ``fake_model`` fixture of ``tests/gateway/conftest.py``, with
:func:`running` (on its own thread), or by hand:
``python -m orchard_env.fake_model --port 8123 --key sk-real`` (it prints its URL;
``--host`` listens on another address, e.g. where a cluster's pods reach it).

**Auth.** Every request must carry the server's key (``Authorization: Bearer <key>`` or
``x-api-key: <key>``), else 401: the key only the gateway holds, so a call that got through
the gateway proves the credential swap.

**Script.** A list of turns; the server is stateless and picks turn *n* where *n* is the
number of tool results already in the request's conversation (``function_call_output``
items, ``role: tool`` messages, ``tool_result`` blocks), the last turn repeating. A turn is
one of::

    {"tool": {"command": "echo hi > out.txt"}}   # ask to run a shell command
    {"text": "done"}                              # answer with text
    {"status": 500, "body": {"error": "boom"}}    # fail with this status and JSON body

A tool turn calls the first offered tool named ``exec_command`` (argument ``cmd``), ``Bash``,
``bash``, ``terminal`` or ``shell`` (argument ``command``); a request offering no tools (a
title call) gets a text answer. The default script is the tool turn above, then "done".
``GET .../models`` lists the model. Every request is kept in :attr:`FakeModel.requests`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import secrets
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

DEFAULT_SCRIPT: list[dict[str, Any]] = [
    {"tool": {"command": "echo hi > out.txt"}},
    {"text": "done"},
]
SHELL_TOOLS = {"exec_command": "cmd", "Bash": "command", "bash": "command", "terminal": "command"}
SHELL_TOOLS["shell"] = "command"
USAGE = {"input": 11, "output": 7}


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class FakeModel:
    key: str = field(default_factory=lambda: "sk-fake-" + secrets.token_hex(8))
    script: list[dict[str, Any]] = field(default_factory=lambda: list(DEFAULT_SCRIPT))
    model: str = "fake-model"
    requests: list[Seen] = field(default_factory=list)
    port: int = 0
    host: str = "127.0.0.1"
    _server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self, port: int = 0) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    # HTTP/1.1, keep-alive, Content-Length or chunked bodies

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line.strip():
                    break
                method, target, _ = line.decode("latin-1").split(" ", 2)
                headers: dict[str, str] = {}
                while (raw := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = raw.decode("latin-1").partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = await _read_body(reader, headers)
                await self._answer(writer, method, target, headers, body)
                await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    break
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()

    async def _answer(
        self,
        writer: asyncio.StreamWriter,
        method: str,
        target: str,
        headers: dict[str, str],
        raw: bytes,
    ) -> None:
        path = target.split("?", 1)[0]
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("latin-1")
        self.requests.append(Seen(method, target, headers, body))
        given = headers.get("x-api-key") or headers.get("authorization", "").removeprefix("Bearer ")
        if given != self.key:
            _json(writer, 401, {"error": {"message": "invalid api key", "type": "auth"}})
            return
        if method == "GET" and path.endswith("/models"):
            _json(writer, 200, {"object": "list", "data": [{"id": self.model, "object": "model"}]})
            return
        if method != "POST" or not isinstance(body, dict):
            _json(writer, 404, {"error": {"message": f"no route {method} {path}"}})
            return
        turn = self.turn(body)
        if "status" in turn:
            _json(writer, int(turn["status"]), turn.get("body", {}))
            return
        if path.endswith("/responses"):
            events = responses_events(self.model, turn, body)
        elif path.endswith("/chat/completions"):
            events = chat_events(self.model, turn, body)
        elif path.endswith("/messages"):
            events = messages_events(self.model, turn, body)
        else:
            _json(writer, 404, {"error": {"message": f"no route {method} {path}"}})
            return
        if body.get("stream"):
            _sse_head(writer)
            for name, data in events:
                chunk = (f"event: {name}\n" if name else "") + f"data: {_dump(data)}\n\n"
                _chunk(writer, chunk.encode())
                await writer.drain()
            _chunk(writer, b"")
        elif path.endswith("/responses"):
            _json(writer, 200, events[-1][1]["response"])
        elif path.endswith("/messages"):
            _json(writer, 200, events[-1][1])
        else:
            _json(writer, 200, chat_json(self.model, turn))

    def turn(self, body: dict[str, Any]) -> dict[str, Any]:
        done = count_tool_results(body)
        turn = self.script[min(done, len(self.script) - 1)]
        tool = pick_tool(body)
        if "tool" in turn and tool is None:
            return {"text": "no shell tool offered"}
        if "tool" in turn and tool is not None:
            return {"tool_name": tool, "arguments": {SHELL_TOOLS[tool]: turn["tool"]["command"]}}
        return turn


def count_tool_results(body: dict[str, Any]) -> int:
    count = 0
    for item in body.get("input") or []:
        if isinstance(item, dict) and item.get("type") == "function_call_output":
            count += 1
    for message in body.get("messages") or []:
        if not isinstance(message, dict):
            continue
        if message.get("role") == "tool":
            count += 1
        content = message.get("content")
        if isinstance(content, list):
            count += sum(
                1 for b in content if isinstance(b, dict) and b.get("type") == "tool_result"
            )
    return count


def pick_tool(body: dict[str, Any]) -> str | None:
    names = []
    for tool in body.get("tools") or []:
        if isinstance(tool, dict):
            names.append(tool.get("name") or (tool.get("function") or {}).get("name"))
    return next((name for name in names if name in SHELL_TOOLS), None)


def responses_events(model: str, turn: dict[str, Any], body: dict[str, Any]) -> list[Any]:
    rid = "resp_" + secrets.token_hex(6)
    usage = {
        "input_tokens": USAGE["input"],
        "output_tokens": USAGE["output"],
        "total_tokens": USAGE["input"] + USAGE["output"],
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 0},
    }
    base = {"id": rid, "object": "response", "model": model, "status": "in_progress", "output": []}
    events: list[Any] = [("response.created", {"type": "response.created", "response": base})]
    if "tool_name" in turn:
        args = json.dumps(turn["arguments"])
        item = {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_1",
            "name": turn["tool_name"],
            "arguments": "",
        }
        events.append(
            (
                "response.output_item.added",
                {"type": "response.output_item.added", "output_index": 0, "item": item},
            )
        )
        for part in _split(args):
            events.append(
                (
                    "response.function_call_arguments.delta",
                    {
                        "type": "response.function_call_arguments.delta",
                        "output_index": 0,
                        "item_id": "fc_1",
                        "delta": part,
                    },
                )
            )
        done = {**item, "arguments": args, "status": "completed"}
    else:
        text = turn.get("text", "")
        item = {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        events.append(
            (
                "response.output_item.added",
                {"type": "response.output_item.added", "output_index": 0, "item": item},
            )
        )
        for part in _split(text):
            events.append(
                (
                    "response.output_text.delta",
                    {
                        "type": "response.output_text.delta",
                        "output_index": 0,
                        "content_index": 0,
                        "item_id": "msg_1",
                        "delta": part,
                    },
                )
            )
        done = {
            **item,
            "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }
    events.append(
        (
            "response.output_item.done",
            {"type": "response.output_item.done", "output_index": 0, "item": done},
        )
    )
    final = {**base, "status": "completed", "output": [done], "usage": usage}
    events.append(("response.completed", {"type": "response.completed", "response": final}))
    return events


def _chat_usage() -> dict[str, int]:
    return {
        "prompt_tokens": USAGE["input"],
        "completion_tokens": USAGE["output"],
        "total_tokens": USAGE["input"] + USAGE["output"],
    }


def chat_json(model: str, turn: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": turn.get("text")}
    finish = "stop"
    if "tool_name" in turn:
        message["tool_calls"] = [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": turn["tool_name"], "arguments": json.dumps(turn["arguments"])},
            }
        ]
        finish = "tool_calls"
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": _chat_usage(),
    }


def chat_events(model: str, turn: dict[str, Any], body: dict[str, Any]) -> list[Any]:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": model}
    events: list[Any] = [
        (
            None,
            {
                **head,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                    }
                ],
            },
        )
    ]
    if "tool_name" in turn:
        args = json.dumps(turn["arguments"])
        first = {
            "index": 0,
            "id": "call_1",
            "type": "function",
            "function": {"name": turn["tool_name"], "arguments": ""},
        }
        events.append(
            (
                None,
                {
                    **head,
                    "choices": [
                        {"index": 0, "delta": {"tool_calls": [first]}, "finish_reason": None}
                    ],
                },
            )
        )
        for part in _split(args):
            delta = {"tool_calls": [{"index": 0, "function": {"arguments": part}}]}
            events.append(
                (None, {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
            )
        finish = "tool_calls"
    else:
        for part in _split(turn.get("text", "")):
            events.append(
                (
                    None,
                    {
                        **head,
                        "choices": [
                            {"index": 0, "delta": {"content": part}, "finish_reason": None}
                        ],
                    },
                )
            )
        finish = "stop"
    events.append((None, {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}))
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append((None, {**head, "choices": [], "usage": _chat_usage()}))
    events.append((None, "[DONE]"))
    return events


def messages_events(model: str, turn: dict[str, Any], body: dict[str, Any]) -> list[Any]:
    mid = "msg_" + secrets.token_hex(6)
    start: dict[str, Any] = {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "usage": {"input_tokens": USAGE["input"], "output_tokens": 1},
    }
    events: list[Any] = [("message_start", {"type": "message_start", "message": start})]
    if "tool_name" in turn:
        args = json.dumps(turn["arguments"])
        block: dict[str, Any] = {
            "type": "tool_use",
            "id": "toolu_1",
            "name": turn["tool_name"],
            "input": {},
        }
        deltas = [{"type": "input_json_delta", "partial_json": p} for p in _split(args)]
        final_block = {**block, "input": turn["arguments"]}
        stop = "tool_use"
    else:
        text = turn.get("text", "")
        block = {"type": "text", "text": ""}
        deltas = [{"type": "text_delta", "text": p} for p in _split(text)]
        final_block = {"type": "text", "text": text}
        stop = "end_turn"
    events.append(
        ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": block})
    )
    for delta in deltas:
        events.append(
            ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})
        )
    events.append(("content_block_stop", {"type": "content_block_stop", "index": 0}))
    events.append(
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": {"output_tokens": USAGE["output"]},
            },
        )
    )
    events.append(("message_stop", {"type": "message_stop"}))
    whole = {
        **start,
        "content": [final_block],
        "stop_reason": stop,
        "usage": {"input_tokens": USAGE["input"], "output_tokens": USAGE["output"]},
    }
    events.append((None, whole))  # the non-streamed answer (never sent as an event)
    if body.get("stream"):
        events.pop()
    return events


def _split(text: str) -> Iterator[str]:
    step = max(1, len(text) // 3)
    for i in range(0, len(text), step):
        yield text[i : i + step]


def _dump(data: Any) -> str:
    return data if isinstance(data, str) else json.dumps(data)


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        parts: list[bytes] = []
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                return b"".join(parts)
            parts.append(data[:-2])
    return await reader.readexactly(int(headers.get("content-length") or 0))


def _json(writer: asyncio.StreamWriter, status: int, body: Any) -> None:
    data = json.dumps(body).encode()
    writer.write(
        f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n".encode()
        + data
    )


def _sse_head(writer: asyncio.StreamWriter) -> None:
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )


def _chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")


@contextlib.contextmanager
def running(**options: Any) -> Iterator[FakeModel]:
    """A :class:`FakeModel` serving on its own event loop in a daemon thread."""
    loop = asyncio.new_event_loop()
    fake = FakeModel(**options)
    thread = threading.Thread(target=loop.run_forever, name="fake-model", daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(fake.start(), loop).result(10)
    try:
        yield fake
    finally:
        asyncio.run_coroutine_threadsafe(fake.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def _main(host: str, port: int, key: str) -> None:
    fake = FakeModel(key=key, host=host)
    await fake.start(port)
    sys.stdout.write(f"{fake.url}\n")
    sys.stdout.flush()
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--key", default="sk-fake")
    args = parser.parse_args()
    asyncio.run(_main(args.host, args.port, args.key))
