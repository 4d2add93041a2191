"""The agent's table of finished jobs, in-process: what it keeps, and what it frees when it
lets a job or its output go (memory back to the budget, spool files closed)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from orchard_env.agent.daemon import jobs, spool
from orchard_env.agent.daemon.jobs import Job, JobTable
from orchard_env.agent.daemon.loop import Loop
from orchard_env.agent.daemon.procs import Processes


@pytest.fixture
def table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> JobTable:
    monkeypatch.setenv(spool.SPOOL_ENV, str(tmp_path))
    return JobTable(Processes(Loop()))


def finish(table: JobTable, job_id: str, output: bytes) -> Job:
    """A job that printed ``output`` and exited 0."""
    job = table.add(job_id, "fingerprint", jobs.DEFAULT_MAX_OUTPUT)
    job._output(0, output)
    job._finish(time.monotonic(), exit_code=0)
    return job


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_past_the_count_the_oldest_jobs_go_and_their_memory_returns(
    table: JobTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jobs, "JOB_KEEP_COUNT", 3)
    finished = [finish(table, f"job-{i}", b"x" * 1000) for i in range(7)]
    assert list(table.jobs) == ["job-4", "job-5", "job-6"]
    kept = finished[4:]
    assert table.memory.used == sum(job.log.size for job in kept) > 0
    assert all(job.log.size == 0 and b'"truncated":true' in job.final for job in finished[:4])  # type: ignore[operator]


def test_past_the_age_finished_jobs_go(table: JobTable) -> None:
    old = finish(table, "old", b"out")
    old.finished_at -= jobs.JOB_KEEP_SECONDS + 1
    last = finish(table, "new", b"out")
    assert list(table.jobs) == ["new"]
    assert table.memory.used == last.log.size


def test_past_the_spool_count_the_oldest_outputs_are_dropped_and_their_files_closed(
    table: JobTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jobs, "SPOOLED_KEEP_COUNT", 2)
    big = b"y" * (spool.JOB_MEMORY + 1)  # past a job's memory: its log spills to a file
    finished = [finish(table, f"job-{i}", big) for i in range(5)]
    fds = [job.log.fd for job in finished]
    assert fds[3] is not None and fds[4] is not None and fds[:3] == [None] * 3
    assert list(table.jobs) == [f"job-{i}" for i in range(5)]  # the records stay
    assert [b'"truncated":true' in job.final for job in finished] == [True] * 3 + [False] * 2  # type: ignore[operator]


def test_a_job_that_goes_closes_its_spool_file(
    table: JobTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jobs, "JOB_KEEP_COUNT", 1)
    first = finish(table, "first", b"z" * (spool.JOB_MEMORY + 1))
    fd = first.log.fd
    assert fd is not None and is_open(fd)
    finish(table, "second", b"out")
    assert list(table.jobs) == ["second"]
    assert first.log.fd is None and not is_open(fd)


def test_past_the_byte_budget_the_oldest_outputs_are_dropped(
    table: JobTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jobs, "JOB_BUFFER_BUDGET", 2500)
    finished = [finish(table, f"job-{i}", b"w" * 900) for i in range(4)]
    sizes = [job.log.size for job in finished]
    assert sizes[:2] == [0, 0] and all(size > 900 for size in sizes[2:])
    assert table.held_bytes == sum(sizes) <= 2500
