"""Images of ``images/`` built for real with Podman in tests, and removed afterwards with the
build stages they left behind (each run with changed sources would leave about 750 MB
otherwise). Test images are tagged ``localhost/orchard-test/<name>:<pid>``."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import docker
import docker.errors

from images.build import build_images

TEST_REPOSITORY = "localhost/orchard-test"


def image_ref(name: str) -> str:
    return f"{TEST_REPOSITORY}/{name}:{os.getpid()}"


def host_ca_bundle() -> Path | None:
    """The machine's CA bundle, handed to pip in an image build: it includes the CA of a
    TLS-intercepting proxy when the machine trusts one (as this one may)."""
    path = Path(os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt")
    return path if path.is_file() else None


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
        remove_built(docker_client, {name: ref}, started)


def remove_built(docker_client: docker.DockerClient, refs: dict[str, str], started: int) -> None:
    """Remove images built since ``started`` (a Unix time): ``refs`` (name -> reference) and
    the build stages their builds left behind (untagged, labelled like the image)."""
    for name, ref in refs.items():
        with contextlib.suppress(docker.errors.ImageNotFound):
            docker_client.images.remove(ref, force=True)
        stages = docker_client.api.images(
            filters={"dangling": True, "label": f"org.opencontainers.image.title=orchard-{name}"}
        )
        for stage in stages:
            if int(stage["Created"]) >= started:
                with contextlib.suppress(docker.errors.APIError):
                    docker_client.images.remove(stage["Id"], force=True)
