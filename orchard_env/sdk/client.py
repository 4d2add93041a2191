"""The synchronous client (``httpx.Client``) and its sandbox handle.

Everything here is I/O: the requests, retries and decisions are the flows of
:mod:`orchard_env.sdk._flows`, shared with :mod:`orchard_env.sdk.aio`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Self, TypeVar, cast, overload

import httpx

from orchard_env import errors, protocol
from orchard_env.sdk import _cleanup
from orchard_env.sdk import _flows as flows
from orchard_env.sdk import _trajectories as trajectories
from orchard_env.sdk._base import ClientCore, ClientView, Flow, Send, Sleep, transport_error
from orchard_env.sdk._handle import (
    CHUNK,
    OutputSink,
    PartFile,
    SandboxBase,
    file_mode,
    keep_beating,
    local_file,
    route,
)
from orchard_env.sdk._transport import LeanSyncTransport, proxied
from orchard_env.sdk.results import ExecResult, FileEntry, Health, PatchResult, UploadResult

if TYPE_CHECKING:
    from orchard_env.sdk.pty import PtyProcess

logger = logging.getLogger("orchard_env.sdk")

_T = TypeVar("_T")


class SandboxClient(ClientView):
    """A connection to an Orchard service (alias-compatible with upstream Orchard Env).

    Where it connects: ``base_url``/``api_key`` arguments, else ``ORCHARD_URL`` /
    ``ORCHARD_API_KEY``, else upstream's ``SANDBOX_BASE_URL`` / ``SANDBOX_API_KEY``, else the
    config file's context (``context=`` or the current one), else ``http://127.0.0.1:8000``.
    ``prefix`` (or ``SANDBOX_PREFIX``) makes sandbox ids ``<prefix>-<8 hex>``.

    ``retries`` is how many times a failed request is tried again (connection errors and
    503 only, with exponential backoff); ``timeout`` is the default read timeout in seconds.
    With ``auto_cleanup`` the sandboxes this client created are deleted by ``close()``, on
    leaving ``with``, at interpreter exit and on SIGINT/SIGTERM. ``transport`` replaces the
    network (e.g. ``httpx.MockTransport`` in tests); PTY sessions always use the network.
    """

    def __init__(
        self,
        base_url: str | None = None,
        timeout: float = 1200,
        auto_cleanup: bool = True,
        api_key: str | None = None,
        prefix: str | None = None,
        *,
        context: str | None = None,
        transport: httpx.BaseTransport | None = None,
        retries: int = 3,
    ) -> None:
        self._core = ClientCore(
            base_url=base_url,
            timeout=timeout,
            auto_cleanup=auto_cleanup,
            api_key=api_key,
            prefix=prefix,
            context=context,
            retries=retries,
        )
        self._http = httpx.Client(
            base_url=self._core.base_url,
            headers=self._core.headers,
            timeout=self._core.http_timeout(),
            transport=transport or (None if proxied() else LeanSyncTransport()),
        )
        self._sleep: Callable[[float], None] = time.sleep
        self._heartbeats: weakref.WeakSet[Sandbox] = weakref.WeakSet()
        if auto_cleanup:
            target = _cleanup.Target(
                self._core.base_url, tuple(self._core.headers.items()), transport
            )
            self._core.on_tracking(
                partial(_cleanup.track, target), partial(_cleanup.untrack, target)
            )

    @property
    def is_closed(self) -> bool:
        """Whether :meth:`close` has run (a closed client sends nothing)."""
        return self._http.is_closed

    # --- sandboxes ---------------------------------------------------------------------------

    def create_sandbox(
        self,
        image: str,
        block_network: bool = True,
        sandbox_id: str | None = None,
        cpu: str | float | None = None,
        memory: str | int | None = None,
        timeout: int | None = None,
        wait_ready: bool = True,
        poll_interval: float = 1.0,
        *,
        labels: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        ttl_seconds: int | None = None,
        idle_timeout_seconds: int | None = None,
        model_gateway: Mapping[str, Any] | None = None,
        tools: bool | Sequence[str] | None = None,
    ) -> Sandbox:
        """Create a sandbox and (``wait_ready``) wait until it runs; return its handle.

        ``timeout`` is how long it may take to become ready (default 3600 s). If it fails to
        start, times out or the wait is interrupted (Ctrl-C), the sandbox is deleted and the
        error raised: :class:`~orchard_env.errors.SandboxNotReady` with the reason,
        :class:`~orchard_env.errors.Timeout` (also a ``TimeoutError``).

        ``tools``: the agent harnesses at ``/opt/sandbox-tools`` (on PATH): None or True for
        all the service has, False for none, or names (``["codex", "pi"]``).
        """
        request = flows.create_request(
            self._core,
            image=image,
            block_network=block_network,
            sandbox_id=sandbox_id,
            cpu=cpu,
            memory=memory,
            timeout=timeout,
            labels=labels,
            env=env,
            workdir=workdir,
            ttl_seconds=ttl_seconds,
            idle_timeout_seconds=idle_timeout_seconds,
            model_gateway=model_gateway,
            tools=tools,
        )
        info = self._run(
            flows.create_sandbox(
                self._core, request, wait_ready=wait_ready, poll_interval=poll_interval
            )
        )
        return Sandbox(self, info)

    def get_sandbox(self, sandbox_id: str) -> Sandbox:
        """A handle to an existing sandbox (raises SandboxNotFound for unknown ids)."""
        return Sandbox(self, self._run(flows.get_sandbox(self._core, sandbox_id)))

    def list_sandboxes(
        self,
        labels: Mapping[str, str] | None = None,
        status: str | protocol.SandboxStatus | None = None,
        *,
        include_deleted: bool = False,
        chunk_size: int = flows.LIST_CHUNK_SIZE,
    ) -> list[protocol.SandboxInfo]:
        """Sandboxes visible to this key, optionally only those with all ``labels``, newest
        first; fetched ``chunk_size`` per request."""
        return self._run(
            flows.list_sandboxes(self._core, labels, status, include_deleted, chunk_size)
        )

    def delete_sandbox(self, sandbox_id: str, missing_ok: bool = False) -> bool:
        """Delete a sandbox; True if deleted now, False if already gone (with ``missing_ok``)."""
        return self._run(flows.delete_sandbox(self._core, sandbox_id, missing_ok=missing_ok))

    def cleanup_all(self) -> list[str]:
        """Delete every sandbox this client created and has not deleted; return the ids
        deleted. Deletes run in parallel with a short timeout; failures are logged, not
        raised (those sandboxes stay tracked for the next attempt).
        """
        ids = self._core.created()
        done = _cleanup.in_parallel(lambda sid: self._run(flows.discard(self._core, sid)), ids)
        return [sid for sid, ok in zip(ids, done, strict=True) if ok]

    # --- snapshots ---------------------------------------------------------------------------

    def restore(
        self,
        snapshot_id: str,
        sandbox_id: str | None = None,
        *,
        labels: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        timeout: int | None = None,
        ttl_seconds: int | None = None,
        idle_timeout_seconds: int | None = None,
    ) -> Sandbox:
        """A new sandbox from a snapshot, ready when this returns.

        It has the snapshot's files and the source sandbox's resources, workdir, network
        setting, env and labels (``env`` and ``labels`` are added over those). Processes are
        not carried over: only the filesystem. Tracked for cleanup like a created sandbox.
        """
        info = self._run(
            flows.restore_snapshot(
                self._core,
                snapshot_id,
                sandbox_id=sandbox_id,
                labels=labels,
                env=env,
                timeout=timeout,
                ttl_seconds=ttl_seconds,
                idle_timeout_seconds=idle_timeout_seconds,
            )
        )
        return Sandbox(self, info)

    def list_snapshots(
        self, labels: Mapping[str, str] | None = None, *, include_deleted: bool = False
    ) -> list[protocol.Snapshot]:
        """Snapshots visible to this key, oldest first, optionally only those with ``labels``."""
        return self._run(flows.list_snapshots(self._core, labels, include_deleted))

    def get_snapshot(self, snapshot_id: str) -> protocol.Snapshot:
        """One snapshot's record (deleted ones too while remembered)."""
        return self._run(flows.get_snapshot(self._core, snapshot_id))

    def delete_snapshot(self, snapshot_id: str, recursive: bool = False) -> list[str]:
        """Delete a snapshot; with ``recursive`` its descendants too (without, one that has
        child snapshots raises Conflict). Returns the ids deleted. Sandboxes restored from
        it keep running."""
        return self._run(flows.delete_snapshot(self._core, snapshot_id, recursive=recursive))

    # --- jobs --------------------------------------------------------------------------------

    def get_job(self, job_id: str) -> ExecResult:
        """A job's current state; ``is_complete`` says whether it has finished."""
        return self._run(flows.get_job(self._core, job_id))

    def wait_job(self, job_id: str, timeout: float = 300, poll_interval: float = 0.1) -> ExecResult:
        """Wait up to ``timeout`` seconds for a job to finish; return its state either way."""
        return self._run(
            flows.wait_job(self._core, job_id, timeout=timeout, poll_interval=poll_interval)
        )

    def cancel_job(self, job_id: str) -> ExecResult:
        """Kill a job's process tree; the job ends ``failed`` with ``cancelled`` set."""
        return self._run(flows.cancel_job(self._core, job_id))

    # --- service -----------------------------------------------------------------------------

    def health(self) -> Health:
        """The service's ``GET /health``: status, version and backend."""
        return self._run(flows.health(self._core))

    def resources(self) -> protocol.ResourcesReport:
        """Capacity, what live sandboxes asked for, and what is left."""
        return self._run(flows.resources(self._core))

    def usage(
        self, since: datetime | str | None = None, until: datetime | str | None = None
    ) -> protocol.UsageReport:
        """Sandbox-seconds per sandbox in the period (an admin key sees every key's)."""
        return self._run(flows.usage(self._core, since, until))

    def create_key(
        self,
        name: str,
        admin: bool = False,
        *,
        max_sandboxes: int | None = None,
        max_cpu: float | None = None,
        max_memory: str | None = None,
    ) -> protocol.KeyCreated:
        """Create an API key (admin only); its secret is in the result and nowhere else.
        ``max_*``: its own limits instead of the service's per-key defaults."""
        limits = {"max_sandboxes": max_sandboxes, "max_cpu": max_cpu, "max_memory": max_memory}
        return self._run(flows.create_key(self._core, name, admin, limits))

    def list_keys(self) -> list[protocol.KeyInfo]:
        """Every API key (never their secrets); needs an admin key."""
        return self._run(flows.list_keys(self._core))

    def revoke_key(self, key_id: str) -> protocol.KeyInfo:
        """Revoke a key: requests with it are refused from now on (admin)."""
        return self._run(flows.revoke_key(self._core, key_id))

    # --- warm pools (admin) ------------------------------------------------------------------

    def create_pool(
        self,
        name: str,
        image: str,
        size: int,
        *,
        block_network: bool = True,
        cpu: str | float | None = None,
        memory: str | int | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        ttl_seconds: int | None = None,
    ) -> protocol.PoolInfo:
        """Keep ``size`` sandboxes of this spec ready (admin only): a ``create_sandbox`` with
        the same image, cpu, memory, network, env and workdir, and no ``sandbox_id``, takes one.
        ``ttl_seconds``: how long one waits unclaimed before it is replaced."""
        return self._run(
            flows.create_pool(
                self._core,
                name,
                image,
                size,
                block_network=block_network,
                cpu=cpu,
                memory=memory,
                env=env,
                workdir=workdir,
                ttl_seconds=ttl_seconds,
            )
        )

    def list_pools(self) -> list[protocol.PoolInfo]:
        """Every warm pool, by name, with how many sandboxes are ready and starting (admin)."""
        return self._run(flows.list_pools(self._core))

    def get_pool(self, name: str) -> protocol.PoolInfo:
        """One warm pool: its spec, size, ready and starting counts, last refill error (admin)."""
        return self._run(flows.get_pool(self._core, name))

    def resize_pool(self, name: str, size: int) -> protocol.PoolInfo:
        """Grow or shrink a pool (admin): shrinking removes waiting sandboxes, not claimed ones."""
        return self._run(flows.resize_pool(self._core, name, size))

    def delete_pool(self, name: str) -> protocol.PoolInfo:
        """Remove the pool and the sandboxes waiting in it (claimed ones stay their owners')."""
        return self._run(flows.delete_pool(self._core, name))

    # --- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop heartbeats, delete created sandboxes (``auto_cleanup``), close connections."""
        if self._http.is_closed:
            return
        for sandbox in list(self._heartbeats):
            sandbox.stop_heartbeat()
        try:
            if self._core.auto_cleanup:
                self.cleanup_all()
        finally:
            self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SandboxClient(base_url={self.base_url!r})"

    # --- the driver --------------------------------------------------------------------------

    def _run(self, flow: Flow[_T]) -> _T:
        """Run a flow to its end with blocking I/O."""
        value: object = None
        error: BaseException | None = None
        while True:
            try:
                step = flow.throw(error) if error is not None else flow.send(value)
            except StopIteration as stop:
                return cast(_T, stop.value)
            value, error = None, None
            try:
                value = self._perform(step)
            except BaseException as exc:  # the flow decides: retry, clean up or re-raise
                error = exc

    def _perform(self, step: Send | Sleep) -> object:
        if isinstance(step, Sleep):
            self._sleep(step.seconds)
            return None
        request = self._http.build_request(
            step.method,
            step.path,
            params=tuple(step.params),
            json=step.json,
            content=step.content() if step.content is not None else None,
            headers=step.headers,
            timeout=self._core.http_timeout(step.timeout),
        )
        response = self._http.send(request, stream=step.stream)
        if step.stream and response.is_error:
            try:
                response.read()
            finally:
                response.close()
        return response

    def _exec_events(
        self, sandbox_id: str, request: protocol.ExecRequest, *, cancel_on_interrupt: bool
    ) -> Iterator[protocol.ExecEvent]:
        replay = flows.StreamReplay(self._core, sandbox_id)
        try:
            while True:
                response = self._run(flows.open_exec_stream(self._core, sandbox_id, request))
                failure: httpx.TransportError | None = None
                try:
                    for line in response.iter_lines():
                        event = replay.feed(line)
                        if event is not None:
                            yield event
                        if replay.final is not None:
                            return
                except httpx.TransportError as exc:
                    failure = exc
                finally:
                    response.close()
                self._sleep(replay.reconnect_delay(failure))
        except KeyboardInterrupt:
            if cancel_on_interrupt and replay.final is None and request.job_id is not None:
                self._cancel_interrupted(request.job_id)
            raise

    def _cancel_interrupted(self, job_id: str) -> None:
        """Cancel a job whose caller was interrupted while it ran (errors are not theirs)."""
        with contextlib.suppress(errors.OrchardError):
            self.cancel_job(job_id)


