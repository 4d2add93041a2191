"""The SQLite store: schema versioning, durability, and its idempotent inserts."""

from __future__ import annotations

import sqlite3
import stat
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from orchard_env.errors import ConfigError
from orchard_env.orchestrator.records import JobRecord, SandboxRecord, UsageRow
from orchard_env.orchestrator.store import _MIGRATIONS, LiveUsage, SQLiteStore
from orchard_env.protocol import ExecRequest, JobStatus, SandboxStatus

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def sandbox(sandbox_id: str, status: SandboxStatus = SandboxStatus.READY) -> SandboxRecord:
    return SandboxRecord(
        sandbox_id=sandbox_id,
        image="debian:12",
        cpu=1.0,
        memory_bytes=1024**3,
        status=status,
        created_at=NOW,
        ready_timeout_seconds=60,
        last_activity_at=NOW,
    )


async def test_schema_is_versioned_and_the_file_private(tmp_path: Path) -> None:
    path = tmp_path / "state" / "orchard.db"
    store = SQLiteStore(path)
    await store.open()
    await store.put_sandbox(sandbox("one"))
    await store.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    reopened = SQLiteStore(path)
    await reopened.open()  # migrations already applied: no error, data kept
    assert (await reopened.get_sandbox("one")) == sandbox("one")
    await reopened.close()
    with sqlite3.connect(path) as db:
        versions = [row[0] for row in db.execute("SELECT version FROM schema_migrations")]
        assert versions == list(range(1, len(_MIGRATIONS) + 1))
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        db.execute("INSERT INTO schema_migrations VALUES (99, 'future')")
    future = SQLiteStore(path)
    with pytest.raises(ConfigError) as raised:
        await future.open()
    assert raised.value.message == (
        f"the state database {path} has schema version 99, newer than this Orchard understands "
        f"({len(_MIGRATIONS)})"
    )


async def test_inserts_are_idempotent(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "orchard.db")
    await store.open()
    try:
        assert await store.insert_sandbox(sandbox("dup"))
        assert not await store.insert_sandbox(sandbox("dup"))
        # A deleted record's id can be taken again, and its jobs go with it.
        job = JobRecord(
            job_id="j1",
            sandbox_id="dup",
            command="true",
            request=ExecRequest(command="true"),
            created_at=NOW,
        )
        assert await store.insert_job(job) == (job, True)
        other = job.model_copy(update={"command": "false"})
        assert await store.insert_job(other) == (job, False)
        await store.put_sandbox(sandbox("dup", SandboxStatus.DELETED))
        assert await store.insert_sandbox(sandbox("dup"))
        assert await store.get_job("", "j1") is None

        row = UsageRow(
            sandbox_id="dup", owner=None, image="x", cpu=1, memory_bytes=1, started_at=NOW
        )
        await store.open_usage(row)
        await store.open_usage(row)  # one open row per sandbox
        assert len(await store.list_usage(NOW, datetime(2027, 1, 1, tzinfo=UTC))) == 1
    finally:
        await store.close()


async def test_sandbox_pages_are_positions_in_newest_first_order(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "orchard.db")
    await store.open()
    try:
        later = NOW.replace(minute=1)
        for name in ("b", "a", "c"):  # one instant: the id orders them
            await store.put_sandbox(sandbox(name))
        await store.put_sandbox(sandbox("z").model_copy(update={"created_at": later}))
        await store.put_sandbox(sandbox("gone", SandboxStatus.DELETED))

        async def ids(**options: Any) -> list[str]:
            return [r.sandbox_id for r in await store.list_sandboxes(**options)]

        assert await ids() == ["z", "a", "b", "c"]
        assert await ids(limit=2) == ["z", "a"]
        assert await ids(after=(NOW, "a"), limit=2) == ["b", "c"]
        assert await ids(after=(later, "z")) == ["a", "b", "c"]
        assert await ids(after=(NOW, "c")) == []
        assert await ids(status=SandboxStatus.DELETED) == ["gone"]
        assert await ids(include_deleted=True, after=(NOW, "b")) == ["c", "gone"]
    finally:
        await store.close()


async def test_jobs_of_a_version_1_database_get_upstreams_statuses(tmp_path: Path) -> None:
    path = tmp_path / "orchard.db"
    with sqlite3.connect(path) as db:
        db.executescript(_MIGRATIONS[0])
        db.execute("CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, applied_at TEXT)")
        db.execute("INSERT INTO schema_migrations VALUES (1, '2026-03-01T12:00:00.000000Z')")
        request = ExecRequest(command="sleep 9").model_dump_json()
        for job_id, status, timed_out in [("t", "timeout", 1), ("c", "cancelled", 0)]:
            db.execute(
                "INSERT INTO jobs (job_id, sandbox_id, status, command, request, created_at, "
                "timed_out) VALUES (?, 'sb', ?, 'sleep 9', ?, '2026-03-01T12:00:00.000000Z', ?)",
                (job_id, status, request, timed_out),
            )
    store = SQLiteStore(path)
    await store.open()
    try:
        timed, cancelled = await store.get_job("", "t"), await store.get_job("", "c")
        assert timed is not None and cancelled is not None
        assert (timed.status, timed.timed_out, timed.cancelled) == (JobStatus.FAILED, True, False)
        assert (cancelled.status, cancelled.cancelled) == (JobStatus.FAILED, True)
    finally:
        await store.close()


