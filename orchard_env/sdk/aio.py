"""The asyncio client (``httpx.AsyncClient``) and its sandbox handle.

The same API as :mod:`orchard_env.sdk.client`, awaited; the requests, retries and decisions
are the shared flows of :mod:`orchard_env.sdk._flows`.
"""

# ruff: noqa: ASYNC109 -- `timeout=` parameters are the public API (upstream SDK compatible)

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self, TypeVar, cast, overload

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
    share_docs,
)
from orchard_env.sdk._transport import LeanTransport, proxied
from orchard_env.sdk.client import Sandbox, SandboxClient
from orchard_env.sdk.pty import AsyncPtyProcess, init_frame, ws_url
from orchard_env.sdk.results import ExecResult, FileEntry, Health, PatchResult, UploadResult

logger = logging.getLogger("orchard_env.sdk")

_T = TypeVar("_T")
# Creates and ready-waits hold a connection for as long as the service takes to start the
# sandbox: a lower cap than the tasks a caller runs at once queues their commands behind them.
_LIMITS = httpx.Limits(max_connections=1000, max_keepalive_connections=200)


class AsyncSandboxClient(ClientView):
    """The asyncio :class:`~orchard_env.sdk.SandboxClient`: same arguments, same methods.

    Sandboxes it creates are tracked like the sync client's, and deleted by ``close()`` /
    ``async with`` exit and, without a custom ``transport``, at interpreter exit and on
    SIGINT/SIGTERM too.
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
        transport: httpx.AsyncBaseTransport | None = None,
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
        self._http = httpx.AsyncClient(
            base_url=self._core.base_url,
            headers=self._core.headers,
            timeout=self._core.http_timeout(),
            transport=transport or (None if proxied() else LeanTransport()),
            limits=_LIMITS,
        )
        self._sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
        self._heartbeats: set[AsyncSandbox] = set()
        # At interpreter exit there is no event loop to drive a custom async transport, so
        # only clients on the real network are registered for exit-time cleanup.
        if auto_cleanup and transport is None:
            target = _cleanup.Target(self._core.base_url, tuple(self._core.headers.items()))
            self._core.on_tracking(
                partial(_cleanup.track, target), partial(_cleanup.untrack, target)
            )

    @property
    def is_closed(self) -> bool:
        """Whether :meth:`close` has run (a closed client sends nothing)."""
        return self._http.is_closed

    # --- sandboxes ---------------------------------------------------------------------------

    async def create_sandbox(
        self,
        image: str,
        block_network: bool = True,
        sandbox_id: str | None = None,
        cpu: str | float | None = None,
        memory: str | int | None = None,
        timeout: int | None = None,
        wait_ready: bool = True,
        poll_interval: float = 2.0,
        *,
        labels: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        ttl_seconds: int | None = None,
        idle_timeout_seconds: int | None = None,
        model_gateway: Mapping[str, Any] | None = None,
        tools: bool | Sequence[str] | None = None,
    ) -> AsyncSandbox:
        """See :meth:`SandboxClient.create_sandbox`; cancelling the task deletes the sandbox."""
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
        info = await self._run(
            flows.create_sandbox(
                self._core, request, wait_ready=wait_ready, poll_interval=poll_interval
            )
        )
        return AsyncSandbox(self, info)

    async def get_sandbox(self, sandbox_id: str) -> AsyncSandbox:
        return AsyncSandbox(self, await self._run(flows.get_sandbox(self._core, sandbox_id)))

    async def list_sandboxes(
        self,
        labels: Mapping[str, str] | None = None,
        status: str | protocol.SandboxStatus | None = None,
        *,
        include_deleted: bool = False,
        chunk_size: int = flows.LIST_CHUNK_SIZE,
    ) -> list[protocol.SandboxInfo]:
        """See :meth:`SandboxClient.list_sandboxes`."""
        return await self._run(
            flows.list_sandboxes(self._core, labels, status, include_deleted, chunk_size)
        )

    async def delete_sandbox(self, sandbox_id: str, missing_ok: bool = False) -> bool:
        return await self._run(flows.delete_sandbox(self._core, sandbox_id, missing_ok=missing_ok))

    async def cleanup_all(self) -> list[str]:
        """See :meth:`SandboxClient.cleanup_all`."""
        ids = self._core.created()
        done = await asyncio.gather(*(self._run(flows.discard(self._core, sid)) for sid in ids))
        return [sid for sid, ok in zip(ids, done, strict=True) if ok]

    # --- snapshots ---------------------------------------------------------------------------

    async def restore(
        self,
        snapshot_id: str,
        sandbox_id: str | None = None,
        *,
        labels: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        timeout: int | None = None,
        ttl_seconds: int | None = None,
        idle_timeout_seconds: int | None = None,
    ) -> AsyncSandbox:
        """A new sandbox from a snapshot, ready when this returns (see ``SandboxClient``)."""
        info = await self._run(
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
        return AsyncSandbox(self, info)

    async def list_snapshots(
        self, labels: Mapping[str, str] | None = None, *, include_deleted: bool = False
    ) -> list[protocol.Snapshot]:
        return await self._run(flows.list_snapshots(self._core, labels, include_deleted))

    async def get_snapshot(self, snapshot_id: str) -> protocol.Snapshot:
        return await self._run(flows.get_snapshot(self._core, snapshot_id))

    async def delete_snapshot(self, snapshot_id: str, recursive: bool = False) -> list[str]:
        return await self._run(flows.delete_snapshot(self._core, snapshot_id, recursive=recursive))

    # --- jobs --------------------------------------------------------------------------------

    async def get_job(self, job_id: str) -> ExecResult:
        return await self._run(flows.get_job(self._core, job_id))

    async def wait_job(
        self, job_id: str, timeout: float = 300, poll_interval: float = 0.1
    ) -> ExecResult:
        return await self._run(
            flows.wait_job(self._core, job_id, timeout=timeout, poll_interval=poll_interval)
        )

    async def cancel_job(self, job_id: str) -> ExecResult:
        return await self._run(flows.cancel_job(self._core, job_id))

    # --- service -----------------------------------------------------------------------------

    async def health(self) -> Health:
        return await self._run(flows.health(self._core))

    async def resources(self) -> protocol.ResourcesReport:
        return await self._run(flows.resources(self._core))

    async def usage(
        self, since: datetime | str | None = None, until: datetime | str | None = None
    ) -> protocol.UsageReport:
        return await self._run(flows.usage(self._core, since, until))

    async def create_key(
        self,
        name: str,
        admin: bool = False,
        *,
        max_sandboxes: int | None = None,
        max_cpu: float | None = None,
        max_memory: str | None = None,
    ) -> protocol.KeyCreated:
        limits = {"max_sandboxes": max_sandboxes, "max_cpu": max_cpu, "max_memory": max_memory}
        return await self._run(flows.create_key(self._core, name, admin, limits))

    async def list_keys(self) -> list[protocol.KeyInfo]:
        return await self._run(flows.list_keys(self._core))

    async def revoke_key(self, key_id: str) -> protocol.KeyInfo:
        return await self._run(flows.revoke_key(self._core, key_id))

    # --- warm pools (admin) ------------------------------------------------------------------

    async def create_pool(
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
        return await self._run(
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

    async def list_pools(self) -> list[protocol.PoolInfo]:
        """Every warm pool, by name, with how many sandboxes are ready and starting (admin)."""
        return await self._run(flows.list_pools(self._core))

    async def get_pool(self, name: str) -> protocol.PoolInfo:
        """One warm pool: its spec, size, ready and starting counts, last refill error (admin)."""
        return await self._run(flows.get_pool(self._core, name))

    async def resize_pool(self, name: str, size: int) -> protocol.PoolInfo:
        """Grow or shrink a pool (admin): shrinking removes waiting sandboxes, not claimed ones."""
        return await self._run(flows.resize_pool(self._core, name, size))

    async def delete_pool(self, name: str) -> protocol.PoolInfo:
        """Remove the pool and the sandboxes waiting in it (claimed ones stay their owners')."""
        return await self._run(flows.delete_pool(self._core, name))

    # --- lifecycle ---------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop heartbeats, delete created sandboxes (``auto_cleanup``), close connections."""
        if self._http.is_closed:
            return
        for sandbox in list(self._heartbeats):
            await sandbox._end_heartbeat()
        try:
            if self._core.auto_cleanup:
                await self.cleanup_all()
        finally:
            await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncSandboxClient(base_url={self.base_url!r})"

    # --- the driver --------------------------------------------------------------------------

    async def _run(self, flow: Flow[_T]) -> _T:
        """Run a flow to its end with awaited I/O."""
        value: object = None
        error: BaseException | None = None
        while True:
            try:
                step = flow.throw(error) if error is not None else flow.send(value)
            except StopIteration as stop:
                return cast(_T, stop.value)
            value, error = None, None
            try:
                value = await self._perform(step)
            except BaseException as exc:  # the flow decides: retry, clean up or re-raise
                error = exc

    async def _perform(self, step: Send | Sleep) -> object:
        if isinstance(step, Sleep):
            await self._sleep(step.seconds)
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
        response = await self._http.send(request, stream=step.stream)
        if step.stream and response.is_error:
            try:
                await response.aread()
            finally:
                await response.aclose()
        return response

    async def _exec_events(
        self, sandbox_id: str, request: protocol.ExecRequest, *, cancel_on_interrupt: bool
    ) -> AsyncIterator[protocol.ExecEvent]:
        replay = flows.StreamReplay(self._core, sandbox_id)
        try:
            while True:
                response = await self._run(flows.open_exec_stream(self._core, sandbox_id, request))
                failure: httpx.TransportError | None = None
                try:
                    async for line in response.aiter_lines():
                        event = replay.feed(line)
                        if event is not None:
                            yield event
                        if replay.final is not None:
                            return
                except httpx.TransportError as exc:
                    failure = exc
                finally:
                    await response.aclose()
                await self._sleep(replay.reconnect_delay(failure))
        except (KeyboardInterrupt, asyncio.CancelledError):
            if cancel_on_interrupt and replay.final is None and request.job_id is not None:
                await self._cancel_interrupted(request.job_id)
            raise

    async def _cancel_interrupted(self, job_id: str) -> None:
        """Cancel a job whose caller was interrupted while it ran (errors are not theirs)."""
        with contextlib.suppress(errors.OrchardError):
            await self.cancel_job(job_id)


class AsyncSandbox(SandboxBase):
    """One sandbox, asyncio flavour (alias ``AsyncSandboxInstance``). ``async with`` deletes it."""

    def __init__(self, client: AsyncSandboxClient, info: protocol.SandboxInfo) -> None:
        super().__init__(info)
        self._client = client
        self._core = client._core
        self._heartbeat_task: asyncio.Task[None] | None = None

    async def refresh(self) -> protocol.SandboxInfo:
        self.info = await self._client._run(flows.get_sandbox(self._core, self.sandbox_id))
        return self.info

    # --- exec --------------------------------------------------------------------------------

    @overload
    async def exec(
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
    async def exec(
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
    ) -> AsyncPtyProcess: ...

    async def exec(
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
    ) -> ExecResult | AsyncPtyProcess:
        """See :meth:`Sandbox.exec`."""
        if pty:
            return await self.pty(
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
        result = await self._client._run(
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
    ) -> AsyncIterator[protocol.ExecEvent]:
        """See :meth:`Sandbox.exec_stream`; iterate with ``async for``. The command is
        cancelled when the task is (Ctrl-C under ``asyncio.run``), unless
        ``cancel_on_interrupt=False``."""
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

    async def exec_streamed(
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
        """See :meth:`Sandbox.exec_streamed`."""
        final: protocol.Job | None = None
        job_id = job_id or flows.new_job_id()
        try:
            async for event in self.exec_stream(
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
        except (KeyboardInterrupt, asyncio.CancelledError):
            if cancel_on_interrupt and final is None:
                await self._client._cancel_interrupted(job_id)
            raise
        result = flows.stream_result(final, timeout)
        if check:
            result.check_returncode()
        return result

    async def get_job(self, job_id: str) -> ExecResult:
        return await self._client.get_job(job_id)

    async def list_jobs(self) -> list[ExecResult]:
        return await self._client._run(flows.list_jobs(self._core, self.sandbox_id))

    async def apply_patch(
        self,
        patch: str,
        timeout: float = 30,
        *,
        cwd: str | None = None,
        check: bool = False,
        three_way: bool = False,
        reverse: bool = False,
    ) -> PatchResult:
        """See :meth:`Sandbox.apply_patch`."""
        return await self._client._run(
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

    async def upload_file(
        self, local_path: str | os.PathLike[str], remote_path: str
    ) -> UploadResult:
        path = Path(local_path)
        stat = local_file(path)

        async def body() -> AsyncIterator[bytes]:
            handle = await asyncio.to_thread(path.open, "rb")
            try:
                while chunk := await asyncio.to_thread(handle.read, CHUNK):
                    yield chunk
            finally:
                handle.close()

        return await self._client._run(
            flows.upload(
                self._core,
                self.sandbox_id,
                remote_path,
                body,
                size=stat.st_size,
                mode=file_mode(stat),
            )
        )

    async def upload_content(self, content: str | bytes, remote_path: str) -> UploadResult:
        data = content.encode() if isinstance(content, str) else content
        return await self._client._run(
            flows.upload(
                self._core, self.sandbox_id, remote_path, lambda: data, size=len(data), mode=None
            )
        )

    async def download_file(self, remote_path: str, local_path: str | os.PathLike[str]) -> int:
        """See :meth:`Sandbox.download_file`."""
        part = await asyncio.to_thread(PartFile, Path(local_path))
        try:
            response = await self._client._run(
                flows.download(self._core, self.sandbox_id, remote_path, stream=True)
            )
            try:
                async for chunk in response.aiter_bytes(CHUNK):
                    await asyncio.to_thread(part.write, chunk)
            except httpx.TransportError as exc:
                raise transport_error(self._core, f"downloading {remote_path}", exc) from exc
            finally:
                await response.aclose()
        except BaseException:
            part.discard()
            raise
        return await asyncio.to_thread(part.commit)

    async def download_content(self, remote_path: str) -> bytes:
        response = await self._client._run(
            flows.download(self._core, self.sandbox_id, remote_path, stream=False)
        )
        return response.content

    async def list_files(self, remote_path: str = "/workspace") -> list[FileEntry]:
        return await self._client._run(flows.list_files(self._core, self.sandbox_id, remote_path))

    async def delete_file(self, path: str, recursive: bool = False) -> None:
        await self._client._run(
            flows.delete_file(self._core, self.sandbox_id, path, recursive=recursive)
        )

    async def mkdir(self, path: str) -> None:
        await self._client._run(flows.mkdir(self._core, self.sandbox_id, path))

    # --- model calls (see docs/harnesses.md) ----------------------------------------------

    async def model_calls(self, trajectory_id: str | None = None) -> list[dict[str, Any]]:
        """The sandbox's recorded model calls (``orchard.model_call/v1``), oldest first."""
        return await self._client._run(
            trajectories.model_calls(self._core, self.sandbox_id, trajectory_id)
        )

    async def trajectories(self) -> list[protocol.TrajectorySummary]:
        """Calls, tokens and errors per trajectory of the sandbox."""
        return await self._client._run(trajectories.trajectories(self._core, self.sandbox_id))

    async def set_trajectory(self, trajectory_id: str) -> None:
        """Send the sandbox's next model calls to ``trajectory_id`` (a new episode)."""
        self.info = await self._client._run(
            trajectories.set_trajectory(self._core, self.sandbox_id, trajectory_id)
        )

    # --- liveness ----------------------------------------------------------------------------

    async def heartbeat(self) -> protocol.HeartbeatResponse:
        return await self._client._run(flows.heartbeat(self._core, self.sandbox_id))

    def start_heartbeat(self, interval: float = 60) -> None:
        """Send a heartbeat every ``interval`` seconds from a background task."""
        if self._heartbeat_task is not None and not self._heartbeat_task.done():
            return

        async def beat() -> None:
            while True:
                await asyncio.sleep(interval)
                try:
                    await self.heartbeat()
                except errors.OrchardError as exc:
                    if not keep_beating(self.sandbox_id, exc):
                        return

        self._heartbeat_task = asyncio.get_running_loop().create_task(
            beat(), name=f"orchard-heartbeat-{self.sandbox_id}"
        )
        self._client._heartbeats.add(self)

    def stop_heartbeat(self) -> None:
        """Cancel the heartbeat task (``await`` of delete() or close() waits for it to end)."""
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()

    async def _end_heartbeat(self) -> None:
        task, self._heartbeat_task = self._heartbeat_task, None
        self._client._heartbeats.discard(self)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # --- snapshots ---------------------------------------------------------------------------

    async def snapshot(
        self,
        name: str | None = None,
        labels: Mapping[str, str] | None = None,
        ttl_seconds: int | None = None,
    ) -> protocol.Snapshot:
        """Snapshot the sandbox's filesystem (not its processes)."""
        return await self._client._run(
            flows.snapshot_sandbox(
                self._core, self.sandbox_id, name=name, labels=labels, ttl_seconds=ttl_seconds
            )
        )

    async def fork(
        self,
        count: int,
        labels: Mapping[str, str] | None = None,
        *,
        allow_partial: bool = False,
    ) -> list[AsyncSandbox]:
        """``count`` ready copies of this sandbox's filesystem, in one call (see
        ``Sandbox.fork``)."""
        infos = await self._client._run(
            flows.fork_sandbox(
                self._core, self.sandbox_id, count, labels=labels, allow_partial=allow_partial
            )
        )
        return [AsyncSandbox(self._client, info) for info in infos]

    # --- terminal ----------------------------------------------------------------------------

    async def pty(
        self,
        cmd: str | list[str] | None = None,
        rows: int = 24,
        cols: int = 80,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        login_shell: bool = False,
    ) -> AsyncPtyProcess:
        """See :meth:`Sandbox.pty`."""
        frame = init_frame(
            cmd, rows=rows, cols=cols, env=dict(env or {}), cwd=cwd, login_shell=login_shell
        )
        return await AsyncPtyProcess.connect(
            ws_url(self._core.base_url, self.sandbox_id), self._core.api_key, frame
        )

    # --- lifecycle ---------------------------------------------------------------------------

    async def delete(self) -> None:
        """Delete the sandbox (nothing happens if it is already gone)."""
        await self._end_heartbeat()
        if not self._deleted:
            await self._client.delete_sandbox(self.sandbox_id, missing_ok=True)
            self._deleted = True

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            await self.delete()
            return
        try:
            await self.delete()
        except errors.OrchardError as failure:  # do not hide the error that got us here
            logger.warning("could not delete sandbox %s: %s", self.sandbox_id, failure)


AsyncSandboxInstance = AsyncSandbox
"""Upstream Orchard Env's name for :class:`AsyncSandbox`."""

share_docs(AsyncSandboxClient, SandboxClient)
share_docs(AsyncSandbox, Sandbox)
