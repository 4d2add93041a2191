"""The file routes: read, write (atomically), list, delete and make directories in the sandbox."""

from __future__ import annotations

import errno
import os
import stat
import time

from . import proof
from .http import FILE_CHUNK, HTTPError, Request, invalid, os_error


def iso_utc(ns: int) -> str:
    seconds, rest = divmod(ns, 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{rest // 1000:06d}Z"


def read_file(req: Request, path: str) -> None:
    """Stream a regular file (Content-Length from fstat)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except IsADirectoryError:
        raise invalid(f"{path} is a directory") from None
    except OSError as exc:
        raise os_error(exc, path, "reading") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise invalid(f"{path} is a directory")
        if not stat.S_ISREG(info.st_mode):
            raise invalid(f"{path} is not a regular file")
        req.conn.write(
            req.head(
                200,
                [
                    ("Content-Type", "application/octet-stream"),
                    ("Content-Length", str(info.st_size)),
                ],
                proof.RAW,
            )
        )
        left = info.st_size
        while left:
            chunk = os.read(fd, min(left, FILE_CHUNK))
            if not chunk:
                raise ConnectionResetError(f"{path} shrank while it was being sent")
            left -= len(chunk)
            req.conn.write(chunk)
    finally:
        os.close(fd)


def write_file(req: Request, path: str, umask: int) -> None:
    """Write the body to a temporary file beside ``path``, then rename it over ``path``."""
    mode_text = req.query.get("mode")
    mode: int | None = None
    if mode_text:
        try:
            mode = int(mode_text, 8)
        except ValueError:
            mode = -1
        if not 0 <= mode <= 0o7777:
            raise invalid(f"mode {mode_text!r} is not an octal file mode like 0644")
    if os.path.isdir(path):
        raise invalid(f"{path} is a directory")
    parent, name = os.path.split(path)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise os_error(exc, parent, "creating") from None
    if mode is None:
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except OSError:
            mode = 0o666 & ~umask
    tmp = os.path.join(parent, f".{name}.{os.urandom(6).hex()}.orchard-upload")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise os_error(exc, path, "writing") from None
    size = 0
    try:
        try:
            for chunk in req.body():
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
                size += len(chunk)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        os.unlink(tmp)
        raise os_error(exc, path, "writing") from None
    except BaseException:
        os.unlink(tmp)
        raise
    req.send_json(200, {"path": path, "size": size})


def list_dir(req: Request, path: str) -> None:
    try:
        names = sorted(os.listdir(path))
    except NotADirectoryError:
        raise invalid(f"{path} is not a directory") from None
    except OSError as exc:
        raise os_error(exc, path, "listing") from None
    entries = []
    for name in names:
        try:
            info = os.lstat(os.path.join(path, name))
        except FileNotFoundError:
            continue  # removed while listing
        except OSError as exc:
            raise os_error(exc, os.path.join(path, name), "reading") from None
        mode = info.st_mode
        kind = (
            "file"
            if stat.S_ISREG(mode)
            else "directory"
            if stat.S_ISDIR(mode)
            else "symlink"
            if stat.S_ISLNK(mode)
            else "other"
        )
        entries.append(
            {
                "name": name,
                "type": kind,
                "size": info.st_size,
                "modified": iso_utc(info.st_mtime_ns),
            }
        )
    req.send_json(200, entries)


def delete_path(req: Request, path: str) -> None:
    recursive = req.flag("recursive", False)
    if path == "/":
        raise invalid("refusing to delete /")
    try:
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode):
            os.unlink(path)
        elif recursive:
            import shutil  # rarely needed: keep it out of the idle agent

            shutil.rmtree(path)
        else:
            os.rmdir(path)
    except OSError as exc:
        if exc.errno == errno.ENOTEMPTY:
            raise HTTPError(
                409, "conflict", f"directory {path} is not empty (pass recursive=true)"
            ) from None
        raise os_error(exc, path, "deleting") from None
    req.send_json(200, {"deleted": path})


def make_dir(req: Request, path: str) -> None:
    try:
        if req.flag("parents", True):
            os.makedirs(path, exist_ok=True)
        else:
            os.mkdir(path)
    except FileExistsError:
        raise HTTPError(409, "conflict", f"{path} already exists") from None
    except OSError as exc:
        raise os_error(exc, path, "creating") from None
    req.send_json(200, {"path": path})


# PTY
