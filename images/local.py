"""Images built on this machine and imported through the engine API (no registry needed).

Two images, each labelled with a recipe key (a hash of everything that defines it) so an
image that is present and current is never rebuilt, and one whose definition changed is:

* ``localhost/orchard/busybox:latest`` -- the host's static busybox and its applet links,
  nothing else: no Python, no bash, no libc. It proves the agent bundle needs nothing from
  the image.
* ``localhost/orchard/sandbox:latest`` -- the default sandbox: a Debian bookworm
  ``debootstrap --variant=minbase`` root filesystem plus ``images/sandbox/packages.txt``.
  The root filesystem tarball is cached (keyed by the recipe), so rebuilding the image
  after it was removed from the engine takes seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import docker
import docker.errors

from orchard_env.errors import OrchardError

BUSYBOX_IMAGE = "localhost/orchard/busybox:latest"
SANDBOX_IMAGE = "localhost/orchard/sandbox:latest"
RECIPE_LABEL = "orchard.image-recipe"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
DEBIAN_SUITE = "bookworm"
# Bump when the build steps below change in a way the package list does not show.
_RECIPE_VERSION = 1
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

Progress = Callable[[str], None]


@dataclass(frozen=True)
class LocalImage:
    """One locally built image and its state on the engine."""

    name: str
    present: bool
    recipe: str | None = None  # the recipe key it was built from (label orchard.image-recipe)
    image_id: str | None = None
    size_bytes: int | None = None


def image_cache_dir() -> Path:
    """Where root filesystem tarballs are cached: ``$XDG_CACHE_HOME/orchard/images``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "orchard" / "images"


def sandbox_packages() -> list[str]:
    """The Debian packages of the sandbox image (``images/sandbox/packages.txt``)."""
    text = resources.files("images.sandbox").joinpath("packages.txt").read_text("utf-8")
    names = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return sorted({name for name in names if name})


