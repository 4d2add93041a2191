"""Every API operation, written once as a flow (see :mod:`orchard_env.sdk._base`).

A flow builds the request(s), decides what to do with each answer and returns the result;
the sync and async clients only run it. Paths and JSON fields are the wire API's
(``/work/notes/wire.md``): upstream Orchard Env's routes plus Orchard's extensions.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import httpx

from orchard_env import errors, protocol
from orchard_env.sdk._base import (
    CLEANUP_TIMEOUT,
    ClientCore,
    Flow,
    RequestBody,
    Retry,
    Send,
    Sleep,
    build,
    call,
    describe,
    error_from_response,
    json_body,
    seg,
    send,
    whole_seconds,
)
from orchard_env.sdk.results import ExecResult, FileEntry, Health, PatchResult, UploadResult

logger = logging.getLogger("orchard_env.sdk")

DEFAULT_READY_TIMEOUT = 3600
"""Seconds create_sandbox waits for readiness when no ``timeout`` is given (upstream's)."""

LONG_POLL = 300
"""Longest single server-side wait we ask for; longer waits are several long-polls."""

EXEC_GRACE = 60
"""Seconds past a command's own timeout that the client waits for its result."""


LIST_CHUNK_SIZE = 500  # sandboxes per page of a list, as kubectl's default


def _sandbox(sandbox_id: str) -> str:
    return f"/sandboxes/{seg(sandbox_id)}"


# --- sandboxes ----------------------------------------------------------------------------


def create_request(
    core: ClientCore,
    *,
    image: str,
    block_network: bool,
    sandbox_id: str | None,
    cpu: str | float | None,
    memory: str | int | None,
    timeout: int | None,
    labels: Mapping[str, str] | None,
    env: Mapping[str, str] | None,
    workdir: str | None,
    ttl_seconds: int | None,
    idle_timeout_seconds: int | None,
    model_gateway: Mapping[str, Any] | None = None,
    tools: bool | Sequence[str] | None = None,
) -> protocol.CreateSandboxRequest:
    return build(
        protocol.CreateSandboxRequest,
        image=image,
        block_network=block_network,
        sandbox_id=core.new_sandbox_id(sandbox_id),
        cpu=cpu,
        memory=memory,
        timeout=timeout,
        labels=dict(labels or {}),
        env=dict(env or {}),
        workdir=workdir,
        ttl_seconds=ttl_seconds,
        idle_timeout_seconds=idle_timeout_seconds,
        model_gateway=None if model_gateway is None else dict(model_gateway),
        tools=tools if tools is None or isinstance(tools, bool) else list(tools),
    )


def create_sandbox(
    core: ClientCore,
    request: protocol.CreateSandboxRequest,
    *,
    wait_ready: bool,
    poll_interval: float,
) -> Flow[protocol.SandboxInfo]:
    """POST, then wait for readiness; whatever goes wrong after the POST deletes the sandbox.

    With a client-chosen id the POST is retried like any idempotent call, and a 409 after a
    failed attempt means that attempt created it: the sandbox is ours, fetch it. Without one,
    the POST is only retried when it provably never reached the server.
    """
    payload = request.model_dump(mode="json", exclude_none=True)
    for empty in ("labels", "env"):
        if not payload[empty]:
            del payload[empty]
    chosen_id = request.sandbox_id is not None
    try:
        outcome = yield from send(
            core,
            Send(
                "POST",
                "/sandboxes",
                json=payload,
                retry=Retry.SAFE if chosen_id else Retry.UNSENT_ONLY,
            ),
        )
    except GeneratorExit:
        raise
    except BaseException as exc:
        # Interrupted mid-POST: the sandbox may exist. With our own id we can remove it.
        if request.sandbox_id is not None and not isinstance(exc, Exception):
            yield from discard(core, request.sandbox_id)
        raise
    response = outcome.response
    if response.status_code == 409 and chosen_id and outcome.maybe_sent_before:
        assert request.sandbox_id is not None
        logger.info(
            "sandbox %s already exists after a retried create: it is ours", request.sandbox_id
        )
        info = yield from get_sandbox(core, request.sandbox_id)
    else:
        info = protocol.SandboxInfo.model_validate(json_body(response))
    core.track(info.sandbox_id)
    if not wait_ready or info.status is protocol.SandboxStatus.READY:  # e.g. from a warm pool
        return info
    try:
        return (
            yield from wait_ready_flow(
                core, info.sandbox_id, timeout=request.timeout, poll_interval=poll_interval
            )
        )
    except GeneratorExit:
        raise
    except BaseException:
        # Failed, timed out, interrupted (Ctrl-C, task cancelled): nobody will get a handle
        # to this sandbox, so it must not be left running.
        yield from discard(core, info.sandbox_id)
        raise


def wait_ready_flow(
    core: ClientCore, sandbox_id: str, *, timeout: int | None, poll_interval: float
) -> Flow[protocol.SandboxInfo]:
    limit = timeout or DEFAULT_READY_TIMEOUT
    deadline = core.clock() + limit
    while True:
        chunk = whole_seconds(min(deadline - core.clock(), LONG_POLL))
        try:
            data = yield from call(
                core,
                Send(
                    "GET",
                    f"{_sandbox(sandbox_id)}/wait",
                    params=[("timeout", str(chunk))],
                    timeout=chunk + 30,
                ),
            )
        except errors.Timeout:
            info = None
        else:
            info = protocol.SandboxInfo.model_validate(data)
            if info.ready or info.status is protocol.SandboxStatus.READY:
                return info
            if info.status is protocol.SandboxStatus.FAILED:
                raise errors.SandboxNotReady(
                    f"sandbox {sandbox_id} failed to start: "
                    f"{info.status_message or 'no reason given'}; it was deleted",
                    hint="check the image and the resources asked for; the service log has more",
                )
            if info.status in (protocol.SandboxStatus.DELETED, protocol.SandboxStatus.NOT_FOUND):
                raise errors.SandboxNotFound(f"sandbox {sandbox_id} was deleted while starting")
        if core.clock() >= deadline:
            state = f" (last status: {info.status.value})" if info else ""
            raise errors.Timeout(
                f"sandbox {sandbox_id} did not become ready within {limit}s{state}; it was deleted",
                hint="pass a larger timeout= to create_sandbox, or check the service's capacity",
            )
        if info is not None:  # the server's wait returned early: do not spin
            yield Sleep(poll_interval)


def discard(core: ClientCore, sandbox_id: str) -> Flow[bool]:
    """Delete a sandbox while cleaning up: False (and a log line) if it failed, never raise."""
    try:
        yield from delete_sandbox(core, sandbox_id, missing_ok=True, quick=True)
    except errors.OrchardError as exc:
        logger.warning(
            "could not delete sandbox %s (%s); with auto_cleanup it is retried at exit",
            sandbox_id,
            exc,
        )
        return False
    return True


def get_sandbox(core: ClientCore, sandbox_id: str) -> Flow[protocol.SandboxInfo]:
    # A deleted sandbox is 404 to upstream's clients; this SDK shows its record (and why).
    params = [("include_deleted", "true")]
    data = yield from call(core, Send("GET", _sandbox(sandbox_id), params=params))
    return protocol.SandboxInfo.model_validate(data)


def list_sandboxes(
    core: ClientCore,
    labels: Mapping[str, str] | None,
    status: str | protocol.SandboxStatus | None,
    include_deleted: bool,
    chunk_size: int = LIST_CHUNK_SIZE,
) -> Flow[list[protocol.SandboxInfo]]:
    """Every sandbox that matches, fetched ``chunk_size`` at a time (as kubectl's
    ``--chunk-size``), so a large list is never one huge answer."""
    params = [("label", f"{key}={value}") for key, value in (labels or {}).items()]
    if status is not None:
        try:
            params.append(("status", protocol.SandboxStatus(status).value))
        except ValueError:
            known = ", ".join(s.value for s in protocol.SandboxStatus)
            raise errors.InvalidRequest(
                f"unknown sandbox status {status!r}", hint=f"use one of {known}"
            ) from None
    if include_deleted:
        params.append(("include_deleted", "true"))
    if chunk_size < 1:
        raise errors.InvalidRequest(
            f"chunk_size must be at least 1, not {chunk_size}", hint="500 is the default"
        )
    params.append(("limit", str(chunk_size)))
    sandboxes: list[protocol.SandboxInfo] = []
    token: str | None = None
    while True:
        page_params = params if token is None else [*params, ("continue", token)]
        data = yield from call(core, Send("GET", "/sandboxes", params=page_params))
        page = protocol.SandboxList.model_validate(data)
        sandboxes.extend(page.sandboxes)
        if page.continue_token is None:
            return sandboxes
        token = page.continue_token


def delete_sandbox(
    core: ClientCore, sandbox_id: str, *, missing_ok: bool, quick: bool = False
) -> Flow[bool]:
    """Delete; True if it was deleted now, False if it was already gone (``missing_ok``).

    A 404, or ``already_deleted``, after an attempt whose answer was lost means that attempt
    deleted it: True.
    """
    req = Send(
        "DELETE",
        _sandbox(sandbox_id),
        timeout=CLEANUP_TIMEOUT if quick else None,
        max_retries=1 if quick else None,
    )
    outcome = yield from send(core, req)
    if outcome.response.is_error:
        error = error_from_response(outcome.response)
        if not isinstance(error, errors.SandboxNotFound):
            raise error
    elif protocol.DeleteResponse.model_validate(json_body(outcome.response)).already_deleted:
        error = errors.SandboxNotFound(f"sandbox {sandbox_id} was already deleted")
    else:
        core.untrack(sandbox_id)
        return True
    core.untrack(sandbox_id)
    if outcome.maybe_sent_before:
        return True
    if not missing_ok:
        raise error
    return False


def heartbeat(core: ClientCore, sandbox_id: str) -> Flow[protocol.HeartbeatResponse]:
    # Short timeout: a background heartbeat must never hold up close() for long.
    data = yield from call(core, Send("POST", f"{_sandbox(sandbox_id)}/heartbeat", timeout=30))
    return protocol.HeartbeatResponse.model_validate(data)


# --- exec and jobs ------------------------------------------------------------------------


def exec_request(
    command: str | list[str],
    *,
    timeout: float | None,
    cwd: str | None,
    env: Mapping[str, str] | None,
    login_shell: bool,
    stdin: str | bytes | None,
    job_id: str | None,
    wait: bool,
    check: bool,
    shell: bool = True,
) -> protocol.ExecRequest:
    """The request exec and exec_stream send; always carries a client-chosen job id.

    ``shell=False`` sends a list as ``argv`` (an exact argv, no shell); otherwise it is
    ``command``, which a list reaches joined with spaces, as upstream ran it.
    """
    if not shell and not isinstance(command, list):
        raise errors.InvalidRequest(
            "shell=False needs the command as a list (an exact argv)",
            hint='e.g. exec(["ls", "-l", "my file"], shell=False); a string is shell text',
        )
    if check and not wait:
        raise errors.InvalidRequest(
            "check=True needs wait=True: a job still running has no exit code to check",
            hint="call check_returncode() on wait_job(job_id)'s result instead",
        )
    if isinstance(stdin, bytes):
        try:
            stdin = stdin.decode()
        except UnicodeDecodeError:
            raise errors.InvalidRequest(
                "stdin must be UTF-8 text",
                hint="upload binary input as a file (upload_content) and redirect from it",
            ) from None
    return build(
        protocol.ExecRequest,
        command=command if shell else None,
        argv=None if shell else command,
        timeout_seconds=whole_seconds(300 if timeout is None else timeout),
        cwd=cwd,
        env=dict(env or {}),
        login_shell=login_shell,
        wait=wait,
        job_id=job_id or new_job_id(),
        stdin=stdin,
    )


def new_job_id() -> str:
    return uuid.uuid4().hex


def _exec_payload(request: protocol.ExecRequest) -> dict[str, Any]:
    return request.model_dump(mode="json", exclude_none=True)


def exec_command(
    core: ClientCore, sandbox_id: str, request: protocol.ExecRequest, *, poll_interval: float
) -> Flow[ExecResult]:
    """Run a command exactly once, however often the connection drops.

    The job id is chosen here, so every retry of the POST names the same job and the server
    returns it instead of starting the command again. If the server's own wait runs out
    first, long-poll ``/jobs/{id}/wait`` until the job is done or our deadline passes.
    """
    limit = request.timeout_seconds + EXEC_GRACE
    started = core.clock()
    data = yield from call(
        core,
        Send(
            "POST",
            f"{_sandbox(sandbox_id)}/exec",
            json=_exec_payload(request),
            timeout=limit if request.wait else None,
        ),
    )
    result = _job(data, request.timeout_seconds)
    if not request.wait or result.is_complete:
        return result
    result = yield from wait_job(
        core,
        result.job_id,
        timeout=limit - (core.clock() - started),
        poll_interval=poll_interval,
        command_timeout=request.timeout_seconds,
    )
    if not result.is_complete:
        raise errors.Timeout(
            f"job {result.job_id} ({result.command!r}) is still {result.status.value} "
            f"{limit}s after it was submitted with a {request.timeout_seconds}s timeout",
            hint="the sandbox may be overloaded; get_job(job_id) shows its state, "
            "cancel_job(job_id) stops it",
        )
    return result


def _job(data: Any, command_timeout: int | None = None) -> ExecResult:
    result = ExecResult.model_validate(data)
    result._timeout_seconds = command_timeout
    return result


def wait_job(
    core: ClientCore,
    job_id: str,
    *,
    timeout: float,
    poll_interval: float,
    command_timeout: int | None = None,
) -> Flow[ExecResult]:
    """Long-poll until the job is done or ``timeout`` passes; return its latest state."""
    deadline = core.clock() + max(timeout, 0.0)
    while True:
        chunk = whole_seconds(min(deadline - core.clock(), LONG_POLL))
        data = yield from call(
            core,
            Send(
                "GET",
                f"/jobs/{seg(job_id)}/wait",
                params=[("timeout", str(chunk))],
                timeout=chunk + 30,
            ),
        )
        result = _job(data, command_timeout)
        if result.is_complete or core.clock() >= deadline:
            return result
        # An early answer (e.g. another replica's wait): pause before asking again.
        yield Sleep(min(poll_interval, max(deadline - core.clock(), 0.0)))


def get_job(core: ClientCore, job_id: str) -> Flow[ExecResult]:
    data = yield from call(core, Send("GET", f"/jobs/{seg(job_id)}"))
    return _job(data)


def cancel_job(core: ClientCore, job_id: str) -> Flow[ExecResult]:
    data = yield from call(core, Send("POST", f"/jobs/{seg(job_id)}/cancel"))
    return _job(data)


def list_jobs(core: ClientCore, sandbox_id: str) -> Flow[list[ExecResult]]:
    data = yield from call(core, Send("GET", f"{_sandbox(sandbox_id)}/jobs"))
    return [_job(item) for item in data]


def open_exec_stream(
    core: ClientCore, sandbox_id: str, request: protocol.ExecRequest
) -> Flow[httpx.Response]:
    """Open ``/exec/stream`` (NDJSON). Re-opening with the same job id replays its output."""
    outcome = yield from send(
        core,
        Send(
            "POST",
            f"{_sandbox(sandbox_id)}/exec/stream",
            json=_exec_payload(request),
            timeout=request.timeout_seconds + EXEC_GRACE,
            stream=True,
        ),
    )
    if outcome.response.is_error:
        raise error_from_response(outcome.response)
    return outcome.response


class StreamReplay:
    """Turns NDJSON lines into events, dropping what a re-attached stream replays.

    When the connection drops (or the stream ends without its ``exit`` event), the client
    sleeps :meth:`reconnect_delay` and opens the stream again with the same job id; the
    server replays the job's output from the start, and this yields only the part of each
    stream not delivered before (and ``started`` only once).
    """

    def __init__(self, core: ClientCore, sandbox_id: str) -> None:
        self._core = core
        self._sandbox_id = sandbox_id
        self._delivered = {"stdout": 0, "stderr": 0}
        self._seen = {"stdout": 0, "stderr": 0}
        self._started = False
        self._reconnects = 0
        self.final: ExecResult | None = None

    def reconnect_delay(self, failure: httpx.TransportError | None) -> float:
        """Seconds to wait before re-attaching, or raise once the retries are used up."""
        reason = describe(failure) if failure is not None else "the stream ended early"
        retries = self._core.retry.retries
        if self._reconnects >= retries:
            raise errors.ServiceUnreachable(
                f"lost the output stream of a command in sandbox {self._sandbox_id} at "
                f"{self._core.base_url} ({reason}); gave up after {retries} reconnects",
                hint="the command may still be running: list_jobs() shows it",
            )
        delay = self._core.retry.backoff(self._reconnects, self._core.rng)
        self._reconnects += 1
        self._seen = {"stdout": 0, "stderr": 0}
        logger.info(
            "exec stream in sandbox %s interrupted (%s); re-attaching in %.2fs (%d/%d)",
            self._sandbox_id,
            reason,
            delay,
            self._reconnects,
            retries,
        )
        return delay

    def feed(self, line: str) -> protocol.ExecEvent | None:
        if not line.strip():
            return None
        event = protocol.ExecEvent.model_validate_json(line)
        if event.event == "started":
            if self._started:
                return None
            self._started = True
            return event
        if event.event == "error":  # ended by the service: re-attaching would not help
            raise errors.error_class(event.code or "internal")(event.message or "stream ended")
        if event.event == "exit":
            assert event.job is not None, "exit events carry the job"
            self.final = ExecResult.model_validate(event.job.model_dump())
            return event
        text = event.data or ""
        seen = self._seen[event.event]
        fresh = text[max(self._delivered[event.event] - seen, 0) :]
        self._seen[event.event] = seen + len(text)
        if not fresh:
            return None
        self._delivered[event.event] += len(fresh)
        return event.model_copy(update={"data": fresh})


def stream_result(job: protocol.Job | None, timeout: float | None) -> ExecResult:
    """The result of a streamed exec, from its ``exit`` event's job."""
    if job is None:
        raise errors.OrchardError("the output stream ended without the command's exit status")
    result = ExecResult.model_validate(job.model_dump())
    result._timeout_seconds = whole_seconds(300 if timeout is None else timeout)
    return result


# --- patches and files --------------------------------------------------------------------


def apply_patch(
    core: ClientCore,
    sandbox_id: str,
    patch: str,
    *,
    timeout: float,
    cwd: str | None,
    check: bool,
    three_way: bool,
    reverse: bool,
) -> Flow[PatchResult]:
    request = build(
        protocol.PatchRequest,
        patch=patch,
        timeout_seconds=whole_seconds(timeout),
        cwd=cwd,
        check=check,
        three_way=three_way,
        reverse=reverse,
    )
    data = yield from call(
        core,
        Send(
            "POST",
            f"{_sandbox(sandbox_id)}/apply_patch",
            json=request.model_dump(mode="json", exclude_none=True),
            timeout=request.timeout_seconds + EXEC_GRACE,
            # Applying a patch twice fails the second time: never resend one that may have run.
            retry=Retry.UNSENT_ONLY,
        ),
    )
    return PatchResult.model_validate(data)


def upload(
    core: ClientCore,
    sandbox_id: str,
    remote_path: str,
    body: Callable[[], RequestBody],
    *,
    size: int,
    mode: int | None,
) -> Flow[UploadResult]:
    """``PUT /files/raw``: the body is streamed as is (no base64), re-sent whole on retry."""
    params = [("path", remote_path)]
    if mode is not None:
        params.append(("mode", format(mode & 0o7777, "04o")))
    data = yield from call(
        core,
        Send(
            "PUT",
            f"{_sandbox(sandbox_id)}/files/raw",
            params=params,
            content=body,
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)},
        ),
    )
    return UploadResult.model_validate(data)


