"""The agent's routes, its enrollment and request authentication (see :mod:`.proof`), and
its entry point (``main``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import files, proof
from .http import (
    MAX_HEADER_BYTES,
    HTTPError,
    Request,
    decode_b64,
    error_response,
    invalid,
    log,
    read_request,
    string_map,
)
from .jobs import DEFAULT_MAX_OUTPUT, Job, JobTable
from .procs import Processes, command_env, initial_environ, kill_tree, with_tools_path

if TYPE_CHECKING:
    from .model import Relay  # imported only for a sandbox with a model gateway

AGENT_VERSION = "0.1.0"
MAX_ENROLL_BODY = 1024 * 1024
STREAM_CHUNK = 256 * 1024  # bytes of a job's event log sent per write
DEFAULT_WORKDIR = "/workspace"


class Agent:
    """Routes, jobs and PTY sessions of one agent process."""

    def __init__(self, workdir: str) -> None:
        self.key: bytes | None = None  # the sandbox's key, from the orchestrator's enrollment
        self.workdir = workdir
        self.base_env = with_tools_path(command_env(initial_environ(), sys.prefix))
        self.umask = os.umask(0o022)
        os.umask(self.umask)
        self.procs = Processes()
        self.jobs = JobTable(self.procs)
        self.model_relay: Relay | None = None  # for a sandbox with a model gateway

    def shutdown(self) -> None:
        """Kill every running command and PTY session (the agent is stopping)."""
        self.jobs.kill_all()
        for root in self.procs.pty_roots:
            kill_tree(root)

    # HTTP

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    req = await read_request(reader, writer)
                except HTTPError as exc:
                    writer.write(error_response(exc))
                    await writer.drain()
                    break
                if req is None:
                    break
                await self.respond(req)
                if not req.keep_alive:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def respond(self, req: Request) -> None:
        try:
            await self.route(req)
            if not req.body_done:
                await req.discard_body()
        except HTTPError as exc:
            if req.started:
                req.keep_alive = False
                return
            if not req.body_done and exc.status != 413:
                await req.discard_body()
            await req.send_json(exc.status, {"code": exc.code, "message": exc.message})
        except (ConnectionError, asyncio.IncompleteReadError):
            raise
        except Exception as exc:
            import traceback  # only on the rare failure path

            log(f"{req.method} {req.path} failed:\n{traceback.format_exc()}")
            req.keep_alive = False
            if not req.started:
                await req.send_json(500, {"code": "internal", "message": f"agent error: {exc!r}"})

    async def route(self, req: Request) -> None:
        method, path = req.method, req.path
        if path == "/health" and method == "GET":
            if "authorization" in req.headers:  # a proven answer: the orchestrator's probe
                self.check_auth(req)
            status = {"status": "ok", "pid": os.getpid(), "version": AGENT_VERSION}
            await req.send_json(200, {**status, "enrolled": self.key is not None})
            return
        if path == "/enroll" and method == "POST":
            await self.enroll(req)
            return
        self.check_auth(req)
        routes: dict[tuple[str, str], Callable[[Request], Any]] = {
            ("POST", "/exec"): self.exec,
            ("GET", "/files"): lambda req: files.read_file(req, self.path_arg(req)),
            ("PUT", "/files"): lambda req: files.write_file(req, self.path_arg(req), self.umask),
            ("DELETE", "/files"): lambda req: files.delete_path(req, self.path_arg(req)),
            ("GET", "/files/list"): lambda req: files.list_dir(req, self.path_arg(req)),
            ("POST", "/files/mkdir"): lambda req: files.make_dir(req, self.path_arg(req)),
            ("GET", "/pty"): self.pty,
            ("POST", "/model/relay"): self.model_park,
        }
        handler = routes.get((method, path))
        if handler is not None:
            await handler(req)
            return
        if path.startswith("/exec/"):
            job_id, _, action = path[len("/exec/") :].partition("/")
            if action == "" and method == "GET":
                await self.stream_job(req, self.jobs[job_id])
                return
            if action == "cancel" and method == "POST":
                cancelled = self.jobs.cancel(job_id)
                await req.send_json(200, {"job_id": job_id, "cancelled": cancelled})
                return
        elif path in {p for _, p in routes}:
            raise HTTPError(405, "invalid_request", f"{method} is not allowed on {path}")
        raise HTTPError(404, "not_found", f"no route {method} {path}")

    def check_auth(self, req: Request, key: bytes | None = None) -> None:
        """Accept only a request MAC'd with the sandbox's key (``key``: the one being enrolled);
        from then on every answer to it is proven with the same key and nonce."""
        key = key or self.key
        if key is None:
            raise HTTPError(401, "unauthenticated", "the agent is not enrolled yet")
        scheme, _, given = req.headers.get("authorization", "").partition(" ")
        nonce = req.headers.get(proof.NONCE_HEADER.lower(), "")
        body = req.headers.get(proof.BODY_HEADER.lower(), "")
        if scheme != proof.SCHEME or not nonce or not body:
            raise HTTPError(
                401, "unauthenticated", f"missing 'Authorization: {proof.SCHEME} <mac>' and nonce"
            )
        expected = proof.request_mac(key, nonce, req.method, req.target, body)
        if not proof.same(given.strip(), expected):
            raise HTTPError(401, "unauthenticated", "invalid request MAC")
        req.key, req.nonce, req.body_digest = key, nonce, body
        if not req.has_body:
            req.check_body(proof.digest(b""))

    async def enroll(self, req: Request) -> None:
        """Take the sandbox's key and environment, once: the orchestrator's first request."""
        if self.key is not None:
            self.check_auth(req)  # 401 unless it is the key the agent holds
            raise HTTPError(409, "conflict", "the agent is enrolled already")
        raw = await req.read_body(MAX_ENROLL_BODY)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise invalid("the enrollment must be a JSON object {key, env}")
        key, env = body.get("key"), string_map(body.get("env"), "env")
        if not isinstance(key, str) or not key:
            raise invalid("key must be a non-empty string")
        self.check_auth(req, key.encode())
        req.check_body(proof.digest(raw))
        if "model" in body:  # a model gateway: imported only for a sandbox that has one
            from . import model

            self.model_relay = await model.start(body["model"])
        self.key = key.encode()
        self.base_env = with_tools_path({**self.base_env, **env})
        log("enrolled")
        await req.send_json(200, {"enrolled": True})

    async def model_park(self, req: Request) -> None:
        if self.model_relay is None:
            raise HTTPError(409, "conflict", "this sandbox has no model gateway")
        await self.model_relay.park(req)

    def resolve(self, raw: str) -> str:
        if "\0" in raw:
            raise invalid("path contains a NUL byte")
        # normpath keeps a leading "//" (POSIX leaves its meaning open); "//" is "/" here.
        path = os.path.normpath(os.path.join(self.workdir, raw))
        return "/" + path.lstrip("/") if path.startswith("//") else path

    def path_arg(self, req: Request) -> str:
        return self.resolve(req.arg("path"))

    async def pty(self, req: Request) -> None:
        from .pty import serve_pty  # terminals are rare: not in the idle agent's memory

        await serve_pty(req, self.procs, self.base_env, self.resolve)

    # exec

    async def exec(self, req: Request) -> None:
        body = await req.json()
        command = body.get("command")
        if isinstance(command, str):
            if not command.strip():
                raise invalid("command is empty")
        elif not (
            isinstance(command, list) and command and all(isinstance(a, str) for a in command)
        ):
            raise invalid("command must be a non-empty string or a non-empty list of strings")
        job_id = body.get("job_id") or os.urandom(16).hex()
        if not isinstance(job_id, str) or len(job_id) > 128:
            raise invalid("job_id must be a string of at most 128 characters")
        fingerprint = json.dumps(command)
        job = self.jobs.get(job_id)
        if job is not None:
            if job.fingerprint != fingerprint:
                raise HTTPError(
                    409, "conflict", f"job_id {job_id} is already used by a different command"
                )
            await self.stream_job(req, job)
            return
        cwd = self.resolve(body.get("cwd") or self.workdir)
        if not os.path.isdir(cwd):
            what = "is not a directory" if os.path.exists(cwd) else "does not exist"
            raise invalid(f"cwd {cwd} {what}")
        env = {**self.base_env, **string_map(body.get("env"), "env")}
        timeout = body.get("timeout")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0
        ):
            raise invalid("timeout must be a positive number of seconds")
        max_output = body.get("max_output_bytes")
        if max_output is None:
            max_output = DEFAULT_MAX_OUTPUT
        elif isinstance(max_output, bool) or not isinstance(max_output, int) or max_output < 0:
            raise invalid("max_output_bytes must be a non-negative integer")
        stdin = body.get("stdin")
        data = None if stdin is None else decode_b64(stdin, "stdin")
        job = self.jobs.add(job_id, fingerprint, max_output)
        login = bool(body.get("login_shell"))
        if self.jobs.was_cancelled_ahead(job_id):
            job.end_cancelled()
        else:
            job.start(command, login, cwd, env, float(timeout) if timeout else None, data)
        await self.stream_job(req, job)

    async def stream_job(self, req: Request, job: Job) -> None:
        """Replay the job's events from the start, follow live output, end with ``x``."""
        await req.discard_body()
        req.start_chunked("application/x-ndjson")
        sent = 0
        while True:
            chunk = job.log.read(sent, STREAM_CHUNK)
            if chunk:
                req.write_chunk(chunk)
                sent += len(chunk)
                await req.writer.drain()
            elif job.final is not None:
                req.write_chunk(job.final)
                break
            else:
                await job.changed()
        req.end_chunked()
        await req.writer.drain()

    # files


