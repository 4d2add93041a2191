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

from orchard_env import errors, http1
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
        await _handshake(reader, writer, key, tampered, where)
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
) -> None:
    nonce, headers = proof.sign(key, "POST", RELAY_PATH, proof.digest(b""))
    headers += [("Upgrade", RELAY_PROTOCOL), ("Connection", "Upgrade")]
    writer.write(http1.request_head("POST", RELAY_PATH, "agent", headers, 0))
    try:
        async with asyncio.timeout(HANDSHAKE_SECONDS):
            answer = await http1.read_head(reader, "POST")
            body = b""
            if answer.status != 101:
                if answer.length is None or answer.length > peer.MAX_ERROR_BYTES:
                    raise tampered(f"the agent sent an error of {answer.length} bytes")
                body = await reader.readexactly(answer.length)
    except http1.BadAnswer as exc:
        raise tampered(f"the agent's answer to the model relay: {exc}") from None
    except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
        raise errors.AgentUnavailable(f"{where} broke off the model relay: {exc!r}") from None
    given = answer.header(proof.PROOF_HEADER.lower()) or ""
    kind = proof.UPGRADE if answer.status == 101 else proof.digest(body)
    if answer.status != 401 and not proof.same(
        given, proof.response_mac(key, nonce, answer.status, kind)
    ):
        raise tampered(
            "its answer to the model relay carries no valid proof of the sandbox's key: "
            "something other than the sandbox's agent answered"
        )
    if answer.status != 101:
        raise errors.AgentUnavailable(
            f"{where} refused the model relay: HTTP {answer.status}: "
            f"{body[:200].decode(errors='replace')}"
        )


async def paired(reader: asyncio.StreamReader) -> bool:
    """Wait until a harness connection takes the parked connection: True then (its bytes
    follow), False when the connection ended first or broke the protocol."""
    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        return await reader.readexactly(len(PAIRED)) == PAIRED
    return False
