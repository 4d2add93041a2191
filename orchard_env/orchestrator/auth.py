"""Who is calling: the key behind a request and what it may see."""

from __future__ import annotations

from dataclasses import dataclass, field

from orchard_env.config import ServiceSettings
from orchard_env.errors import PermissionDenied
from orchard_env.orchestrator.keys import verify_key
from orchard_env.orchestrator.store import Store
from orchard_env.protocol import KeyQuota


@dataclass(frozen=True)
class Caller:
    """The authenticated caller. ``key_id`` None means authentication is off."""

    key_id: str | None
    admin: bool
    quota: KeyQuota = field(default_factory=KeyQuota)

    @property
    def owner(self) -> str | None:
        """What new sandboxes and jobs record as their owner."""
        return self.key_id

    @property
    def owner_filter(self) -> str | None:
        """The owner to restrict listings to (None: everything)."""
        return None if self.admin else self.key_id

    def can_see(self, owner: str | None) -> bool:
        return self.admin or owner == self.key_id

    def require_admin(self) -> None:
        if not self.admin:
            raise PermissionDenied(
                "this needs an admin key", hint="ask an admin, or use a key made with --admin"
            )


ANONYMOUS_ADMIN = Caller(key_id=None, admin=True)


async def authenticate(store: Store, settings: ServiceSettings, api_key: str | None) -> Caller:
    if not settings.require_api_key:
        return ANONYMOUS_ADMIN
    record = await verify_key(store, api_key)
    return Caller(key_id=record.key_id, admin=record.admin, quota=record.quota)
