"""API keys: creation, listing, revocation and verification.

A key reads ``ork_<key_id>_<secret>``: ``key_id`` is 10 lowercase hex characters (the public
handle used to list and revoke it), ``secret`` is ``token_urlsafe(32)``. Only the SHA-256 of the
whole key is stored; the key itself is shown once, at creation, and never logged.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import secrets
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from orchard_env.config import ServiceSettings
from orchard_env.errors import (
    AuthenticationRequired,
    ConfigError,
    InvalidRequest,
    KeyNotFound,
    OrchardError,
    PermissionDenied,
)
from orchard_env.orchestrator.records import KeyRecord, utcnow
from orchard_env.orchestrator.store import Store, open_store
from orchard_env.protocol import (
    KeyCreated,
    KeyCreateRequest,
    KeyInfo,
    KeyQuota,
    validation_text,
)

log = logging.getLogger(__name__)

KEY_RE = re.compile(r"^ork_([0-9a-f]{10})_([A-Za-z0-9_-]{16,})$")
NO_KEYS_HINT = (
    "on the service's machine, create one with `orchard keys create admin --admin --local`"
)


def revoked_message(key_id: str | None) -> str:
    return f"the API key {key_id} was revoked"


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def _new_key() -> tuple[str, str]:
    key_id = secrets.token_hex(5)
    return key_id, f"ork_{key_id}_{secrets.token_urlsafe(32)}"


async def create_key(
    store: Store, name: str, *, admin: bool = False, quota: KeyQuota | None = None
) -> KeyCreated:
    """Make a key (``quota``: its own limits instead of the service's per-key defaults); the
    returned :class:`KeyCreated` is the only place its secret appears."""
    try:
        request = KeyCreateRequest(name=name, admin=admin)
    except ValidationError as exc:
        raise InvalidRequest(
            f"key name {name!r} is invalid: use 1-64 letters, digits, '_', '.', '@' or '-'"
        ) from exc
    for _ in range(5):
        key_id, api_key = _new_key()
        record = KeyRecord(
            key_id=key_id,
            name=request.name,
            sha256=hash_key(api_key),
            admin=request.admin,
            created_at=utcnow(),
            quota=quota or KeyQuota(),
        )
        if await store.insert_key(record):
            return KeyCreated(**record.to_info().model_dump(), api_key=api_key)
    raise OrchardError("could not allocate a unique key id after 5 attempts")


async def import_key(
    store: Store, name: str, api_key: str, *, admin: bool = False
) -> tuple[KeyInfo, bool]:
    """Store a key made elsewhere (``orchard deploy`` puts one in a Kubernetes Secret).

    Returns the key's info and whether it was added. A key already stored is left as it is, so
    a revoked key stays revoked when it is imported again.
    """
    match = KEY_RE.match(api_key)
    if match is None:
        raise InvalidRequest(
            "the key to import is not an Orchard API key (ork_<10 hex digits>_<secret>)"
        )
    try:
        request = KeyCreateRequest(name=name, admin=admin)
    except ValidationError as exc:
        raise InvalidRequest(
            f"key name {name!r} is invalid: use 1-64 letters, digits, '_', '.', '@' or '-'"
        ) from exc
    record = KeyRecord(
        key_id=match.group(1),
        name=request.name,
        sha256=hash_key(api_key),
        admin=request.admin,
        created_at=utcnow(),
    )
    if await store.insert_key(record):
        return record.to_info(), True
    existing = await store.get_key(record.key_id)
    if existing is None or not hmac.compare_digest(existing.sha256, record.sha256):
        raise InvalidRequest(
            f"cannot import the key: a different key with id {record.key_id} exists",
            hint="make a new key to import",
        )
    return existing.to_info(), False


async def import_key_file(store: Store, path: Path, name: str = "bootstrap") -> None:
    """Import the admin key in ``path`` if the file exists (the ``bootstrap_key_file`` setting)."""
    try:
        api_key = (await asyncio.to_thread(path.read_text)).strip()
    except FileNotFoundError:
        log.info("no bootstrap key file", extra={"path": str(path)})
        return
    try:
        info, added = await import_key(store, name, api_key, admin=True)
    except InvalidRequest as exc:
        raise ConfigError(f"bootstrap_key_file {path}: {exc.message}", hint=exc.hint) from exc
    log.info(
        "bootstrap key imported" if added else "bootstrap key already known",
        extra={"key_id": info.key_id, "revoked": info.revoked_at is not None},
    )


async def list_keys(store: Store) -> list[KeyInfo]:
    return [record.to_info() for record in await store.list_keys()]


async def revoke_key(store: Store, key_id: str) -> KeyInfo:
    """Revoke a key (revoking an already revoked key keeps its first revocation time)."""
    record = await store.get_key(key_id)
    if record is None:
        raise KeyNotFound(f"API key {key_id} does not exist", hint="`orchard keys list` shows them")
    if record.revoked_at is None:
        record = record.model_copy(update={"revoked_at": utcnow()})
        await store.put_key(record)
    return record.to_info()


async def verify_key(store: Store, api_key: str | None) -> KeyRecord:
    """The active key record for ``api_key``; 401/403 errors as the wire API defines them."""
    if not api_key:
        if await store.count_active_keys() == 0:
            raise AuthenticationRequired(
                "this service requires an API key and none exists yet", hint=NO_KEYS_HINT
            )
        raise AuthenticationRequired("missing API key: send it in the X-API-Key header")
    match = KEY_RE.match(api_key)
    record = await store.get_key(match.group(1)) if match else None
    if record is None or not hmac.compare_digest(record.sha256, hash_key(api_key)):
        if await store.count_active_keys() == 0:
            raise AuthenticationRequired(
                "this service requires an API key and none exists yet", hint=NO_KEYS_HINT
            )
        raise PermissionDenied("the API key is not valid", hint="check the key, or ask an admin")
    if record.revoked_at is not None:
        raise PermissionDenied(revoked_message(record.key_id), hint="ask an admin for a new key")
    return record


# --- synchronous helpers for the CLI (it owns no event loop) ------------------------------


def create_key_sync(
    settings: ServiceSettings, name: str, *, admin: bool = False, **limits: Any
) -> KeyCreated:
    """:func:`create_key` on the service's SQLite store, from synchronous code; ``limits``
    are the :class:`~orchard_env.protocol.KeyQuota` fields (None: the service's default)."""
    try:
        quota = KeyQuota(**limits)
    except ValidationError as exc:
        raise InvalidRequest(validation_text(exc)) from None

    async def run() -> KeyCreated:
        async with open_store(settings) as store:
            return await create_key(store, name, admin=admin, quota=quota)

    return asyncio.run(run())


def key_is_valid_sync(settings: ServiceSettings, api_key: str, *, admin: bool = False) -> bool:
    """Whether ``api_key`` is an active key of this service (and an admin key, if asked)."""

    async def run() -> bool:
        async with open_store(settings) as store:
            try:
                record = await verify_key(store, api_key)
            except (AuthenticationRequired, PermissionDenied):
                return False
            return record.admin or not admin

    return asyncio.run(run())