def download(
    core: ClientCore, sandbox_id: str, remote_path: str, *, stream: bool
) -> Flow[httpx.Response]:
    """``GET /files/raw``; with ``stream`` the body is left for the caller to read."""
    outcome = yield from send(
        core,
        Send(
            "GET",
            f"{_sandbox(sandbox_id)}/files/raw",
            params=[("path", remote_path)],
            stream=stream,
        ),
    )
    if outcome.response.is_error:
        raise error_from_response(outcome.response)
    return outcome.response


def list_files(core: ClientCore, sandbox_id: str, remote_path: str) -> Flow[list[FileEntry]]:
    data = yield from call(
        core, Send("GET", f"{_sandbox(sandbox_id)}/files/list", params=[("path", remote_path)])
    )
    listing = protocol.FileList.model_validate(data)
    return [FileEntry.model_validate(entry, from_attributes=True) for entry in listing.files]


def delete_file(core: ClientCore, sandbox_id: str, path: str, *, recursive: bool) -> Flow[None]:
    params = [("path", path), ("recursive", "true" if recursive else "false")]
    yield from call(core, Send("DELETE", f"{_sandbox(sandbox_id)}/files", params=params))


def mkdir(core: ClientCore, sandbox_id: str, path: str) -> Flow[None]:
    request = build(protocol.MkdirRequest, path=path, parents=True)
    yield from call(
        core,
        Send("POST", f"{_sandbox(sandbox_id)}/files/mkdir", json=request.model_dump(mode="json")),
    )


