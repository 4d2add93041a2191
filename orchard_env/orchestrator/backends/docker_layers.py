"""Incremental snapshots on the local engine's overlay storage: a sandbox's second snapshot
stores only what changed in its writable layer since its first, and so on.

A container's writable layer is an overlay upper directory on this host. A snapshot records
what that directory held (a :data:`Manifest`: each path's type, owner, mode, size, times and
inode, never its content). The next snapshot compares the directory with that record while
the sandbox is paused, and writes only the difference into the (empty) upper directory of a
helper container created, never started, from the previous snapshot's image: changed files
hard-linked (the sandbox stays paused until the helper is committed, so neither side can
change them), directories, links and devices recreated with their owner, mode, times and
extended attributes, and an overlay whiteout for each path that is gone. Committing the
helper gives an image whose parent is the previous snapshot and whose own layer is that
difference.

The sandbox's files are hostile input: nothing here follows a symbolic link (every call is
on ``lstat``'s terms), a path is written below the helper's directory only through parents
this code created there as directories, and overlay's own attributes beyond the opaque
marker (redirects, metacopy) make the caller fall back to a full commit.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

import docker

Entry = tuple[int, int, int, int, int, int, int, bool]
"""``(st_mode, uid, gid, size, mtime_ns, ctime_ns, inode, opaque)`` of one path."""
Manifest = dict[str, Entry]
"""What an upper directory held, by path relative to it (``/``-separated)."""

log = logging.getLogger(__name__)

MAX_LAYERS = 100
"""An incremental snapshot adds a layer; past this many, the next one is a full commit of
the sandbox over its own image (overlay mounts a bounded number of layers)."""
OPAQUE = "trusted.overlay.opaque"
_UNSUPPORTED = ("trusted.overlay.redirect", "trusted.overlay.metacopy")
_KEPT_PREFIXES = ("user.", "security.", "trusted.")


class Unsupported(Exception):
    """The upper directory uses overlay features a copy cannot reproduce; commit it whole."""


def _xattrs(path: str) -> dict[str, bytes]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EPERM):
            return {}
        raise
    found = {}
    for name in names:
        if name in _UNSUPPORTED:
            raise Unsupported(f"{path} has {name}")
        if name.startswith(_KEPT_PREFIXES):
            found[name] = os.getxattr(path, name, follow_symlinks=False)
    return found


def scan(upper: Path) -> Manifest:
    """Every path below ``upper`` (not following links), with what identifies its state."""
    manifest: Manifest = {}
    pending = [""]
    while pending:
        relative = pending.pop()
        with os.scandir(upper / relative if relative else upper) as entries:
            for entry in entries:
                path = f"{relative}/{entry.name}" if relative else entry.name
                st = entry.stat(follow_symlinks=False)
                opaque = False
                if stat.S_ISDIR(st.st_mode):
                    opaque = _xattrs(entry.path).get(OPAQUE) == b"y"
                    pending.append(path)
                elif stat.S_ISREG(st.st_mode) and st.st_size and not st.st_blocks:
                    _xattrs(entry.path)  # a metacopy stub (no data of its own) raises
                manifest[path] = (
                    st.st_mode,
                    st.st_uid,
                    st.st_gid,
                    st.st_size,
                    st.st_mtime_ns,
                    st.st_ctime_ns,
                    st.st_ino,
                    opaque,
                )
    return manifest


def _parts(path: str) -> list[str]:
    return path.split("/")


def _parent(path: str) -> str:
    return path.rpartition("/")[0]


def write_difference(source: Path, target: Path, before: Manifest, now: Manifest) -> list[str]:
    """Make ``target`` (an empty upper directory over the layers ``before`` describes the top
    of) hold what turns them into ``now``, the state of ``source``. Returns the files it
    hard-linked: linking, and unlinking with the helper, changes their ``ctime``, which
    :func:`relinked` takes back into ``now`` once the helper is gone."""
    refreshed = {
        path
        for path, entry in now.items()
        if entry[7] and (path not in before or not before[path][7] or before[path][6] != entry[6])
    }  # directories emptied and refilled (opaque): everything below them is written again

    def below_refreshed(path: str) -> bool:
        parts = _parts(path)
        return any("/".join(parts[:i]) in refreshed for i in range(1, len(parts)))

    changed = sorted(
        (path for path, entry in now.items() if before.get(path) != entry or below_refreshed(path)),
        key=_parts,
    )
    made: set[str] = set()
    directories: list[str] = []
    linked: list[str] = []

    def make_directory(path: str, *, opaque: bool) -> None:
        if path in made:
            return
        parent = _parent(path)
        if parent:
            make_directory(parent, opaque=False)
        (target / path).mkdir(0o700)
        _copy_attributes(source / path, target / path, keep_opaque=opaque)
        made.add(path)
        directories.append(path)

    for path in changed:
        entry = now[path]
        mode = entry[0]
        if stat.S_ISSOCK(mode):
            continue  # a commit does not keep sockets either
        parent = _parent(path)
        if parent:
            make_directory(parent, opaque=False)
        if stat.S_ISDIR(mode):
            make_directory(path, opaque=path in refreshed)
        elif stat.S_ISREG(mode):
            os.link(source / path, target / path, follow_symlinks=False)
            linked.append(path)
        elif stat.S_ISLNK(mode):
            (target / path).symlink_to((source / path).readlink())
            _copy_attributes(source / path, target / path, keep_opaque=False)
        else:  # devices (overlay's whiteouts are 0/0 character devices) and FIFOs
            rdev = os.lstat(source / path).st_rdev
            os.mknod(target / path, mode, rdev)
            _copy_attributes(source / path, target / path, keep_opaque=False)
    removed = {path for path in before if path not in now}
    for path in sorted(removed, key=_parts):
        parent = _parent(path)
        if parent in removed:
            continue  # its parent's whiteout hides it
        if parent and not (parent in now and stat.S_ISDIR(now[parent][0])):
            continue  # the parent is no longer a directory: what replaced it hides this
        if below_refreshed(path):
            continue  # an opaque parent hides it
        if parent:
            make_directory(parent, opaque=False)
        os.mknod(target / path, stat.S_IFCHR, os.makedev(0, 0))
    for path in reversed(directories):  # children first: making them changed these times
        st = os.lstat(source / path)
        os.utime(target / path, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
    return linked


def relinked(source: Path, now: Manifest, linked: list[str]) -> None:
    """Take the ``ctime`` of the files :func:`write_difference` linked (and the helper's
    removal unlinked) back into ``now``, so the next snapshot does not store them again;
    anything else about them must be as scanned (the sandbox is still paused)."""
    for path in linked:
        st = os.lstat(source / path)
        entry = now[path]
        if (st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns) == (
            entry[0],
            entry[6],
            entry[3],
            entry[4],
        ):
            now[path] = (*entry[:5], st.st_ctime_ns, *entry[6:])


def _copy_attributes(source: Path, target: Path, *, keep_opaque: bool) -> None:
    st = os.lstat(source)
    os.chown(target, st.st_uid, st.st_gid, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        target.chmod(stat.S_IMODE(st.st_mode))
    for name, value in _xattrs(str(source)).items():
        if name.startswith("trusted.overlay.") and not (name == OPAQUE and keep_opaque):
            continue
        os.setxattr(target, name, value, follow_symlinks=False)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def save(path: Path, container_id: str, image: str, manifest: Manifest) -> None:
    """Record the snapshot just taken (written whole, then renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"container": container_id, "image": image, "paths": manifest}))
    tmp.replace(path)


