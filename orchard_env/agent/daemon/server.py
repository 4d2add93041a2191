"""The agent's routes, its enrollment and request authentication (see :mod:`.proof`), and
its entry point (``main``): the main thread runs the :class:`~.loop.Loop` (which accepts
connections and owns the jobs), each connection is served by a thread of its own."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import files, proof
from .http import (
    Conn,
    HTTPError,
    Request,
    decode_b64,
    error_response,
    invalid,
    listen_socket,
    log,
    read_request,
    string_map,
)
from .jobs import DEFAULT_MAX_OUTPUT, Job, JobTable
from .loop import Loop
from .procs import Processes, command_env, initial_environ, kill_tree, with_tools_path

if TYPE_CHECKING:
    from .model import Relay  # imported only for a sandbox with a model gateway

AGENT_VERSION = "0.1.0"
MAX_ENROLL_BODY = 1024 * 1024
STREAM_CHUNK = 256 * 1024  # bytes of a job's event log sent per write
DEFAULT_WORKDIR = "/workspace"


class Agent:
    """Routes, jobs and PTY sessions of one agent process."""

    def __init__(self, workdir: str, procs: Processes | None = None) -> None:
        """``procs``: the children (and the loop) of agents sharing a process (as the
        benchmark's fleet does); a loop and children of its own by default."""
        self.procs = procs or Processes(Loop())
        self.loop = self.procs.loop
        self.key: bytes | None = None  # the sandbox's key, from the orchestrator's enrollment
        self.workdir = workdir
        self.base_env = with_tools_path(command_env(initial_environ(), sys.prefix))
        self.umask = os.umask(0o022)
        os.umask(self.umask)
        self.jobs = JobTable(self.procs)
        self.model_relay: Relay | None = None  # for a sandbox with a model gateway

    def shutdown(self) -> None:
        """Kill every running command and PTY session (the agent is stopping)."""
        self.jobs.kill_all()
        for root in self.procs.pty_roots:
            kill_tree(root)

    # HTTP

    def handle(self, conn: Conn) -> None:
        """Serve one connection's requests, in its own thread, until it closes."""
        try:
            while True:
                try:
                    req = read_request(conn)
                except HTTPError as exc:
                    conn.write(error_response(exc))
                    break
                if req is None:
                    break
                self.respond(req)
                if not req.keep_alive:
                    break
        except OSError:
            pass  # the connection broke (ConnectionError included)
        finally:
            conn.close()

    def respond(self, req: Request) -> None:
        try:
            self.route(req)
            if not req.body_done:
                req.discard_body()
        except HTTPError as exc:
            if req.started:
                req.keep_alive = False
                return
            if not req.body_done and exc.status != 413:
                req.discard_body()
            req.send_json(exc.status, {"code": exc.code, "message": exc.message})
        except ConnectionError:
            raise  # the connection broke: nothing can be answered on it
        except Exception as exc:
            import traceback  # only on the rare failure path

            log(f"{req.method} {req.path} failed:\n{traceback.format_exc()}")
            req.keep_alive = False
            if not req.started:
                req.send_json(500, {"code": "internal", "message": f"agent error: {exc!r}"})

    def route(self, req: Request) -> None:
        method, path = req.method, req.path
        if path == "/health" and method == "GET":
            if "authorization" in req.headers:  # a proven answer: the orchestrator's probe
                self.check_auth(req)
            status = {"status": "ok", "pid": os.getpid(), "version": AGENT_VERSION}
            req.send_json(200, {**status, "enrolled": self.key is not None})
            return
        if path == "/enroll" and method == "POST":
            self.enroll(req)
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
            handler(req)
            return
        if path.startswith("/exec/"):
            job_id, _, action = path[len("/exec/") :].partition("/")
            if action == "" and method == "GET":
                self.stream_job(req, self.jobs[job_id])
                return
            if action == "cancel" and method == "POST":
                cancelled = self.loop.call(self.jobs.cancel, job_id)
                req.send_json(200, {"job_id": job_id, "cancelled": cancelled})
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

    def enroll(self, req: Request) -> None:
        """Take the sandbox's key and environment, once: the orchestrator's first request."""
        if self.key is not None:
            self.check_auth(req)  # 401 unless it is the key the agent holds
            raise HTTPError(409, "conflict", "the agent is enrolled already")
        raw = req.read_body(MAX_ENROLL_BODY)
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

            self.model_relay = model.start(body["model"], self.loop)
        self.key = key.encode()
        self.base_env = with_tools_path({**self.base_env, **env})
        log("enrolled")
        req.send_json(200, {"enrolled": True})

    def model_park(self, req: Request) -> None:
        if self.model_relay is None:
            raise HTTPError(409, "conflict", "this sandbox has no model gateway")
        self.model_relay.park(req)

    def resolve(self, raw: str) -> str:
        if "\0" in raw:
            raise invalid("path contains a NUL byte")
        # normpath keeps a leading "//" (POSIX leaves its meaning open); "//" is "/" here.
        path = os.path.normpath(os.path.join(self.workdir, raw))
        return "/" + path.lstrip("/") if path.startswith("//") else path

    def path_arg(self, req: Request) -> str:
        return self.resolve(req.arg("path"))

    def pty(self, req: Request) -> None:
        from .pty import serve_pty  # terminals are rare: not in the idle agent's memory

        serve_pty(req, self.procs, self.base_env, self.resolve)

    # exec

    def exec(self, req: Request) -> None:
        body = req.json()
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
            self.attach(req, job, fingerprint)
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
        login = bool(body.get("login_shell"))
        limit = float(timeout) if timeout else None

        def admit() -> tuple[Job, bool]:
            """On the loop: a new job started (or ended, if cancelled ahead), or the one that
            took this id meanwhile (another connection's exec of it)."""
            known = self.jobs.get(job_id)
            if known is not None:
                return known, False
            job = self.jobs.add(job_id, fingerprint, max_output)
            if self.jobs.was_cancelled_ahead(job_id):
                job.end_cancelled()
            else:
                job.start(command, login, cwd, env, limit, data)
            return job, True

        job, new = self.loop.call(admit)
        if new:
            self.stream_job(req, job)
        else:
            self.attach(req, job, fingerprint)

    def attach(self, req: Request, job: Job, fingerprint: str) -> None:
        """A repeated exec of ``job``'s id: its stream, if it is the same command."""
        if job.fingerprint != fingerprint:
            raise HTTPError(
                409, "conflict", f"job_id {job.job_id} is already used by a different command"
            )
        self.stream_job(req, job)

    def stream_job(self, req: Request, job: Job) -> None:
        """Replay the job's events from the start, follow live output, end with ``x``."""
        req.discard_body()
        req.start_chunked("application/x-ndjson")
        sent = 0
        while True:
            chunk, final = job.next_events(sent, STREAM_CHUNK)
            if chunk:
                req.write_chunk(chunk)
                sent += len(chunk)
            else:
                req.write_chunk(final)
                break
        req.end_chunked()

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


def serve(listen: tuple[str, str, int], workdir: str) -> None:
    agent = Agent(workdir)
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as exc:
        log(f"cannot create workdir {workdir}: {exc}")
    kind, address, port = listen
    sock = listen_socket(kind, address, port)
    agent.loop.serve(sock, agent.handle)
    log(f"version {AGENT_VERSION} listening on {kind}:{address}{f':{port}' if port else ''}")
    try:
        agent.loop.run()
    finally:
        # Commands first, then the socket; connections' threads end with the process (an
        # agent killed while waiting for them would leave its commands running).
        agent.shutdown()
        sock.close()
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
    serve(listen, workdir)
    return 0
