"""Copy files and directory trees into and out of a sandbox, with ``docker cp``'s rules.

Built on the file API alone (list, mkdir, streamed upload and download), so it works on any
image, with or without tar. The rules, for ``copy_in`` (``copy_out`` mirrors them):

* a file onto a path ending in ``/`` or onto an existing directory lands inside it under its
  own name; onto any other path, at that path (its parent must exist);
* a directory onto an existing directory lands inside it under its own name; onto a path
  that does not exist, becomes it; ``SRC/.`` (or ``.``, the working directory in the
  sandbox) copies the directory's contents instead;
* symlinks and special files are skipped and reported (the file API moves regular files).

Names the sandbox reports are checked before anything is written locally: a name with a
``/``, or ``.``/``..``, is refused, so a hostile sandbox cannot write outside the
destination.
"""

from __future__ import annotations

import os
import posixpath
import stat
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

from orchard_env import errors
from orchard_env.sdk.client import Sandbox

Kind = Literal["file", "directory", "symlink", "other"]


@dataclass
class CopyReport:
    """What a copy moved: regular files, their bytes, and the paths it skipped."""

    files: int = 0
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)


def _safe_name(name: str, where: str) -> str:
    if name in ("", ".", "..") or "/" in name or "\0" in name:
        raise errors.OrchardError(
            f"the sandbox listed an unsafe name {name!r} in {where}; nothing more is copied",
            hint="a file name cannot contain '/' or be '.' or '..'",
        )
    return name


def remote_kind(sandbox: Sandbox, path: str) -> Kind | None:
    """What ``path`` is in the sandbox, or None when it does not exist."""
    path = posixpath.normpath(path) if path else "."
    if path in ("/", "."):
        return "directory"
    parent, name = posixpath.split(path)
    try:
        entries = sandbox.list_files(parent or ".")
    except (errors.FileNotFound, errors.InvalidRequest):
        return None
    for entry in entries:
        if entry.name == name:
            return entry.type
    return None


def _local_kind(path: Path) -> Kind | None:
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "directory"
    return "symlink" if stat.S_ISLNK(mode) else "other"


def _contents_only(spec: str) -> bool:
    """``SRC/.`` (and ``.``, the sandbox's working directory): the directory's contents."""
    return spec in (".", "./") or spec.endswith("/.")


def _lands_inside(source: str, dest: str, dest_kind: Kind | None, where: str) -> bool:
    """Whether a directory copied onto ``dest`` goes inside it under its own name (docker
    cp's rule); a destination that is a file is refused."""
    if dest_kind not in (None, "directory"):
        raise errors.InvalidRequest(
            f"cannot copy directory {source} onto {dest}: it is a {dest_kind}{where}",
            hint="give a directory (or a path that does not exist yet) as the destination",
        )
    return dest_kind == "directory" and not _contents_only(source)


def _missing(where: str, path: str) -> errors.OrchardError:
    return errors.FileNotFound(
        f"{path} does not exist{where}", hint="check the path (`orchard sandbox ls` lists one)"
    )


# --- into the sandbox ------------------------------------------------------------------------


def _upload_tree(sandbox: Sandbox, local: Path, remote: str, report: CopyReport) -> None:
    sandbox.mkdir(remote)
    for child in sorted(local.iterdir()):
        target = posixpath.join(remote, child.name)
        kind = _local_kind(child)
        if kind == "directory":
            _upload_tree(sandbox, child, target, report)
        elif kind == "file":
            report.bytes += sandbox.upload_file(child, target).size
            report.files += 1
        else:
            report.skipped.append(str(child))


def copy_in(sandbox: Sandbox, source: str, dest: str) -> CopyReport:
    """Copy a local file or directory to ``dest`` in the sandbox (docker cp's rules)."""
    local = Path(source)
    kind = _local_kind(local)
    if kind is None:
        raise _missing("", source)
    if kind not in ("file", "directory"):
        raise errors.InvalidRequest(
            f"{source} is a {kind}", hint="cp copies regular files and directories"
        )
    report = CopyReport()
    dest_kind = remote_kind(sandbox, dest)
    if kind == "file":
        if dest.endswith("/") and dest_kind != "directory":
            raise _missing(f" in sandbox {sandbox.sandbox_id} (a directory)", dest)
        target = posixpath.join(dest, local.name) if dest_kind == "directory" else dest
        report.bytes += sandbox.upload_file(local, target).size
        report.files += 1
        return report
    inside = _lands_inside(source, dest, dest_kind, " in the sandbox")
    target = posixpath.join(dest, local.resolve().name) if inside else dest
    _upload_tree(sandbox, local, target, report)
    return report