# --- service, usage, keys -----------------------------------------------------------------


def health(core: ClientCore) -> Flow[Health]:
    data = yield from call(core, Send("GET", "/health"))
    return Health.model_validate(data)


def resources(core: ClientCore) -> Flow[protocol.ResourcesReport]:
    data = yield from call(core, Send("GET", "/resources"))
    return protocol.ResourcesReport.model_validate(data)


def usage(
    core: ClientCore, since: datetime | str | None, until: datetime | str | None
) -> Flow[protocol.UsageReport]:
    params = [
        (name, value.isoformat() if isinstance(value, datetime) else value)
        for name, value in (("since", since), ("until", until))
        if value is not None
    ]
    data = yield from call(core, Send("GET", "/usage", params=params))
    return protocol.UsageReport.model_validate(data)


def create_key(
    core: ClientCore, name: str, admin: bool, limits: dict[str, Any]
) -> Flow[protocol.KeyCreated]:
    request = build(protocol.KeyCreateRequest, name=name, admin=admin, **limits)
    data = yield from call(
        core,
        Send("POST", "/keys", json=request.model_dump(mode="json"), retry=Retry.UNSENT_ONLY),
    )
    return protocol.KeyCreated.model_validate(data)


def list_keys(core: ClientCore) -> Flow[list[protocol.KeyInfo]]:
    data = yield from call(core, Send("GET", "/keys"))
    return [protocol.KeyInfo.model_validate(item) for item in data]


