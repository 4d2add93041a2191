"""Jobs: commands run in sandboxes through their agents, idempotent by job id.

A submission inserts the job row first (``INSERT OR IGNORE``): a job id that is already known
returns the existing job and runs nothing. Ids are unique per scope, the key that owns the
sandbox: another key's job ``x`` is neither a conflict for this key's ``x`` nor visible. The
command is sent to the agent with its job id, so a lost connection, or an orchestrator restart,
re-attaches to the same run (the agent replays its output from the start) instead of running
it again.

Each running job has an in-memory :class:`JobRun` (live output, a done event, followers for
streamed output); the store holds the durable state: queued, then running, then the final
row with its output, written before anyone is told the job finished.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from typing import Any, Literal

from orchard_env.agent.client import AgentClient, Exit, Output
from orchard_env.config import ServiceSettings
from orchard_env.errors import AgentUnavailable, Conflict, JobNotFound, OrchardError
from orchard_env.orchestrator.agents import AgentPool
from orchard_env.orchestrator.auth import Caller
from orchard_env.orchestrator.health import AgentHealth
from orchard_env.orchestrator.records import JobRecord, SandboxRecord
from orchard_env.orchestrator.revocation import KeySessions
from orchard_env.orchestrator.sandboxes import SandboxService, command_oom_reason
from orchard_env.orchestrator.store import Store
from orchard_env.protocol import ExecEvent, ExecRequest, Job, JobStatus, SandboxStatus

log = logging.getLogger(__name__)

Stream = Literal["stdout", "stderr"]
STREAMS: tuple[Stream, Stream] = ("stdout", "stderr")
MAX_RUNNING_JOBS = 1024
"""Commands in flight at once across all sandboxes; more wait in ``queued``."""
RECONNECT_SECONDS = 30.0
"""How long a job keeps trying to re-attach to its agent after a broken connection."""
WAIT_GRACE_SECONDS = 30
"""``exec wait=true`` waits for the command's timeout plus this, then returns it running."""
CANCEL_WAIT_SECONDS = 10.0
TIMEOUT_EXIT_CODE = 124
"""The exit code of a command killed at its timeout, as GNU ``timeout`` and upstream report."""
RESTART_LOST = "orchestrator restarted and the agent no longer has this job"


async def skip_seen(
    events: AsyncIterator[Output | Exit], seen: dict[Stream, int]
) -> AsyncIterator[Output | Exit]:
    """A job stream the agent replays from the start, without the first ``seen`` bytes of
    each output stream (delivered before the link broke)."""
    offsets = dict.fromkeys(STREAMS, 0)
    async for event in events:
        if isinstance(event, Output):
            start = seen[event.stream] - offsets[event.stream]
            offsets[event.stream] += len(event.data)
            if start >= len(event.data):
                continue
            if start > 0:
                event = Output(event.stream, event.data[start:])
        yield event


def cut_marker(dropped: int) -> str:
    """The line that stands in a capped stream where its middle was dropped."""
    return f"\n[... {dropped} bytes truncated ...]\n"


def whole_characters(tail: bytes) -> int:
    """How many leading bytes of a tail cut out of UTF-8 text belong to a character whose
    start was dropped (at most 3 continuation bytes)."""
    skip = 0
    while skip < min(3, len(tail)) and 0x80 <= tail[skip] < 0xC0:
        skip += 1
    return skip


