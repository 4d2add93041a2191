"""Read a running container's writable layer from the host and write it as an OCI layer.

Works through ``/proc`` of the host (the snapshotter runs with the host's PID namespace):

* :func:`find_container_pid` finds a process of the container by its id in
  ``/proc/<pid>/cgroup`` (containerd, CRI-O, runc and Podman all name the container's cgroup
  after its id);
* :func:`root_upperdir` reads ``/proc/<pid>/mountinfo`` for the overlay mounted at the
  container's ``/`` and returns its ``upperdir`` (a host path) and the container's other mount
  points (bind mounts whose stub files and directories must not be part of the layer);
* :func:`freeze` stops the container's processes through its freezer cgroup while the layer is
  read (cgroup v2 ``cgroup.freeze`` or v1 ``freezer.state``), when that cgroup is writable;
* :func:`write_layer` tars the upperdir as a gzip OCI layer, converting overlayfs whiteouts to
  OCI ones: a 0/0 character device (a deleted path) becomes ``.wh.<name>``, a directory with the
  ``trusted.overlay.opaque`` (or ``user.overlay.opaque``) xattr ``y`` gets ``.wh..wh..opq``.

Not handled (overlayfs features container runtimes do not turn on): ``redirect_dir`` renamed
directories and ``metacopy`` files. Extended attributes of the files are not copied.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import logging
import os
import stat
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from orchard_env import errors

logger = logging.getLogger(__name__)

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
_OPAQUE_XATTRS = ("trusted.overlay.opaque", "user.overlay.opaque")


@dataclass(frozen=True)
class RootMount:
    """The container's root overlay as the host sees it."""

    upperdir: Path
    # Mount points inside the container other than "/" ("etc/hosts", "run/orchard", ...),
    # relative to its root: the runtime's stubs for them are left out of the layer.
    mount_points: frozenset[str]


@dataclass(frozen=True)
class Layer:
    """A gzip-compressed layer tar written to ``path``."""

    path: Path
    digest: str  # sha256 of the compressed bytes: the blob's digest
    diff_id: str  # sha256 of the uncompressed tar: the image config's rootfs.diff_ids entry
    size_bytes: int  # compressed size


def find_container_pid(container_id: str, *, proc: Path = Path("/proc")) -> int:
    """The lowest pid whose cgroup path names ``container_id`` (the container's init).

    ``container_id`` may carry the runtime prefix a pod's status reports
    (``containerd://<id>``, ``cri-o://<id>``).
    """
    bare = container_id.rpartition("://")[2]
    if len(bare) < 12 or not all(c in "0123456789abcdef" for c in bare):
        raise errors.InvalidRequest(
            f"container id {container_id!r} is not a hex container id",
            hint="pass the pod's status.containerStatuses[].containerID",
        )
    pids: list[int] = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cgroups = (entry / "cgroup").read_text()
        except OSError:  # the process ended while we looked
            continue
        if bare in cgroups:
            pids.append(int(entry.name))
    if not pids:
        raise errors.NotFound(
            f"no process of container {bare[:12]} on this node",
            hint="the container is not running here, or the snapshotter does not run with "
            "hostPID: true",
        )
    return min(pids)


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit() and len(field[i + 1 : i + 4]) == 3:
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def root_upperdir(pid: int, *, proc: Path = Path("/proc")) -> RootMount:
    """The upperdir of the overlay mounted at ``/`` in the mount namespace of ``pid``."""
    try:
        lines = (proc / str(pid) / "mountinfo").read_text().splitlines()
    except OSError as exc:
        raise errors.NotFound(
            f"cannot read the mounts of process {pid}: {exc}",
            hint="the snapshotter needs hostPID: true and to run as root",
        ) from exc
    upper: Path | None = None
    mount_points: set[str] = set()
    for line in lines:
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        mount_point = _unescape(left.split(" ")[4])
        fields = right.split(" ")
        if mount_point != "/":
            mount_points.add(mount_point.strip("/"))
            continue
        if fields[0] != "overlay":
            continue
        for option in (fields[2] if len(fields) > 2 else "").split(","):
            if option.startswith("upperdir="):
                upper = Path(_unescape(option.removeprefix("upperdir=")))  # the last "/" wins
    if upper is None:
        raise errors.NotSupported(
            f"the root of process {pid} is not an overlay mount with an upperdir",
            hint="snapshots need the overlayfs snapshotter of containerd (the default)",
        )
    return RootMount(upperdir=upper, mount_points=frozenset(mount_points))


