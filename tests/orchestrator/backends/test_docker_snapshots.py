"""DockerEngineBackend snapshots against the real engine (Podman here): commit, restore,
independence of forks, lineage labels, what is not in the image, and image removal."""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from uuid import uuid4

import docker
import pytest

from orchard_env import errors
from orchard_env.agent.client import AgentClient, Exit, Output
from orchard_env.config import ServiceSettings, service_settings
from orchard_env.orchestrator.backends.base import (
    BackendSandbox,
    Capability,
    SandboxSpec,
    SnapshotImage,
)
from orchard_env.orchestrator.backends.docker_engine import (
    LABEL_INSTANCE,
    LABEL_SANDBOX_ID,
    SNAPSHOT_REPOSITORY,
    DockerEngineBackend,
)
from tests.conftest import image_tags
from tests.orchestrator.backends.conftest import emptied

pytestmark = pytest.mark.engine


@pytest.fixture
def settings(tmp_path_factory: pytest.TempPathFactory, engine_instance: str) -> ServiceSettings:
    # Short state dir (agent socket path limit); an instance of its own, so the images this
    # module leaves behind on failure can be found and removed.
    return service_settings(
        state_dir=tmp_path_factory.mktemp("sn"), instance=f"{engine_instance}-snap"
    )


def remove_snapshot_images(client: docker.DockerClient, instance: str) -> list[str]:
    """Remove this instance's snapshot images; return their tags."""
    tags = []
    for tag in image_tags(client, f"{LABEL_INSTANCE}={instance}"):
        if tag.startswith(f"{SNAPSHOT_REPOSITORY}/"):
            tags.append(tag)
            with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                client.images.remove(tag)
    return tags


@pytest.fixture
def leftovers(
    docker_client: docker.DockerClient, settings: ServiceSettings
) -> Iterator[Callable[[], list[str]]]:
    """What the engine still holds for this instance: containers and snapshot images."""

    def held() -> list[str]:
        containers = docker_client.containers.list(
            all=True, filters={"label": f"{LABEL_INSTANCE}={settings.instance}"}
        )
        images = image_tags(docker_client, f"{LABEL_INSTANCE}={settings.instance}")
        return [c.name for c in containers] + images

    yield held
    remove_snapshot_images(docker_client, settings.instance)


@pytest.fixture
async def backend(
    settings: ServiceSettings, agent_bundle: Path, leftovers: Callable[[], list[str]]
) -> AsyncIterator[DockerEngineBackend]:
    async with emptied(DockerEngineBackend(settings, bundle_dir=agent_bundle)) as opened:
        yield opened


def restoring(image: SnapshotImage) -> dict[str, str]:
    """The spec fields of a restore of ``image``, as the orchestrator authorises it."""
    return {"image": image.ref, "snapshot_id": image.ref.rsplit(":", 1)[1]}


async def run(sandbox: BackendSandbox, command: str) -> str:
    """Run ``command`` with the image's sh through the agent; its output (must exit 0)."""
    assert sandbox.agent is not None and sandbox.agent.uds is not None
    output = b""
    async with AgentClient(token=sandbox.agent.token, uds=sandbox.agent.uds) as agent:
        await agent.wait_ready(30)
        async for event in agent.exec(uuid4().hex, command, timeout=60):
            if isinstance(event, Output):
                output += event.data
            elif isinstance(event, Exit):
                assert event.exit_code == 0, output.decode()
                return output.decode()
    raise AssertionError("the agent's stream ended without an exit event")


def test_the_engine_backend_can_snapshot() -> None:
    assert Capability.SNAPSHOT in DockerEngineBackend.capabilities


