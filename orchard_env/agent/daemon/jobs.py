"""Exec jobs: one command run per job id, its output kept as the NDJSON events every attacher
replays, and the table of jobs the agent remembers (bounded by age, count and bytes)."""

from __future__ import annotations

import base64
import functools
import json
import os
import signal
import subprocess
import threading
import time

from .http import HTTPError
from .loop import Timer
from .procs import Processes, build_argv, exit_fields, kill_tree, oom_kills, spawn_failure
from .spool import Budget, EventLog, TailRing, spool_dir

DEFAULT_MAX_OUTPUT = 10 * 1024 * 1024  # per stream, when the request names no cap
READ_CHUNK = 64 * 1024
EXIT_DRAIN_GRACE = 1.0  # seconds to wait for pipe EOF after the command itself exited
JOB_KEEP_SECONDS = 3600.0
JOB_KEEP_COUNT = 1000
JOB_BUFFER_BUDGET = 256 * 1024 * 1024  # output kept for finished jobs, all together
SPOOLED_KEEP_COUNT = 64  # finished jobs that keep a spool file (and its descriptor) open
CANCELLED_AHEAD_KEEP = 1024  # ids cancelled before their exec arrived, remembered at most


class JobTable:
    """The jobs this agent knows by id: running ones, and finished ones for a while. Changed
    on the agent's loop only (see :mod:`.loop`); other threads may look a job up."""

    def __init__(self, procs: Processes) -> None:
        self.procs = procs
        self.jobs: dict[str, Job] = {}
        # Finished jobs in the order they finished, and those of them still holding output
        # (with its bytes and spool files counted), so that keeping them bounded costs the
        # same per finished job however many are kept.
        self.finished: dict[Job, None] = {}
        self.holding: dict[Job, None] = {}
        self.held_bytes = 0
        self.held_spools = 0
        self.memory = Budget()
        self.spool_dir = spool_dir()
        self.cancelled_ahead: dict[str, None] = {}  # insertion-ordered: the oldest go first

    def get(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)

    def __getitem__(self, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise HTTPError(404, "job_not_found", f"job {job_id} is not known to this agent")
        return job

    def add(self, job_id: str, fingerprint: str, max_output: int) -> Job:
        job = self.jobs[job_id] = Job(self, job_id, fingerprint, max_output)
        return job

    def cancel(self, job_id: str) -> bool:
        """Kill a job; False when it already ended. A job id not known yet is remembered, so
        that its exec, should it arrive after the cancel (the two race on separate
        connections), ends cancelled without running (:meth:`was_cancelled_ahead`)."""
        job = self.jobs.get(job_id)
        if job is not None:
            return job.kill("cancel")
        self.cancelled_ahead[job_id] = None
        while len(self.cancelled_ahead) > CANCELLED_AHEAD_KEEP:
            del self.cancelled_ahead[next(iter(self.cancelled_ahead))]
        return True

    def was_cancelled_ahead(self, job_id: str) -> bool:
        if job_id not in self.cancelled_ahead:
            return False
        del self.cancelled_ahead[job_id]
        return True

    def kill_all(self) -> None:
        for job in self.jobs.values():
            job.kill("cancel")

    def job_finished(self, job: Job) -> None:
        """Keep finished jobs bounded by age, count and buffered bytes (oldest go first): a
        job past the age or count loses its record, one past the bytes or spool files its
        output (its final event stays)."""
        self.finished[job] = None
        self.holding[job] = None
        self.held_bytes += job.log.size
        self.held_spools += job.log.fd is not None
        now = time.monotonic()
        while self.finished:
            oldest = next(iter(self.finished))
            expired = now - oldest.finished_at > JOB_KEEP_SECONDS
            if len(self.finished) <= JOB_KEEP_COUNT and not expired:
                break
            del self.finished[oldest]
            if self.jobs.get(oldest.job_id) is oldest:
                del self.jobs[oldest.job_id]
            self._release(oldest)
        while self.holding and (
            self.held_bytes > JOB_BUFFER_BUDGET or self.held_spools > SPOOLED_KEEP_COUNT
        ):
            self._release(next(iter(self.holding)))

    def _release(self, job: Job) -> None:
        """Free a finished job's output (once)."""
        if job in self.holding:
            del self.holding[job]
            self.held_spools -= job.log.fd is not None
            self.held_bytes -= job.drop_output()


class Job:
    """One command run, kept by job_id so a repeated submission attaches instead of rerunning.

    Output is kept as encoded NDJSON lines in an :class:`EventLog` (the stream every attacher
    replays from the start; memory first, then a spool file) and the final ``x`` line apart.
    The loop runs the job; attachers' threads read its events through :meth:`next_events`,
    and :attr:`cond` guards what they read.
    Past half of ``max_output`` bytes a stream's output goes to a :class:`TailRing` of the
    other half, emitted when the command has ended; the ``x`` line says how many bytes fell
    between the two (``dropped``, per stream).
    """

    def __init__(self, table: JobTable, job_id: str, fingerprint: str, max_output: int) -> None:
        self.table = table
        self.job_id = job_id
        self.fingerprint = fingerprint
        self.tail_cap = max_output // 2
        self.head_cap = max_output - self.tail_cap
        self.log = EventLog(table.memory, table.spool_dir)
        self.final: bytes | None = None
        self.sizes = [0, 0]  # head bytes per stream
        self.tails: list[TailRing | None] = [None, None]
        self.dropped = [0, 0]  # bytes lost per stream: between head and tail, or a full disk
        self.timed_out = False
        self.cancelled = False
        self.done = False
        self.finished_at = 0.0
        self.pgid: int | None = None
        self.cond = threading.Condition()
        self._oom_kills_before: int | None = None
        self._started = 0.0
        self._returncode: int | None = None  # the command exited (and was reaped)
        self._fds: list[int | None] = [None, None]
        self._stdin: tuple[int, memoryview] | None = None
        self._timers: list[Timer] = []

    # event buffer

    def next_events(self, offset: int, limit: int) -> tuple[bytes, bytes]:
        """(events from ``offset``, b"") as soon as there are any, else (b"", the final
        event) once the job has ended: waits (in an attacher's thread) until one is true."""
        with self.cond:
            while True:
                chunk = self.log.read(offset, limit)
                if chunk:
                    return chunk, b""
                if self.final is not None:
                    return b"", self.final
                self.cond.wait()

    def drop_output(self) -> int:
        """Free a finished job's output, keeping its final event (marked truncated)."""
        assert self.final is not None
        with self.cond:
            freed = self.log.size
            self.log.close()
            final = json.loads(self.final)
            final["truncated"] = True
            self.final = json.dumps(final, separators=(",", ":")).encode() + b"\n"
        return freed

    def _output(self, index: int, data: bytes) -> None:
        kind = b"o" if index == 0 else b"e"
        with self.cond:
            if self.log.append(b'{"t":"%s","d":"%s"}\n' % (kind, base64.b64encode(data))):
                self.cond.notify_all()
            else:
                self.dropped[index] += len(data)

    def _emit(self, index: int, data: bytes) -> None:
        room = max(self.head_cap - self.sizes[index], 0)
        head, rest = data[:room], data[room:]
        if head:
            self.sizes[index] += len(head)
            self._output(index, head)
        if rest:
            tail = self.tails[index]
            if tail is None:
                tail = self.tails[index] = TailRing(self.tail_cap, self.table.spool_dir)
            tail.write(rest)

    def _emit_tails(self) -> None:
        for index, tail in enumerate(self.tails):
            if tail is not None:
                self.dropped[index] += tail.dropped
                for chunk in tail.chunks(READ_CHUNK):
                    self._output(index, chunk)
                tail.close()
        self.tails = [None, None]

    def _finish(
        self,
        started: float,
        *,
        exit_code: int | None = None,
        sig: int | None = None,
        error: str | None = None,
        oom_killed: bool = False,
    ) -> None:
        self._emit_tails()
        final = {
            "t": "x",
            "exit_code": exit_code,
            "signal": sig,
            "timed_out": self.timed_out,
            "cancelled": self.cancelled,
            "oom_killed": oom_killed,
            "truncated": any(self.dropped),
            "dropped": self.dropped,
            "error": error,
            "duration": round(time.monotonic() - started, 6),
        }
        with self.cond:
            self.final = json.dumps(final, separators=(",", ":")).encode() + b"\n"
            self.cond.notify_all()
        self.done = True
        self.finished_at = time.monotonic()
        self.pgid = None
        self.table.job_finished(self)

    # running

    def end_cancelled(self) -> None:
        """End a job cancelled before its exec arrived, without running it."""
        self.cancelled = True
        self._finish(time.monotonic(), error="cancelled before it started")

    def start(
        self,
        command: str | list[str],
        login_shell: bool,
        cwd: str,
        env: dict[str, str],
        timeout: float | None,
        stdin: bytes | None,
    ) -> None:
        """Spawn the command in its own session; output is collected by the loop."""
        started = self._started = time.monotonic()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        in_r, in_w = os.pipe() if stdin is not None else (None, None)
        argv = build_argv(command, login_shell, err_w)
        # An interactive login bash gets its stderr on err_w, and /dev/null until then.
        quiet = login_shell and argv[1] == "--login"
        self._oom_kills_before = oom_kills()
        try:
            proc = self.table.procs.spawn(
                argv,
                (err_w,) if quiet else (),
                cwd=cwd,
                env=env,
                stdin=in_r if in_r is not None else subprocess.DEVNULL,
                stdout=out_w,
                stderr=subprocess.DEVNULL if quiet else err_w,
            )
        except OSError as exc:
            for fd in (out_r, err_r, in_w):
                if fd is not None:
                    os.close(fd)
            self._finish(started, **spawn_failure(exc, argv[0], cwd))
            return
        finally:
            for fd in (out_w, err_w, in_r):
                if fd is not None:
                    os.close(fd)
        self.pgid = proc.pid
        procs = self.table.procs
        procs.expose_to_oom_killer(proc.pid)
        self._fds = [out_r, err_r]
        for index, fd in enumerate((out_r, err_r)):
            os.set_blocking(fd, False)
            procs.loop.add_reader(fd, functools.partial(self._on_output, index))
        if in_w is not None and stdin is not None:
            os.set_blocking(in_w, False)
            self._stdin = (in_w, memoryview(stdin))
            procs.loop.add_writer(in_w, self._feed_stdin)
        if timeout:
            self._timers.append(procs.loop.call_later(timeout, self._time_out))
        procs.watch_child(proc, self._on_exit)

    def _time_out(self) -> None:
        self.kill("timeout")

    def _feed_stdin(self) -> None:
        assert self._stdin is not None
        fd, left = self._stdin
        try:
            written = os.write(fd, left)
        except BlockingIOError:
            return
        except OSError:
            written = len(left)  # the command closed its stdin early
        if written < len(left):
            self._stdin = (fd, left[written:])
        else:
            self._close_stdin()

    def _close_stdin(self) -> None:
        if self._stdin is not None:
            fd = self._stdin[0]
            self._stdin = None
            self.table.procs.loop.remove_writer(fd)
            os.close(fd)

    def _on_output(self, index: int) -> None:
        fd = self._fds[index]
        if fd is None:
            return
        try:
            data = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self._emit(index, data)
        else:
            self._close_stream(index)

    def _close_stream(self, index: int) -> None:
        fd = self._fds[index]
        if fd is None:
            return
        self._fds[index] = None
        self.table.procs.loop.remove_reader(fd)
        os.close(fd)
        if self._fds == [None, None] and self._returncode is not None:
            self._ended()

    def _on_exit(self, returncode: int) -> None:
        """The command exited: the job ends once its pipes are closed. A background child
        may still hold them: it gets a moment, then reading stops (the command itself is
        done; its leftovers keep running)."""
        self._returncode = returncode
        if self._fds == [None, None]:
            self._ended()
        else:
            loop = self.table.procs.loop
            self._timers.append(loop.call_later(EXIT_DRAIN_GRACE, self._drain_and_close))

    def _ended(self) -> None:
        assert self._returncode is not None
        for timer in self._timers:
            timer.cancel()
        self._close_stdin()
        exit_code, sig = exit_fields(self._returncode)
        self._finish(
            self._started,
            exit_code=exit_code,
            sig=sig,
            oom_killed=self._oom_killed(exit_code, sig),
        )

    def _oom_killed(self, exit_code: int | None, sig: int | None) -> bool:
        """The command ended by a SIGKILL the agent did not send (its own, or 137 from a
        shell whose child it was) while the sandbox's cgroup counted a new OOM kill."""
        killed = sig == signal.SIGKILL or exit_code == 128 + signal.SIGKILL
        if not killed or self.timed_out or self.cancelled or self._oom_kills_before is None:
            return False
        after = oom_kills()
        return after is not None and after > self._oom_kills_before

    def _drain_and_close(self) -> None:
        for index, fd in enumerate(self._fds):
            while fd is not None:
                try:
                    data = os.read(fd, READ_CHUNK)
                except OSError:
                    break
                if not data:
                    break
                self._emit(index, data)
            self._close_stream(index)

    def kill(self, reason: str) -> bool:
        """SIGKILL everything the command started (timeout or cancel), ``setsid`` and
        ``nohup`` descendants included; False when already done.

        A command that has exited by itself is not killed (nor reported cancelled or timed
        out) even while its output drains: its pid is reaped first, so it may be reused by
        now and must never be signalled."""
        self.table.procs.reap()  # a command exited, its SIGCHLD not handled yet: now it is
        if self.done or self.pgid is None or self._returncode is not None:
            return False
        if reason == "timeout":
            self.timed_out = True
        else:
            self.cancelled = True
        kill_tree(self.pgid)
        return True
