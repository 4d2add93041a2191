"""The orchestrator's state: sandboxes, jobs, snapshots, keys and usage, behind one interface.

:class:`Store` is the contract (SQLite today; Redis when several replicas run).
:class:`SQLiteStore` keeps one connection on one dedicated thread, so every call is serialised
without a lock, and commits each change before returning: a change the API acknowledged is on
disk. The schema is versioned in a ``schema_migrations`` table and migrated on open.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from orchard_env.config import ServiceSettings
from orchard_env.errors import ConfigError
from orchard_env.orchestrator.records import (
    LIVE_STATUSES,
    JobRecord,
    KeyRecord,
    PoolRecord,
    SandboxRecord,
    SnapshotRecord,
    UsageRow,
)
from orchard_env.protocol import ExecRequest, JobStatus, KeyQuota, SandboxStatus

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

log = logging.getLogger(__name__)

DONE_JOB_STATUSES = tuple(s.value for s in JobStatus if s.done)
_LIVE = tuple(sorted(s.value for s in LIVE_STATUSES))
_DATETIME = TypeAdapter(datetime)  # a datetime as the records' JSON has it


@dataclass(frozen=True)
class LiveUsage:
    """What quotas count: the service's live sandboxes (warm pools' included) and, of one
    owner, the live sandboxes outside pools with their cores and memory."""

    live: int
    owned: int = 0
    cpu: float = 0.0
    memory_bytes: int = 0


class Store(Protocol):
    """Durable orchestrator state. Every method returns after the change is durable."""

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    # sandboxes
    async def insert_sandbox(self, record: SandboxRecord) -> bool:
        """Add a record; False if a live (not deleted) one has that id. A deleted record with
        the same id is replaced and its jobs dropped."""
        ...

    async def put_sandbox(self, record: SandboxRecord) -> None: ...

    async def touch_sandbox(self, sandbox_id: str, at: datetime) -> bool:
        """Set a live sandbox's ``last_activity_at`` and nothing else; False if it is gone or
        no longer live (nothing written)."""
        ...

    async def get_sandbox(self, sandbox_id: str) -> SandboxRecord | None: ...

    async def list_sandboxes(
        self,
        *,
        owner: str | None = None,
        include_deleted: bool = False,
        status: SandboxStatus | None = None,
        after: tuple[datetime, str] | None = None,
        limit: int | None = None,
        pooled: bool | str = False,
    ) -> list[SandboxRecord]:
        """Newest first (then by id); ``owner`` None means every owner. A page: at most
        ``limit`` records, those after the ``(created_at, id)`` position ``after``.
        ``pooled``: False leaves out the sandboxes waiting in a warm pool, True includes them,
        a pool's name gives only its."""
        ...

    async def first_pooled(self, pool: str) -> SandboxRecord | None:
        """The ready sandbox that has waited longest in ``pool``, if any."""
        ...

    async def live_usage(self, owner: str | None) -> LiveUsage:
        """Counted in the store, without reading a record: its cost does not grow with the
        number of sandboxes as reading them all would (``owner`` None: the service's alone)."""
        ...

    async def remove_sandbox(self, sandbox_id: str) -> None:
        """Forget a sandbox that never came to be: its record, jobs and open usage row."""
        ...

    async def purge_sandboxes(self, ended_before: datetime) -> int: ...

    # warm pools
    async def insert_pool(self, record: PoolRecord) -> bool:
        """Add a pool; False if one has that name."""
        ...

    async def put_pool(self, record: PoolRecord) -> None: ...

    async def get_pool(self, name: str) -> PoolRecord | None: ...

    async def list_pools(self) -> list[PoolRecord]:
        """By name."""
        ...

    async def delete_pool(self, name: str) -> None: ...

    # jobs
    async def insert_job(self, record: JobRecord) -> tuple[JobRecord, bool]:
        """Insert unless the job_id exists in the record's scope; returns the stored row and
        whether it was new."""
        ...

    async def put_job(self, record: JobRecord) -> None: ...

    async def get_job(self, scope: str, job_id: str) -> JobRecord | None: ...

    async def find_jobs(self, job_id: str) -> list[JobRecord]:
        """The jobs with this id in every scope, newest first (for admin keys)."""
        ...

    async def list_jobs(self, sandbox_id: str) -> list[JobRecord]:
        """Newest first."""
        ...

    async def unfinished_jobs(self) -> list[JobRecord]: ...

    async def purge_jobs(self, completed_before: datetime) -> int: ...

    # API keys
    async def insert_key(self, record: KeyRecord) -> bool: ...

    async def get_key(self, key_id: str) -> KeyRecord | None: ...

    async def list_keys(self) -> list[KeyRecord]: ...

    async def put_key(self, record: KeyRecord) -> None: ...

    async def count_active_keys(self) -> int: ...

    # usage
    async def open_usage(self, row: UsageRow) -> None:
        """Start a usage row for a sandbox unless one is already open."""
        ...

    async def close_usage(self, sandbox_id: str, ended_at: datetime) -> None: ...

    async def list_usage(
        self, since: datetime, until: datetime, *, owner: str | None = None
    ) -> list[UsageRow]:
        """Rows overlapping [since, until]; ``owner`` None means every owner."""
        ...

    # snapshots
    async def insert_snapshot(self, record: SnapshotRecord) -> None: ...

    async def put_snapshot(self, record: SnapshotRecord) -> None: ...

    async def get_snapshot(self, snapshot_id: str) -> SnapshotRecord | None: ...

    async def list_snapshots(
        self, *, owner: str | None = None, include_deleted: bool = False
    ) -> list[SnapshotRecord]:
        """Oldest first (parents before their children); ``owner`` None means every owner."""
        ...

    async def purge_snapshots(self, deleted_before: datetime) -> int:
        """Forget deleted snapshots whose image is gone, deleted before ``deleted_before``,
        that no other snapshot names as its parent."""
        ...

    # model calls (purged with their sandbox)
    async def insert_model_call(self, record: dict[str, Any]) -> None: ...

    async def list_model_calls(
        self,
        sandbox_id: str,
        *,
        trajectory_id: str | None = None,
        after: int = 0,
        limit: int = 1000,
    ) -> list[tuple[int, str]]:
        """(cursor, record JSON) after the cursor ``after``, oldest first."""
        ...

    async def model_call_totals(self, sandbox_id: str) -> tuple[int, int, dict[str, int]]:
        """(calls, tokens in + out, last seq per trajectory) of a sandbox."""
        ...

    async def list_trajectories(self, sandbox_id: str) -> list[dict[str, Any]]: ...