async def test_restore_gets_the_files_of_the_moment_of_the_snapshot(
    backend: DockerEngineBackend,
    spec: Callable[..., SandboxSpec],
    docker_client: docker.DockerClient,
    busybox_image: str,
    settings: ServiceSettings,
) -> None:
    source_spec = spec(env={"MODE": "train"})
    source = await backend.create(source_spec)
    await run(source, "echo v1 > /workspace/state.txt && head -c 100000 /dev/zero > /tmp/pad")
    snapshot_id = f"snap-{secrets.token_hex(6)}"
    image = await backend.snapshot(source.sandbox_id, snapshot_id)
    assert image.ref == f"{SNAPSHOT_REPOSITORY}/{settings.instance}:{snapshot_id}"
    assert 100_000 <= image.size_bytes < 1_000_000  # its own layer, not the base image again
    await run(source, "echo v2 > /workspace/state.txt")

    restored = await backend.create(spec(**restoring(image)))
    assert await run(restored, "cat /workspace/state.txt") == "v1\n"
    assert await run(source, "cat /workspace/state.txt") == "v2\n"

    committed = docker_client.images.get(image.ref)
    config = committed.attrs["Config"]
    base = docker_client.images.get(busybox_image).attrs["Config"]
    assert config["Labels"]["orchard.snapshot-id"] == snapshot_id
    assert config["Labels"]["orchard.source-sandbox"] == source.sandbox_id
    assert config["Labels"][LABEL_INSTANCE] == settings.instance
    assert config["Labels"]["orchard.record"] == ""
    assert config["Labels"].get("orchard.snapshot-parent", "") == ""
    assert config["Labels"]["orchard.agent-key"] == ""  # blanked: the key is not in it
    assert not any(source_spec.agent_token in item for item in config["Env"])
    assert source_spec.agent_token not in json.dumps(committed.attrs)
    assert (config.get("Entrypoint") or []) == (base.get("Entrypoint") or [])
    assert (config.get("Cmd") or []) == (base.get("Cmd") or [])


async def test_successive_snapshots_store_only_what_changed(
    backend: DockerEngineBackend,
    spec: Callable[..., SandboxSpec],
    docker_client: docker.DockerClient,
    settings: ServiceSettings,
    leftovers: Callable[[], list[str]],
) -> None:
    source = await backend.create(spec())
    await run(
        source,
        "cd /workspace && head -c 1000000 /dev/urandom > big && echo keep > keep"
        " && mkdir -p tree/sub && echo x > tree/x && echo y > tree/sub/y && echo f > gone",
    )
    first = await backend.snapshot(source.sandbox_id, f"snap-{secrets.token_hex(6)}")
    assert first.size_bytes >= 1_000_000
    await run(
        source,
        "cd /workspace && rm big gone && rm -r tree/sub && head -c 500000 /dev/zero > tree/new"
        " && chmod 640 keep && ln -s keep link && mkfifo pipe"
        " && rm /linuxrc && rm -r /usr/sbin && mkdir /usr/sbin && echo only > /usr/sbin/only"
        " && touch \"/tmp/$(printf 'odd\\nname\\377')\"",  # not UTF-8, with a newline
    )
    second = await backend.snapshot(source.sandbox_id, f"snap-{secrets.token_hex(6)}")
    assert 500_000 <= second.size_bytes < 600_000  # the new file, not the 1 MB one again
    await run(source, "echo more > /usr/sbin/more && echo v3 > /workspace/keep")
    third = await backend.snapshot(source.sandbox_id, f"snap-{secrets.token_hex(6)}")
    assert third.size_bytes < 100_000  # nor the new file of the second
    layers = [
        len(docker_client.images.get(i.ref).attrs["RootFS"]["Layers"])
        for i in (first, second, third)
    ]
    assert layers[1:] == [layers[0] + 1, layers[0] + 2]  # each on top of the one before

    listing = "cd /workspace && ls -A . tree && ls -A /usr/sbin && stat -c '%a %F' keep pipe"
    at_first = await backend.create(spec(**restoring(first)))
    assert (
        await run(
            at_first,
            "cat /workspace/gone /workspace/tree/sub/y /linuxrc >/dev/null"
            " && wc -c < /workspace/big",
        )
        == "1000000\n"
    )
    at_second = await backend.create(spec(**restoring(second)))
    assert (await run(at_second, listing)).split() == [
        ".:",
        "keep",
        "link",
        "pipe",
        "tree",
        "tree:",
        "new",
        "x",
        "only",
        "640",
        "regular",
        "file",
        "644",
        "fifo",
    ]
    assert (
        await run(
            at_second,
            "readlink /workspace/link; cat /workspace/keep; test ! -e /linuxrc && echo no-linuxrc;"
            " test -e \"/tmp/$(printf 'odd\\nname\\377')\" && echo odd-kept",
        )
        == "keep\nkeep\nno-linuxrc\nodd-kept\n"
    )
    at_third = await backend.create(spec(**restoring(third)))
    assert (await run(at_third, "ls -A /usr/sbin; cat /workspace/keep")).split() == [
        "more",
        "only",
        "v3",
    ]
    assert await run(source, "ls -A /usr/sbin; cat /workspace/keep") == "more\nonly\nv3\n"
    record = settings.state_dir / "snapshot-layers" / f"{source.sandbox_id}.json"
    assert record.is_file()
    assert not [name for name in leftovers() if name.endswith("-snapshot")]  # no helper left
    await backend.delete(source.sandbox_id)
    assert not record.exists()