# --- out of the sandbox ----------------------------------------------------------------------


def _download_tree(sandbox: Sandbox, remote: str, local: Path, report: CopyReport) -> None:
    local.mkdir(exist_ok=True)
    for entry in sandbox.list_files(remote):
        name = _safe_name(entry.name, remote)
        source = posixpath.join(remote, name)
        if entry.type == "directory":
            _download_tree(sandbox, source, local / name, report)
        elif entry.type == "file":
            report.bytes += sandbox.download_file(source, local / name)
            report.files += 1
        else:
            report.skipped.append(source)


def copy_out(sandbox: Sandbox, source: str, dest: str) -> CopyReport:
    """Copy a file or directory from the sandbox to local ``dest`` (docker cp's rules)."""
    kind = remote_kind(sandbox, source)
    if kind is None:
        raise _missing(f" in sandbox {sandbox.sandbox_id}", source)
    if kind not in ("file", "directory"):
        raise errors.InvalidRequest(
            f"{source} is a {kind} in the sandbox", hint="cp copies regular files and directories"
        )
    local = Path(dest)
    dest_kind = _local_kind(local)
    report = CopyReport()
    if kind == "file":
        if dest.endswith(os.sep) and dest_kind != "directory":
            raise _missing(" (a directory)", dest)
        target = local / _base_name(source) if dest_kind == "directory" else local
        report.bytes += sandbox.download_file(source, target)
        report.files += 1
        return report
    inside = _lands_inside(source, dest, dest_kind, "")
    if dest_kind is None and not local.parent.is_dir():
        raise _missing(" (the destination's parent directory)", str(local.parent))
    _download_tree(sandbox, source, local / _base_name(source) if inside else local, report)
    return report


def _base_name(source: str) -> str:
    """The name a copy of ``source`` gets locally (``/`` is copied as ``root``)."""
    return _safe_name(posixpath.basename(posixpath.normpath(source)) or "root", source)


# --- tar streams (``-``) ---------------------------------------------------------------------


def tar_out(sandbox: Sandbox, source: str, stream: IO[bytes]) -> CopyReport:
    """Write ``source`` (a file or directory in the sandbox) to ``stream`` as a tar archive
    whose top entry is its base name (``.`` for ``SRC/.``), as ``docker cp SRC -`` does."""
    with tempfile.TemporaryDirectory(prefix="orchard-cp-") as scratch:
        report = copy_out(sandbox, source, scratch + os.sep)
        with tarfile.open(fileobj=stream, mode="w|") as archive:
            if _contents_only(source):
                archive.add(scratch, arcname=".")
            else:
                (top,) = list(Path(scratch).iterdir())
                archive.add(top, arcname=top.name)
    return report


def tar_in(sandbox: Sandbox, stream: IO[bytes], dest: str) -> CopyReport:
    """Extract a tar archive read from ``stream`` into the directory ``dest`` in the sandbox,
    as ``docker cp - DEST`` does. Members are filtered like ``tarfile``'s ``data`` filter
    (no absolute paths, no ``..``, no devices)."""
    if remote_kind(sandbox, dest) != "directory":
        raise _missing(f" in sandbox {sandbox.sandbox_id} (a directory to extract into)", dest)
    with tempfile.TemporaryDirectory(prefix="orchard-cp-") as scratch:
        try:
            with tarfile.open(fileobj=stream, mode="r|*") as archive:
                archive.extractall(scratch, filter="data")
        except tarfile.TarError as exc:
            raise errors.InvalidRequest(
                f"standard input is not a tar archive: {exc}",
                hint="`cp - SANDBOX:DIR` extracts a tar stream; to write one file, "
                "give a local file as the source",
            ) from exc
        report = CopyReport()
        _upload_tree(sandbox, Path(scratch), dest, report)
    return report