# --- SQLite --------------------------------------------------------------------------------

_MIGRATIONS: tuple[str, ...] = (
    # 1: initial schema
    """
    CREATE TABLE sandboxes (
        id TEXT PRIMARY KEY,
        owner TEXT,
        status TEXT NOT NULL,
        created_at TEXT NOT NULL,
        ended_at TEXT,
        record TEXT NOT NULL
    );
    CREATE INDEX sandboxes_owner ON sandboxes(owner);
    CREATE INDEX sandboxes_status ON sandboxes(status);
    CREATE TABLE jobs (
        job_id TEXT PRIMARY KEY,
        sandbox_id TEXT NOT NULL,
        owner TEXT,
        status TEXT NOT NULL,
        command TEXT NOT NULL,
        request TEXT NOT NULL,
        created_at TEXT NOT NULL,
        started_at TEXT,
        completed_at TEXT,
        stdout TEXT NOT NULL DEFAULT '',
        stderr TEXT NOT NULL DEFAULT '',
        exit_code INTEGER,
        timed_out INTEGER NOT NULL DEFAULT 0,
        truncated INTEGER NOT NULL DEFAULT 0,
        error TEXT
    );
    CREATE INDEX jobs_sandbox ON jobs(sandbox_id, created_at);
    CREATE INDEX jobs_status ON jobs(status);
    CREATE TABLE api_keys (
        key_id TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        sha256 TEXT NOT NULL UNIQUE,
        admin INTEGER NOT NULL,
        created_at TEXT NOT NULL,
        revoked_at TEXT
    );
    CREATE TABLE usage (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        sandbox_id TEXT NOT NULL,
        owner TEXT,
        image TEXT NOT NULL,
        cpu REAL NOT NULL,
        memory_bytes INTEGER NOT NULL,
        labels TEXT NOT NULL,
        started_at TEXT NOT NULL,
        ended_at TEXT
    );
    CREATE INDEX usage_sandbox ON usage(sandbox_id);
    CREATE INDEX usage_started ON usage(started_at);
    """,
    # 2: upstream's job statuses only: timed-out and cancelled jobs are failed, with a flag
    """
    ALTER TABLE jobs ADD COLUMN cancelled INTEGER NOT NULL DEFAULT 0;
    UPDATE jobs SET status = 'failed', cancelled = 1 WHERE status = 'cancelled';
    UPDATE jobs SET status = 'failed', timed_out = 1 WHERE status = 'timeout';
    """,
    # 3: snapshots
    """
    CREATE TABLE snapshots (
        id TEXT PRIMARY KEY,
        owner TEXT,
        parent_id TEXT,
        created_at TEXT NOT NULL,
        deleted_at TEXT,
        image_removed INTEGER NOT NULL DEFAULT 0,
        record TEXT NOT NULL
    );
    CREATE INDEX snapshots_owner ON snapshots(owner);
    CREATE INDEX snapshots_parent ON snapshots(parent_id);
    """,
    # 4: job ids unique per scope (the owner of the job's sandbox), not service-wide
    """
    CREATE TABLE jobs_scoped (
        job_id TEXT NOT NULL,
        scope TEXT NOT NULL DEFAULT '',
        sandbox_id TEXT NOT NULL,
        owner TEXT,
        status TEXT NOT NULL,
        command TEXT NOT NULL,
        request TEXT NOT NULL,
        created_at TEXT NOT NULL,
        started_at TEXT,
        completed_at TEXT,
        stdout TEXT NOT NULL DEFAULT '',
        stderr TEXT NOT NULL DEFAULT '',
        exit_code INTEGER,
        timed_out INTEGER NOT NULL DEFAULT 0,
        cancelled INTEGER NOT NULL DEFAULT 0,
        truncated INTEGER NOT NULL DEFAULT 0,
        error TEXT,
        PRIMARY KEY (scope, job_id)
    );
    INSERT INTO jobs_scoped (job_id, scope, sandbox_id, owner, status, command, request,
        created_at, started_at, completed_at, stdout, stderr, exit_code, timed_out, cancelled,
        truncated, error)
    SELECT job_id,
        COALESCE((SELECT s.owner FROM sandboxes s WHERE s.id = jobs.sandbox_id), owner, ''),
        sandbox_id, owner, status, command, request, created_at, started_at, completed_at,
        stdout, stderr, exit_code, timed_out, cancelled, truncated, error
    FROM jobs;
    DROP TABLE jobs;
    ALTER TABLE jobs_scoped RENAME TO jobs;
    CREATE INDEX jobs_sandbox ON jobs(sandbox_id, created_at);
    CREATE INDEX jobs_status ON jobs(status);
    CREATE INDEX jobs_id ON jobs(job_id);
    """,
    # 5: per-key quotas (JSON of KeyQuota)
    """
    ALTER TABLE api_keys ADD COLUMN quota TEXT NOT NULL DEFAULT '{}';
    """,
    # 6: warm pools; a pooled sandbox's row names its pool until it is claimed
    """
    CREATE TABLE pools (
        name TEXT PRIMARY KEY,
        created_at TEXT NOT NULL,
        record TEXT NOT NULL
    );
    ALTER TABLE sandboxes ADD COLUMN pool TEXT;
    CREATE INDEX sandboxes_pool ON sandboxes(pool);
    """,
    # 7: model calls through the gateway (JSON of orchard.model_call/v1 records)
    """
    CREATE TABLE model_calls (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        sandbox_id TEXT NOT NULL,
        trajectory_id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        started_at TEXT NOT NULL,
        status INTEGER,
        tokens_in INTEGER NOT NULL DEFAULT 0,
        tokens_out INTEGER NOT NULL DEFAULT 0,
        record TEXT NOT NULL
    );
    CREATE INDEX model_calls_sandbox ON model_calls(sandbox_id, id);
    CREATE INDEX model_calls_trajectory ON model_calls(sandbox_id, trajectory_id, seq);
    """,
    # 8: jobs ended by the OOM killer say so
    """
    ALTER TABLE jobs ADD COLUMN oom_killed INTEGER NOT NULL DEFAULT 0;
    """,
    # 9: sandbox listings in their order (newest first, then id) from an index, so a page
    # reads its rows and stops, however many sandboxes there are
    """
    CREATE INDEX sandboxes_listing ON sandboxes(created_at DESC, id);
    """,
)