async def test_job_ids_of_a_version_3_database_get_the_scope_of_their_sandboxs_owner(
    tmp_path: Path,
) -> None:
    path = tmp_path / "orchard.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, applied_at TEXT)")
        for version, script in enumerate(_MIGRATIONS[:3], start=1):
            db.executescript(script)
            db.execute(
                "INSERT INTO schema_migrations VALUES (?, '2026-03-01T12:00:00.000000Z')",
                (version,),
            )
        db.execute(
            "INSERT INTO sandboxes (id, owner, status, created_at, record) "
            "VALUES ('sb', 'k-alice', 'ready', '2026-03-01T12:00:00.000000Z', '{}')"
        )
        request = ExecRequest(command="true").model_dump_json()
        for job_id, sandbox_id, owner in [("a", "sb", "k-admin"), ("b", "gone", None)]:
            db.execute(
                "INSERT INTO jobs (job_id, sandbox_id, owner, status, command, request, "
                "created_at) VALUES (?, ?, ?, 'succeeded', 'true', ?, "
                "'2026-03-01T12:00:00.000000Z')",
                (job_id, sandbox_id, owner, request),
            )
    store = SQLiteStore(path)
    await store.open()
    try:
        migrated = await store.get_job("k-alice", "a")  # the sandbox's owner, not the caller
        assert migrated is not None and migrated.owner == "k-admin"
        assert await store.get_job("", "b") is not None  # no sandbox, no owner: unscoped
        # The same id in another scope is another job; in the same scope it is the same.
        theirs = migrated.model_copy(update={"scope": "k-bob", "owner": "k-bob"})
        assert await store.insert_job(theirs) == (theirs, True)
        assert await store.insert_job(migrated.model_copy(update={"command": "x"})) == (
            migrated,
            False,
        )
        assert [job.scope for job in await store.find_jobs("a")] == ["k-alice", "k-bob"]
    finally:
        await store.close()


async def test_live_usage_counts_what_quotas_count(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "orchard.db")
    await store.open()
    rows = [
        sandbox("a1").model_copy(update={"owner": "a", "cpu": 0.5}),
        sandbox("a2", SandboxStatus.PENDING).model_copy(update={"owner": "a", "cpu": 2.0}),
        sandbox("a-gone", SandboxStatus.DELETED).model_copy(update={"owner": "a"}),
        sandbox("a-failed", SandboxStatus.FAILED).model_copy(update={"owner": "a"}),
        sandbox("pooled").model_copy(update={"owner": "a", "pool": "warm"}),
        sandbox("b1", SandboxStatus.UNSCHEDULABLE).model_copy(update={"owner": "b"}),
    ]
    for record in rows:
        await store.put_sandbox(record)
    assert await store.live_usage(None) == LiveUsage(live=4)
    assert await store.live_usage("a") == LiveUsage(4, 2, 2.5, 2 * 1024**3)
    assert await store.live_usage("c") == LiveUsage(4, 0, 0.0, 0)
    await store.close()


async def test_a_page_of_sandboxes_is_read_in_index_order_not_sorted(tmp_path: Path) -> None:
    """The cost of a page must not grow with the sandboxes held: the plan walks the listing
    index and stops at the limit, with no sort of every row."""
    store = SQLiteStore(tmp_path / "orchard.db")
    await store.open()
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)
    await store.list_sandboxes(limit=100)
    await store.list_sandboxes(limit=100, after=(NOW, "sb-1"))
    store._db.set_trace_callback(None)
    listings = [s for s in statements if s.startswith("SELECT record FROM sandboxes")]
    assert len(listings) == 2
    for statement in listings:
        plan = " | ".join(row[3] for row in store._db.execute(f"EXPLAIN QUERY PLAN {statement}"))
        assert "sandboxes_listing" in plan and "TEMP B-TREE" not in plan, plan
    await store.close()


async def test_touching_a_sandbox_changes_its_activity_and_nothing_else(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "orchard.db")
    await store.open()
    try:
        record = sandbox("busy").model_copy(
            update={"env": {"GREETING": 'héllo "quoted"\n'}, "labels": {"k": "✓"}, "cpu": 0.25}
        )
        await store.put_sandbox(record)
        await store.put_sandbox(sandbox("gone", SandboxStatus.DELETED))
        for at in (NOW.replace(minute=5, microsecond=123456), NOW.replace(minute=6)):
            assert await store.touch_sandbox("busy", at)
            assert await store.get_sandbox("busy") == record.model_copy(
                update={"last_activity_at": at}
            )
        assert not await store.touch_sandbox("gone", NOW.replace(minute=7))
        assert await store.get_sandbox("gone") == sandbox("gone", SandboxStatus.DELETED)
        assert not await store.touch_sandbox("missing", NOW)
        assert await store.get_sandbox("missing") is None
    finally:
        await store.close()