def parse_listen(value: str) -> tuple[str, str, int]:
    """``unix:/path`` -> ("unix", path, 0); ``tcp:HOST:PORT`` -> ("tcp", host, port)."""
    kind, _, rest = value.partition(":")
    if kind == "unix" and rest.startswith("/"):
        return "unix", rest, 0
    if kind == "tcp":
        host, _, port = rest.rpartition(":")
        if host and port.isdigit() and 0 < int(port) < 65536:
            return "tcp", host.strip("[]"), int(port)
    raise ValueError(f"--listen {value!r} must be unix:/abs/path.sock or tcp:HOST:PORT")


def become_undumpable() -> bool:
    """Make this process non-dumpable, so that nothing in the sandbox without CAP_SYS_PTRACE
    (root included) can ptrace it or read its memory, environ or fds through /proc.

    The kernel clears the dumpable flag (to ``fs.suid_dumpable``, 0 or 2: neither lets a
    process without CAP_SYS_PTRACE in) whenever the effective gid changes, so changing it and
    back does what ``prctl(PR_SET_DUMPABLE, 0)`` would, without ctypes. It needs CAP_SETGID
    (an agent running as root); False where it cannot.
    """
    gid = os.getegid()
    try:
        os.setegid(gid + 1 if gid < 65534 else gid - 1)
        os.setegid(gid)
    except OSError:
        return False
    return True


