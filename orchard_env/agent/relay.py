"""The orchestrator's end of an agent's parked model relay (:mod:`.daemon.model`): where the
agent listens on TCP and the sandbox cannot dial out (Kubernetes), the orchestrator opens
the connections its harnesses' model calls will come back on.

:func:`park` sends the signed ``POST /model/relay`` and accepts the connection only with
the agent's proof of the sandbox's key in its ``101``: whatever else listens at the agent's
address (an impostor in the pod, a pod that took over a dead one's IP) is
:class:`~orchard_env.errors.AgentTampered` and never gets a harness's bytes. The connection
returned then waits for :data:`~.daemon.model.PAIRED` (:func:`paired`).
"""

from __future__ import annotations

import asyncio
import contextlib

from orchard_env import errors
from orchard_env.agent import peer
from orchard_env.agent.daemon import proof
from orchard_env.agent.daemon.model import PAIRED, RELAY_PATH, RELAY_PROTOCOL

HANDSHAKE_SECONDS = 10.0


async def park(
    host: str, port: int, key: bytes, tampered: peer.Tampered, *, limit: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the agent at ``host:port`` parked for one harness connection (its
    reader's line ``limit`` bounds the agent's answer head too).

    Raises :class:`~orchard_env.errors.AgentUnavailable` when the agent cannot be reached
    or refuses (a proven error answer), and what ``tampered`` makes for an answer without
    the proof.
    """
    where = f"agent at {host}:{port}"
    try:
        async with asyncio.timeout(HANDSHAKE_SECONDS):
            reader, writer = await asyncio.open_connection(host, port, limit=limit)
    except (OSError, TimeoutError) as exc:
        raise errors.AgentUnavailable(f"{where} is unreachable: {exc!r}") from None
    try:
        await _handshake(reader, writer, key, tampered, where, limit)
    except BaseException:
        writer.close()
        raise
    return reader, writer


async def _handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    key: bytes,
    tampered: peer.Tampered,
    where: str,
    limit: int,
) -> None:
    nonce, headers = proof.sign(key, "POST", RELAY_PATH, proof.digest(b""))
    head = [
        f"POST {RELAY_PATH} HTTP/1.1",
        "Host: agent",
        f"Upgrade: {RELAY_PROTOCOL}",
        "Connection: Upgrade",
        "Content-Length: 0",
        *(f"{name}: {value}" for name, value in headers.items()),
    ]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
    try:
        async with asyncio.timeout(HANDSHAKE_SECONDS):
            raw = await reader.readuntil(b"\r\n\r\n")
            status, fields = _parse_head(raw, tampered)
            body = b""
            if status != 101:
                length = fields.get("content-length", "0")
                if not length.isdigit() or int(length) > peer.MAX_ERROR_BYTES:
                    raise tampered(f"the agent sent an error of {length[:20]!r} bytes")
                body = await reader.readexactly(int(length))
    except asyncio.LimitOverrunError:
        raise tampered(f"the agent sent a response head over {limit} bytes") from None
    except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
        raise errors.AgentUnavailable(f"{where} broke off the model relay: {exc!r}") from None
    given = fields.get(proof.PROOF_HEADER.lower(), "")
    kind = proof.UPGRADE if status == 101 else proof.digest(body)
    if status != 401 and not proof.same(given, proof.response_mac(key, nonce, status, kind)):
        raise tampered(
            "its answer to the model relay carries no valid proof of the sandbox's key: "
            "something other than the sandbox's agent answered"
        )
    if status != 101:
        raise errors.AgentUnavailable(
            f"{where} refused the model relay: HTTP {status}: {body[:200].decode(errors='replace')}"
        )


def _parse_head(raw: bytes, tampered: peer.Tampered) -> tuple[int, dict[str, str]]:
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise tampered(f"the agent sent a bad status line {lines[0][:100]!r}")
    fields: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            fields[name.strip().lower()] = value.strip()
    return int(parts[1]), fields


async def paired(reader: asyncio.StreamReader) -> bool:
    """Wait until a harness connection takes the parked connection: True then (its bytes
    follow), False when the connection ended first or broke the protocol."""
    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        return await reader.readexactly(len(PAIRED)) == PAIRED
    return False