def revoke_key(core: ClientCore, key_id: str) -> Flow[protocol.KeyInfo]:
    data = yield from call(core, Send("DELETE", f"/keys/{seg(key_id)}"))
    return protocol.KeyInfo.model_validate(data)


# --- warm pools (admin) -------------------------------------------------------------------


def _pool(name: str) -> str:
    return f"/pools/{seg(name)}"


def create_pool(
    core: ClientCore,
    name: str,
    image: str,
    size: int,
    *,
    block_network: bool,
    cpu: str | float | None,
    memory: str | int | None,
    env: Mapping[str, str] | None,
    workdir: str | None,
    ttl_seconds: int | None,
) -> Flow[protocol.PoolInfo]:
    request = build(
        protocol.PoolCreateRequest,
        name=name,
        image=image,
        size=size,
        block_network=block_network,
        cpu=cpu,
        memory=memory,
        env=dict(env or {}),
        workdir=workdir,
        ttl_seconds=ttl_seconds,
    )
    data = yield from call(
        core,
        Send(
            "POST",
            "/pools",
            json=request.model_dump(mode="json", exclude_none=True),
            retry=Retry.UNSENT_ONLY,
        ),
    )
    return protocol.PoolInfo.model_validate(data)


def list_pools(core: ClientCore) -> Flow[list[protocol.PoolInfo]]:
    data = yield from call(core, Send("GET", "/pools"))
    return protocol.PoolList.model_validate(data).pools