def load(path: Path, container_id: str) -> tuple[str, Manifest] | None:
    """The image and manifest of this container's last snapshot, if one was recorded."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("container") != container_id:
        return None
    paths = data.get("paths")
    if not isinstance(paths, dict) or not isinstance(data.get("image"), str):
        return None
    return data["image"], {key: tuple(value) for key, value in paths.items()}


def commit_difference(
    client: docker.DockerClient,
    container: Any,
    upper: Path,
    previous: tuple[str, Manifest],
    manifest: Manifest,
    ref: str,
    changes: list[str],
) -> tuple[Any, Any, list[str]] | None:
    """``container`` committed as the previous snapshot plus what changed since, with the
    previous snapshot's image and the files hard-linked (for :func:`relinked`); None when
    that cannot be had (the previous image is gone, its layers are many, the engine's
    storage is not this host's overlay) and a full commit must be taken instead."""
    previous_ref, before = previous
    name = f"{container.name}-snapshot"
    with contextlib.suppress(docker.errors.NotFound):
        client.api.remove_container(name, force=True)  # a crash's leftover
    try:
        below = client.images.get(previous_ref)
        if len(below.attrs.get("RootFS", {}).get("Layers") or []) >= MAX_LAYERS:
            return None
        helper = client.containers.create(
            previous_ref,
            name=name,
            command=["never-started"],
            entrypoint=["never-started"],
            labels=dict(container.labels),
            network_mode="none",
        )
    except docker.errors.APIError:
        return None
    try:
        target = upper_dir(helper.attrs)
        if target is None:
            return None
        linked = write_difference(upper, target, before, manifest)
        repository, _, tag = ref.rpartition(":")
        return helper.commit(repository=repository, tag=tag, changes=changes), below, linked
    except (OSError, Unsupported, docker.errors.APIError) as exc:
        log.warning(
            "an incremental snapshot failed; taking a full one",
            extra={"snapshot_image": ref, "error": str(exc)},
        )
        return None
    finally:
        with contextlib.suppress(docker.errors.APIError):
            client.api.remove_container(helper.id, force=True)


def upper_dir(attrs: dict[str, Any]) -> Path | None:
    """A container's writable layer, if the engine keeps it in an overlay directory of
    this host (the engine may be remote, or use another storage driver)."""
    driver = attrs.get("GraphDriver") or {}
    upper = (driver.get("Data") or {}).get("UpperDir")
    if driver.get("Name") not in ("overlay", "overlay2") or not upper:
        return None
    path = Path(upper)
    return path if path.is_dir() else None
