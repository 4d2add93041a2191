"""The tools payload in real containers (engine tier): every harness on PATH in the Debian
image and in busybox (no libc, bash or Python), after the image's own PATH, in login shells
too; the mount read-only; VERSIONS; the opt-out; snapshots without it, restores with it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import docker
import docker.errors
import pytest

from orchard_env import errors
from orchard_env.config import ServiceSettings, service_settings
from orchard_env.orchestrator.backends.docker_engine import LABEL_INSTANCE
from orchard_env.sdk import SandboxClient
from orchard_env.tools import HARNESSES
from tests.conftest import image_tags, remove_sandboxes
from tests.servers import Live, live_service

pytestmark = pytest.mark.engine

# First lines only (hermes adds its install details), a failing harness fails the command.
VERSIONS_CMD = "set -e; " + "; ".join(
    f'v=$({name} --version); echo "$v" | head -n 1' for name in HARNESSES
)
# The first line each harness prints for --version, as in the payload's VERSIONS file.
EXPECTED = {
    "codex": "codex-cli ",
    "claude": " (Claude Code)",
    "opencode": ".",
    "pi": ".",
    "hermes": "Hermes Agent v",
}


@pytest.fixture
def settings(
    tmp_path_factory: pytest.TempPathFactory,
    engine_instance: str,
    agent_bundle: Path,
    tools_payload: Path,
) -> ServiceSettings:
    return service_settings(
        state_dir=tmp_path_factory.mktemp("tl"),
        instance=f"{engine_instance}-tools",
        agent_bundle_dir=agent_bundle,
        tools_dir=tools_payload,
    )


@pytest.fixture
def orchard(settings: ServiceSettings, docker_client: docker.DockerClient) -> Iterator[Live]:
    with live_service(settings, key_name="tools-engine") as running:
        yield running
    remove_sandboxes(docker_client, settings.instance)
    for tag in image_tags(docker_client, f"{LABEL_INSTANCE}={settings.instance}"):
        with contextlib.suppress(docker.errors.NotFound):
            docker_client.images.remove(tag)


def harness_versions(output: str) -> dict[str, str]:
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == len(HARNESSES), output
    found = dict(zip(HARNESSES, lines, strict=True))
    for name, fragment in EXPECTED.items():
        assert fragment in found[name], (name, found[name])
    return found


@pytest.mark.parametrize("image_fixture", ["sandbox_image", "busybox_image"])
def test_every_harness_reports_its_version_via_path(
    orchard: Live, image_fixture: str, request: pytest.FixtureRequest, tools_payload: Path
) -> None:
    image = request.getfixturevalue(image_fixture)
    url, key = orchard
    recorded = (tools_payload / "VERSIONS").read_text()
    with (
        SandboxClient(base_url=url, api_key=key) as client,
        client.create_sandbox(image, memory="1Gi") as sandbox,
    ):
        # HOME on the sandbox's own disk: codex and opencode write state there.
        plain = sandbox.exec(VERSIONS_CMD, env={"HOME": "/root"}, timeout=300)
        assert plain.exit_code == 0, plain.stderr
        found = harness_versions(plain.stdout)
        for name, line in found.items():
            assert f"{name:<9}{line}" in recorded  # the same as the payload's VERSIONS
        login = sandbox.exec(VERSIONS_CMD, login_shell=True, timeout=300)
        assert login.exit_code == 0, login.stderr
        assert harness_versions(login.stdout) == found
        path = sandbox.exec("echo $PATH").stdout.strip()
        assert path.endswith(":/opt/sandbox-tools/bin")
        assert path.split(":")[0] == "/usr/local/sbin"  # the image's own PATH comes first
        assert "/opt/sandbox-tools/bin" in sandbox.exec("echo $PATH", login_shell=True).stdout
        if image_fixture == "sandbox_image":
            # A login shell a command starts itself (Debian's /etc/profile sets PATH anew)
            # and a plain one: the payload's profile script is where login shells source it.
            for shell in ("bash -lc", "bash -c", "sh -lc"):
                found = sandbox.exec(f"{shell} 'command -v codex'")
                assert found.stdout == "/opt/sandbox-tools/bin/codex\n", (shell, found.stderr)
        # A process the agent did not start (the engine's exec, PID 1's environment) finds
        # them too: upstream's "reachable from kubectl exec" check.
        outside = sandbox.exec(
            "p=$(tr '\\0' '\\n' < /proc/1/environ | grep '^PATH=' | cut -d= -f2-); "
            'env -i HOME=/root PATH="$p" sh -c "codex --version"'
        )
        assert outside.stdout.startswith("codex-cli "), outside.stderr
        touch = sandbox.exec("touch /opt/sandbox-tools/x")
        assert touch.exit_code != 0 and "Read-only file system" in touch.stderr
        versions = sandbox.exec("cat /opt/sandbox-tools/VERSIONS").stdout
        assert versions == recorded
        # The harnesses that need a bash get the payload's where the image has none.
        shell = sandbox.exec("[ -x /bin/bash ] && echo has-bash || echo no-bash").stdout
        assert shell.strip() == ("has-bash" if image_fixture == "sandbox_image" else "no-bash")


def test_hermes_leaves_the_image_python_alone(orchard: Live, sandbox_image: str) -> None:
    url, key = orchard
    script = (
        "before=$(command -v python3); hermes --version >/dev/null 2>&1; "
        'after=$(command -v python3); echo "$before $after"; '
        'python3 -c "import sys; print(sys.prefix)"'
    )
    with (
        SandboxClient(base_url=url, api_key=key) as client,
        client.create_sandbox(sandbox_image, memory="1Gi") as sandbox,
    ):
        out = sandbox.exec(script, env={"HOME": "/root"}, timeout=120).stdout.split()
        assert out == ["/usr/bin/python3", "/usr/bin/python3", "/usr"]


def test_opt_out_and_subsets(orchard: Live, busybox_image: str) -> None:
    url, key = orchard
    with SandboxClient(base_url=url, api_key=key) as client:
        with client.create_sandbox(busybox_image, tools=False) as sandbox:
            assert sandbox.info.tools == []
            gone = sandbox.exec("ls /opt/sandbox-tools; command -v codex; echo $PATH")
            assert "sandbox-tools" not in gone.stdout and "No such file" in gone.stderr
        with client.create_sandbox(busybox_image, tools=["pi", "codex"]) as sandbox:
            assert sandbox.info.tools == ["codex", "pi"]
            listing = sandbox.exec(
                "ls /opt/sandbox-tools/bin; cut -c1-9 /opt/sandbox-tools/VERSIONS"
            )
            assert listing.stdout.split() == ["codex", "pi", "codex", "pi"]
            assert sandbox.exec("pi --version", env={"HOME": "/root"}).stdout.strip() != ""
            assert sandbox.exec("command -v claude").exit_code != 0
            assert sandbox.exec("ls /opt/sandbox-tools/claude").exit_code != 0
            assert "Read-only" in sandbox.exec("touch /opt/sandbox-tools/codex/x").stderr
        with pytest.raises(errors.InvalidRequest, match=r"unknown harness 'gemini'.*known: codex"):
            client.create_sandbox(busybox_image, tools=["codex", "gemini"])


def test_snapshot_leaves_the_payload_out_and_restore_mounts_it(
    orchard: Live, sandbox_image: str, docker_client: docker.DockerClient
) -> None:
    url, key = orchard
    with SandboxClient(base_url=url, api_key=key) as client:
        with client.create_sandbox(sandbox_image, memory="512Mi") as source:
            source.exec("echo kept > /workspace/state.txt", check=True)
            snap = source.snapshot()
        # The image holds at most the empty mount point, none of the 1.4 GB.
        inside = docker_client.containers.run(
            snap.image,
            entrypoint=["/bin/sh", "-c", "ls -A /opt/sandbox-tools 2>&1 | wc -l"],
            remove=True,
            network_mode="none",
        )
        assert inside.decode().strip() == "0"
        profile = docker_client.containers.run(
            snap.image,
            entrypoint=["/bin/sh", "-c", "[ -s /etc/profile.d/sandbox-tools.sh ] || echo empty"],
            remove=True,
            network_mode="none",
        )
        assert profile == b"empty\n"  # at most its empty mount point
        with client.restore(snap.snapshot_id) as restored:
            assert restored.exec("cat /workspace/state.txt").stdout == "kept\n"
            again = restored.exec("codex --version", env={"HOME": "/root"})
            assert again.stdout.startswith("codex-cli ")
        client.delete_snapshot(snap.snapshot_id)