def _recipe_key(parts: dict[str, Any]) -> str:
    blob = json.dumps({**parts, "recipe_version": _RECIPE_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _is_current(client: docker.DockerClient, name: str, key: str) -> bool:
    """Whether the engine has image ``name`` built from recipe ``key``."""
    try:
        image = client.images.get(name)
    except docker.errors.ImageNotFound:
        return False
    return bool((image.labels or {}).get(RECIPE_LABEL) == key)


def _import(
    client: docker.DockerClient, src: str | bytes, name: str, key: str, changes: Iterable[str]
) -> str:
    """Import a root filesystem tar (a path or the bytes) as image ``name``."""
    repository, tag = name.rsplit(":", 1)
    answer = client.api.import_image(
        src=src,
        repository=repository,
        tag=tag,
        changes=[*changes, f"LABEL {RECIPE_LABEL}={key}"],
    )
    for line in str(answer).splitlines():
        with contextlib.suppress(ValueError):
            message = json.loads(line)
            if isinstance(message, dict) and message.get("error"):
                raise OrchardError(
                    f"the engine refused to import {name}: {message['error']}",
                    hint="check the engine's storage (`podman info`) and free disk space",
                )
    if not _is_current(client, name, key):
        raise OrchardError(
            f"the engine imported {name} but does not list it with recipe {key}",
            hint="run `podman images` to see what it holds, then retry",
        )
    return name


# --- busybox ---------------------------------------------------------------------------------


def _is_static_elf64(binary: bytes) -> bool:
    """A little-endian 64-bit ELF file without a PT_INTERP program header (no loader)."""
    if binary[:6] != b"\x7fELF\x02\x01":
        return False
    phoff = int.from_bytes(binary[32:40], "little")
    size = int.from_bytes(binary[54:56], "little")
    count = int.from_bytes(binary[56:58], "little")
    headers = (binary[phoff + i * size : phoff + i * size + 4] for i in range(count))
    return all(int.from_bytes(kind, "little") != 3 for kind in headers)  # 3 = PT_INTERP


def _busybox_applets(busybox: Path) -> list[str]:
    listing = subprocess.run(
        [str(busybox), "--list-full"], capture_output=True, text=True, check=False
    )
    if listing.returncode != 0 or not listing.stdout.strip():
        raise OrchardError(
            f"{busybox} --list-full failed: {listing.stderr.strip() or 'no applets listed'}",
            hint="install the static busybox: apt-get install busybox-static",
        )
    return sorted(line.strip() for line in listing.stdout.splitlines() if line.strip())


def _busybox_rootfs(binary: bytes, applets: list[str], mtime: int) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:

        def add(name: str, kind: bytes, mode: int, data: bytes = b"", link: str = "") -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime, info.linkname = kind, mode, mtime, link
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data else None)

        for folder in ("bin", "sbin", "usr", "usr/bin", "usr/sbin", "etc", "workspace"):
            add(folder, tarfile.DIRTYPE, 0o755)
        add("tmp", tarfile.DIRTYPE, 0o1777)
        add("root", tarfile.DIRTYPE, 0o700)
        add("etc/passwd", tarfile.REGTYPE, 0o644, b"root:x:0:0:root:/root:/bin/sh\n")
        add("etc/group", tarfile.REGTYPE, 0o644, b"root:x:0:\n")
        add("bin/busybox", tarfile.REGTYPE, 0o755, binary)
        for applet in applets:
            if applet != "bin/busybox":
                add(applet, tarfile.SYMTYPE, 0o777, link="/bin/busybox")
    return buffer.getvalue()


def ensure_busybox_image(client: docker.DockerClient, *, busybox: Path | None = None) -> str:
    """Make sure ``localhost/orchard/busybox:latest`` exists (static busybox only)."""
    binary_path = busybox or Path("/bin/busybox")
    try:
        binary = binary_path.read_bytes()
    except FileNotFoundError:
        raise OrchardError(
            f"{binary_path} does not exist", hint="apt-get install busybox-static"
        ) from None
    if not _is_static_elf64(binary):
        raise OrchardError(
            f"{binary_path} is not a statically linked x86-64/arm64 executable: the image has "
            "no libc for it",
            hint="apt-get install busybox-static",
        )
    applets = _busybox_applets(binary_path)
    key = _recipe_key({"busybox": hashlib.sha256(binary).hexdigest(), "applets": applets})
    if _is_current(client, BUSYBOX_IMAGE, key):
        return BUSYBOX_IMAGE
    rootfs = _busybox_rootfs(binary, applets, int(binary_path.stat().st_mtime))
    changes = [f"ENV PATH={_PATH}", "WORKDIR /workspace", 'CMD ["sh"]']
    return _import(client, rootfs, BUSYBOX_IMAGE, key, changes)


# --- Debian sandbox ----------------------------------------------------------------------------

# What is pruned from the root filesystem after debootstrap (globs relative to it): package
# indexes and caches, docs, logs, and host files debootstrap copied in (the engine provides
# resolv.conf and hostname). Directories apt and dpkg expect (lists/partial, archives/partial)
# and the debconf database stay.
_PRUNE = (
    "var/lib/apt/lists/*_*",
    "var/cache/apt/*.bin",
    "var/cache/apt/archives/*.deb",
    "var/cache/debconf/*-old",
    "usr/share/doc/*",
    "usr/share/man/*",
    "usr/share/info/*",
    "usr/share/locale/*",
    "tmp/*",
    "etc/resolv.conf",
    "etc/hostname",
)


def _find_debootstrap() -> str:
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    found = shutil.which("debootstrap", path=search)
    if found is None:
        raise OrchardError(
            "debootstrap is not installed; it builds the sandbox image's root filesystem",
            hint="apt-get install debootstrap (scripts/setup-host.sh installs everything)",
        )
    return found


def _mounts_under(root: Path) -> list[str]:
    """Mount points inside ``root`` (debootstrap mounts /proc and /sys while it runs)."""
    prefix = str(root.resolve()) + "/"
    with Path("/proc/self/mounts").open() as mounts:
        points = [line.split()[1] for line in mounts if line.split()[1].startswith(prefix)]
    return sorted(points, key=len, reverse=True)


def _remove_rootfs(root: Path) -> None:
    """Delete a build directory, unmounting what a failed debootstrap left mounted first."""
    for point in _mounts_under(root):
        subprocess.run(["umount", "--lazy", point], capture_output=True, check=False)
    if _mounts_under(root):
        raise OrchardError(
            f"cannot unmount what debootstrap mounted under {root}",
            hint=f"unmount those paths by hand (see /proc/mounts), then delete {root}",
        )
    shutil.rmtree(root, ignore_errors=True)


def _prune(root: Path) -> None:
    for pattern in _PRUNE:
        for path in root.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    for log in (root / "var" / "log").rglob("*"):
        if log.is_file():
            log.unlink()
    (root / "etc" / "machine-id").write_text("")
    (root / "workspace").mkdir(mode=0o755, exist_ok=True)


def _debootstrap(
    root: Path, packages: list[str], suite: str, mirror: str, progress: Progress | None
) -> None:
    command = [
        _find_debootstrap(),
        "--variant=minbase",
        f"--include={','.join(packages)}",
        suite,
        str(root),
        mirror,
    ]
    tail: deque[str] = deque(maxlen=15)
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    ) as process:
        assert process.stdout is not None  # stdout=PIPE above
        for raw in process.stdout:
            line = raw.rstrip()
            tail.append(line)
            if progress is not None and line:
                progress(line)
    if process.returncode != 0:
        kept = root.parent / "debootstrap-failed.log"
        with contextlib.suppress(OSError):
            shutil.copyfile(root / "debootstrap" / "debootstrap.log", kept)
        raise OrchardError(
            f"debootstrap {suite} failed (exit {process.returncode}):\n" + "\n".join(tail),
            hint=f"is {mirror} reachable? debootstrap's own log is kept in {kept}",
        )