async def test_an_incremental_snapshot_never_follows_the_sandboxs_links(
    backend: DockerEngineBackend, spec: Callable[..., SandboxSpec], tmp_path: Path
) -> None:
    """A directory snapshotted once, then replaced by a link to a host path: the next
    snapshot's whiteouts and files land in its own layer, never through the link."""
    host = tmp_path / "host"
    host.mkdir()
    source = await backend.create(spec())
    await run(source, "mkdir -p /workspace/d && echo f > /workspace/d/victim")
    await backend.snapshot(source.sandbox_id, f"snap-{secrets.token_hex(6)}")
    await run(
        source,
        f"rm -r /workspace/d && ln -s {host} /workspace/d"
        f" && mkdir /workspace/e && ln -s {host}/planted /workspace/e/l",
    )
    second = await backend.snapshot(source.sandbox_id, f"snap-{secrets.token_hex(6)}")
    assert list(host.iterdir()) == []
    restored = await backend.create(spec(**restoring(second)))
    assert (
        await run(restored, "readlink /workspace/d; readlink /workspace/e/l")
        == f"{host}\n{host}/planted\n"
    )


async def test_a_sandbox_left_paused_by_an_interrupted_snapshot_is_resumed(
    backend: DockerEngineBackend,
    spec: Callable[..., SandboxSpec],
    docker_client: docker.DockerClient,
) -> None:
    """A snapshot pauses the sandbox; a service killed before resuming it leaves it frozen,
    which the next look at it (adoption, the reaper's inspection) undoes."""
    source = await backend.create(spec())
    (container,) = docker_client.containers.list(
        filters={"label": f"{LABEL_SANDBOX_ID}={source.sandbox_id}"}
    )
    container.pause()
    assert [found.sandbox_id for found in await backend.list()] == [source.sandbox_id]
    container.reload()
    assert container.status == "running"
    assert await run(source, "echo alive") == "alive\n"


async def test_restoring_a_snapshot_whose_workdir_is_now_a_file_is_a_clear_error(
    backend: DockerEngineBackend, spec: Callable[..., SandboxSpec], settings: ServiceSettings
) -> None:
    source = await backend.create(spec())
    await run(source, "cd / && rm -rf /workspace && echo not a dir > /workspace")
    image = await backend.snapshot(source.sandbox_id, f"snap-{secrets.token_hex(6)}")
    wanted = spec(**restoring(image), workdir="/workspace")
    with pytest.raises(errors.InvalidRequest) as caught:
        await backend.create(wanted)
    assert caught.value.message.startswith("workdir '/workspace' is not a directory in image ")
    assert caught.value.hint is not None and "snapshot" in caught.value.hint
    assert await backend.inspect(wanted.sandbox_id) is None
    assert not (settings.sandboxes_dir / wanted.sandbox_id).exists()