async def serve(listen: tuple[str, str, int], workdir: str) -> None:
    loop = asyncio.get_running_loop()
    agent = Agent(workdir)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGCHLD, agent.procs.reap)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as exc:
        log(f"cannot create workdir {workdir}: {exc}")
    kind, address, port = listen
    if kind == "unix":
        os.makedirs(os.path.dirname(address), exist_ok=True)
        server = await asyncio.start_unix_server(
            agent.handle, address, limit=MAX_HEADER_BYTES, backlog=1024
        )
        # Anyone in the sandbox may connect: every request needs the key's MAC, and every
        # answer proves the agent holds it.
        os.chmod(address, 0o666)  # noqa: S103
    else:
        server = await asyncio.start_server(
            agent.handle, address, port, limit=MAX_HEADER_BYTES, backlog=1024
        )
    log(f"version {AGENT_VERSION} listening on {kind}:{address}{f':{port}' if port else ''}")
    try:
        await stop.wait()
    finally:
        # Commands first, and the server closed without waiting for its connections (on
        # Python >= 3.11.7 ``async with server`` would wait for the orchestrator's kept-alive
        # ones, and an agent killed meanwhile would leave its commands running).
        agent.shutdown()
        server.close()
        if kind == "unix":
            with contextlib.suppress(OSError):
                os.unlink(address)


USAGE = "usage: orchard-agent --listen unix:/path/agent.sock|tcp:HOST:PORT"


def main(argv: list[str] | None = None) -> int:
    """The entry point. Its one option is parsed by hand: argparse (and gettext, which it
    imports) would stay in the idle agent's memory for nothing."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 1 and args[0].startswith("--listen="):
        args = ["--listen", args[0].removeprefix("--listen=")]
    if len(args) != 2 or args[0] != "--listen":
        print(USAGE, file=sys.stderr)
        return 2
    try:
        listen = parse_listen(args[1])
    except ValueError as exc:
        print(f"{USAGE}\norchard-agent: error: {exc}", file=sys.stderr)
        return 2
    workdir = os.environ.get("ORCHARD_AGENT_WORKDIR") or DEFAULT_WORKDIR
    if not become_undumpable():
        log("cannot make itself non-dumpable (not root): commands of the same user may trace it")
    asyncio.run(serve(listen, workdir))
    return 0
