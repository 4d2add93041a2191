"""`orchard sandbox list` and bash's TAB completion of ids: the paths that run them before
the command-line framework, the SDK and pydantic are loaded.

A list is what scripts run most and a TAB what people wait on, so their start-up should be
the interpreter's own plus one request: :func:`quick_sandbox_list` parses the options it
knows, asks the service over a socket of its own, and prints a table, ``-o wide``,
``-o name`` or ``-q`` with the same code the full command uses; :func:`quick_completion`
answers bash's completion of the id a command takes first (``orchard sandbox get <TAB>``).
Anything else (``--json``, ``--help``, an option it does not know, a value the full command
would refuse, another shell or position, an answer that is not a page of what was asked,
a service that cannot be reached) makes them print nothing and return False, and the full
command runs instead, with its own errors and retries: both only read, so asking twice is
harmless.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import Any
from urllib.parse import SplitResult, urlencode, urlsplit

from orchard_cli.output import Column, emit_list, output_format, pairs, parse_pairs, when
from orchard_env import __version__
from orchard_env.contexts import client_settings
from orchard_env.errors import OrchardError

Wire = Mapping[str, Any]
"""A sandbox as the service sends it (``SandboxInfo`` in JSON)."""

SANDBOX_COLUMNS: tuple[Column[Wire], ...] = (
    Column("ID", lambda sb: sb["sandbox_id"]),
    Column("STATUS", lambda sb: sb["status"]),
    Column("IMAGE", lambda sb: sb["image"]),
    Column("CPU", lambda sb: sb["cpu"]),
    Column("MEMORY", lambda sb: sb["memory"]),
    Column("NETWORK", lambda sb: "blocked" if sb["block_network"] else "open"),
    Column("LABELS", lambda sb: pairs(sb.get("labels") or {})),
    Column("CREATED", lambda sb: when(sb["created_at"])),
    Column("EXPIRES", lambda sb: when(sb.get("expires_at")), wide=True),
    Column("LAST ACTIVITY", lambda sb: when(sb.get("last_activity_at")), wide=True),
    Column("SNAPSHOT", lambda sb: sb.get("source_snapshot") or "", wide=True),
    Column("OWNER", lambda sb: sb.get("owner") or "", wide=True),
    Column("BACKEND", lambda sb: sb.get("backend", ""), wide=True),
    Column("MESSAGE", lambda sb: sb.get("status_message", ""), wide=True),
)

MAX_CHUNK_SIZE = 10_000
MAX_ANSWER = 256 * 1024**2  # bytes of one page; a larger one is left to the full command
READ_SIZE = 256 * 1024
_TIMEOUT = 30.0  # seconds per socket operation; a slower service gets the full command
_PROXY_VARIABLES = frozenset({"http_proxy", "https_proxy", "all_proxy"})
_VALUED = {
    "-l": "label",
    "--label": "label",
    "--status": "status",
    "--chunk-size": "chunk_size",
    "-o": "output",
    "--output": "output",
    "--url": "url",
    "--api-key": "api_key",
    "--context": "context",
}
_FLAGS = {"-q": "quiet", "--quiet": "quiet"}


ID_COMMANDS: dict[tuple[str, str], str] = {
    **{("sandbox", name): "sandboxes" for name in ("get", "exec", "shell", "ls", "patch")},
    **{("sandbox", name): "sandboxes" for name in ("fork", "rm")},
    ("snapshot", "create"): "sandboxes",
    **{("snapshot", name): "snapshots" for name in ("get", "rm", "restore")},
    **{("trajectory", name): "sandboxes" for name in ("list", "show", "export")},
}
"""Commands whose first argument is a sandbox's or a snapshot's id, and what to list for it
(tests/cli/test_listing.py checks this against the commands' own completion)."""


def emit_sandboxes(sandboxes: list[Wire], fmt: str) -> None:
    """Print sandboxes (in their JSON form) in ``fmt``, for both paths."""
    emit_list(sandboxes, SANDBOX_COLUMNS, fmt, kind="sandbox", key=lambda sb: sb["sandbox_id"])


def quick_sandbox_list(args: list[str]) -> bool:
    """Run ``orchard sandbox list ARGS`` if it can be run without the framework; False (and
    nothing printed) if the full command must run it."""
    options = _options(args)
    if options is None:
        return False
    try:
        fmt = output_format(options.get("output"), quiet="quiet" in options)
        settings = client_settings(
            options.get("url"), options.get("api_key"), options.get("context")
        )
        labels = parse_pairs(options.get("labels"), "label")
    except OrchardError:
        return False
    chunk_size = options.get("chunk_size", "500")
    if fmt not in ("table", "wide", "name", "quiet") or not _chunk(chunk_size):
        return False
    params = [("label", f"{key}={value}") for key, value in labels.items()]
    if "status" in options:
        params.append(("status", options["status"]))
    params.append(("limit", chunk_size))
    sandboxes = _fetch(settings.url, settings.api_key, "sandboxes", params)
    if sandboxes is None:
        return False
    emit_sandboxes(sandboxes, fmt)
    return True


def quick_completion(environ: Mapping[str, str]) -> bool:
    """Answer bash's completion (typer's protocol: ``COMP_WORDS``, ``COMP_CWORD``, the ids
    that start with the word being completed, one per line) of the first argument of a
    command in :data:`ID_COMMANDS`; False for anything else."""
    words = environ.get("COMP_WORDS", "")
    if environ.get("_ORCHARD_COMPLETE") != "complete_bash" or any(c in words for c in "\"'\\"):
        return False
    split = words.split()
    if words.endswith((" ", "\t")) or not words:
        split.append("")
    kind = ID_COMMANDS.get((split[1], split[2])) if len(split) == 4 else None
    if kind is None or environ.get("COMP_CWORD") != "3":
        return False
    try:
        settings = client_settings()
    except OrchardError:
        return False
    found = _fetch(settings.url, settings.api_key, kind, [])
    if found is None:
        return False
    key = "sandbox_id" if kind == "sandboxes" else "snapshot_id"
    ids = [str(item.get(key)) for item in found if str(item.get(key)).startswith(split[3])]
    sys.stdout.write("\n".join(ids))
    return True


def _options(args: list[str]) -> dict[str, Any] | None:
    """The options as the full command reads them (the last of a repeated one wins, labels
    add up; ``--name=value``, ``-lVALUE`` and ``-oFORMAT`` too), or None for anything this
    path does not handle."""
    options: dict[str, Any] = {}
    rest = iter(args)
    for arg in rest:
        key: str | None
        value: str | None
        if arg in _FLAGS:
            options[_FLAGS[arg]] = True
            continue
        if arg in _VALUED:
            key, value = _VALUED[arg], next(rest, None)
        elif arg.startswith("--") and "=" in arg:
            name, _, value = arg.partition("=")
            key = _VALUED.get(name)
        elif arg[:2] in ("-l", "-o"):
            key, value = _VALUED[arg[:2]], arg[2:]
        else:
            return None
        if key is None or value is None:
            return None
        if key == "label":
            options.setdefault("labels", []).append(value)
        else:
            options[key] = value
    return options


def _chunk(value: str) -> bool:
    return value.isdecimal() and 1 <= int(value) <= MAX_CHUNK_SIZE


def _fetch(
    url: str, api_key: str | None, kind: str, params: list[tuple[str, str]]
) -> list[Wire] | None:
    """Every page of ``GET /<kind>`` (sandboxes, snapshots), or None if any answer is not a
    page of them."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or "@" in parts.netloc or parts.query:
        return None
    if any(name.lower() in _PROXY_VARIABLES for name in os.environ):
        return None  # the SDK honours a proxy; this path does not
    headers = f"User-Agent: orchard-cli/{__version__}\r\n"
    if api_key:
        headers += f"X-API-Key: {api_key}\r\n"
    found: list[Wire] = []
    token: str | None = None
    try:
        while True:
            query = urlencode(params if token is None else [*params, ("continue", token)])
            page = json.loads(_get(parts, f"{parts.path.rstrip('/')}/{kind}?{query}", headers))
            if not isinstance(page, dict) or not isinstance(page.get(kind), list):
                return None
            found.extend(page[kind])
            token = page.get("continue")
            if token is None:
                return found
            if not isinstance(token, str):
                return None
    except (OSError, ValueError):
        return None


def _get(parts: SplitResult, target: str, headers: str) -> bytes:
    """The body of a 200 answer to an HTTP/1.0 GET (so the answer is never chunked, and ends
    with the connection); ValueError for any other answer."""
    import socket

    port = parts.port or (443 if parts.scheme == "https" else 80)
    with socket.create_connection((parts.hostname or "", port), timeout=_TIMEOUT) as plain:
        sock = plain
        if parts.scheme == "https":
            import ssl

            sock = ssl.create_default_context().wrap_socket(plain, server_hostname=parts.hostname)
        request = f"GET {target} HTTP/1.0\r\nHost: {parts.netloc}\r\n{headers}\r\n"
        sock.sendall(request.encode("latin-1"))
        answer = bytearray()
        while piece := sock.recv(READ_SIZE):
            answer += piece
            if len(answer) > MAX_ANSWER:
                raise ValueError("answer too large")
    head, _, body = bytes(answer).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if lines[0].split(" ")[1:2] != ["200"]:
        raise ValueError(f"answer {lines[0]!r}")
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length" and int(value) != len(body):
            raise ValueError("answer cut short")
    return body