def _find_cgroup_dir(root: Path, container_id: str, depth: int = 8) -> Path | None:
    """The directory under ``root`` named after ``container_id`` (breadth first)."""
    level = [root]
    for _ in range(depth):
        below: list[Path] = []
        for directory in level:
            with contextlib.suppress(OSError):
                for child in directory.iterdir():
                    if child.is_dir() and not child.is_symlink():
                        if container_id in child.name:
                            return child
                        below.append(child)
        level = below
    return None


def _freezer_file(
    pid: int, container_id: str, proc: Path, cgroup_root: Path
) -> tuple[Path, str, str] | None:
    """(file, frozen value, thawed value) of the freezer of ``pid``'s cgroup, if any.

    The cgroup path in ``/proc/<pid>/cgroup`` is relative to the reader's cgroup namespace (a
    pod has its own): when it does not name a directory under ``cgroup_root`` (the host's
    cgroup tree, mounted), the directory named after the container is searched for.
    """
    for line in (proc / str(pid) / "cgroup").read_text().splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and controllers == "":
            base, control, frozen, thawed = cgroup_root, "cgroup.freeze", "1", "0"
        elif "freezer" in controllers.split(","):
            base, control, frozen, thawed = (
                cgroup_root / "freezer",
                "freezer.state",
                "FROZEN",
                "THAWED",
            )
        else:
            continue
        direct = base / path.lstrip("/")
        if ".." not in Path(path).parts and (direct / control).exists():
            return direct / control, frozen, thawed
        found = _find_cgroup_dir(base, container_id)
        if found is not None and (found / control).exists():
            return found / control, frozen, thawed
    return None


def _is_frozen(control: Path) -> bool:
    if control.name == "cgroup.freeze":
        return "frozen 1" in (control.parent / "cgroup.events").read_text().splitlines()
    return control.read_text().strip() == "FROZEN"


@contextlib.contextmanager
def freeze(
    pid: int,
    container_id: str,
    *,
    proc: Path = Path("/proc"),
    cgroup_root: Path = Path("/sys/fs/cgroup"),
    timeout: float = 10.0,
) -> Iterator[str | None]:
    """Freeze the cgroup of ``pid`` (of container ``container_id``) for the duration; yields
    None when frozen, or the reason it could not be (then the snapshot is not consistent)."""
    try:
        found = _freezer_file(pid, container_id.rpartition("://")[2], proc, cgroup_root)
    except (OSError, ValueError) as exc:
        found, reason = None, f"cannot read the cgroup of process {pid}: {exc}"
    else:
        reason = f"no writable freezer for the cgroup of process {pid} under {cgroup_root}"
    if found is None:
        yield reason
        return
    control, frozen, thawed = found
    try:
        control.write_text(frozen)
    except OSError as exc:
        yield f"cannot freeze {control}: {exc}"
        return
    try:
        deadline = time.monotonic() + timeout
        while not _is_frozen(control):
            if time.monotonic() > deadline:
                raise errors.Timeout(f"the container's cgroup did not freeze in {timeout:g} s")
            time.sleep(0.01)
        yield None
    finally:
        control.write_text(thawed)


class _Sink(Protocol):
    def write(self, data: bytes, /) -> int: ...

    def flush(self) -> None: ...


class _HashingWriter:
    """A write-only file object that hashes and counts what passes through it."""

    def __init__(self, target: _Sink) -> None:
        self._target = target
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self._target.write(data)

    def flush(self) -> None:
        self._target.flush()


CAP_SYS_ADMIN = 21