def _build_rootfs_tarball(
    target: Path, packages: list[str], suite: str, mirror: str, progress: Progress | None
) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="rootfs-", dir=target.parent))
    try:
        if progress is not None:
            progress(f"debootstrap {suite} (minbase + {len(packages)} packages) from {mirror}")
        _debootstrap(root, packages, suite, mirror, progress)
        _prune(root)
        if progress is not None:
            progress(f"packing the root filesystem into {target}")
        partial = target.with_suffix(".partial")
        packed = subprocess.run(
            ["tar", "--numeric-owner", "-C", str(root), "-cf", str(partial), "."],
            capture_output=True,
            text=True,
            check=False,
        )
        if packed.returncode != 0:
            partial.unlink(missing_ok=True)
            raise OrchardError(
                f"tar could not pack {root}: {packed.stderr.strip()}",
                hint=f"check the free space of {target.parent}",
            )
        partial.replace(target)
    finally:
        _remove_rootfs(root)


def ensure_sandbox_image(
    client: docker.DockerClient,
    *,
    progress: Progress | None = None,
    cache_dir: Path | None = None,
    mirror: str = DEBIAN_MIRROR,
    suite: str = DEBIAN_SUITE,
) -> str:
    """Make sure ``localhost/orchard/sandbox:latest`` exists and matches packages.txt.

    Needs root and debootstrap the first time (a few minutes); later builds import the
    cached root filesystem tarball. ``progress`` receives short lines as the build goes.
    """
    packages = sandbox_packages()
    key = _recipe_key({"suite": suite, "variant": "minbase", "packages": packages})
    if _is_current(client, SANDBOX_IMAGE, key):
        return SANDBOX_IMAGE
    tarball = (cache_dir or image_cache_dir()) / f"sandbox-{suite}-{key}.tar"
    if not tarball.is_file():
        if os.geteuid() != 0:
            raise OrchardError(
                "building the sandbox image's root filesystem needs root (debootstrap "
                "creates device nodes and runs dpkg in a chroot)",
                hint="run it as root, e.g. `sudo orchard images build-local`",
            )
        _build_rootfs_tarball(tarball, packages, suite, mirror, progress)
    if progress is not None:
        progress(f"importing {tarball.name} as {SANDBOX_IMAGE}")
    changes = [f"ENV PATH={_PATH}", "ENV LANG=C.UTF-8", "WORKDIR /workspace", 'CMD ["bash"]']
    return _import(client, str(tarball), SANDBOX_IMAGE, key, changes)


def list_local_images(client: docker.DockerClient) -> list[LocalImage]:
    """The locally built images: whether the engine has each, and from which recipe."""
    found: list[LocalImage] = []
    for name in (BUSYBOX_IMAGE, SANDBOX_IMAGE):
        try:
            image = client.images.get(name)
        except docker.errors.ImageNotFound:
            found.append(LocalImage(name=name, present=False))
            continue
        found.append(
            LocalImage(
                name=name,
                present=True,
                recipe=(image.labels or {}).get(RECIPE_LABEL),
                image_id=str(image.id),
                size_bytes=int(image.attrs.get("Size") or 0),
            )
        )
    return found
