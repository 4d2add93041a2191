"""Upstream's README usage, unchanged, against real containers (engine tier); and what a
command does to memory, processes and output cannot take the agent down.

The orchestrator runs under uvicorn on loopback with the real engine backend (Podman here)
and the locally built images: the Debian sandbox image (python3, bash, git) and a busybox
image with no Python and no bash at all. Paths are the real ``/workspace`` of a container.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from orchard_env import errors
from orchard_env.config import ServiceSettings, service_settings
from orchard_env.sdk import AsyncSandboxClient, SandboxClient
from tests.cli.conftest import run_orchard
from tests.servers import Live, live_service

pytestmark = pytest.mark.engine

PATCH = """\
--- a/app.py
+++ b/app.py
@@ -1,2 +1,2 @@
 def greet(name):
-    return f"Hello, {name}"
+    return f"Hello, {name}!"
"""


@pytest.fixture
def settings(
    tmp_path_factory: pytest.TempPathFactory, engine_instance: str, agent_bundle: Path
) -> ServiceSettings:
    # A short state dir: the agent's socket path must fit a unix socket address.
    return service_settings(
        state_dir=tmp_path_factory.mktemp("sdk"),
        instance=f"{engine_instance}-sdk",
        agent_bundle_dir=agent_bundle,
    )


@pytest.fixture
def orchard(settings: ServiceSettings) -> Iterator[Live]:
    """The orchestrator under uvicorn on loopback with the real engine backend."""
    with live_service(settings, key_name="sdk-engine") as running:
        yield running


def test_readme_flow_in_a_real_container(orchard: Live, sandbox_image: str, tmp_path: Path) -> None:
    url, key = orchard
    local = tmp_path / "local_file.py"
    local.write_text("import os\nprint(os.getcwd(), os.environ['DEBUG'])\n")
    with SandboxClient(base_url=url, api_key=key) as client:
        with client.create_sandbox(sandbox_image, memory="512Mi") as sandbox:
            result = sandbox.exec("echo 'Hello, World!'")
            assert result.stdout == "Hello, World!\n"

            sandbox.upload_file(str(local), "/workspace/script.py")
            result = sandbox.exec(
                "python3 script.py", timeout=60, cwd="/workspace", env={"DEBUG": "1"}
            )
            assert result.stdout == "/workspace 1\n"

            sandbox.exec("echo 'Generated in sandbox' > /workspace/output.txt")
            sandbox.download_file("/workspace/output.txt", str(tmp_path / "local_output.txt"))
            assert (tmp_path / "local_output.txt").read_text() == "Generated in sandbox\n"
            files = {f["name"]: f["type"] for f in sandbox.list_files("/workspace")}
            assert files == {"script.py": "file", "output.txt": "file"}

            sandbox.exec("git init -q /workspace", check=True)
            sandbox.upload_content(
                b'def greet(name):\n    return f"Hello, {name}"\n', "/workspace/app.py"
            )
            assert sandbox.apply_patch(PATCH).success
            assert b'f"Hello, {name}!"' in sandbox.download_content("/workspace/app.py")

            with sandbox.pty(["bash", "-c", "tty -s && echo HAS_TTY; exit 7"]) as proc:
                assert b"HAS_TTY" in proc.read_all(timeout=20)
                assert proc.wait(timeout=10) == 7
            sandbox_id = sandbox.sandbox_id
        with pytest.raises(errors.SandboxNotFound):
            client.get_sandbox(sandbox_id).exec("true")


async def test_async_client_on_an_image_without_python_or_bash(
    orchard: Live, busybox_image: str
) -> None:
    url, key = orchard
    async with (
        AsyncSandboxClient(base_url=url, api_key=key) as client,
        await client.create_sandbox(busybox_image) as sandbox,
    ):
        result = await sandbox.exec("echo $((6 * 7)); ls /usr/bin/python3 /bin/bash")
        assert result.stdout == "42\n" and result.exit_code != 0
        await sandbox.upload_content("busybox\n", "/workspace/note.txt")
        assert (await sandbox.exec(["cat", "/workspace/note.txt"])).stdout == "busybox\n"
        streamed = [e.data async for e in sandbox.exec_stream("echo a; echo b") if e.data]
        assert "".join(c or "" for c in streamed) == "a\nb\n"
        proc = await sandbox.exec(["sh"], pty=True)
        await proc.write_stdin("exit 3\n")
        assert await proc.wait(timeout=20) == 3
        await proc.close()


def test_login_shell_sources_a_guarded_bashrc_on_exec_and_pty(
    orchard: Live, conda_image: str
) -> None:
    """SWE-bench-style images activate conda in a ``~/.bashrc`` that returns early unless the
    shell is interactive: login_shell=True must see that environment, as upstream's did."""
    url, key = orchard
    probe = "echo $CONDA_DEFAULT_ENV; python"
    with (
        SandboxClient(base_url=url, api_key=key) as client,
        client.create_sandbox(conda_image, memory="256Mi") as sandbox,
    ):
        login = sandbox.exec(probe, login_shell=True)
        assert (login.stdout, login.stderr) == ("testbed\nconda-testbed-python\n", "")
        joined = sandbox.exec(["echo", "$CONDA_DEFAULT_ENV", "&&", "python"], login_shell=True)
        assert joined.stdout == "testbed\nconda-testbed-python\n"
        plain = sandbox.exec("echo ${CONDA_DEFAULT_ENV:-none}")
        assert plain.stdout == "none\n"
        with sandbox.pty(["bash", "-c", probe], login_shell=True) as proc:
            assert b"testbed\r\nconda-testbed-python" in proc.read_all(timeout=20)
            assert proc.wait(timeout=10) == 0


