"""Session fixtures shared by the engine-tier tests: the engine client, the locally built
images, the agent bundle, and the instance name engine tests label their containers with.

Without an engine these fixtures fail with EngineNotFound's message; set
``ORCHARD_SKIP_ENGINE=1`` to skip the engine tests instead. Containers and snapshot images of
this session's test instances (``pytest-<pid>...``) are removed when the session ends, and
those of earlier sessions whose process is gone are removed when the engine is first used.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from images.local import ensure_busybox_image, ensure_sandbox_image, image_cache_dir
from orchard_env.agent.bundle import RUN_DIR_MOUNT
from orchard_env.errors import EngineNotFound
from orchard_env.orchestrator.backends import run_dir
from orchard_env.orchestrator.backends.docker_engine import (
    LABEL_CREATED_BY,
    LABEL_INSTANCE,
    find_engine,
)
from tests.kube_local import LocalCluster
from tests.kube_local import local_cluster as find_local_cluster

TEST_INSTANCE = f"pytest-{os.getpid()}"
_TEST_INSTANCE_RE = re.compile(r"^pytest-(\d+)")


def _is_removable(labels: dict[str, str] | None, *, current: bool) -> bool:
    """Whether an object labelled ``labels`` belongs to this session's test instances
    (``current``), or to an earlier session whose pytest process no longer exists."""
    match = _TEST_INSTANCE_RE.match((labels or {}).get(LABEL_INSTANCE, ""))
    if match is None:
        return False
    pid = int(match.group(1))
    if pid == os.getpid():
        return current
    return not current and not Path(f"/proc/{pid}").exists()


def _remove_test_objects(client: docker.DockerClient, *, current: bool) -> None:
    """Remove the containers, then the images (snapshots), of test instances: this session's
    (``current``) or dead sessions'. The list endpoints' own summaries are used: inspecting
    each object would fail (Podman: 500 "no such ...") when another session removes it.
    A container's agent directory is unmounted too (the backend's delete would have)."""
    created_by = {"label": f"{LABEL_CREATED_BY}=orchard"}
    for summary in client.api.containers(all=True, filters=created_by):
        if _is_removable(summary.get("Labels"), current=current):
            _remove_container(client, summary)
    for summary in listed_images(client, created_by):
        if _is_removable(summary.get("Labels"), current=current):
            _ignore_gone(client.api.remove_image, summary["Id"], force=True)


def _remove_container(client: docker.DockerClient, summary: dict[str, Any]) -> None:
    _ignore_gone(client.api.remove_container, summary["Id"], force=True, v=True)
    for mount in summary.get("Mounts") or ():
        if mount.get("Destination") == RUN_DIR_MOUNT:
            run_dir.unmount(Path(mount["Source"]))


def remove_sandboxes(client: docker.DockerClient, instance: str) -> None:
    """Remove an instance's sandbox containers as the backend's delete would (their agent
    directories unmounted too), for tests whose service has stopped with some left."""
    for summary in client.api.containers(
        all=True, filters={"label": f"{LABEL_INSTANCE}={instance}"}
    ):
        _remove_container(client, summary)


def _ignore_gone(remove: Any, object_id: str, **options: Any) -> None:
    try:
        remove(object_id, **options)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as exc:
        if "no such" not in str(exc) and "not known" not in str(exc):
            raise


def image_tags(client: docker.DockerClient, label: str) -> list[str]:
    """The tags of the images carrying ``label``, from one listing (the SDK's ``images.list``
    inspects each image after listing, which fails when a reaper removes one in between)."""
    listed = listed_images(client, {"label": label})
    return [tag for image in listed for tag in image.get("RepoTags") or ()]


def listed_images(client: docker.DockerClient, filters: dict[str, str]) -> list[dict[str, Any]]:
    """The engine's image summaries. Podman's listing itself fails ("image not known") when
    an image goes meanwhile (another session removing its own): ask again."""
    for attempt in range(10):
        try:
            listed: list[dict[str, Any]] = client.api.images(filters=filters)
            return listed
        except docker.errors.APIError as exc:
            if "image not known" not in str(exc) or attempt == 9:
                raise
            time.sleep(0.1)
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def local_cluster() -> Iterator[LocalCluster]:
    """The real local control plane (tests/kube_local.py), for the ``kube_real`` tier;
    skipped without its binaries, except under ``make test`` (``ORCHARD_KUBE_REAL=require``,
    what CI runs), where that fails."""
    with find_local_cluster() as found:
        if isinstance(found, str):
            if os.environ.get("ORCHARD_KUBE_REAL") == "require":
                pytest.fail(f"ORCHARD_KUBE_REAL=require (make test), but: {found}")
            pytest.skip(found)
        yield found


@pytest.fixture(scope="session")
def docker_client() -> Iterator[docker.DockerClient]:
    if os.environ.get("ORCHARD_SKIP_ENGINE") == "1":
        pytest.skip("ORCHARD_SKIP_ENGINE=1: engine tests skipped")
    try:
        url = find_engine(None)
    except EngineNotFound as exc:
        pytest.fail(
            f"{exc.message}\nhint: {exc.hint}\n(set ORCHARD_SKIP_ENGINE=1 to skip engine tests)",
            pytrace=False,
        )
    client = docker.DockerClient(base_url=url, timeout=120)
    _remove_test_objects(client, current=False)
    yield client
    _remove_test_objects(client, current=True)
    client.close()


@pytest.fixture(scope="session")
def engine_instance(docker_client: docker.DockerClient) -> str:
    """The orchestrator instance name for engine tests. Containers labelled with it, or with
    it plus a suffix (``f"{engine_instance}-other"``), are removed when the session ends."""
    return TEST_INSTANCE


@pytest.fixture(scope="session")
def busybox_image(docker_client: docker.DockerClient) -> str:
    """An image with a static busybox only: no Python, no bash, no libc."""
    return ensure_busybox_image(docker_client)


@pytest.fixture(scope="session")
def sandbox_image(docker_client: docker.DockerClient) -> str:
    """The default Debian sandbox image (built with debootstrap the first time, then cached)."""
    return ensure_sandbox_image(docker_client)


@pytest.fixture(scope="session")
def agent_bundle() -> Path:
    """The relocatable agent bundle, cached across test runs."""
    from orchard_env.agent.bundle import ensure_bundle

    return ensure_bundle(image_cache_dir().parent / "test-bundle")


@pytest.fixture(scope="session")
def tools_payload() -> Path:
    """The tools payload (all five harnesses), built once per machine into its cache
    (/var/cache/orchard/tools/<key>) by the first test run that needs it: minutes, from the
    registries; seconds after."""
    from orchard_env.tools.payload import ensure_payload

    return ensure_payload(progress=lambda line: print(f"tools payload: {line}", flush=True))


# ~/.bashrc as SWE-bench-style images have it: guarded against non-interactive shells, then
# activating conda. The fake conda's python says who it is.
GUARDED_BASHRC = b"""\
[ -z "$PS1" ] && return
export CONDA_DEFAULT_ENV=testbed
export PATH="/opt/conda/envs/testbed/bin:$PATH"
"""
FAKE_PYTHON = b"#!/bin/sh\necho conda-testbed-python\n"


def _conda_layer() -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for folder in (
            "opt/conda",
            "opt/conda/envs",
            "opt/conda/envs/testbed",
            "opt/conda/envs/testbed/bin",
        ):
            info = tarfile.TarInfo(folder)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for name, data, mode in (
            ("root/.bashrc", GUARDED_BASHRC, 0o644),
            ("opt/conda/envs/testbed/bin/python", FAKE_PYTHON, 0o755),
        ):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.fixture(scope="session")
def conda_image(docker_client: docker.DockerClient, sandbox_image: str) -> str:
    """The Debian sandbox image plus a guarded ``/root/.bashrc`` that activates a fake conda
    env (``python`` prints ``conda-testbed-python``): only a shell that sources ~/.bashrc
    as an interactive one sees it. Built once (committed from a container), then reused."""
    layer = _conda_layer()
    base = docker_client.images.get(sandbox_image).id
    key = hashlib.sha256(layer + str(base).encode()).hexdigest()[:12]
    name = f"localhost/orchard/test-conda:{key}"
    with contextlib.suppress(docker.errors.ImageNotFound):
        docker_client.images.get(name)
        return name
    container = docker_client.containers.create(sandbox_image, command=["true"])
    try:
        container.put_archive("/", layer)
        container.commit(repository=name.rsplit(":", 1)[0], tag=key)
    finally:
        container.remove(force=True)
    return name
