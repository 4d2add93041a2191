"""The locally built images: what is in them, and that building them again is a no-op."""

from __future__ import annotations

import sys
from pathlib import Path

import docker
import pytest

from images import local
from images.local import RECIPE_LABEL, list_local_images, sandbox_packages
from orchard_env.errors import OrchardError


def _run(client: docker.DockerClient, image: str, script: str) -> str:
    """Run ``script`` with the image's sh; its output once it exited (a followed log stream
    can lose the end of the output on Podman 4, so wait first, then read the log)."""
    container = client.containers.run(image, ["sh", "-c", script], detach=True, network_mode="none")
    try:
        assert container.wait(timeout=60)["StatusCode"] == 0
        return bytes(container.logs(stdout=True, stderr=True)).decode()
    finally:
        container.remove(force=True)


@pytest.mark.engine
def test_busybox_image_has_no_python_and_no_bash(
    docker_client: docker.DockerClient, busybox_image: str
) -> None:
    found = _run(
        docker_client,
        busybox_image,
        "for p in python3 python bash perl; do command -v $p >/dev/null && echo has-$p; done; "
        "for d in /usr/lib/python3 /lib/x86_64-linux-gnu /lib64; do [ -e $d ] && echo has-$d; "
        "done; stat -c %a /tmp; pwd",
    )
    assert found.split() == ["1777", "/workspace"]


@pytest.mark.engine
def test_sandbox_image_has_git_bash_and_python(
    docker_client: docker.DockerClient, sandbox_image: str
) -> None:
    found = _run(
        docker_client,
        sandbox_image,
        "git --version; bash -c 'echo bash $BASH_VERSINFO'; python3 -c 'import ssl, sqlite3; "
        'print("python ok")\'; pwd; ls /var/lib/apt/lists; test -e /usr/share/doc/git || '
        "echo docs pruned",
    )
    lines = found.splitlines()
    assert lines[0].startswith("git version 2.")
    assert lines[1:] == ["bash 5", "python ok", "/workspace", "partial", "docs pruned"]


@pytest.mark.engine
def test_building_again_keeps_the_same_images(
    docker_client: docker.DockerClient, busybox_image: str, sandbox_image: str
) -> None:
    before = {image.name: image.image_id for image in list_local_images(docker_client)}
    assert local.ensure_busybox_image(docker_client) == busybox_image
    assert local.ensure_sandbox_image(docker_client) == sandbox_image
    after = list_local_images(docker_client)
    assert {image.name: image.image_id for image in after} == before
    assert all(image.present and image.recipe for image in after)
    labels = docker_client.images.get(sandbox_image).labels
    assert labels[RECIPE_LABEL] == next(i.recipe for i in after if i.name == sandbox_image)


def test_package_list_is_sorted_unique_and_without_comments() -> None:
    packages = sandbox_packages()
    assert packages == sorted(set(packages))
    assert {"bash", "git", "python3", "ca-certificates"} <= set(packages)
    assert not any(name.startswith("#") or " " in name for name in packages)


def test_prune_empties_caches_but_keeps_what_apt_and_dpkg_need(tmp_path: Path) -> None:
    files = [
        "var/lib/apt/lists/deb.debian.org_debian_dists_bookworm_InRelease",
        "var/lib/apt/lists/lock",
        "var/cache/apt/pkgcache.bin",
        "var/cache/apt/archives/git_1_amd64.deb",
        "var/cache/debconf/config.dat",
        "var/cache/debconf/config.dat-old",
        "var/log/apt/term.log",
        "var/log/dpkg.log",
        "usr/share/doc/git/copyright",
        "usr/share/locale/de/LC_MESSAGES/git.mo",
        "etc/resolv.conf",
        "etc/hostname",
        "etc/machine-id",
        "usr/bin/git",
    ]
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    (tmp_path / "var/lib/apt/lists/partial").mkdir()
    (tmp_path / "var/cache/apt/archives/partial").mkdir()

    local._prune(tmp_path)

    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if not p.is_dir())
    assert left == [
        "etc/machine-id",
        "usr/bin/git",
        "var/cache/debconf/config.dat",
        "var/lib/apt/lists/lock",
    ]
    assert (tmp_path / "etc/machine-id").read_text() == ""
    for folder in ("var/lib/apt/lists/partial", "var/cache/apt/archives/partial", "var/log/apt"):
        assert (tmp_path / folder).is_dir()
    assert (tmp_path / "workspace").is_dir()


def test_only_a_static_busybox_is_accepted(tmp_path: Path) -> None:
    assert local._is_static_elf64(Path("/bin/busybox").read_bytes())  # busybox-static
    assert not local._is_static_elf64(Path(sys.executable).resolve().read_bytes())
    script = tmp_path / "busybox"
    script.write_text("#!/bin/sh\n")
    no_engine = docker.DockerClient(base_url="unix:///nonexistent.sock", version="1.41")
    with pytest.raises(OrchardError) as caught:  # refused before the engine is asked anything
        local.ensure_busybox_image(no_engine, busybox=script)
    assert caught.value.message == (
        f"{script} is not a statically linked x86-64/arm64 executable: the image has no libc for it"
    )