def get_pool(core: ClientCore, name: str) -> Flow[protocol.PoolInfo]:
    data = yield from call(core, Send("GET", _pool(name)))
    return protocol.PoolInfo.model_validate(data)


def resize_pool(core: ClientCore, name: str, size: int) -> Flow[protocol.PoolInfo]:
    request = build(protocol.PoolResizeRequest, size=size)
    data = yield from call(core, Send("PATCH", _pool(name), json=request.model_dump(mode="json")))
    return protocol.PoolInfo.model_validate(data)


def delete_pool(core: ClientCore, name: str) -> Flow[protocol.PoolInfo]:
    data = yield from call(core, Send("DELETE", _pool(name)))
    return protocol.PoolInfo.model_validate(data)


# --- snapshots, restore and fork ----------------------------------------------------------


def _snapshot(snapshot_id: str) -> str:
    return f"/snapshots/{seg(snapshot_id)}"


def snapshot_sandbox(
    core: ClientCore,
    sandbox_id: str,
    *,
    name: str | None,
    labels: Mapping[str, str] | None,
    ttl_seconds: int | None,
) -> Flow[protocol.Snapshot]:
    request = build(
        protocol.SnapshotRequest, name=name, labels=dict(labels or {}), ttl_seconds=ttl_seconds
    )
    data = yield from call(
        core,
        Send(
            "POST",
            f"{_sandbox(sandbox_id)}/snapshot",
            json=request.model_dump(mode="json", exclude_none=True),
            # Sent twice, it would take two snapshots.
            retry=Retry.UNSENT_ONLY,
        ),
    )
    return protocol.Snapshot.model_validate(data)