def _ts(value: datetime) -> str:
    """A UTC timestamp that sorts as text (fixed width, microseconds always present)."""
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _opt_ts(value: datetime | None) -> str | None:
    return None if value is None else _ts(value)


def _dt(value: str) -> datetime:
    """What :func:`_ts` wrote (``fromisoformat`` reads it, ``Z`` included, in a fortieth of
    the time of ``strptime``: a job row has three)."""
    return datetime.fromisoformat(value)


def _opt_dt(value: str | None) -> datetime | None:
    return None if value is None else _dt(value)


_JOB_COLUMNS = (
    "job_id, scope, sandbox_id, owner, status, command, request, created_at, started_at, "
    "completed_at, stdout, stderr, exit_code, timed_out, cancelled, truncated, error, oom_killed"
)
_JOB_VALUES = "VALUES (" + ", ".join("?" for _ in _JOB_COLUMNS.split(",")) + ")"


def _upsert(table: str, columns: str, key: tuple[str, ...]) -> str:
    """Insert a row, or update every other column of the one with its ``key``: what ``INSERT
    OR REPLACE`` does when the key is the table's only unique constraint, without deleting
    the old row and inserting a new one into every index (half the time of a job's write)."""
    names = [name.strip() for name in columns.split(",")]
    values = ", ".join("?" for _ in names)
    updates = ", ".join(f"{name} = excluded.{name}" for name in names if name not in key)
    return (
        f"INSERT INTO {table} ({columns}) VALUES ({values}) "  # noqa: S608 (our names only)
        f"ON CONFLICT ({', '.join(key)}) DO UPDATE SET {updates}"
    )


_SANDBOX_COLUMNS = "id, owner, status, created_at, ended_at, pool, record"
_PUT_JOB = _upsert("jobs", _JOB_COLUMNS, ("scope", "job_id"))
_PUT_SANDBOX = _upsert("sandboxes", _SANDBOX_COLUMNS, ("id",))


def _job_params(r: JobRecord) -> tuple[Any, ...]:
    return (
        r.job_id,
        r.scope,
        r.sandbox_id,
        r.owner,
        r.status.value,
        r.command,
        r.request.model_dump_json(),
        _ts(r.created_at),
        _opt_ts(r.started_at),
        _opt_ts(r.completed_at),
        r.stdout,
        r.stderr,
        r.exit_code,
        int(r.timed_out),
        int(r.cancelled),
        int(r.truncated),
        r.error,
        int(r.oom_killed),
    )


def _parse(model: type[M], text: str, what: str) -> M | None:
    """A stored record, or None (logged) if it no longer reads: one unreadable row must not
    make every list of its kind fail."""
    try:
        return model.model_validate_json(text)
    except ValidationError as exc:
        log.error(f"unreadable stored {what}; leaving it out", extra={"error": str(exc)})
        return None