async def test_the_agent_and_its_socket_directory_are_not_in_the_image(
    backend: DockerEngineBackend,
    spec: Callable[..., SandboxSpec],
    docker_client: docker.DockerClient,
) -> None:
    source = await backend.create(spec())
    await run(source, "echo hi > /workspace/x")
    image = await backend.snapshot(source.sandbox_id, f"snap-{secrets.token_hex(6)}")
    # Run the bare image, without Orchard's mounts: the mount points are empty directories.
    # Detached, then wait and read the logs: an attached run can hang on Podman's stream.
    container = docker_client.containers.run(
        image.ref,
        entrypoint=["/bin/sh", "-c"],
        command=["ls -A /opt/orchard-agent /run/orchard; cat /workspace/x"],
        detach=True,
        network_mode="none",
    )
    try:
        container.wait(timeout=60)
        listing = container.logs()
    finally:
        container.remove(force=True)
    assert listing.decode() == "/opt/orchard-agent:\n\n/run/orchard:\nhi\n"


async def test_restores_are_independent_and_lineage_is_labelled(
    backend: DockerEngineBackend,
    spec: Callable[..., SandboxSpec],
    docker_client: docker.DockerClient,
) -> None:
    source = await backend.create(spec())
    await run(source, "echo base > /workspace/state.txt")
    parent_id = f"snap-{secrets.token_hex(6)}"
    parent = await backend.snapshot(source.sandbox_id, parent_id)
    forks = [await backend.create(spec(**restoring(parent))) for _ in range(3)]
    for index, fork in enumerate(forks):
        await run(fork, f"echo fork-{index} > /workspace/state.txt")
    for index, fork in enumerate(forks):
        assert await run(fork, "cat /workspace/state.txt") == f"fork-{index}\n"
    child = await backend.snapshot(
        forks[0].sandbox_id, f"snap-{secrets.token_hex(6)}", parent=parent_id
    )
    labels = docker_client.images.get(child.ref).attrs["Config"]["Labels"]
    assert labels["orchard.snapshot-parent"] == parent_id
    assert child.size_bytes < 100_000  # only what changed since the restore
    grandchild = await backend.create(spec(**restoring(child)))
    assert await run(grandchild, "cat /workspace/state.txt") == "fork-0\n"


async def test_an_image_in_use_is_kept_and_deleting_everything_leaves_nothing(
    backend: DockerEngineBackend,
    spec: Callable[..., SandboxSpec],
    leftovers: Callable[[], list[str]],
) -> None:
    source = await backend.create(spec())
    parent = await backend.snapshot(source.sandbox_id, f"snap-{secrets.token_hex(6)}")
    restored = await backend.create(spec(**restoring(parent)))
    child = await backend.snapshot(restored.sandbox_id, f"snap-{secrets.token_hex(6)}")
    assert await backend.delete_snapshot(parent.ref) is False  # a container runs on it
    await backend.delete(restored.sandbox_id)
    assert await backend.delete_snapshot(parent.ref) is True  # the child image keeps its layers
    grandchild = await backend.create(spec(**restoring(child)))
    await run(grandchild, "true")
    await backend.delete(grandchild.sandbox_id)
    await backend.delete(source.sandbox_id)
    assert await backend.delete_snapshot(child.ref) is True
    assert await backend.delete_snapshot(child.ref) is True  # already gone: quiet
    assert leftovers() == []
    with pytest.raises(errors.ImageNotFound, match="is no longer on this machine's engine"):
        await backend.create(spec(**restoring(child)))


async def test_snapshot_errors(backend: DockerEngineBackend) -> None:
    with pytest.raises(errors.SandboxNotFound, match="has no container to snapshot"):
        await backend.snapshot("no-such-box", f"snap-{secrets.token_hex(6)}")
    with pytest.raises(errors.InvalidRequest, match="is not a snapshot image"):
        await backend.delete_snapshot("localhost/orchard/sandbox:latest")
