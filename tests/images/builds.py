"""Images of ``images/`` built for real with Podman in tests, and removed afterwards with the
build stages they left behind (each run with changed sources would leave about 750 MB
otherwise). Test images are tagged ``localhost/orchard-test/<name>:<pid>``."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import docker
import docker.errors

from images.build import build_images

TEST_REPOSITORY = "localhost/orchard-test"


def image_ref(name: str) -> str:
    return f"{TEST_REPOSITORY}/{name}:{os.getpid()}"


def built_image(
    docker_client: docker.DockerClient,
    builder: str,
    name: str,
    ref: str | None = None,
    **kwargs: object,
) -> Iterator[str]:
    """Build image ``name`` as ``ref`` (``build_images``' ``kwargs``), yield the reference,
    then remove it and its build stages (a generator for ``yield from`` in fixtures)."""
    ref = ref or image_ref(name)
    started = int(time.time()) - 1
    try:
        build_images({name: ref}, builder=builder, **kwargs)  # type: ignore[arg-type]
        yield ref
    finally:
        with contextlib.suppress(docker.errors.ImageNotFound):
            docker_client.images.remove(ref, force=True)
        # the build stages this build left behind (untagged, labelled like the image)
        stages = docker_client.api.images(
            filters={"dangling": True, "label": f"org.opencontainers.image.title=orchard-{name}"}
        )
        for stage in stages:
            if int(stage["Created"]) >= started:
                with contextlib.suppress(docker.errors.APIError):
                    docker_client.images.remove(stage["Id"], force=True)