def restore_snapshot(
    core: ClientCore,
    snapshot_id: str,
    *,
    sandbox_id: str | None,
    labels: Mapping[str, str] | None,
    env: Mapping[str, str] | None,
    timeout: int | None,
    ttl_seconds: int | None,
    idle_timeout_seconds: int | None,
) -> Flow[protocol.SandboxInfo]:
    """POST restore; the answer is the sandbox, ready. Retried like a create: with a
    client-chosen id a 409 after a lost answer means the earlier attempt made it."""
    request = build(
        protocol.RestoreRequest,
        sandbox_id=core.new_sandbox_id(sandbox_id),
        labels=dict(labels or {}),
        env=dict(env or {}),
        timeout=timeout,
        ttl_seconds=ttl_seconds,
        idle_timeout_seconds=idle_timeout_seconds,
    )
    chosen_id = request.sandbox_id
    try:
        outcome = yield from send(
            core,
            Send(
                "POST",
                f"{_snapshot(snapshot_id)}/restore",
                json=request.model_dump(mode="json", exclude_none=True),
                retry=Retry.SAFE if chosen_id else Retry.UNSENT_ONLY,
            ),
        )
    except GeneratorExit:
        raise
    except BaseException as exc:
        if chosen_id is not None and not isinstance(exc, Exception):  # interrupted mid-POST
            yield from discard(core, chosen_id)
        raise
    response = outcome.response
    if response.is_error:
        error = error_from_response(response)
        if not (
            isinstance(error, errors.SandboxExists) and chosen_id and outcome.maybe_sent_before
        ):
            raise error
        info = yield from get_sandbox(core, chosen_id)
        if info.source_snapshot != snapshot_id:
            raise error
        core.track(info.sandbox_id)
        return (yield from wait_ready_flow(core, chosen_id, timeout=timeout, poll_interval=1.0))
    info = protocol.SandboxInfo.model_validate(json_body(response))
    core.track(info.sandbox_id)
    return info


