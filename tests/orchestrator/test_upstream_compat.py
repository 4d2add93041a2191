"""Upstream Orchard Env's clients, replayed against our orchestrator.

Each test sends the exact JSON bodies, query strings and WebSocket frames that upstream's SDK
(``orchard_env/client/sandbox_client.py`` and ``process.py`` in microsoft/Orchard) sends, written
out literally, and checks the fields and JSON types that SDK reads from the answers: its
``JobResult`` needs ``job_id``/``sandbox_id``/``command``/``status``/``created_at`` (a float),
its exec loop stops only at ``succeeded``/``failed``, its create flow sizes ``/wait`` with the
create answer's ``timeout``, its async client needs ``application/json`` bodies (aiohttp), and
its PTY handle reads ``ready``/``stdout``/``exit``/``error`` frames.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from datetime import datetime, timedelta
from typing import Any

from tests.orchestrator.conftest import Connect, Service, StartService
from tests.orchestrator.fakes import AgentProcessBackend
from tests.orchestrator.test_pty import frames_until_close, stdout_of

PATCH = """\
--- a/app.py
+++ b/app.py
@@ -1,2 +1,2 @@
 def greet(name):
-    return f"Hello, {name}"
+    return f"Hello, {name}!"
"""


def answer(response: Any, status: int = 200) -> Any:
    """The JSON body, as upstream's SDK reads it: a 2xx (``raise_for_status``) with a JSON
    content type (aiohttp's ``response.json()`` refuses anything else)."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    return response.json()


def check_job(job: dict[str, Any]) -> None:
    """What upstream's ``JobResult`` reads, with the JSON types it declares."""
    for name in ("job_id", "sandbox_id", "command", "status", "stdout", "stderr"):
        assert isinstance(job[name], str), name
    assert job["status"] in ("queued", "running", "succeeded", "failed")
    assert job["exit_code"] is None or isinstance(job["exit_code"], int)
    assert job["error"] is None or isinstance(job["error"], str)
    assert isinstance(job["created_at"], float)
    for name in ("started_at", "completed_at"):
        assert job[name] is None or isinstance(job[name], float), name


def check_sandbox(info: dict[str, Any], sandbox_id: str) -> None:
    """``GET /sandboxes/{id}`` and ``/wait``: upstream's fields and types."""
    assert info["sandbox_id"] == sandbox_id
    for name in ("namespace", "image", "pod_name", "cpu", "memory", "status", "status_message"):
        assert isinstance(info[name], str), name
    assert isinstance(info["block_network"], bool) and isinstance(info["ready"], bool)
    assert isinstance(info["created_at"], float)
    assert abs(info["created_at"] - time.time()) < 3600 * 24 * 365  # epoch seconds, not ms


async def create(service: Service, payload: dict[str, Any]) -> dict[str, Any]:
    """Upstream's ``create_sandbox``: POST, then ``/wait`` sized by the answer's ``timeout``."""
    created = answer(await service.http.post("/sandboxes", json=payload), status=201)
    assert isinstance(created["sandbox_id"], str) and isinstance(created["timeout"], int)
    for name in ("namespace", "image", "cpu", "memory", "status"):
        assert isinstance(created[name], str), name
    assert isinstance(created["block_network"], bool)
    assert created["status"] in ("pending", "ready")
    sandbox_id = created["sandbox_id"]
    waited = answer(
        await service.http.get(
            f"/sandboxes/{sandbox_id}/wait", params={"timeout": created["timeout"]}
        )
    )
    check_sandbox(waited, sandbox_id)
    assert waited["ready"] is True and waited["status"] == "ready"
    return created


async def workdir(service: Service, sandbox_id: str) -> str:
    """The sandbox's working directory (the test backend's agents run in a temp dir, so the
    absolute paths upstream's examples use are taken under it)."""
    job = answer(
        await service.http.post(
            f"/sandboxes/{sandbox_id}/exec",
            json={
                "command": "pwd",
                "timeout_seconds": None,
                "cwd": None,
                "env": None,
                "login_shell": False,
                "wait": True,
            },
        )
    )
    return str(job["stdout"]).strip()


async def test_service_banner_and_health(service: Service) -> None:
    anonymous = service.as_key(None)
    banner = answer(await anonymous.get("/"))
    assert banner["status"] == "running"
    assert isinstance(banner["service"], str) and isinstance(banner["version"], str)
    health = answer(await anonymous.get("/health"))
    assert health["status"] == "healthy"


async def test_create_with_every_upstream_field_then_get(service: Service) -> None:
    # SANDBOX_PREFIX=myapp makes upstream's ids "<prefix>-<8 hex>".
    payload = {
        "image": "python:3.11-slim",
        "block_network": False,
        "sandbox_id": "myapp-1a2b3c4d",
        "cpu": "2",
        "memory": "4Gi",
        "timeout": 600,
    }
    created = await create(service, payload)
    assert created["sandbox_id"] == "myapp-1a2b3c4d"
    assert created["timeout"] == 600
    assert (created["image"], created["block_network"]) == ("python:3.11-slim", False)
    assert (created["cpu"], created["memory"]) == ("2", "4Gi")
    shown = answer(await service.http.get("/sandboxes/myapp-1a2b3c4d"))
    check_sandbox(shown, "myapp-1a2b3c4d")
    missing = await service.http.get("/sandboxes/myapp-00000000")
    assert missing.status_code == 404


async def test_create_with_the_defaults_only(service: Service) -> None:
    created = await create(service, {"image": "python:3.11-slim", "block_network": True})
    assert created["sandbox_id"] and created["block_network"] is True
    assert created["timeout"] == service.orchard.settings.ready_timeout_seconds


async def test_exec_waits_server_side(service: Service) -> None:
    sandbox_id = (await create(service, {"image": "python:3.11-slim", "block_network": True}))[
        "sandbox_id"
    ]
    url = f"/sandboxes/{sandbox_id}/exec"
    # sandbox.exec("echo 'Hello, World!'"): every field sent, null when not given.
    body = {
        "command": "echo 'Hello, World!'",
        "timeout_seconds": None,
        "cwd": None,
        "env": None,
        "login_shell": False,
        "wait": True,
    }
    job = answer(await service.http.post(url, json=body))
    check_job(job)
    assert (job["status"], job["exit_code"], job["stdout"]) == ("succeeded", 0, "Hello, World!\n")
    assert job["sandbox_id"] == sandbox_id and job["error"] is None
    assert job["created_at"] <= job["started_at"] <= job["completed_at"]

    # sandbox.exec("...", timeout=60, cwd=..., env={"DEBUG": "1"}), as upstream's README.
    cwd = await workdir(service, sandbox_id)
    body = {
        "command": "printenv DEBUG && pwd",
        "timeout_seconds": 60,
        "cwd": cwd,
        "env": {"DEBUG": "1"},
        "login_shell": False,
        "wait": True,
    }
    job = answer(await service.http.post(url, json=body))
    check_job(job)
    assert (job["status"], job["stdout"]) == ("succeeded", f"1\n{cwd}\n")

    # A list command is joined with spaces and run through bash, as upstream ran it: globs,
    # operators and redirections inside it work.
    def listed(command: list[str]) -> dict[str, Any]:
        return {
            "command": command,
            "timeout_seconds": None,
            "cwd": cwd,
            "env": None,
            "login_shell": False,
            "wait": True,
        }

    job = answer(await service.http.post(url, json=listed(["echo", "hi", ">", "a.py"])))
    check_job(job)
    assert (job["status"], job["stdout"], job["command"]) == ("succeeded", "", "echo hi > a.py")
    job = answer(await service.http.post(url, json=listed(["ls", "*.py"])))
    assert (job["status"], job["stdout"]) == ("succeeded", "a.py\n")
    job = answer(await service.http.post(url, json=listed(["echo hi && echo there"])))
    assert (job["status"], job["stdout"]) == ("succeeded", "hi\nthere\n")

    # Orchard's argv runs exactly, with no shell.
    exact = {"argv": ["ls", "*.py"], "cwd": cwd, "wait": True}
    job = answer(await service.http.post(url, json=exact))
    assert (job["status"], job["command"]) == ("failed", "ls '*.py'")
    assert "*.py" in job["stderr"] and job["stdout"] == ""
    both = await service.http.post(url, json={**exact, "command": "ls"})
    assert both.status_code == 400 and "exactly one of command" in both.text


async def test_failures_and_timeouts_end_as_failed(service: Service) -> None:
    """Upstream's SDK polls until ``succeeded`` or ``failed``: a timed-out command must be
    ``failed`` (upstream's own example runs ``sleep 10`` with ``timeout=2``)."""
    sandbox_id = (await create(service, {"image": "python:3.11-slim", "block_network": True}))[
        "sandbox_id"
    ]
    url = f"/sandboxes/{sandbox_id}/exec"
    body = {
        "command": "exit 1",
        "timeout_seconds": None,
        "cwd": None,
        "env": None,
        "login_shell": False,
        "wait": True,
    }
    failed = answer(await service.http.post(url, json=body))
    check_job(failed)
    assert (failed["status"], failed["exit_code"]) == ("failed", 1)

    body = {
        "command": "sleep 10",
        "timeout_seconds": 1,
        "cwd": None,
        "env": None,
        "login_shell": False,
        "wait": True,
    }
    timed_out = answer(await service.http.post(url, json=body))
    check_job(timed_out)
    assert timed_out["status"] == "failed"
    # Upstream's report: GNU timeout's exit code, its message, and a note on stderr.
    assert (timed_out["exit_code"], timed_out["error"]) == (124, "Command timed out after 1s")
    assert timed_out["stderr"].endswith("Command timed out after 1s\n")
    assert timed_out["timed_out"] is True


async def test_exec_without_wait_then_polling_and_job_wait(service: Service) -> None:
    """Upstream's fallback: POST without ``wait``, keep ``job_id``, poll ``GET /jobs/{id}``
    until complete; ``GET /jobs/{id}/wait`` answers the finished job."""
    sandbox_id = (await create(service, {"image": "python:3.11-slim", "block_network": True}))[
        "sandbox_id"
    ]
    body = {
        "command": "sleep 0.2; echo done",
        "timeout_seconds": 30,
        "cwd": None,
        "env": None,
        "login_shell": False,
    }
    submitted = answer(await service.http.post(f"/sandboxes/{sandbox_id}/exec", json=body))
    job_id = submitted["job_id"]
    assert isinstance(job_id, str) and submitted["status"] in ("queued", "running")

    deadline = time.monotonic() + 10
    while True:
        job = answer(await service.http.get(f"/jobs/{job_id}"))
        check_job(job)
        if job["status"] in ("succeeded", "failed"):
            break
        assert time.monotonic() < deadline, f"job still {job['status']}"
        await asyncio.sleep(0.1)  # upstream's poll_interval
    assert (job["status"], job["stdout"], job["exit_code"]) == ("succeeded", "done\n", 0)

    waited = answer(await service.http.get(f"/jobs/{job_id}/wait", params={"timeout": 300}))
    check_job(waited)
    assert waited["status"] == "succeeded" and waited["completed_at"] == job["completed_at"]
    assert (await service.http.get("/jobs/no-such-job")).status_code == 404


async def test_files_base64_listing_and_patch(service: Service) -> None:
    sandbox_id = (await create(service, {"image": "python:3.11-slim", "block_network": True}))[
        "sandbox_id"
    ]
    root = await workdir(service, sandbox_id)
    base = f"/sandboxes/{sandbox_id}/files"
    source = b'def greet(name):\n    return f"Hello, {name}"\n'

    # upload_content(source, "<workdir>/app.py")
    path = f"{root}/app.py"
    body = {"path": path, "content": base64.b64encode(source).decode("utf-8")}
    uploaded = answer(await service.http.post(base, json=body))
    assert uploaded == {"success": True, "path": path, "size": len(source)}

    # download_content(path): GET with params={"path": ...}
    downloaded = answer(await service.http.get(base, params={"path": path}))
    assert (downloaded["path"], downloaded["size"]) == (path, len(source))
    assert base64.b64decode(downloaded["content"]) == source

    # list_files(root): upstream reads response["files"]
    listed = answer(await service.http.get(f"{base}/list", params={"path": root}))
    assert listed["path"] == root
    (entry,) = listed["files"]
    assert (entry["name"], entry["type"], entry["size"]) == ("app.py", "file", len(source))
    assert isinstance(entry["size"], int) and isinstance(entry["modified"], str)

    # apply_patch(PATCH): git apply in the working directory
    result = answer(
        await service.http.post(
            f"/sandboxes/{sandbox_id}/apply_patch", json={"patch": PATCH, "timeout_seconds": 30}
        )
    )
    assert (result["success"], result["exit_code"], result["error"]) == (True, 0, None)
    assert isinstance(result["stdout"], str) and isinstance(result["stderr"], str)
    patched = answer(await service.http.get(base, params={"path": path}))
    assert b'f"Hello, {name}!"' in base64.b64decode(patched["content"])

    # upstream's API reference example: its last line has no newline
    body = {
        "patch": "--- a/f.txt\n+++ b/f.txt\n@@ -1 +1,2 @@\n line1\n+line2",
        "timeout_seconds": 30,
    }
    await service.http.post(base, json={"path": f"{root}/f.txt", "content": "bGluZTEK"})
    result = answer(await service.http.post(f"/sandboxes/{sandbox_id}/apply_patch", json=body))
    assert result["success"] is True, result
    patched = answer(await service.http.get(base, params={"path": f"{root}/f.txt"}))
    assert base64.b64decode(patched["content"]) == b"line1\nline2\n"

    bad = answer(
        await service.http.post(
            f"/sandboxes/{sandbox_id}/apply_patch",
            json={"patch": "not a patch\n", "timeout_seconds": 30},
        )
    )
    assert bad["success"] is False and isinstance(bad["exit_code"], int)


async def test_heartbeat_and_delete(service: Service) -> None:
    sandbox_id = (await create(service, {"image": "python:3.11-slim", "block_network": True}))[
        "sandbox_id"
    ]
    beat = answer(await service.http.post(f"/sandboxes/{sandbox_id}/heartbeat"))
    assert (beat["status"], beat["sandbox_id"]) == ("ok", sandbox_id)

    deleted = answer(await service.http.delete(f"/sandboxes/{sandbox_id}"))
    assert (deleted["status"], deleted["sandbox_id"]) == ("deleted", sandbox_id)
    # Upstream's context managers delete on exit, maybe after the reaper already did: a 2xx.
    again = answer(await service.http.delete(f"/sandboxes/{sandbox_id}"))
    assert (again["status"], again["sandbox_id"]) == ("deleted", sandbox_id)
    assert (await service.http.post(f"/sandboxes/{sandbox_id}/heartbeat")).status_code == 404


def init_frame(cmd: list[str]) -> str:
    """Upstream's ``_build_init_frame`` output for exec(cmd, pty=True) with no env or cwd."""
    return json.dumps(
        {
            "type": "init",
            "cmd": cmd,
            "env": {},
            "cwd": None,
            "rows": 24,
            "cols": 80,
            "login_shell": False,
        }
    )


async def test_pty_session_with_the_key_in_the_query(service: Service, ws_connect: Connect) -> None:
    sandbox_id = (await create(service, {"image": "ubuntu:22.04", "block_network": True}))[
        "sandbox_id"
    ]
    assert service.admin is not None
    url = f"/sandboxes/{sandbox_id}/exec/pty?api_key={service.admin.api_key}"

    # exec(["bash", "-c", "tty -s && echo HAS_TTY; echo done; exit 7"], pty=True)
    async with ws_connect(url) as ws:
        await ws.send(init_frame(["bash", "-c", "tty -s && echo HAS_TTY; echo done; exit 7"]))
        frames = await frames_until_close(ws)
    assert frames[0]["type"] == "ready" and isinstance(frames[0]["pid"], int)
    assert frames[-1] == {"type": "exit", "code": 7}
    assert stdout_of(frames).replace(b"\r\n", b"\n") == b"HAS_TTY\ndone\n"

    # exec(["cat"], pty=True): write_stdin, read the echo, resize, kill("TERM")
    async with ws_connect(url) as ws:
        await ws.send(init_frame(["cat"]))
        assert json.loads(await ws.recv())["type"] == "ready"
        stdin = base64.b64encode(b"ping\n").decode("ascii")
        await ws.send(json.dumps({"type": "stdin", "data": stdin}))
        echoed = b""
        while b"ping\r\n" not in echoed:
            frame = json.loads(await ws.recv())
            assert frame["type"] == "stdout", frame
            echoed += base64.b64decode(frame["data"])
        await ws.send(json.dumps({"type": "resize", "rows": 50, "cols": 200}))
        await ws.send(json.dumps({"type": "signal", "sig": "TERM"}))
        frames = await frames_until_close(ws)
    assert frames[-1] == {"type": "exit", "code": -15}  # negative: killed by that signal


async def test_a_capped_log_keeps_its_end_in_the_text_upstream_reads(
    start_service: StartService,
) -> None:
    """Upstream's ``JobResult`` reads ``stdout`` and ``status`` only (never ``truncated``): a
    test log over the cap must still end with its summary, the cut marked in the text."""
    service = await start_service(max_output_bytes=100)
    sandbox_id = (await create(service, {"image": "python:3.11-slim", "block_network": True}))[
        "sandbox_id"
    ]
    body = {
        "command": "for i in $(seq 500); do echo test_$i PASSED; done; echo '1 failed, 499 passed'",
        "timeout_seconds": None,
        "cwd": None,
        "env": None,
        "login_shell": False,
        "wait": True,
    }
    job = answer(await service.http.post(f"/sandboxes/{sandbox_id}/exec", json=body))
    check_job(job)
    assert job["stdout"].startswith("test_1 PASSED\n")
    assert job["stdout"].endswith("test_500 PASSED\n1 failed, 499 passed\n")
    assert "\n[... " in job["stdout"] and " bytes truncated ...]\n" in job["stdout"]


# --- the decided differences (docs/api.md, "Upstream compatibility") -----------------------


async def test_unknown_fields_are_400_naming_the_field(service: Service) -> None:
    """Upstream ignored a misspelt field (``timout``) and ran with the default: here it is a
    400 that names it. Every field upstream's SDK sends is known."""
    response = await service.http.post(
        "/sandboxes", json={"image": "python:3.11-slim", "block_network": True, "timout": 5}
    )
    assert response.status_code == 400
    assert response.json()["detail"]["code"] == "invalid_request"
    assert "timout" in response.json()["detail"]["message"]


async def test_a_deleted_sandbox_is_404_as_upstream_and_delete_stays_idempotent(
    service: Service,
) -> None:
    sandbox_id = (await create(service, {"image": "python:3.11-slim", "block_network": True}))[
        "sandbox_id"
    ]
    answer(await service.http.delete(f"/sandboxes/{sandbox_id}"))
    # get_sandbox() after a delete: upstream's SDK gets 404 (raise_for_status), as upstream.
    gone = await service.http.get(f"/sandboxes/{sandbox_id}")
    assert gone.status_code == 404
    assert gone.json()["detail"]["message"] == (
        f"sandbox {sandbox_id} was deleted: deleted by request"
    )
    # The instance's delete() on context exit after a delete elsewhere: still a 2xx.
    assert answer(await service.http.delete(f"/sandboxes/{sandbox_id}"))["status"] == "deleted"
    # An id that never existed is 404 (upstream answered "deleted" for any id).
    assert (await service.http.delete("/sandboxes/never-was")).status_code == 404


async def test_the_request_timeout_governs_readiness_up_to_the_service_limit(
    service: Service, backend: AgentProcessBackend
) -> None:
    """Upstream's SDK sends ``timeout`` (default 3600 on upstream's side) and waits that long;
    here the request's value is the deadline of the whole start, pull included."""
    limit = service.orchard.settings.max_ready_timeout_seconds
    created = await create(service, {"image": "python:3.11-slim", "timeout": limit})
    assert created["timeout"] == limit
    # The backend gets it for the pull (the engine's pull stops at it).
    assert backend.sandboxes[created["sandbox_id"]].spec.ready_timeout_seconds == limit
    too_long = await service.http.post(
        "/sandboxes", json={"image": "python:3.11-slim", "timeout": limit + 1}
    )
    assert too_long.status_code == 400
    assert too_long.json()["detail"]["message"] == (
        f"timeout: {limit + 1} s is above this service's limit of {limit} s for a sandbox "
        "to become ready"
    )


async def test_no_idle_expiry_for_a_client_that_never_heartbeats(service: Service) -> None:
    created = await create(service, {"image": "python:3.11-slim", "block_network": True})
    sandbox_id = created["sandbox_id"]
    shown = answer(await service.http.get(f"/sandboxes/{sandbox_id}"))
    assert shown["idle_timeout_seconds"] is None
    ttl = service.orchard.settings.sandbox_ttl_seconds
    assert shown["expires_at"] == created["created_at"] + ttl


async def test_pty_refusals_close_after_the_handshake_with_a_reason(
    service: Service, ws_connect: Connect
) -> None:
    """Upstream closed before accepting, so its clients saw a bare HTTP 403; here the
    handshake succeeds, an ``error`` frame says why, and the close code tells which."""
    assert service.admin is not None
    url = f"/sandboxes/no-such-box/exec/pty?api_key={service.admin.api_key}"
    async with ws_connect(url) as ws:
        frames = await frames_until_close(ws)
        assert ws.close_code == 4404
    assert frames == [{"type": "error", "message": "sandbox no-such-box does not exist"}]


async def test_upstreams_default_size_is_one_setting_away(start_service: StartService) -> None:
    """Orchard sizes a sandbox that asks for nothing at 1 CPU / 2Gi; a service (or a
    deployment profile's ``limits``) set to 4 / 16Gi answers upstream's defaults."""
    service = await start_service(default_cpu=4.0, default_memory=16 * 1024**3)
    created = await create(service, {"image": "python:3.11-slim", "block_network": True})
    assert (created["cpu"], created["memory"]) == ("4", "16Gi")


async def test_file_listing_types_and_times(service: Service) -> None:
    """``type`` is ``file``/``directory`` for what upstream listed so, plus ``symlink`` (not
    followed) and ``other``; ``modified`` is ISO 8601 in UTC, which ``fromisoformat`` reads
    as upstream's zone-less local time string was read."""
    sandbox_id = (await create(service, {"image": "python:3.11-slim", "block_network": True}))[
        "sandbox_id"
    ]
    root = await workdir(service, sandbox_id)
    body = {
        "command": "mkdir d && echo x > f && ln -s d link && mkfifo pipe",
        "timeout_seconds": None,
        "cwd": None,
        "env": None,
        "login_shell": False,
        "wait": True,
    }
    answer(await service.http.post(f"/sandboxes/{sandbox_id}/exec", json=body))
    listed = answer(
        await service.http.get(f"/sandboxes/{sandbox_id}/files/list", params={"path": root})
    )
    types = {entry["name"]: entry["type"] for entry in listed["files"]}
    assert types == {"d": "directory", "f": "file", "link": "symlink", "pipe": "other"}
    for entry in listed["files"]:
        modified = datetime.fromisoformat(entry["modified"])
        assert modified.utcoffset() == timedelta(0)
        assert abs(modified.timestamp() - time.time()) < 3600