class Sandbox(SandboxBase):
    """One sandbox (alias ``SandboxInstance``). Leaving ``with`` deletes it."""

    def __init__(self, client: SandboxClient, info: protocol.SandboxInfo) -> None:
        super().__init__(info)
        self._client = client
        self._core = client._core
        self._heartbeat_stop: threading.Event | None = None
        self._heartbeat_thread: threading.Thread | None = None

    def refresh(self) -> protocol.SandboxInfo:
        """Fetch the sandbox's current state into ``info``."""
        self.info = self._client._run(flows.get_sandbox(self._core, self.sandbox_id))
        return self.info

    # --- exec --------------------------------------------------------------------------------

    @overload
    def exec(
        self,
        command: str | list[str],
        timeout: float | None = 300,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        wait: bool = True,
        poll_interval: float = 0.1,
        login_shell: bool = False,
        *,
        stdin: str | bytes | None = None,
        check: bool = False,
        job_id: str | None = None,
        shell: bool = True,
        pty: Literal[False] = False,
    ) -> ExecResult: ...

    @overload
    def exec(
        self,
        command: str | list[str],
        timeout: float | None = 300,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        wait: bool = True,
        poll_interval: float = 0.1,
        login_shell: bool = False,
        *,
        pty: Literal[True],
        rows: int = 24,
        cols: int = 80,
    ) -> PtyProcess: ...

    def exec(
        self,
        command: str | list[str],
        timeout: float | None = 300,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        wait: bool = True,
        poll_interval: float = 0.1,
        login_shell: bool = False,
        *,
        stdin: str | bytes | None = None,
        check: bool = False,
        job_id: str | None = None,
        shell: bool = True,
        pty: bool = False,
        rows: int = 24,
        cols: int = 80,
    ) -> ExecResult | PtyProcess:
        """Run a command through bash (``/bin/sh`` in images without it), as upstream does: a
        list is joined with spaces first (``["ls", "*.py"]`` globs). ``shell=False`` runs a
        list as an exact argv instead, with no shell. Returns when it has finished
        (``wait=False``: at once, with the queued job).

        The command runs exactly once even if the connection drops: the SDK picks the job id
        and retries name the same job. ``check=True`` raises CommandFailed unless it
        succeeded. ``pty=True`` (upstream's spelling) returns :meth:`pty`'s process instead.
        """
        if pty:
            return self.pty(
                command, rows=rows, cols=cols, env=env, cwd=cwd, login_shell=login_shell
            )
        request = flows.exec_request(
            command,
            timeout=timeout,
            cwd=cwd,
            env=env,
            login_shell=login_shell,
            stdin=stdin,
            job_id=job_id,
            wait=wait,
            check=check,
            shell=shell,
        )
        result = self._client._run(
            flows.exec_command(self._core, self.sandbox_id, request, poll_interval=poll_interval)
        )
        if check:
            result.check_returncode()
        return result

    def exec_stream(
        self,
        command: str | list[str],
        timeout: float | None = 300,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        login_shell: bool = False,
        *,
        stdin: str | bytes | None = None,
        job_id: str | None = None,
        shell: bool = True,
        cancel_on_interrupt: bool = True,
    ) -> Iterator[protocol.ExecEvent]:
        """Run a command and yield its output as it happens.

        Events: ``started``, then ``stdout``/``stderr`` text chunks, then one ``exit`` whose
        ``job`` is the final result. A dropped connection re-attaches to the same job
        without repeating output already yielded; so does calling again with the same
        ``job_id`` and command. Ctrl-C (``KeyboardInterrupt``) while waiting cancels the
        command in the sandbox before it propagates, unless ``cancel_on_interrupt=False``
        (the job keeps running; re-attach with its ``job_id``). One that lands in the body
        of your loop, between events, does not pass through here: catch it there and call
        ``cancel_job`` with the job id you gave (:meth:`exec_streamed` does).
        """
        request = flows.exec_request(
            command,
            timeout=timeout,
            cwd=cwd,
            env=env,
            login_shell=login_shell,
            stdin=stdin,
            job_id=job_id,
            wait=False,
            check=False,
            shell=shell,
        )
        return self._client._exec_events(
            self.sandbox_id, request, cancel_on_interrupt=cancel_on_interrupt
        )

    def exec_streamed(
        self,
        command: str | list[str],
        timeout: float | None = 300,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        login_shell: bool = False,
        *,
        stdout: OutputSink | None = None,
        stderr: OutputSink | None = None,
        stdin: str | bytes | None = None,
        check: bool = False,
        job_id: str | None = None,
        shell: bool = True,
        cancel_on_interrupt: bool = True,
    ) -> ExecResult:
        """Like :meth:`exec`, but output goes to ``stdout``/``stderr`` as it arrives.

        A sink is a text stream (default: this process's) or a callable taking each chunk.
        Ctrl-C cancels the command unless ``cancel_on_interrupt=False`` (see
        :meth:`exec_stream`).
        """
        final: protocol.Job | None = None
        job_id = job_id or flows.new_job_id()
        try:
            for event in self.exec_stream(
                command,
                timeout,
                cwd,
                env,
                login_shell,
                stdin=stdin,
                job_id=job_id,
                shell=shell,
                cancel_on_interrupt=False,  # below: an interrupt in a sink counts too
            ):
                final = route(event, stdout, stderr) or final
        except KeyboardInterrupt:
            if cancel_on_interrupt and final is None:
                self._client._cancel_interrupted(job_id)
            raise
        result = flows.stream_result(final, timeout)
        if check:
            result.check_returncode()
        return result

    def get_job(self, job_id: str) -> ExecResult:
        """One of this sandbox's jobs by id (see :meth:`SandboxClient.get_job`)."""
        return self._client.get_job(job_id)

    def list_jobs(self) -> list[ExecResult]:
        """This sandbox's jobs, newest first."""
        return self._client._run(flows.list_jobs(self._core, self.sandbox_id))

    def apply_patch(
        self,
        patch: str,
        timeout: float = 30,
        *,
        cwd: str | None = None,
        check: bool = False,
        three_way: bool = False,
        reverse: bool = False,
    ) -> PatchResult:
        """``git apply`` a unified diff (in ``cwd``, default the workdir).

        ``check`` only tests whether it applies; ``three_way`` falls back to a 3-way merge;
        ``reverse`` un-applies it. ``success`` and the output say how it went.
        """
        return self._client._run(
            flows.apply_patch(
                self._core,
                self.sandbox_id,
                patch,
                timeout=timeout,
                cwd=cwd,
                check=check,
                three_way=three_way,
                reverse=reverse,
            )
        )

    # --- files -------------------------------------------------------------------------------

    def upload_file(self, local_path: str | os.PathLike[str], remote_path: str) -> UploadResult:
        """Copy a local file into the sandbox, streamed (any size), keeping its mode."""
        path = Path(local_path)
        stat = local_file(path)

        def body() -> Iterator[bytes]:
            with path.open("rb") as handle:
                while chunk := handle.read(CHUNK):
                    yield chunk

        return self._client._run(
            flows.upload(
                self._core,
                self.sandbox_id,
                remote_path,
                body,
                size=stat.st_size,
                mode=file_mode(stat),
            )
        )

    def upload_content(self, content: str | bytes, remote_path: str) -> UploadResult:
        """Write ``content`` (text is UTF-8 encoded) to a file in the sandbox."""
        data = content.encode() if isinstance(content, str) else content
        return self._client._run(
            flows.upload(
                self._core, self.sandbox_id, remote_path, lambda: data, size=len(data), mode=None
            )
        )

    def download_file(self, remote_path: str, local_path: str | os.PathLike[str]) -> int:
        """Copy a file out of the sandbox, streamed; return its size in bytes.

        The local file appears complete or not at all (written beside it, then renamed).
        """
        part = PartFile(Path(local_path))
        try:
            response = self._client._run(
                flows.download(self._core, self.sandbox_id, remote_path, stream=True)
            )
            try:
                for chunk in response.iter_bytes(CHUNK):
                    part.write(chunk)
            except httpx.TransportError as exc:
                raise transport_error(self._core, f"downloading {remote_path}", exc) from exc
            finally:
                response.close()
        except BaseException:
            part.discard()
            raise
        return part.commit()

    def download_content(self, remote_path: str) -> bytes:
        """A file's bytes."""
        response = self._client._run(
            flows.download(self._core, self.sandbox_id, remote_path, stream=False)
        )
        return response.content

    def list_files(self, remote_path: str = "/workspace") -> list[FileEntry]:
        """A directory's entries (``entry.name`` or upstream's ``entry["name"]``)."""
        return self._client._run(flows.list_files(self._core, self.sandbox_id, remote_path))

    def delete_file(self, path: str, recursive: bool = False) -> None:
        """Delete a file, or a directory (non-empty ones only with ``recursive``)."""
        self._client._run(flows.delete_file(self._core, self.sandbox_id, path, recursive=recursive))

    def mkdir(self, path: str) -> None:
        """Create a directory and its parents (no error if it exists)."""
        self._client._run(flows.mkdir(self._core, self.sandbox_id, path))

    # --- model calls (see docs/harnesses.md) ----------------------------------------------

    def model_calls(self, trajectory_id: str | None = None) -> list[dict[str, Any]]:
        """The sandbox's recorded model calls (``orchard.model_call/v1``), oldest first."""
        return self._client._run(
            trajectories.model_calls(self._core, self.sandbox_id, trajectory_id)
        )

    def trajectories(self) -> list[protocol.TrajectorySummary]:
        """Calls, tokens and errors per trajectory of the sandbox."""
        return self._client._run(trajectories.trajectories(self._core, self.sandbox_id))

    def set_trajectory(self, trajectory_id: str) -> None:
        """Send the sandbox's next model calls to ``trajectory_id`` (a new episode)."""
        self.info = self._client._run(
            trajectories.set_trajectory(self._core, self.sandbox_id, trajectory_id)
        )

    # --- liveness ----------------------------------------------------------------------------

    def heartbeat(self) -> protocol.HeartbeatResponse:
        """Mark the sandbox as in use now (its idle timeout restarts)."""
        return self._client._run(flows.heartbeat(self._core, self.sandbox_id))

    def start_heartbeat(self, interval: float = 60) -> None:
        """Send a heartbeat every ``interval`` seconds from a background thread."""
        if self._heartbeat_thread is not None and self._heartbeat_thread.is_alive():
            return
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(interval) and not self._client.is_closed:
                try:
                    self.heartbeat()
                except errors.OrchardError as exc:
                    if not keep_beating(self.sandbox_id, exc):
                        return

        self._heartbeat_stop = stop
        self._heartbeat_thread = threading.Thread(
            target=beat, name=f"orchard-heartbeat-{self.sandbox_id}", daemon=True
        )
        self._client._heartbeats.add(self)
        self._heartbeat_thread.start()

    def stop_heartbeat(self) -> None:
        """Stop the thread :meth:`start_heartbeat` started (no error if none runs)."""
        if self._heartbeat_stop is not None:
            self._heartbeat_stop.set()
        thread, self._heartbeat_thread = self._heartbeat_thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._client._heartbeats.discard(self)

    # --- snapshots ---------------------------------------------------------------------------

    def snapshot(
        self,
        name: str | None = None,
        labels: Mapping[str, str] | None = None,
        ttl_seconds: int | None = None,
    ) -> protocol.Snapshot:
        """Snapshot the sandbox's filesystem (not its processes); ``client.restore(snapshot_id)``
        makes a sandbox from it. ``ttl_seconds``: deleted that long after (default: kept)."""
        return self._client._run(
            flows.snapshot_sandbox(
                self._core, self.sandbox_id, name=name, labels=labels, ttl_seconds=ttl_seconds
            )
        )

    def fork(
        self,
        count: int,
        labels: Mapping[str, str] | None = None,
        *,
        allow_partial: bool = False,
    ) -> list[Sandbox]:
        """Snapshot this sandbox and restore it ``count`` times at once: ``count`` new
        sandboxes with its files (not its processes), resources, env and labels (plus
        ``labels``), all ready, in one call.

        If any fork fails, the others are deleted and the first failure's error is raised,
        naming every failure; with ``allow_partial`` the forks that started are returned.
        """
        infos = self._client._run(
            flows.fork_sandbox(
                self._core, self.sandbox_id, count, labels=labels, allow_partial=allow_partial
            )
        )
        return [Sandbox(self._client, info) for info in infos]

    # --- terminal ----------------------------------------------------------------------------

    def pty(
        self,
        cmd: str | list[str] | None = None,
        rows: int = 24,
        cols: int = 80,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        login_shell: bool = False,
    ) -> PtyProcess:
        """Start a process on a pseudo-terminal (default: the image's shell)."""
        from orchard_env.sdk.pty import PtyProcess, init_frame, ws_url  # websockets: on use

        frame = init_frame(
            cmd, rows=rows, cols=cols, env=dict(env or {}), cwd=cwd, login_shell=login_shell
        )
        return PtyProcess(ws_url(self._core.base_url, self.sandbox_id), self._core.api_key, frame)

    # --- lifecycle ---------------------------------------------------------------------------

    def delete(self) -> None:
        """Delete the sandbox (nothing happens if it is already gone)."""
        self.stop_heartbeat()
        if not self._deleted:
            self._client.delete_sandbox(self.sandbox_id, missing_ok=True)
            self._deleted = True

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.delete()
            return
        try:
            self.delete()
        except errors.OrchardError as failure:  # do not hide the error that got us here
            logger.warning("could not delete sandbox %s: %s", self.sandbox_id, failure)


SandboxInstance = Sandbox
"""Upstream Orchard Env's name for :class:`Sandbox`."""
