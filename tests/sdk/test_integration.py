"""The SDK against the real orchestrator, in-process, upstream-README style.

The orchestrator is :func:`orchard_env.orchestrator.app.create_app` on the service-tier fake
backend (``tests/orchestrator/fakes.py``): every sandbox is the real agent as a host
process, so exec, files, streams and PTY are real; only the container around it is not.
The async client talks to the app over ``httpx.ASGITransport``; the sync client and PTY
sessions over a real uvicorn on 127.0.0.1 in a thread. Paths are relative to the sandbox
workdir (absolute paths would land on this host: there is no container).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from orchard_env import errors
from orchard_env.sdk import AsyncSandboxClient, Sandbox, SandboxClient
from tests.orchestrator.fakes import AgentProcessBackend
from tests.servers import Live

PATCH = """\
--- a/greet.txt
+++ b/greet.txt
@@ -1 +1 @@
-hello
+hello, patched
"""


# --- sync client over a real socket -------------------------------------------------------


def test_readme_sync_usage(live: Live, tmp_path: Path) -> None:
    local = tmp_path / "local_file.py"
    local.write_text("print('from a script')\n")
    with SandboxClient(base_url=live.url, api_key=live.api_key) as client:
        assert client.health().status == "healthy"
        with client.create_sandbox("debian:12", labels={"suite": "sdk"}) as sandbox:
            assert client.resources().sandboxes == 1
            assert sandbox.heartbeat().status == "ok"
            result = sandbox.exec("echo 'Hello, World!'")
            assert (result.stdout, result.exit_code, result.succeeded) == (
                "Hello, World!\n",
                0,
                True,
            )

            sandbox.upload_file(local, "script.py")
            result = sandbox.exec("python3 script.py", timeout=60, env={"DEBUG": "1"})
            assert result.stdout == "from a script\n"
            assert sandbox.exec("echo $DEBUG", env={"DEBUG": "1"}).stdout == "1\n"

            sandbox.exec("echo generated > output.txt", check=True)
            assert sandbox.download_file("output.txt", tmp_path / "local_output.txt") == 10
            assert (tmp_path / "local_output.txt").read_text() == "generated\n"

            names = {entry["name"] for entry in sandbox.list_files(".")}
            assert {"script.py", "output.txt"} <= names

            failed = sandbox.exec("ls /nonexistent-orchard-path")
            assert failed.failed and failed.exit_code != 0 and "nonexistent" in failed.stderr
            with pytest.raises(errors.CommandFailed, match="exited with code"):
                sandbox.exec("exit 4", check=True)

            [listed] = client.list_sandboxes(labels={"suite": "sdk"})
            assert listed.sandbox_id == sandbox.sandbox_id
        with pytest.raises(errors.SandboxNotFound):
            sandbox.exec("true")
        assert client.list_sandboxes(labels={"suite": "sdk"}) == []


def test_a_list_is_fetched_page_by_page(live: Live) -> None:
    with SandboxClient(base_url=live.url, api_key=live.api_key) as client:
        made = [client.create_sandbox("any", labels={"suite": "pages"}) for _ in range(3)]
        listed = client.list_sandboxes(labels={"suite": "pages"}, chunk_size=1)
        assert [s.sandbox_id for s in listed] == [s.sandbox_id for s in reversed(made)]
        with pytest.raises(errors.InvalidRequest, match="chunk_size must be at least 1"):
            client.list_sandboxes(chunk_size=0)


def test_binary_files_and_timeouts(live: Live, tmp_path: Path) -> None:
    payload = bytes(range(256)) * 4096 + b"tail"
    with SandboxClient(base_url=live.url, api_key=live.api_key) as client:
        sandbox = client.create_sandbox("debian:12")
        sandbox.mkdir("data/nested")
        sandbox.upload_content(payload, "data/nested/blob.bin")
        assert sandbox.download_content("data/nested/blob.bin") == payload
        with pytest.raises(errors.FileNotFound):
            sandbox.download_content("data/missing.bin")
        sandbox.delete_file("data", recursive=True)
        assert "data" not in {e.name for e in sandbox.list_files(".")}

        slow = sandbox.exec("sleep 30", timeout=1)
        assert slow.timed_out and slow.is_complete and slow.failed
        with pytest.raises(errors.CommandFailed, match="timed out after 1s"):
            sandbox.exec("sleep 30", timeout=1, check=True)

        job = sandbox.exec("sleep 30", wait=False)
        assert job.status in ("queued", "running")
        cancelled = client.cancel_job(job.job_id)
        assert (cancelled.status, cancelled.cancelled) == ("failed", True)
        assert sandbox.exec("cat", stdin="fed through stdin").stdout == "fed through stdin"
    assert client.is_closed


@pytest.mark.skipif(shutil.which("git") is None, reason="apply_patch needs git")
def test_apply_patch(live: Live) -> None:
    with SandboxClient(base_url=live.url, api_key=live.api_key) as client:
        sandbox = client.create_sandbox("debian:12")
        sandbox.upload_content("hello\n", "greet.txt")
        assert sandbox.apply_patch(PATCH, check=True).success  # only checks
        assert sandbox.download_content("greet.txt") == b"hello\n"
        result = sandbox.apply_patch(PATCH)
        assert result.success and result["success"]
        assert sandbox.download_content("greet.txt") == b"hello, patched\n"
        again = sandbox.apply_patch(PATCH)
        assert not again.success and again.stderr


def test_exec_stream_and_streamed(live: Live) -> None:
    with SandboxClient(base_url=live.url, api_key=live.api_key) as client:
        sandbox = client.create_sandbox("debian:12")
        events = list(sandbox.exec_stream("echo out; echo err >&2; exit 3"))
        assert events[0].event == "started" and events[-1].event == "exit"
        text = {
            kind: "".join(e.data or "" for e in events if e.event == kind)
            for kind in ("stdout", "stderr")
        }
        assert text == {"stdout": "out\n", "stderr": "err\n"}
        assert events[-1].job is not None and events[-1].job.exit_code == 3
        out: list[str] = []
        result = sandbox.exec_streamed(
            ["printf", "%s|", "a b", "c"], stdout=out.append, shell=False
        )
        assert "".join(out) == "a b|c|" and result.succeeded
        joined = sandbox.exec(["printf", "'%s|'", "a b", "c", ">&2"])
        assert (joined.stdout, joined.stderr) == ("", "a|b|c|")
        with pytest.raises(errors.InvalidRequest, match="shell=False needs the command as a list"):
            sandbox.exec("true", shell=False)


def test_pty_session(live: Live) -> None:
    with SandboxClient(base_url=live.url, api_key=live.api_key) as client:
        sandbox = client.create_sandbox("debian:12")
        with sandbox.pty(["/bin/sh"], rows=24, cols=80) as shell:
            assert shell.pid is not None and shell.poll() is None
            shell.write_stdin("tty -s && echo HAS_TTY; stty size\n")
            seen = _read_until(shell.read, b"24 80")
            assert b"HAS_TTY" in seen
            shell.resize(50, 200)
            shell.write_stdin("stty size\n")
            _read_until(shell.read, b"50 200")
            shell.write_stdin("exit 7\n")
            assert shell.wait(timeout=10) == 7
        proc = sandbox.exec(["sleep", "60"], pty=True)
        proc.kill("KILL")
        assert proc.wait(timeout=10) == -9
        proc.close()


def test_pty_refused_without_a_valid_key(live: Live) -> None:
    with SandboxClient(base_url=live.url, api_key=live.api_key) as client:
        sandbox_id = client.create_sandbox("debian:12").sandbox_id
        with SandboxClient(
            base_url=live.url, api_key="ork_0000000000_wrong", retries=0
        ) as stranger:
            with pytest.raises(errors.PermissionDenied):
                stranger.get_sandbox(sandbox_id)
            handle = Sandbox(stranger, client.get_sandbox(sandbox_id).info)  # a wrong key
            with pytest.raises(errors.PermissionDenied, match="the API key is not valid"):
                handle.pty(["/bin/sh"])


def _read_until(read: object, marker: bytes, timeout: float = 10.0) -> bytes:
    assert callable(read)
    seen = b""
    deadline = time.monotonic() + timeout
    while marker not in seen:
        assert time.monotonic() < deadline, f"{marker!r} not seen in {seen!r}"
        seen += read(timeout=0.5)
    return seen


# --- async client over ASGI ----------------------------------------------------------------


async def test_readme_async_usage(
    asgi_app: tuple[httpx.ASGITransport, str], backend: AgentProcessBackend, tmp_path: Path
) -> None:
    transport, key = asgi_app
    local = tmp_path / "local_file.py"
    local.write_text("print(6 * 7)\n")
    async with AsyncSandboxClient(
        base_url="http://orchard", api_key=key, transport=transport
    ) as client:
        async with await client.create_sandbox("debian:12") as sandbox:
            result = await sandbox.exec("echo 'Hello, World!'")
            assert result.stdout == "Hello, World!\n"
            await sandbox.upload_file(local, "script.py")
            assert (await sandbox.exec(["python3", "script.py"])).stdout == "42\n"
            await sandbox.exec("echo done > output.txt")
            await sandbox.download_file("output.txt", tmp_path / "local_output.txt")
            assert (tmp_path / "local_output.txt").read_text() == "done\n"
            assert "script.py" in {e.name for e in await sandbox.list_files(".")}
            chunks = [
                e.data async for e in sandbox.exec_stream("echo streamed") if e.event == "stdout"
            ]
            assert "".join(c or "" for c in chunks) == "streamed\n"
            sandbox_id = sandbox.sandbox_id
        assert sandbox_id not in backend.sandboxes
        usage = await client.usage(since="2000-01-01T00:00:00+00:00")
        assert sandbox_id in {record.sandbox_id for record in usage.records}
        leftover = (await client.create_sandbox("debian:12")).sandbox_id
    assert leftover not in backend.sandboxes  # close() deleted what the client created


async def test_concurrent_sandboxes(asgi_app: tuple[httpx.ASGITransport, str]) -> None:
    import asyncio

    transport, key = asgi_app
    async with AsyncSandboxClient(
        base_url="http://orchard", api_key=key, transport=transport
    ) as client:

        async def task(n: int) -> str:
            async with await client.create_sandbox("debian:12") as sandbox:
                return (await sandbox.exec(f"echo task {n}")).stdout

        assert await asyncio.gather(*(task(n) for n in range(3))) == [
            f"task {n}\n" for n in range(3)
        ]


async def test_lost_exec_answer_never_runs_the_command_twice(
    asgi_app: tuple[httpx.ASGITransport, str],
) -> None:
    """The orchestrator ran the command but its answer was lost: the retry must not rerun it."""
    inner, key = asgi_app
    dropped: list[str] = []

    class DropFirstExecAnswer(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            response = await inner.handle_async_request(request)
            if request.url.path.endswith("/exec") and not dropped:
                await response.aread()
                dropped.append(json.loads(request.content)["job_id"])
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
            return response

    async with AsyncSandboxClient(
        base_url="http://orchard", api_key=key, transport=DropFirstExecAnswer()
    ) as client:
        sandbox = await client.create_sandbox("debian:12")
        result = await sandbox.exec("echo ran >> runs.txt; cat runs.txt")
        assert dropped == [result.job_id]
        assert result.stdout == "ran\n"
        assert await sandbox.download_content("runs.txt") == b"ran\n"


async def test_errors_from_the_real_service(asgi_app: tuple[httpx.ASGITransport, str]) -> None:
    transport, key = asgi_app
    async with AsyncSandboxClient(
        base_url="http://orchard", api_key=key, transport=transport
    ) as client:
        with pytest.raises(errors.SandboxNotFound):
            await client.get_sandbox("no-such-sandbox")
        with pytest.raises(errors.ImageNotFound, match="could not be pulled"):
            await client.create_sandbox("missing/image")
        with pytest.raises(errors.LimitExceeded):
            await client.create_sandbox("debian:12", cpu=512)
        with pytest.raises(errors.SandboxNotReady):
            await client.create_sandbox("crash/image", timeout=30)
        assert await client.list_sandboxes(status="ready") == []
        created = await client.create_key("worker")
        assert created.api_key.startswith("ork_")
        assert [k.name for k in await client.list_keys()] == ["sdk-tests", "worker"]
        assert (await client.revoke_key(created.key_id)).revoked_at is not None
    async with AsyncSandboxClient(
        base_url="http://orchard", api_key=created.api_key, transport=transport
    ) as revoked:
        with pytest.raises(errors.PermissionDenied):
            await revoked.list_sandboxes()
    async with AsyncSandboxClient(base_url="http://orchard", transport=transport) as anonymous:
        with pytest.raises(errors.AuthenticationRequired):
            await anonymous.list_sandboxes()


# --- cleanup when the process ends ---------------------------------------------------------

_LEAVE_A_SANDBOX = """
import asyncio, os, signal, sys
from orchard_env import AsyncSandboxClient, SandboxClient

