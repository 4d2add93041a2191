"""A second Podman engine on a btrfs file system with quotas, for the disk-limit tests: the
machine's own engine may be on storage that cannot cap a container's disk (overlay on ext4,
CI's), where Orchard refuses `disk`; this one can, so the limit itself is tested everywhere.

It is the storage `scripts/setup-host.sh` sets up for the machine's engine with
`ORCHARD_QUOTA_STORAGE=yes` (btrfs on a loop file, quotas on), at a scale for one test: a
3 GiB sparse loop file under /var/tmp, its own Podman API service (`--root`, `--runroot`,
`--storage-driver btrfs`), the busybox test image copied into it. All of it goes at the end
of the session.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

LOOP_SIZE = 3 * 1024**3


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        pytest.fail(f"`{' '.join(argv)}` failed: {done.stderr.strip()}", pytrace=False)


@contextlib.contextmanager
def quota_engine(source: docker.DockerClient, image: str) -> Iterator[str]:
    """The URL of a Podman API service on btrfs with quotas, holding ``image`` (copied from
    the ``source`` engine's)."""
    if os.geteuid() != 0:
        pytest.skip("a btrfs engine for disk limits needs root (loop mount)")
    if "btrfs" not in Path("/proc/filesystems").read_text():
        pytest.skip("this kernel has no btrfs: no engine here can limit a sandbox's disk")
    if shutil.which("mkfs.btrfs") is None:
        pytest.fail("mkfs.btrfs is missing: `make host` installs btrfs-progs", pytrace=False)
    home = Path(tempfile.mkdtemp(prefix="orchard-quota-", dir="/var/tmp"))
    loop, mount = home / "fs.btrfs", home / "fs"
    socket = home / "podman.sock"
    podman = ["podman", "--root", str(mount / "storage"), "--runroot", str(home / "run")]
    podman += ["--storage-driver", "btrfs"]
    service: subprocess.Popen[bytes] | None = None
    mount.mkdir()
    try:
        with loop.open("wb") as handle:
            handle.truncate(LOOP_SIZE)
        _run("mkfs.btrfs", "-q", str(loop))
        _run("mount", "-o", "loop,noatime", str(loop), str(mount))
        _run("btrfs", "quota", "enable", str(mount))
        service = subprocess.Popen(
            [*podman, "system", "service", "--time=0", f"unix://{socket}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while not socket.exists():
            if service.poll() is not None or time.monotonic() > deadline:
                pytest.fail("the btrfs engine's API service did not start", pytrace=False)
            time.sleep(0.1)
        load = subprocess.run(
            [*podman, "load", "-q"],
            input=b"".join(source.api.get_image(image)),  # by name: the archive keeps it
            capture_output=True,
            timeout=120,
            check=False,
        )
        if load.returncode != 0:
            pytest.fail(f"loading {image} into the btrfs engine: {load.stderr!r}", pytrace=False)
        yield f"unix://{socket}"
    finally:
        if service is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(service.pid, signal.SIGTERM)
            service.wait(timeout=30)
        subprocess.run([*podman, "rm", "-af", "-t", "0"], capture_output=True, check=False)
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False)
        shutil.rmtree(home, ignore_errors=True)