def _parse_all(model: type[M], rows: Iterable[sqlite3.Row], what: str) -> list[M]:
    return [parsed for row in rows if (parsed := _parse(model, row["record"], what)) is not None]


def _exec_request(text: str) -> ExecRequest:
    """A job's stored request, as it was accepted (rules tightened since do not apply)."""
    try:
        return ExecRequest.model_validate_json(text)
    except ValidationError:
        return ExecRequest.model_construct(**json.loads(text))


def _job_from_row(row: sqlite3.Row) -> JobRecord:
    return JobRecord(
        job_id=row["job_id"],
        scope=row["scope"],
        sandbox_id=row["sandbox_id"],
        owner=row["owner"],
        status=JobStatus(row["status"]),
        command=row["command"],
        request=_exec_request(row["request"]),
        created_at=_dt(row["created_at"]),
        started_at=_opt_dt(row["started_at"]),
        completed_at=_opt_dt(row["completed_at"]),
        stdout=row["stdout"],
        stderr=row["stderr"],
        exit_code=row["exit_code"],
        timed_out=bool(row["timed_out"]),
        cancelled=bool(row["cancelled"]),
        truncated=bool(row["truncated"]),
        error=row["error"],
        oom_killed=bool(row["oom_killed"]),
    )


def _key_from_row(row: sqlite3.Row) -> KeyRecord:
    return KeyRecord(
        key_id=row["key_id"],
        name=row["name"],
        sha256=row["sha256"],
        admin=bool(row["admin"]),
        created_at=_dt(row["created_at"]),
        revoked_at=_opt_dt(row["revoked_at"]),
        quota=KeyQuota.model_validate_json(row["quota"]),
    )


def _usage_from_row(row: sqlite3.Row) -> UsageRow:
    return UsageRow(
        sandbox_id=row["sandbox_id"],
        owner=row["owner"],
        image=row["image"],
        cpu=row["cpu"],
        memory_bytes=row["memory_bytes"],
        labels=json.loads(row["labels"]),
        started_at=_dt(row["started_at"]),
        ended_at=_opt_dt(row["ended_at"]),
    )


