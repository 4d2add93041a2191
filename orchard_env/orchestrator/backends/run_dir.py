"""A sandbox's agent directory on the host, bounded: a tmpfs of its own.

The local engine bind-mounts ``<sandboxes_dir>/<sandbox_id>/`` at ``/run/orchard`` in the
sandbox, where the agent makes its socket (and the gateway its own). Root in the sandbox can
write there too, and a plain directory would take whatever it writes onto the host's disk,
past any ``disk`` limit. So the directory is a tmpfs of :data:`SIZE_BYTES` and
:data:`INODES` files, mounted by the orchestrator on the host before the container is made:
the sockets take inodes only, a write past the bound fails with ENOSPC, and the pages written
are charged to the writer's (the sandbox's) memory. ``nosuid,nodev,noexec``: nothing there
runs.

Mounting needs ``CAP_SYS_ADMIN`` in the host's mount namespace (an orchestrator running as
root); without it :func:`mount` says so and the directory stays a plain one.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from pathlib import Path
from typing import Any

SIZE_BYTES = 1024 * 1024
"""What a sandbox can write in its agent directory (the sockets need none of it)."""
INODES = 64
"""Files a sandbox can make there (with the directory itself and the two sockets)."""

_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8
_MNT_DETACH, _UMOUNT_NOFOLLOW = 2, 8
_MAX_STACKED = 16  # mounts removed from one directory before giving up


@functools.cache
def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _fail(what: str, path: Path) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{what} {path}: {os.strerror(code)}")


def mount(path: Path) -> bool:
    """Mount the bounded tmpfs at ``path`` (an existing directory), unless one is there
    already. False, with nothing mounted, when this process may not mount (not root);
    :class:`OSError` for any other failure."""
    if os.path.ismount(path):
        return True
    options = f"size={SIZE_BYTES},nr_inodes={INODES},mode=0777".encode()
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    if _libc().mount(b"tmpfs", os.fsencode(path), b"tmpfs", flags, options) != 0:
        if ctypes.get_errno() == errno.EPERM:
            return False
        raise _fail("cannot mount a tmpfs at", path)
    return True


def unmount(path: Path) -> None:
    """Unmount whatever is mounted at ``path`` (lazily: nothing still using it breaks);
    quiet when nothing is, or ``path`` is gone."""
    for _ in range(_MAX_STACKED):
        if not os.path.ismount(path):
            return
        if _libc().umount2(os.fsencode(path), _MNT_DETACH | _UMOUNT_NOFOLLOW) != 0:
            raise _fail("cannot unmount", path)
    raise OSError(errno.EBUSY, f"cannot unmount {path}: {_MAX_STACKED} mounts stacked there")