class JobRun:
    """The live state of one job in this process.

    Each stream keeps its head (the first half of the cap) as it arrives, for live readers,
    and its tail (the last half) in a bounded buffer; what fell between is dropped and, at
    the end, marked by :func:`cut_marker` between the two: the end of a log is what graders
    read. The agent cuts the same way (and says how much it dropped); this bounds what a
    misbehaving agent can make the orchestrator hold.
    """

    def __init__(self, record: JobRecord, max_output_bytes: int) -> None:
        self.record = record
        self.max_output_bytes = max_output_bytes
        self.tail_cap = max_output_bytes // 2
        self.head_cap = max_output_bytes - self.tail_cap
        self.parts: dict[Stream, list[str]] = {stream: [] for stream in STREAMS}
        self.chunks: list[tuple[Stream, str]] = []  # (stream, text) in arrival order
        self.received = dict.fromkeys(STREAMS, 0)  # bytes from the agent, per stream
        self.kept = dict.fromkeys(STREAMS, 0)  # bytes of the head, per stream
        self.tails = {stream: bytearray() for stream in STREAMS}
        self.dropped = dict.fromkeys(STREAMS, 0)  # bytes dropped between head and tail
        self.truncated = False
        self.flushed = False
        self.acknowledged = False  # the agent is known to have the job (it sent an event)
        self.done = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self._decoders = {
            stream: codecs.getincrementaldecoder("utf-8")(errors="replace") for stream in STREAMS
        }
        self._changed = asyncio.Event()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _text(self, stream: Stream, text: str) -> None:
        if text:
            self.parts[stream].append(text)
            self.chunks.append((stream, text))
            self._wake()

    def add(self, stream: Stream, data: bytes) -> None:
        """Append output from the agent: the head as text at once (decoded incrementally),
        the rest into the bounded tail."""
        self.received[stream] += len(data)
        room = max(self.head_cap - self.kept[stream], 0)
        head, rest = data[:room], data[room:]
        if head:
            self.kept[stream] += len(head)
            self._text(stream, self._decoders[stream].decode(head))
        if rest:
            tail = self.tails[stream]
            tail += rest
            excess = len(tail) - self.tail_cap
            if excess > 0:
                del tail[:excess]
                self.dropped[stream] += excess
                self.truncated = True

    def flush(self, agent_dropped: dict[Stream, int] | None = None) -> None:
        """End the streams: the tail after the head, with the cut marked between them when
        anything was dropped (here, or by the agent: ``agent_dropped``). Once only."""
        if self.flushed:
            return
        self.flushed = True
        for stream in STREAMS:
            tail = bytes(self.tails[stream])
            dropped = self.dropped[stream] + (agent_dropped or {}).get(stream, 0)
            decoder = self._decoders[stream]
            if dropped:
                # Neither side of the cut keeps part of a character: the head's unfinished
                # one and the tail's leading continuation bytes count as dropped.
                pending = len(decoder.getstate()[0])
                decoder.reset()
                skip = whole_characters(tail)
                text = cut_marker(dropped + pending + skip)
                text += tail[skip:].decode("utf-8", errors="replace")
                self.truncated = True
            else:
                text = decoder.decode(tail, final=True)
            self._text(stream, text)

    def note(self, stream: Stream, line: str) -> None:
        """Append a line of Orchard's own to a stream (outside the cap), on a line of its own."""
        parts = self.parts[stream]
        text = ("\n" if parts and not parts[-1].endswith("\n") else "") + line + "\n"
        self.parts[stream].append(text)
        self.chunks.append((stream, text))
        self._wake()

    def snapshot(self) -> JobRecord:
        if self.done.is_set():
            return self.record
        return self.record.model_copy(
            update={stream: "".join(self.parts[stream]) for stream in STREAMS}
            | {"truncated": self.truncated}
        )

    def finish(self, record: JobRecord) -> None:
        self.record = record
        self.done.set()
        self._wake()

    async def follow(self) -> AsyncIterator[tuple[Stream, str]]:
        """Every output chunk from the start, then live ones until the job is done."""
        index = 0
        while True:
            changed = self._changed
            while index < len(self.chunks):
                yield self.chunks[index]
                index += 1
            if self.done.is_set():
                return
            await changed.wait()


