"""Mutual authentication of the orchestrator and a sandbox's agent (standard library only:
the agent imports it too).

Both hold the sandbox's key, which the orchestrator hands the agent once, in ``POST
/enroll``, before any command can run in the sandbox (see :mod:`orchard_env.agent`); the key
is never on the wire again, in the environment, or in a file. Then:

* every request carries a fresh nonce and ``Authorization: Orchard-HMAC <mac>`` over the
  nonce, method, target and the body's SHA-256 (``-`` for a streamed upload), so the agent
  acts only on the orchestrator's requests and an impostor learns nothing it can reuse;
* every answer to such a request carries ``X-Orchard-Proof``, a MAC over the same nonce,
  the status and the body's SHA-256 (``stream`` for a job stream, ``raw`` for a download,
  ``upgrade`` for a WebSocket); a job stream ends with a ``{"t": "p", "mac"}`` line over the
  SHA-256 of every byte before it. An answer without a valid proof did not come from the
  agent: the orchestrator fails the sandbox.
"""

from __future__ import annotations

import hashlib
import hmac
import os

NONCE_HEADER = "X-Orchard-Nonce"
BODY_HEADER = "X-Orchard-Body-Sha256"
PROOF_HEADER = "X-Orchard-Proof"
SCHEME = "Orchard-HMAC"
UNSIGNED_BODY = "-"  # a streamed upload: its bytes are not covered
STREAM = "stream"
RAW = "raw"
UPGRADE = "upgrade"


def digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _mac(key: bytes, *parts: str) -> str:
    return hmac.new(key, "\n".join(parts).encode(), hashlib.sha256).hexdigest()


def request_mac(key: bytes, nonce: str, method: str, target: str, body: str) -> str:
    return _mac(key, "orchard-request", nonce, method, target, body)


def sign(key: bytes, method: str, target: str, body: str) -> tuple[str, list[tuple[str, str]]]:
    """(nonce, headers) authenticating one request to the agent: a fresh nonce and the MAC
    over it, ``method``, ``target`` and ``body`` (the body's digest, or a proof kind)."""
    nonce = os.urandom(16).hex()  # as secrets.token_hex, without importing random here
    mac = request_mac(key, nonce, method, target, body)
    return nonce, [(NONCE_HEADER, nonce), (BODY_HEADER, body), ("Authorization", f"{SCHEME} {mac}")]


def response_mac(key: bytes, nonce: str, status: int, body: str) -> str:
    return _mac(key, "orchard-response", nonce, str(status), body)


def stream_mac(key: bytes, nonce: str, stream_digest: str) -> str:
    return _mac(key, "orchard-stream", nonce, stream_digest)


def same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())