def fork_sandbox(
    core: ClientCore,
    sandbox_id: str,
    count: int,
    *,
    labels: Mapping[str, str] | None,
    allow_partial: bool,
) -> Flow[list[protocol.SandboxInfo]]:
    """POST fork; the forks that came up, ready. Unless ``allow_partial``, any failure
    deletes the forks that did come up and raises the first failure's error, naming all."""
    ids = None
    if core.prefix is not None:  # the client picks the ids, so they carry its prefix
        ids = [f"{core.prefix}-{uuid.uuid4().hex[:8]}" for _ in range(count)]
    request = build(protocol.ForkRequest, count=count, labels=dict(labels or {}), sandbox_ids=ids)
    data = yield from call(
        core,
        Send(
            "POST",
            f"{_sandbox(sandbox_id)}/fork",
            json=request.model_dump(mode="json", exclude_none=True),
            retry=Retry.UNSENT_ONLY,
        ),
    )
    result = protocol.ForkResult.model_validate(data)
    for info in result.sandboxes:
        core.track(info.sandbox_id)
    if not result.failures:
        return result.sandboxes
    details = "; ".join(f"{f.sandbox_id}: {f.message}" for f in result.failures)
    if allow_partial:
        logger.warning(
            "%d of %d forks of sandbox %s failed: %s",
            len(result.failures),
            count,
            sandbox_id,
            details,
        )
        return result.sandboxes
    for info in result.sandboxes:
        yield from discard(core, info.sandbox_id)
    raise errors.error_class(result.failures[0].code)(
        f"{len(result.failures)} of {count} forks of sandbox {sandbox_id} failed ({details}); "
        f"the {len(result.sandboxes)} that started were deleted "
        f"(snapshot {result.snapshot.snapshot_id} is kept)",
        hint="fork(..., allow_partial=True) keeps the forks that started",
    )


def list_snapshots(
    core: ClientCore, labels: Mapping[str, str] | None, include_deleted: bool
) -> Flow[list[protocol.Snapshot]]:
    params = [("label", f"{key}={value}") for key, value in (labels or {}).items()]
    if include_deleted:
        params.append(("include_deleted", "true"))
    data = yield from call(core, Send("GET", "/snapshots", params=params))
    return protocol.SnapshotList.model_validate(data).snapshots


def get_snapshot(core: ClientCore, snapshot_id: str) -> Flow[protocol.Snapshot]:
    data = yield from call(core, Send("GET", _snapshot(snapshot_id)))
    return protocol.Snapshot.model_validate(data)


def delete_snapshot(core: ClientCore, snapshot_id: str, *, recursive: bool) -> Flow[list[str]]:
    """The ids deleted (children first). A 404 after an attempt whose answer was lost means
    that attempt deleted it."""
    params = [("recursive", "true" if recursive else "false")]
    outcome = yield from send(core, Send("DELETE", _snapshot(snapshot_id), params=params))
    response = outcome.response
    if response.status_code == 404 and outcome.maybe_sent_before:
        return [snapshot_id]
    return protocol.SnapshotDeleteResult.model_validate(json_body(response)).deleted
