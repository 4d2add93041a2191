"""What a sandbox on the local engine mounts of a built payload: the whole payload read-only
at ``/opt/sandbox-tools``, or, for a sandbox that asked for some harnesses only, a small
*view* (its ``bin/`` and ``VERSIONS`` for those harnesses, empty mount points for the rest)
with each chosen harness's folder bind-mounted into it. Nothing is copied: a view is a few
kilobytes, made once per payload and selection beside the payload.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from orchard_env import errors
from orchard_env.tools import PROFILE_TARGET, TOOLS_MOUNT, TOOLS_PROFILE
from orchard_env.tools.payload import MANIFEST

SHARED = ("glibc", "bash")  # folders every harness may need (loader, static bash)


def payload_harnesses(payload: Path) -> tuple[str, ...]:
    """The harnesses a built payload holds (its ``payload.json``)."""
    try:
        return tuple(json.loads((payload / MANIFEST).read_text())["harnesses"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise errors.ConfigError(
            f"{payload} is not a built tools payload ({MANIFEST}: {exc})",
            hint="build one with `orchard images build-local --tools`, or fix tools_dir",
        ) from None


def _make_view(payload: Path, harnesses: tuple[str, ...], dest: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        (tmp / "bin").mkdir()
        for name in harnesses:
            shutil.copy2(payload / "bin" / name, tmp / "bin" / name)
        for folder in (*harnesses, *SHARED):
            if (payload / folder).is_dir():
                (tmp / folder).mkdir()
        lines = (payload / "VERSIONS").read_text().splitlines()
        kept = [line for line in lines if line.split(" ", 1)[0] in harnesses]
        (tmp / "VERSIONS").write_text("".join(f"{line}\n" for line in kept))
        for name in (TOOLS_PROFILE, MANIFEST):
            shutil.copy2(payload / name, tmp / name)
        for path in (tmp, *tmp.rglob("*")):
            if path.is_dir():
                path.chmod(0o755)
        try:
            tmp.rename(dest)
        except OSError:  # another sandbox's create made it first
            if not dest.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def tool_mounts(payload: Path, harnesses: tuple[str, ...]) -> list[tuple[str, Path]]:
    """``(path in the sandbox, host path)`` pairs to bind read-only, in mount order; the last
    one puts the payload's profile script where login shells source it."""
    profile = (PROFILE_TARGET, payload / TOOLS_PROFILE)
    if harnesses == payload_harnesses(payload):
        return [(TOOLS_MOUNT, payload), profile]
    views = payload.parent / f"{payload.name}.views"
    views.mkdir(exist_ok=True)
    view = views / "-".join(harnesses)
    if not view.is_dir():
        _make_view(payload, harnesses, view)
    folders = [f for f in (*harnesses, *SHARED) if (payload / f).is_dir()]
    return [
        (TOOLS_MOUNT, view),
        *((f"{TOOLS_MOUNT}/{f}", payload / f) for f in folders),
        profile,
    ]