# --- what commands do to memory, processes and output (issue: bounded resources) ---

FORK_BOMB = ":(){ :|:& };:; sleep 600"  # the bomb goes to the background: wait
# A bound on a timeout's lateness that only a starved agent misses (it was 339 s).
STARVED = timedelta(seconds=60)
PROCESS_COUNT = "ls -d /proc/[0-9]* | wc -l"


def test_a_fork_bomb_times_out_on_time_and_the_agent_keeps_working(
    orchard: Live,
    sandbox_image: str,
) -> None:
    url, key = orchard
    with (
        SandboxClient(base_url=url, api_key=key) as client,
        client.create_sandbox(sandbox_image, memory="256Mi") as sandbox,
    ):
        bomb = sandbox.exec(FORK_BOMB, timeout=5)
        assert (bomb.timed_out, bomb.exit_code, bomb.error) == (
            True,
            124,
            "Command timed out after 5s",
        )
        assert bomb.started_at is not None and bomb.completed_at is not None
        assert bomb.completed_at - bomb.started_at < timedelta(seconds=5) + STARVED
        after = sandbox.exec(PROCESS_COUNT, timeout=30)
        # The init, the agent, this shell and its ls/wc: the bomb is gone, every process.
        assert after.succeeded and int(after.stdout) <= 6, after.stdout


def test_cancel_kills_setsid_and_nohup_descendants_in_a_container(
    orchard: Live,
    sandbox_image: str,
) -> None:
    url, key = orchard
    escape = (
        "setsid sleep 1001 >/dev/null 2>&1 & nohup sleep 1002 >/dev/null 2>&1 & "
        "(setsid sleep 1003 >/dev/null 2>&1 &); sleep 1000"
    )
    sleeps = "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ' | grep -o 'sleep 100[0-3]' | sort"
    with (
        SandboxClient(base_url=url, api_key=key) as client,
        client.create_sandbox(sandbox_image, memory="256Mi") as sandbox,
    ):
        job = sandbox.exec(escape, wait=False)
        for _ in range(200):
            if sandbox.exec(sleeps).stdout.split("\n")[:-1] == [
                "sleep 1000",
                "sleep 1001",
                "sleep 1002",
                "sleep 1003",
            ]:
                break
        else:
            pytest.fail("the command's sleeps never all started")
        cancelled = client.cancel_job(job.job_id)
        assert cancelled.cancelled
        assert sandbox.exec(sleeps).stdout == ""
        timed = sandbox.exec(escape, timeout=3)
        assert timed.timed_out and sandbox.exec(sleeps).stdout == ""


async def test_output_floods_leave_the_agent_alive(
    orchard: Live,
    sandbox_image: str,
) -> None:
    """8 jobs writing 40 MiB each in a 512Mi sandbox, and 17 MB in a 64Mi one, OOM-killed the
    agent when it held output in memory; now it spills and keeps head and tail."""
    url, key = orchard
    flood = "yes {word} | head -c {size}; echo END"
    async with AsyncSandboxClient(base_url=url, api_key=key) as client:
        async with await client.create_sandbox(sandbox_image, memory="512Mi") as big:
            results = await asyncio.gather(
                *(big.exec(flood.format(word=f"job{i}", size=40 << 20)) for i in range(8))
            )
            for i, result in enumerate(results):
                assert result.succeeded and result.truncated, result.error
                assert result.stdout.startswith(f"job{i}\n") and result.stdout.endswith("END\n")
                assert "bytes truncated ...]" in result.stdout
            assert (await big.exec("echo alive")).stdout == "alive\n"
        async with await client.create_sandbox(sandbox_image, memory="64Mi") as small:
            result = await small.exec(flood.format(word="small", size=17_000_000))
            assert result.succeeded and result.stdout.endswith("END\n"), result.error
            assert (await small.exec("echo alive")).stdout == "alive\n"


def test_a_command_over_the_memory_limit_is_reported_oom_killed(
    orchard: Live, busybox_image: str, tmp_path: Path
) -> None:
    """The kernel kills the command, the sandbox lives on, and the job (SDK and CLI) says why."""
    url, key = orchard
    oom = (
        "OOMKilled: the command was killed for using more than the sandbox's memory limit "
        "of 64Mi; give it more with `memory` at create"
    )
    hog = "x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo kept"
    with (
        SandboxClient(base_url=url, api_key=key) as client,
        client.create_sandbox(busybox_image, memory="64Mi") as sandbox,
    ):
        result = sandbox.exec(hog, timeout=120)
        assert (result.status, result.oom_killed, result.exit_code) == ("failed", True, -9)
        assert result.error == oom
        with pytest.raises(errors.CommandFailed) as caught:
            result.check_returncode()
        assert caught.value.message.startswith(
            f"command {hog!r} (job {result.job_id}) exited with code -9: OOMKilled: "
        )
        env = {
            **os.environ,
            "ORCHARD_URL": url,
            "ORCHARD_API_KEY": key,
            "ORCHARD_CONFIG": str(tmp_path / "none.toml"),
        }
        cli = run_orchard("sandbox", "exec", sandbox.sandbox_id, "--", hog, env=env)
        assert (cli.returncode, cli.stderr.decode().strip()) == (137, oom)
        again = sandbox.exec("echo alive")
        assert (again.stdout, again.oom_killed) == ("alive\n", False)
