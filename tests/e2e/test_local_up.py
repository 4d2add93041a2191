"""`orchard up` on this machine's engine, driven as a user would: the real service process,
the real CLI in subprocesses, a hard kill and restart, then `orchard down`."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import signal
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from orchard_env.config import service_settings
from orchard_env.orchestrator.backends.docker_engine import LABEL_INSTANCE
from orchard_env.sdk import SandboxClient
from provision.local import LocalProvider

pytestmark = pytest.mark.engine

PATCH = """\
--- a/hello.txt
+++ b/hello.txt
@@ -1 +1 @@
-hello
+hello, patched
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def provider(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    engine_instance: str,
    sandbox_image: str,
) -> Iterator[LocalProvider]:
    monkeypatch.setenv("ORCHARD_CONFIG", str(tmp_path / "config.toml"))
    settings = service_settings(
        port=_free_port(), state_dir=tmp_path / "state", instance=f"{engine_instance}-e2e"
    )
    local = LocalProvider(settings, context="e2e")
    yield local
    local.down(lambda _message: None)


def _cli(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-c", "from orchard_cli.main import main; main()", *args],
        capture_output=True,
        input=stdin,
        timeout=120,
        check=False,
        env=dict(os.environ),
    )


def _interactive_shell(sandbox_id: str, keys: bytes) -> tuple[int, bytes]:
    """Run `orchard sandbox shell` with a pseudo-terminal as its stdin/stdout."""
    controller, terminal = pty.openpty()
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from orchard_cli.main import main; main()",
            "sandbox",
            "shell",
            sandbox_id,
        ],
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        env=dict(os.environ),
    )
    os.close(terminal)
    os.write(controller, keys)
    screen = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([controller], [], [], 1)
        if not ready:
            if process.poll() is not None:
                break
            continue
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the terminal closed: the CLI exited
            break
        if not chunk:
            break
        screen += chunk
    os.close(controller)
    try:
        return process.wait(timeout=30), screen
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise AssertionError(f"the shell did not exit; the screen showed {screen!r}") from None


