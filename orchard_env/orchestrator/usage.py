"""``GET /usage``: sandbox-seconds per sandbox, clipped to the asked period."""

from __future__ import annotations

from datetime import datetime, timedelta

from orchard_env.errors import InvalidRequest
from orchard_env.orchestrator.auth import Caller
from orchard_env.orchestrator.store import Store
from orchard_env.protocol import UsageRecord, UsageReport

DEFAULT_PERIOD = timedelta(days=30)


async def usage_report(
    store: Store,
    caller: Caller,
    *,
    now: datetime,
    since: datetime | None = None,
    until: datetime | None = None,
) -> UsageReport:
    """Admins see every owner's usage; other keys only their own sandboxes'."""
    until = until or now
    since = since or until - DEFAULT_PERIOD
    if since.tzinfo is None or until.tzinfo is None:
        raise InvalidRequest("since and until need a timezone, e.g. 2026-01-01T00:00:00Z")
    if since >= until:
        raise InvalidRequest(
            f"since ({since.isoformat()}) must be before until ({until.isoformat()})"
        )
    records = []
    for row in await store.list_usage(since, until, owner=caller.owner_filter):
        start = max(row.started_at, since)
        end = min(row.ended_at or now, until)
        records.append(
            UsageRecord(
                sandbox_id=row.sandbox_id,
                owner=row.owner,
                image=row.image,
                cpu=row.cpu,
                memory_bytes=row.memory_bytes,
                labels=row.labels,
                started_at=row.started_at,
                ended_at=row.ended_at,
                seconds=max((end - start).total_seconds(), 0.0),
            )
        )
    return UsageReport(since=since, until=until, records=records)