how = sys.argv[1]
if how == "async-exit":
    async def main():
        client = AsyncSandboxClient()  # never closed
        sandbox = await client.create_sandbox("debian:12")
        print(sandbox.sandbox_id, flush=True)
    asyncio.run(main())
    sys.exit(0)
client = SandboxClient()  # never closed
print(client.create_sandbox("debian:12").sandbox_id, flush=True)
if how == "sigterm":
    os.kill(os.getpid(), signal.SIGTERM)
    signal.pause()
"""


@pytest.mark.parametrize("how", ["exit", "sigterm", "async-exit"])
def test_sandboxes_left_behind_are_deleted_when_the_process_ends(live: Live, how: str) -> None:
    env = {**os.environ, "ORCHARD_URL": live.url, "ORCHARD_API_KEY": live.api_key}
    done = subprocess.run(
        [sys.executable, "-c", _LEAVE_A_SANDBOX, how],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == (-signal.SIGTERM if how == "sigterm" else 0), done.stderr
    sandbox_id = done.stdout.strip()
    with SandboxClient(base_url=live.url, api_key=live.api_key) as client:
        assert client.get_sandbox(sandbox_id).status == "deleted"


def test_an_oom_killed_sandbox_says_so_in_the_sdk_and_the_cli(
    live: Live, backend: AgentProcessBackend
) -> None:
    """Backend (the engine's OOMKilled) → record → API → SDK error → CLI message."""
    oom = (
        "OOMKilled: its container was killed for using more than its memory limit of 256Mi, "
        "exit code 137; give it more with `memory` at create"
    )
    with SandboxClient(base_url=live.url, api_key=live.api_key) as client:
        sandbox = client.create_sandbox("debian:12", memory="256Mi")
        asyncio.run(backend.kill(sandbox.sandbox_id, exit_code=137, reason="OOMKilled"))
        # The command that was sent when it died: failed, and why.
        result = sandbox.exec("true")
        assert (result.status, result.error) == (
            "failed",
            f"sandbox {sandbox.sandbox_id} is failed: {oom}",
        )
        # Everything after: the error class of a failed sandbox, with the reason.
        with pytest.raises(errors.SandboxNotReady) as raised:
            sandbox.exec("true")
        assert raised.value.message == f"sandbox {sandbox.sandbox_id} failed: {oom}"
        assert client.get_sandbox(sandbox.sandbox_id).info.status_message == oom
        env = {**os.environ, "ORCHARD_URL": live.url, "ORCHARD_API_KEY": live.api_key}
        cli = subprocess.run(
            [
                sys.executable,
                "-m",
                "orchard_cli.main",
                "sandbox",
                "exec",
                sandbox.sandbox_id,
                "--",
                "true",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode != 0
        assert oom in " ".join(cli.stderr.split()), cli.stderr
        assert "Traceback" not in cli.stderr
        sandbox.delete()