def test_up_drive_restart_down(
    provider: LocalProvider, docker_client: docker.DockerClient, tmp_path: Path
) -> None:
    messages: list[str] = []
    result = provider.up(messages.append)
    assert [stage.stage for stage in result.stages] == ["provision", "images", "deploy", "smoke"]
    assert re.match(r"1\d checks passed in [0-9.]+ s$", result.stages[-1].summary)

    # Running `up` again changes nothing and says so.
    again = provider.up(messages.append, smoke=False)
    assert again.stages[2].skipped

    created = _cli("sandbox", "create", "--label", "e2e=yes")
    assert created.returncode == 0, created.stderr
    sandbox_id = created.stdout.decode().strip()

    ran = _cli("sandbox", "exec", sandbox_id, "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert (ran.returncode, ran.stdout, ran.stderr) == (7, b"out\n", b"err\n")

    # A string runs through bash where the image has it, as upstream's agent did.
    bashism = _cli(
        "sandbox", "exec", sandbox_id, "source /etc/os-release && [[ -n $ID ]] && echo $ID"
    )
    assert (bashism.returncode, bashism.stdout) == (0, b"debian\n"), bashism.stderr

    payload = bytes(range(256)) * 4096
    (tmp_path / "blob.bin").write_bytes(payload)
    assert (
        _cli(
            "sandbox", "cp", str(tmp_path / "blob.bin"), f"{sandbox_id}:/workspace/blob.bin"
        ).returncode
        == 0
    )
    back = _cli("sandbox", "cp", f"{sandbox_id}:/workspace/blob.bin", "-")  # a tar stream
    with tarfile.open(fileobj=io.BytesIO(back.stdout)) as archive:
        member = archive.extractfile("blob.bin")
        assert member is not None and member.read() == payload

    listing = json.loads(_cli("sandbox", "ls", sandbox_id, "/workspace", "--json").stdout)
    assert {"name": "blob.bin", "size": len(payload)}.items() <= listing[0].items()

    (tmp_path / "hello.txt").write_bytes(b"hello\n")
    assert (
        _cli("sandbox", "cp", str(tmp_path / "hello.txt"), f"{sandbox_id}:/workspace/").returncode
        == 0
    )
    patched = _cli("sandbox", "patch", sandbox_id, "-", stdin=PATCH.encode())
    assert patched.returncode == 0, patched.stderr
    assert (
        _cli("sandbox", "exec", sandbox_id, "--", "cat /workspace/hello.txt").stdout
        == b"hello, patched\n"
    )

    # `orchard sandbox shell` on a real terminal: type into it, read it, get its exit code.
    code, screen = _interactive_shell(sandbox_id, b"echo $((6 * 7)); exit 3\n")
    assert code == 3, screen
    assert b"42" in screen

    # A command is running when the orchestrator is killed hard; after the restart the
    # sandbox is still there and the command has run exactly once.
    with SandboxClient(context="e2e", auto_cleanup=False) as client:
        sandbox = client.get_sandbox(sandbox_id)
        job = sandbox.exec("sleep 2; echo ran >> /workspace/count", wait=False)
        pid = int(provider.paths.pid_file.read_text())
        os.kill(pid, signal.SIGKILL)
    provider.up(messages.append, smoke=False)
    with SandboxClient(context="e2e", auto_cleanup=False) as client:
        assert client.get_sandbox(sandbox_id).info.status == "ready"
        finished = client.wait_job(job.job_id, timeout=60)
        assert finished.status == "succeeded", finished
        count = client.get_sandbox(sandbox_id).download_content("/workspace/count")
        assert count == b"ran\n"

    status = _cli(
        "status",
        "--state-dir",
        str(provider.settings.state_dir),
        "--port",
        str(provider.settings.port),
        "--context",
        "e2e",
        "--json",
    )
    assert json.loads(status.stdout)["running"] is True

    provider.down(messages.append)
    leftovers = docker_client.containers.list(
        all=True, filters={"label": f"{LABEL_INSTANCE}={provider.settings.instance}"}
    )
    assert leftovers == []
    assert not provider.paths.pid_file.exists()


def test_a_second_orchard_up_on_the_engine_leaves_the_first_ones_sandboxes_alone(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    docker_client: docker.DockerClient,
    sandbox_image: str,
) -> None:
    """The attack of the issue: a second `orchard up --port P --state-dir D2` with the default
    instance, a fast reaper and short ready timeout, then its `orchard down`."""
    monkeypatch.setenv("ORCHARD_CONFIG", str(tmp_path / "config.toml"))
    first = LocalProvider(
        service_settings(port=_free_port(), state_dir=tmp_path / "one"), context="one"
    )
    second = LocalProvider(
        service_settings(
            port=_free_port(),
            state_dir=tmp_path / "two",
            reap_interval_seconds=1,
            ready_timeout_seconds=5,
        ),
        context="two",
    )
    assert first.settings.instance != second.settings.instance

    def quiet(_message: str) -> None:
        pass

    try:
        first.up(quiet, smoke=False)
        with SandboxClient(context="one", auto_cleanup=False) as client:
            sandbox = client.create_sandbox(image=sandbox_image)
            sandbox_id = sandbox.sandbox_id
        second.up(quiet, smoke=False)
        with SandboxClient(context="two", auto_cleanup=False) as client:
            assert client.list_sandboxes() == []
            # Reaper passes of the second (every second) for longer than its ready timeout.
            job = client.create_sandbox(image=sandbox_image).exec("sleep 8", wait=True)
            assert job.returncode == 0
        second.down(quiet)
        with SandboxClient(context="one", auto_cleanup=False) as client:
            survivor = client.get_sandbox(sandbox_id)
            assert survivor.info.status == "ready"
            assert survivor.exec("echo alive").stdout == "alive\n"
    finally:
        second.down(quiet)
        first.down(quiet)
    assert (
        docker_client.containers.list(
            all=True, filters={"label": f"{LABEL_INSTANCE}={first.settings.instance}"}
        )
        == []
    )