def has_capability(bit: int, *, status: Path = Path("/proc/self/status")) -> bool:
    """Whether this process has capability ``bit`` in its effective set."""
    for line in status.read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> bit & 1)
    return False


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _is_opaque(path: Path) -> bool:
    for name in _OPAQUE_XATTRS:
        with contextlib.suppress(OSError):
            if os.getxattr(path, name, follow_symlinks=False) == b"y":
                return True
    return False


def _excluded(rel: str, excluded: frozenset[str]) -> bool:
    return any(rel == e or rel.startswith(e + "/") for e in excluded)


def _tarinfo(rel: str, full: Path) -> tarfile.TarInfo:
    st = full.lstat()
    info = tarfile.TarInfo(rel)
    info.mode = stat.S_IMODE(st.st_mode)
    info.uid, info.gid = st.st_uid, st.st_gid
    info.mtime = int(st.st_mtime)
    return info


def write_layer(upperdir: Path, out: Path, *, exclude: frozenset[str] = frozenset()) -> Layer:
    """Write ``upperdir`` as a gzip OCI layer to ``out``.

    ``exclude``: paths relative to the container's root whose entries (and everything under
    them) are left out.
    """
    if not upperdir.is_dir():
        raise errors.NotFound(f"the container's upperdir {upperdir} does not exist on this host")
    hardlinks: dict[tuple[int, int], str] = {}
    with out.open("wb") as raw:
        compressed = _HashingWriter(raw)
        with gzip.GzipFile(fileobj=compressed, mode="wb", mtime=0) as gz:
            plain = _HashingWriter(gz)
            with tarfile.open(fileobj=plain, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
                for rel, full in _walk(upperdir, exclude):
                    _add(tar, rel, full, hardlinks)
    return Layer(
        path=out,
        digest="sha256:" + compressed.sha256.hexdigest(),
        diff_id="sha256:" + plain.sha256.hexdigest(),
        size_bytes=compressed.size,
    )


def _walk(upperdir: Path, exclude: frozenset[str]) -> Iterator[tuple[str, Path]]:
    """(name relative to the root, host path), a directory before its contents, sorted."""

    def visit(rel_dir: str) -> Iterator[tuple[str, Path]]:
        for name in sorted(child.name for child in (upperdir / rel_dir).iterdir()):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if _excluded(rel, exclude):
                continue
            full = upperdir / rel
            yield rel, full
            if stat.S_ISDIR(full.lstat().st_mode):
                yield from visit(rel)

    return visit("")


def _add(tar: tarfile.TarFile, rel: str, full: Path, hardlinks: dict[tuple[int, int], str]) -> None:
    st = full.lstat()
    parent, _, name = rel.rpartition("/")
    prefix = f"{parent}/" if parent else ""
    if _is_whiteout(st):
        info = tarfile.TarInfo(f"{prefix}{WHITEOUT_PREFIX}{name}")
        info.mtime = int(st.st_mtime)
        tar.addfile(info)
        return
    info = _tarinfo(rel, full)
    if stat.S_ISDIR(st.st_mode):
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
        if _is_opaque(full):
            marker = tarfile.TarInfo(f"{rel}/{OPAQUE_MARKER}")
            marker.mtime = info.mtime
            tar.addfile(marker)
    elif stat.S_ISLNK(st.st_mode):
        info.type = tarfile.SYMTYPE
        info.linkname = str(full.readlink())
        tar.addfile(info)
    elif stat.S_ISREG(st.st_mode):
        key = (st.st_dev, st.st_ino)
        if st.st_nlink > 1 and key in hardlinks:
            info.type = tarfile.LNKTYPE
            info.linkname = hardlinks[key]
            tar.addfile(info)
            return
        hardlinks[key] = rel
        info.size = st.st_size
        with full.open("rb") as f:
            tar.addfile(info, f)
    elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        info.type = tarfile.CHRTYPE if stat.S_ISCHR(st.st_mode) else tarfile.BLKTYPE
        info.devmajor, info.devminor = os.major(st.st_rdev), os.minor(st.st_rdev)
        tar.addfile(info)
    elif stat.S_ISFIFO(st.st_mode):
        info.type = tarfile.FIFOTYPE
        tar.addfile(info)
    else:  # sockets: nothing an image can hold
        logger.info("skipping %s: a socket", rel)