class SQLiteStore:
    """:class:`Store` on one SQLite file (WAL, ``synchronous=NORMAL``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._conn: sqlite3.Connection | None = None

    # -- plumbing --

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run one store operation on the event loop's own thread.

        On WAL with ``synchronous=NORMAL`` a commit does not wait for the disk, so a statement
        costs tens of microseconds, far less than handing it to a thread and back (which was
        a fifth of the service's CPU per exec); one thread also means two transactions never
        interleave on the connection. A crash of the process loses nothing committed.
        """
        if self._conn is None:
            raise RuntimeError("the store is not open")
        return fn(*args)

    @property
    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError("the store is not open")
        return self._conn

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    async def open(self) -> None:
        if self._conn is None:
            self._connect()

    def _connect(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.exists():
            # The database holds key hashes and agent tokens: owner-only from the start.
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600))
        try:
            conn = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=30.0
            )
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
        except sqlite3.DatabaseError as exc:
            raise ConfigError(
                f"cannot open the state database {self.path}: {exc}",
                hint="check the file and its directory (ORCHARD_STATE_DIR), or move it aside",
            ) from exc
        self._conn = conn
        self._migrate()

    def _migrate(self) -> None:
        db = self._db
        db.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations "
            "(version INTEGER PRIMARY KEY, applied_at TEXT NOT NULL)"
        )
        current = db.execute("SELECT COALESCE(MAX(version), 0) FROM schema_migrations").fetchone()[
            0
        ]
        if current > len(_MIGRATIONS):
            raise ConfigError(
                f"the state database {self.path} has schema version {current}, newer than this "
                f"Orchard understands ({len(_MIGRATIONS)})",
                hint="upgrade Orchard, or point ORCHARD_STATE_DIR elsewhere",
            )
        for version, script in enumerate(_MIGRATIONS[current:], start=current + 1):
            with self._tx() as tx:
                for statement in script.split(";"):
                    if statement.strip():
                        tx.execute(statement)
                tx.execute(
                    "INSERT INTO schema_migrations (version, applied_at) VALUES (?, ?)",
                    (version, _ts(datetime.now(UTC))),
                )

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # -- sandboxes --

    async def insert_sandbox(self, record: SandboxRecord) -> bool:
        return await self._call(self._insert_sandbox, record)

    def _insert_sandbox(self, record: SandboxRecord) -> bool:
        with self._tx() as tx:
            row = tx.execute(
                "SELECT status FROM sandboxes WHERE id = ?", (record.sandbox_id,)
            ).fetchone()
            if row is not None:
                if row["status"] != SandboxStatus.DELETED.value:
                    return False
                tx.execute("DELETE FROM jobs WHERE sandbox_id = ?", (record.sandbox_id,))
                tx.execute("DELETE FROM model_calls WHERE sandbox_id = ?", (record.sandbox_id,))
                tx.execute("DELETE FROM sandboxes WHERE id = ?", (record.sandbox_id,))
            tx.execute(
                "INSERT INTO sandboxes (id, owner, status, created_at, ended_at, pool, record) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                self._sandbox_params(record),
            )
        return True

    @staticmethod
    def _sandbox_params(r: SandboxRecord) -> tuple[Any, ...]:
        return (
            r.sandbox_id,
            r.owner,
            r.status.value,
            _ts(r.created_at),
            _opt_ts(r.ended_at),
            r.pool,
            r.model_dump_json(),
        )

    async def put_sandbox(self, record: SandboxRecord) -> None:
        await self._call(self._put_sandbox, record)

    def _put_sandbox(self, record: SandboxRecord) -> None:
        self._db.execute(_PUT_SANDBOX, self._sandbox_params(record))

    async def touch_sandbox(self, sandbox_id: str, at: datetime) -> bool:
        return await self._call(self._touch_sandbox, sandbox_id, at)

    def _touch_sandbox(self, sandbox_id: str, at: datetime) -> bool:
        # One field of the JSON record changed in place: no read, no model parsed or dumped,
        # no index rewritten (each command's end writes this).
        marks = ", ".join("?" * len(_LIVE))
        cursor = self._db.execute(
            "UPDATE sandboxes SET record = json_set(record, '$.last_activity_at', ?) "  # noqa: S608
            f"WHERE id = ? AND status IN ({marks})",
            (_DATETIME.dump_python(at, mode="json"), sandbox_id, *_LIVE),
        )
        return cursor.rowcount == 1

    async def get_sandbox(self, sandbox_id: str) -> SandboxRecord | None:
        return await self._call(self._get_sandbox, sandbox_id)

    def _get_sandbox(self, sandbox_id: str) -> SandboxRecord | None:
        row = self._db.execute(
            "SELECT record FROM sandboxes WHERE id = ?", (sandbox_id,)
        ).fetchone()
        return None if row is None else _parse(SandboxRecord, row["record"], "sandbox")

    async def list_sandboxes(
        self,
        *,
        owner: str | None = None,
        include_deleted: bool = False,
        status: SandboxStatus | None = None,
        after: tuple[datetime, str] | None = None,
        limit: int | None = None,
        pooled: bool | str = False,
    ) -> list[SandboxRecord]:
        return await self._call(
            self._list_sandboxes, owner, include_deleted, status, after, limit, pooled
        )

    def _list_sandboxes(
        self,
        owner: str | None,
        include_deleted: bool,
        status: SandboxStatus | None,
        after: tuple[datetime, str] | None,
        limit: int | None,
        pooled: bool | str,
    ) -> list[SandboxRecord]:
        clauses: list[str] = []
        params: list[object] = []
        if owner is not None:
            clauses.append("owner = ?")
            params.append(owner)
        if status is not None:
            clauses.append("status = ?")
            params.append(status.value)
        elif not include_deleted:
            clauses.append("status != ?")
            params.append(SandboxStatus.DELETED.value)
        if pooled is False:
            # Unary + keeps SQLite off the pool index (almost every row has no pool), so a
            # page walks the listing index in order and stops at ``limit``.
            clauses.append("+pool IS NULL")
        elif pooled is not True:
            clauses.append("pool = ?")
            params.append(pooled)
        if after is not None:
            clauses.append("(created_at < ? OR (created_at = ? AND id > ?))")
            params.extend((_ts(after[0]), _ts(after[0]), after[1]))
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        page = "" if limit is None else f"LIMIT {int(limit)}"
        rows = self._db.execute(
            f"SELECT record FROM sandboxes {where} ORDER BY created_at DESC, id {page}",  # noqa: S608
            params,
        ).fetchall()
        return _parse_all(SandboxRecord, rows, "sandbox")

    async def first_pooled(self, pool: str) -> SandboxRecord | None:
        return await self._call(self._first_pooled, pool)

    async def live_usage(self, owner: str | None) -> LiveUsage:
        return await self._call(self._live_usage, owner)

    def _live_usage(self, owner: str | None) -> LiveUsage:
        marks = ", ".join("?" * len(_LIVE))
        (live,) = self._db.execute(
            f"SELECT COUNT(*) FROM sandboxes WHERE status IN ({marks})",  # noqa: S608 - marks
            _LIVE,
        ).fetchone()
        if owner is None:
            return LiveUsage(live)
        owned, cpu, memory = self._db.execute(
            "SELECT COUNT(*), TOTAL(json_extract(record, '$.cpu')), "  # noqa: S608 - marks
            "TOTAL(json_extract(record, '$.memory_bytes')) FROM sandboxes "
            f"WHERE owner = ? AND pool IS NULL AND status IN ({marks})",
            (owner, *_LIVE),
        ).fetchone()
        return LiveUsage(live, owned, cpu, int(memory))

    def _first_pooled(self, pool: str) -> SandboxRecord | None:
        row = self._db.execute(
            "SELECT record FROM sandboxes WHERE pool = ? AND status = ? "
            "ORDER BY created_at, id LIMIT 1",
            (pool, SandboxStatus.READY.value),
        ).fetchone()
        return None if row is None else _parse(SandboxRecord, row["record"], "sandbox")

    async def remove_sandbox(self, sandbox_id: str) -> None:
        await self._call(self._remove_sandbox, sandbox_id)

    def _remove_sandbox(self, sandbox_id: str) -> None:
        with self._tx() as tx:
            tx.execute("DELETE FROM jobs WHERE sandbox_id = ?", (sandbox_id,))
            tx.execute("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,))
            tx.execute("DELETE FROM usage WHERE sandbox_id = ? AND ended_at IS NULL", (sandbox_id,))

    async def purge_sandboxes(self, ended_before: datetime) -> int:
        return await self._call(self._purge_sandboxes, ended_before)

    def _purge_sandboxes(self, ended_before: datetime) -> int:
        with self._tx() as tx:
            ids = [
                row["id"]
                for row in tx.execute(
                    "SELECT id FROM sandboxes WHERE ended_at IS NOT NULL AND ended_at < ? "
                    "AND status IN (?, ?)",
                    (_ts(ended_before), SandboxStatus.DELETED.value, SandboxStatus.FAILED.value),
                )
            ]
            for sandbox_id in ids:
                tx.execute("DELETE FROM jobs WHERE sandbox_id = ?", (sandbox_id,))
                tx.execute("DELETE FROM model_calls WHERE sandbox_id = ?", (sandbox_id,))
                tx.execute("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,))
        return len(ids)

    # -- warm pools --

    async def insert_pool(self, record: PoolRecord) -> bool:
        return await self._call(self._write_pool, "OR IGNORE", record)

    async def put_pool(self, record: PoolRecord) -> None:
        await self._call(self._write_pool, "OR REPLACE", record)

    def _write_pool(self, verb: str, record: PoolRecord) -> bool:
        cursor = self._db.execute(
            f"INSERT {verb} INTO pools (name, created_at, record) VALUES (?, ?, ?)",  # noqa: S608
            (record.name, _ts(record.created_at), record.model_dump_json()),
        )
        return cursor.rowcount == 1

    async def get_pool(self, name: str) -> PoolRecord | None:
        return await self._call(self._get_pool, name)

    def _get_pool(self, name: str) -> PoolRecord | None:
        row = self._db.execute("SELECT record FROM pools WHERE name = ?", (name,)).fetchone()
        return None if row is None else _parse(PoolRecord, row["record"], "pool")

    async def list_pools(self) -> list[PoolRecord]:
        return await self._call(self._list_pools)

    def _list_pools(self) -> list[PoolRecord]:
        rows = self._db.execute("SELECT record FROM pools ORDER BY name").fetchall()
        return _parse_all(PoolRecord, rows, "pool")

    async def delete_pool(self, name: str) -> None:
        await self._call(self._delete_pool, name)

    def _delete_pool(self, name: str) -> None:
        self._db.execute("DELETE FROM pools WHERE name = ?", (name,))

    # -- jobs --

    async def insert_job(self, record: JobRecord) -> tuple[JobRecord, bool]:
        return await self._call(self._insert_job, record)

    def _insert_job(self, record: JobRecord) -> tuple[JobRecord, bool]:
        with self._tx() as tx:
            cursor = tx.execute(
                f"INSERT OR IGNORE INTO jobs ({_JOB_COLUMNS}) {_JOB_VALUES}",
                _job_params(record),
            )
            if cursor.rowcount == 1:
                return record, True
            row = tx.execute(
                f"SELECT {_JOB_COLUMNS} FROM jobs WHERE scope = ? AND job_id = ?",  # noqa: S608
                (record.scope, record.job_id),
            ).fetchone()
        return _job_from_row(row), False

    async def put_job(self, record: JobRecord) -> None:
        await self._call(self._put_job, record)

    def _put_job(self, record: JobRecord) -> None:
        self._db.execute(_PUT_JOB, _job_params(record))

    async def get_job(self, scope: str, job_id: str) -> JobRecord | None:
        jobs = await self._call(self._select_jobs, "scope = ? AND job_id = ?", (scope, job_id))
        return jobs[0] if jobs else None

    async def find_jobs(self, job_id: str) -> list[JobRecord]:
        return await self._call(self._select_jobs, "job_id = ?", (job_id,))

    async def list_jobs(self, sandbox_id: str) -> list[JobRecord]:
        return await self._call(self._select_jobs, "sandbox_id = ?", (sandbox_id,))

    async def unfinished_jobs(self) -> list[JobRecord]:
        return await self._call(
            self._select_jobs,
            "status IN (?, ?)",
            (JobStatus.QUEUED.value, JobStatus.RUNNING.value),
        )

    def _select_jobs(self, where: str, params: Iterable[Any]) -> list[JobRecord]:
        rows = self._db.execute(
            f"SELECT {_JOB_COLUMNS} FROM jobs WHERE {where} "  # noqa: S608
            "ORDER BY created_at DESC, job_id, scope",
            tuple(params),
        ).fetchall()
        return [_job_from_row(row) for row in rows]

    async def purge_jobs(self, completed_before: datetime) -> int:
        return await self._call(self._purge_jobs, completed_before)

    def _purge_jobs(self, completed_before: datetime) -> int:
        placeholders = ", ".join("?" for _ in DONE_JOB_STATUSES)
        cursor = self._db.execute(
            f"DELETE FROM jobs WHERE status IN ({placeholders}) "  # noqa: S608
            "AND completed_at IS NOT NULL AND completed_at < ?",
            (*DONE_JOB_STATUSES, _ts(completed_before)),
        )
        return cursor.rowcount

    # -- keys --

    async def insert_key(self, record: KeyRecord) -> bool:
        return await self._call(self._insert_key, record)

    def _insert_key(self, record: KeyRecord) -> bool:
        cursor = self._db.execute(
            "INSERT OR IGNORE INTO api_keys "
            "(key_id, name, sha256, admin, created_at, revoked_at, quota) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                record.key_id,
                record.name,
                record.sha256,
                int(record.admin),
                _ts(record.created_at),
                _opt_ts(record.revoked_at),
                record.quota.model_dump_json(),
            ),
        )
        return cursor.rowcount == 1

    async def put_key(self, record: KeyRecord) -> None:
        await self._call(self._put_key, record)

    def _put_key(self, record: KeyRecord) -> None:
        self._db.execute(
            "UPDATE api_keys SET name = ?, admin = ?, revoked_at = ? WHERE key_id = ?",
            (record.name, int(record.admin), _opt_ts(record.revoked_at), record.key_id),
        )

    async def get_key(self, key_id: str) -> KeyRecord | None:
        return await self._call(self._get_key, key_id)

    def _get_key(self, key_id: str) -> KeyRecord | None:
        row = self._db.execute("SELECT * FROM api_keys WHERE key_id = ?", (key_id,)).fetchone()
        return None if row is None else _key_from_row(row)

    async def list_keys(self) -> list[KeyRecord]:
        return await self._call(self._list_keys)

    def _list_keys(self) -> list[KeyRecord]:
        rows = self._db.execute("SELECT * FROM api_keys ORDER BY created_at, key_id").fetchall()
        return [_key_from_row(row) for row in rows]

    async def count_active_keys(self) -> int:
        return await self._call(self._count_active_keys)

    def _count_active_keys(self) -> int:
        row = self._db.execute("SELECT COUNT(*) FROM api_keys WHERE revoked_at IS NULL").fetchone()
        return int(row[0])

    # -- usage --

    async def open_usage(self, row: UsageRow) -> None:
        await self._call(self._open_usage, row)

    def _open_usage(self, row: UsageRow) -> None:
        with self._tx() as tx:
            existing = tx.execute(
                "SELECT 1 FROM usage WHERE sandbox_id = ? AND ended_at IS NULL", (row.sandbox_id,)
            ).fetchone()
            if existing is None:
                tx.execute(
                    "INSERT INTO usage (sandbox_id, owner, image, cpu, memory_bytes, labels, "
                    "started_at, ended_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        row.sandbox_id,
                        row.owner,
                        row.image,
                        row.cpu,
                        row.memory_bytes,
                        json.dumps(row.labels, sort_keys=True),
                        _ts(row.started_at),
                        _opt_ts(row.ended_at),
                    ),
                )

    async def close_usage(self, sandbox_id: str, ended_at: datetime) -> None:
        await self._call(self._close_usage, sandbox_id, ended_at)

    def _close_usage(self, sandbox_id: str, ended_at: datetime) -> None:
        self._db.execute(
            "UPDATE usage SET ended_at = ? WHERE sandbox_id = ? AND ended_at IS NULL",
            (_ts(ended_at), sandbox_id),
        )

    async def list_usage(
        self, since: datetime, until: datetime, *, owner: str | None = None
    ) -> list[UsageRow]:
        return await self._call(self._list_usage, since, until, owner)

    def _list_usage(self, since: datetime, until: datetime, owner: str | None) -> list[UsageRow]:
        sql = "SELECT * FROM usage WHERE started_at < ? AND (ended_at IS NULL OR ended_at > ?)"
        params: list[Any] = [_ts(until), _ts(since)]
        if owner is not None:
            sql += " AND owner = ?"
            params.append(owner)
        rows = self._db.execute(sql + " ORDER BY started_at, id", params).fetchall()
        return [_usage_from_row(row) for row in rows]

    # -- snapshots --

    @staticmethod
    def _snapshot_params(r: SnapshotRecord) -> tuple[Any, ...]:
        return (
            r.snapshot_id,
            r.owner,
            r.parent_snapshot,
            _ts(r.created_at),
            _opt_ts(r.deleted_at),
            int(r.image_removed_at is not None),
            r.model_dump_json(),
        )

    _SNAPSHOT_UPSERT = (
        "INSERT {} INTO snapshots "
        "(id, owner, parent_id, created_at, deleted_at, image_removed, record) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)"
    )

    async def insert_snapshot(self, record: SnapshotRecord) -> None:
        await self._call(self._write_snapshot, "", record)

    async def put_snapshot(self, record: SnapshotRecord) -> None:
        await self._call(self._write_snapshot, "OR REPLACE", record)

    def _write_snapshot(self, verb: str, record: SnapshotRecord) -> None:
        self._db.execute(self._SNAPSHOT_UPSERT.format(verb), self._snapshot_params(record))

    async def get_snapshot(self, snapshot_id: str) -> SnapshotRecord | None:
        return await self._call(self._get_snapshot, snapshot_id)

    def _get_snapshot(self, snapshot_id: str) -> SnapshotRecord | None:
        row = self._db.execute(
            "SELECT record FROM snapshots WHERE id = ?", (snapshot_id,)
        ).fetchone()
        return None if row is None else _parse(SnapshotRecord, row["record"], "snapshot")

    async def list_snapshots(
        self, *, owner: str | None = None, include_deleted: bool = False
    ) -> list[SnapshotRecord]:
        return await self._call(self._list_snapshots, owner, include_deleted)

    def _list_snapshots(self, owner: str | None, include_deleted: bool) -> list[SnapshotRecord]:
        clauses, params = [], []
        if owner is not None:
            clauses.append("owner = ?")
            params.append(owner)
        if not include_deleted:
            clauses.append("deleted_at IS NULL")
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        rows = self._db.execute(
            f"SELECT record FROM snapshots {where} ORDER BY created_at, id",  # noqa: S608
            params,
        ).fetchall()
        return _parse_all(SnapshotRecord, rows, "snapshot")

    async def purge_snapshots(self, deleted_before: datetime) -> int:
        return await self._call(self._purge_snapshots, deleted_before)

    def _purge_snapshots(self, deleted_before: datetime) -> int:
        cursor = self._db.execute(
            "DELETE FROM snapshots WHERE image_removed = 1 AND deleted_at IS NOT NULL "
            "AND deleted_at < ? AND id NOT IN "
            "(SELECT parent_id FROM snapshots WHERE parent_id IS NOT NULL)",
            (_ts(deleted_before),),
        )
        return cursor.rowcount

    # -- model calls --

    async def insert_model_call(self, record: dict[str, Any]) -> None:
        await self._call(self._insert_model_call, record)

    def _insert_model_call(self, record: dict[str, Any]) -> None:
        usage = record.get("usage") or {}
        self._db.execute(
            "INSERT INTO model_calls (sandbox_id, trajectory_id, seq, started_at, status, "
            "tokens_in, tokens_out, record) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                record["sandbox_id"],
                record["trajectory_id"],
                record["seq"],
                record["started_at"],
                record.get("status"),
                int(usage.get("input_tokens") or 0),
                int(usage.get("output_tokens") or 0),
                json.dumps(record),
            ),
        )

    async def list_model_calls(
        self,
        sandbox_id: str,
        *,
        trajectory_id: str | None = None,
        after: int = 0,
        limit: int = 1000,
    ) -> list[tuple[int, str]]:
        return await self._call(self._list_model_calls, sandbox_id, trajectory_id, after, limit)

    def _list_model_calls(
        self, sandbox_id: str, trajectory_id: str | None, after: int, limit: int
    ) -> list[tuple[int, str]]:
        where, params = "sandbox_id = ? AND id > ?", [sandbox_id, after]
        if trajectory_id is not None:
            where += " AND trajectory_id = ?"
            params.append(trajectory_id)
        rows = self._db.execute(
            f"SELECT id, record FROM model_calls WHERE {where} ORDER BY id LIMIT ?",  # noqa: S608
            [*params, limit],
        ).fetchall()
        return [(row["id"], row["record"]) for row in rows]

    async def model_call_totals(self, sandbox_id: str) -> tuple[int, int, dict[str, int]]:
        return await self._call(self._model_call_totals, sandbox_id)

    def _model_call_totals(self, sandbox_id: str) -> tuple[int, int, dict[str, int]]:
        rows = self._db.execute(
            "SELECT trajectory_id, MAX(seq) AS seq, COUNT(*) AS n, "
            "SUM(tokens_in + tokens_out) AS tokens FROM model_calls WHERE sandbox_id = ? "
            "GROUP BY trajectory_id",
            (sandbox_id,),
        ).fetchall()
        calls = sum(row["n"] for row in rows)
        tokens = sum(row["tokens"] or 0 for row in rows)
        return calls, tokens, {row["trajectory_id"]: row["seq"] for row in rows}

    async def list_trajectories(self, sandbox_id: str) -> list[dict[str, Any]]:
        return await self._call(self._list_trajectories, sandbox_id)

    def _list_trajectories(self, sandbox_id: str) -> list[dict[str, Any]]:
        rows = self._db.execute(
            "SELECT trajectory_id, COUNT(*) AS calls, MIN(started_at) AS first_at, "
            "MAX(started_at) AS last_at, SUM(tokens_in) AS input_tokens, "
            "SUM(tokens_out) AS output_tokens, "
            "SUM(CASE WHEN status IS NULL OR status >= 400 THEN 1 ELSE 0 END) AS errors "
            "FROM model_calls WHERE sandbox_id = ? GROUP BY trajectory_id ORDER BY MIN(id)",
            (sandbox_id,),
        ).fetchall()
        return [dict(row) for row in rows]


@asynccontextmanager
async def open_store(settings: ServiceSettings) -> AsyncIterator[SQLiteStore]:
    """The service's SQLite store (``<state_dir>/orchard.db``), opened and closed around a block.

    For tools that work on the state while the service is stopped or running (the CLI's
    bootstrap of the first admin key): SQLite in WAL mode lets both write safely.
    """
    store = SQLiteStore(settings.db_path)
    await store.open()
    try:
        yield store
    finally:
        await store.close()