class JobService:
    def __init__(
        self,
        settings: ServiceSettings,
        store: Store,
        sandboxes: SandboxService,
        agents: AgentPool,
        health: AgentHealth,
        sessions: KeySessions,
        clock: Callable[[], datetime],
        *,
        max_running: int = MAX_RUNNING_JOBS,
    ) -> None:
        self.settings = settings
        self.store = store
        self.sandboxes = sandboxes
        self.agents = agents
        self.health = health
        self.sessions = sessions
        self.clock = clock
        self._runs: dict[tuple[str, str], JobRun] = {}  # (scope, job id) -> run
        self.slots = asyncio.Semaphore(max_running)  # commands in flight; the rest queue

    # --- lookups ---------------------------------------------------------------------------

    def _run_of(self, record: JobRecord) -> JobRun | None:
        return self._runs.get((record.scope, record.job_id))

    def _current(self, record: JobRecord) -> JobRecord:
        run = self._run_of(record)
        return run.snapshot() if run is not None else record

    async def _record(self, job_id: str, caller: Caller) -> JobRecord:
        """The caller's job ``job_id`` (its own scope first; an admin key's, any scope)."""
        record = await self.store.get_job(caller.owner or "", job_id)
        if record is None and caller.admin:
            found = await self.store.find_jobs(job_id)
            record = found[0] if found else None
        if record is None or not caller.can_see(record.owner):
            raise JobNotFound(f"job {job_id} does not exist", hint="job ids are kept for a day")
        return self._current(record)

    async def get(self, job_id: str, caller: Caller) -> Job:
        return (await self._record(job_id, caller)).to_job()

    async def list(self, sandbox_id: str, caller: Caller) -> list[Job]:
        await self.sandboxes.get_record(sandbox_id, caller)
        jobs = []
        for record in await self.store.list_jobs(sandbox_id):
            if caller.can_see(record.owner):  # the same jobs GET /jobs/{id} shows it
                jobs.append(self._current(record).to_job())
        return jobs

    # --- submit ----------------------------------------------------------------------------

    def _max_output(self, request: ExecRequest) -> int:
        cap = self.settings.max_output_bytes
        return cap if request.max_output_bytes is None else min(request.max_output_bytes, cap)

    async def submit(self, sandbox_id: str, request: ExecRequest, caller: Caller) -> JobRecord:
        """Start a job, or return the existing one for a known ``job_id``."""
        sandbox = await self.sandboxes.get_record(sandbox_id, caller)
        scope = sandbox.owner or ""
        if sandbox.status != SandboxStatus.READY:  # else no second read: the job's task checks
            # A retried submission gets its job back whatever the sandbox's state now (on a
            # ready sandbox, the insert below finds it: no read first).
            if request.job_id is not None:
                existing = await self.store.get_job(scope, request.job_id)
                if existing is not None:
                    return self._existing(existing, sandbox_id, caller, request)
            sandbox = await self.sandboxes.require_ready(sandbox_id, caller)
        record = JobRecord(
            job_id=request.job_id or uuid.uuid4().hex,
            sandbox_id=sandbox_id,
            owner=caller.owner,
            scope=scope,
            command=request.text,
            request=request.model_copy(update={"wait": False}),
            created_at=self.clock(),
        )
        stored, created = await self.store.insert_job(record)
        if not created:
            return self._existing(stored, sandbox_id, caller, request)
        self._start(stored, attach=False)
        await self.sandboxes.touch(sandbox.sandbox_id)
        log.debug("job submitted", extra={"job_id": stored.job_id, "sandbox_id": sandbox_id})
        return stored

    def _existing(
        self, record: JobRecord, sandbox_id: str, caller: Caller, request: ExecRequest
    ) -> JobRecord:
        """The job a retried submission names; a job id reused for something else is a 409."""
        if record.sandbox_id != sandbox_id or not caller.can_see(record.owner):
            raise Conflict(
                f"job id {record.job_id} is already used by another sandbox's job",
                hint="job ids must be unique: leave job_id out to get a fresh one",
            )
        if record.request.argv != request.argv or record.command != request.text:
            raise Conflict(
                f"job id {record.job_id} already ran another command: {record.command!r}",
                hint="a retry must resend the same command; use a new job_id for a new one",
            )
        return self._current(record)

    async def exec(self, sandbox_id: str, request: ExecRequest, caller: Caller) -> Job:
        """Submit (or find) a job; with ``wait``, the job once its command has ended. Only
        the wait ends when the caller's key is revoked meanwhile (the command runs on)."""
        record = await self.submit(sandbox_id, request, caller)
        if request.wait:
            timeout = record.request.timeout_seconds + WAIT_GRACE_SECONDS
            waiting = self._wait_for(record, caller, timeout)
            return (await self.sessions.unless_revoked(caller, waiting)).to_job()
        return record.to_job()

    async def stream(
        self, sandbox_id: str, request: ExecRequest, caller: Caller
    ) -> AsyncIterator[ExecEvent]:
        """Submit (or find) a job, then its events: started, output chunks, exit."""
        record = await self.submit(sandbox_id, request, caller)
        return self._events(record, caller)

    async def _events(self, record: JobRecord, caller: Caller) -> AsyncIterator[ExecEvent]:
        job_id = record.job_id
        yield ExecEvent(event="started", job_id=job_id)
        run = self._run_of(record)
        if run is not None:
            async for stream, text in run.follow():
                yield ExecEvent(event=stream, job_id=job_id, data=text)
            final = run.record
        else:
            final = await self._wait_for(record, caller, None)
            for stream in STREAMS:
                text = getattr(final, stream)
                if text:
                    yield ExecEvent(event=stream, job_id=job_id, data=text)
        yield ExecEvent(event="exit", job_id=job_id, job=final.to_job())

    # --- waiting and cancelling -----------------------------------------------------------

    async def _wait_for(
        self, record: JobRecord, caller: Caller, seconds: float | None
    ) -> JobRecord:
        """The job once done, or as it is after ``seconds`` (None: no limit). ``record`` is
        one the caller may see; a job running here is followed in memory, others in the
        store."""
        loop = asyncio.get_running_loop()
        deadline = None if seconds is None else loop.time() + seconds
        while True:
            run = self._run_of(record)
            if run is not None:
                record = run.snapshot()
            else:
                stored = await self.store.get_job(record.scope, record.job_id)
                if stored is None or not caller.can_see(stored.owner):
                    raise JobNotFound(f"job {record.job_id} does not exist")
                record = stored
            remaining = None if deadline is None else deadline - loop.time()
            if record.status.done or (remaining is not None and remaining <= 0):
                return record
            step = 0.25 if run is None else 5.0  # poll the store when no run is in memory
            step = step if remaining is None else min(step, remaining)
            if run is None:
                await asyncio.sleep(step)
            else:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(step):
                        await run.done.wait()
                if run.done.is_set():
                    return run.record  # final, and in the store before done was set

    async def wait(self, job_id: str, caller: Caller, seconds: float) -> Job:
        """The job once finished, or as it is when ``seconds`` run out (never an error)."""
        record = await self._record(job_id, caller)
        waiting = self._wait_for(record, caller, seconds)
        return (await self.sessions.unless_revoked(caller, waiting)).to_job()

    async def cancel(self, job_id: str, caller: Caller) -> Job:
        """Kill a running command's process tree (``failed`` with ``cancelled``); a finished
        job is returned as it is."""
        record = await self._record(job_id, caller)
        run = self._run_of(record)
        if record.status.done or run is None:
            return record.to_job()
        if record.status == JobStatus.QUEUED and run.task is not None:
            # Not sent to the agent yet (waiting for a slot or for the sandbox): just stop it.
            run.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run.task
            self._runs.pop((record.scope, job_id), None)
            final = await self._finalize(
                run, JobStatus.FAILED, error="cancelled before it ran", cancelled=True
            )
            return final.to_job()
        sandbox = await self.store.get_sandbox(record.sandbox_id)
        if sandbox is not None and sandbox.status == SandboxStatus.READY:
            with contextlib.suppress(JobNotFound):
                await self.agents.client(sandbox).cancel(job_id)
        return (await self._wait_for(record, caller, CANCEL_WAIT_SECONDS)).to_job()

    # --- running -------------------------------------------------------------------------------

    def _start(self, record: JobRecord, *, attach: bool) -> JobRun:
        run = JobRun(record, self._max_output(record.request))
        self._runs[record.scope, record.job_id] = run
        # Busy from the moment it is accepted (queued included), not only once its task runs.
        self.sandboxes.hold(record.sandbox_id)
        run.task = asyncio.create_task(self._run(run, attach), name=f"job-{record.job_id}")
        return run

    async def resume(self) -> None:
        """After a restart: re-attach to jobs left running, send those left queued.

        A job's row says ``running`` only once its agent answered, so ``queued`` covers "maybe
        never sent": sending it again is safe, as the agent runs a job id at most once.
        """
        for record in await self.store.unfinished_jobs():
            if (record.scope, record.job_id) not in self._runs:
                log.info(
                    "resuming job",
                    extra={"job_id": record.job_id, "status": record.status.value},
                )
                self._start(record, attach=record.status == JobStatus.RUNNING)

    async def _run(self, run: JobRun, attach: bool) -> None:
        key = (run.record.scope, run.record.job_id)
        try:
            async with self.slots:
                sandbox = await self._sandbox_for(run)
                if sandbox is None:
                    return
                if not attach:
                    # Running from now on for readers; the row says so only once the agent
                    # has answered (see _consume), so a restart before that re-sends it.
                    run.record = run.record.model_copy(
                        update={"status": JobStatus.RUNNING, "started_at": self.clock()}
                    )
                run.acknowledged = attach
                final = await self._drive(run, sandbox, attach)
            if final is not None:
                await self._finish_from_exit(run, final, sandbox.memory_bytes)
        except asyncio.CancelledError:
            raise  # shutdown: the row stays as it is and the next process picks it up
        except Exception as exc:
            log.exception("job failed in the orchestrator", extra={"job_id": key[1]})
            await self._finalize(run, JobStatus.FAILED, error=f"orchestrator error: {exc}")
        finally:
            if self._runs.get(key) is run and run.done.is_set():
                del self._runs[key]
            await self.sandboxes.release(run.record.sandbox_id)

    async def _sandbox_for(self, run: JobRun) -> SandboxRecord | None:
        """The job's sandbox if it can run commands; otherwise the job is failed (None)."""
        sandbox = await self.store.get_sandbox(run.record.sandbox_id)
        if sandbox is not None and sandbox.status in (
            SandboxStatus.PENDING,
            SandboxStatus.UNSCHEDULABLE,
        ):
            with contextlib.suppress(OrchardError):
                sandbox = await self.sandboxes.require_ready(
                    sandbox.sandbox_id, _SYSTEM, wait=sandbox.ready_timeout_seconds
                )
        if sandbox is not None and sandbox.status == SandboxStatus.READY:
            return sandbox
        state = "gone" if sandbox is None else sandbox.status.value
        why = (
            f" ({sandbox.status_message})" if sandbox is not None and sandbox.status_message else ""
        )
        await self._finalize(
            run, JobStatus.FAILED, error=f"sandbox {run.record.sandbox_id} is {state}{why}"
        )
        return None

    def _open(
        self, client: AgentClient, run: JobRun, *, attach: bool
    ) -> AsyncIterator[Output | Exit]:
        if attach:
            return client.attach(run.record.job_id, max_output_bytes=run.max_output_bytes)
        request = run.record.request
        return client.exec(
            run.record.job_id,
            request.agent_command,
            cwd=request.cwd,  # None: the agent's workdir, which is the sandbox's
            env=request.env,  # on top of the sandbox's own environment
            timeout=request.timeout_seconds,
            login_shell=request.login_shell,
            stdin=None if request.stdin is None else request.stdin.encode(),
            max_output_bytes=run.max_output_bytes,
        )

    async def _drive(self, run: JobRun, sandbox: SandboxRecord, attach: bool) -> Exit | None:
        """Run the command (or re-attach to it) until its exit, riding out broken links.

        Sending the same job id again re-attaches (the agent keeps jobs by id and replays
        their output; bytes already seen are skipped). A job resumed after a restart only
        ever attaches: if the agent forgot it, it fails rather than running twice.
        """
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        while True:
            events = self._open(self.agents.client(sandbox), run, attach=attach)
            try:
                final = await self._consume(run, skip_seen(events, dict(run.received)))
            except JobNotFound:
                lost = RESTART_LOST if attach else "the agent no longer has this job"
                await self._finalize(run, JobStatus.FAILED, error=lost)
                return None
            except AgentUnavailable as exc:
                error: Exception = exc
                await self.health.check(sandbox)  # fails the sandbox if its agent is gone
            except OrchardError as exc:  # the agent refused it (bad cwd, ...)
                await self._finalize(run, JobStatus.FAILED, error=exc.message)
                return None
            except Exception as exc:  # a broken link, or the sandbox went away under it
                error = exc
            else:
                if final is not None:
                    return final
                error = ConnectionError("the agent ended the stream before the command exited")
            deadline = deadline or loop.time() + RECONNECT_SECONDS
            current = await self.sandboxes.check_alive(run.record.sandbox_id)
            if current is None or current.status != SandboxStatus.READY:
                state = "gone" if current is None else current.status.value
                why = f": {current.status_message}" if current and current.status_message else ""
                await self._finalize(
                    run,
                    JobStatus.FAILED,
                    error=f"sandbox {run.record.sandbox_id} is {state}{why}",
                )
                return None
            if loop.time() >= deadline:
                await self._finalize(
                    run, JobStatus.FAILED, error=f"lost the connection to the agent: {error}"
                )
                return None
            log.warning(
                "re-attaching to a job", extra={"job_id": run.record.job_id, "error": str(error)}
            )
            await asyncio.sleep(0.5)
            sandbox = current

    async def _consume(self, run: JobRun, events: AsyncIterator[Output | Exit]) -> Exit | None:
        async for event in events:
            if isinstance(event, Exit):
                # Its final row is written next. If the exit came first, the row says queued
                # until then, as it did while the command ran: a restart re-sends it, and the
                # agent, which has the job, replays its end.
                return event
            if not run.acknowledged:
                # The agent has the job: from now on a restart re-attaches, never re-sends.
                run.acknowledged = True
                await self.store.put_job(run.record)
            run.add(event.stream, event.data)
        return None

    async def _finish_from_exit(self, run: JobRun, final: Exit, memory_bytes: int) -> None:
        timeout = run.record.request.timeout_seconds
        exit_code = final.exit_code
        if exit_code is None and final.signal is not None:
            exit_code = -final.signal
        error = final.error
        if final.cancelled:
            error = error or "cancelled"
        elif final.timed_out:
            # Upstream's report, which harnesses test for: GNU timeout's 124, and its message
            # as the error and as the last line of stderr.
            exit_code = TIMEOUT_EXIT_CODE
            error = error or f"Command timed out after {timeout}s"
        elif final.oom_killed:
            error = error or command_oom_reason(memory_bytes)
        elif error is None and final.signal is not None:
            error = f"killed by signal {final.signal}"
        succeeded = final.exit_code == 0 and error is None
        run.flush(dict(zip(STREAMS, final.dropped, strict=True)))
        if final.timed_out and not final.cancelled:
            run.note("stderr", f"Command timed out after {timeout}s")
        await self._finalize(
            run,
            JobStatus.SUCCEEDED if succeeded else JobStatus.FAILED,
            exit_code=exit_code,
            error=error,
            timed_out=final.timed_out,
            cancelled=final.cancelled,
            oom_killed=final.oom_killed,
            truncated=final.truncated,
        )

    async def _finalize(
        self, run: JobRun, status: JobStatus, *, error: str | None, **fields: Any
    ) -> JobRecord:
        if run.done.is_set():
            return run.record
        run.flush()
        truncated = bool(fields.pop("truncated", False)) or run.truncated
        record = run.snapshot().model_copy(
            update={
                "status": status,
                "error": error,
                "completed_at": self.clock(),
                "truncated": truncated,
                **fields,
            }
        )
        await self.store.put_job(record)
        run.finish(record)
        log.debug(
            "job finished",
            extra={"job_id": record.job_id, "status": status.value, "exit_code": record.exit_code},
        )
        return record

    async def close(self) -> None:
        """Stop following jobs (they keep running in their agents; a restart re-attaches)."""
        tasks = [run.task for run in self._runs.values() if run.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._runs.clear()


_SYSTEM = Caller(key_id=None, admin=True)
