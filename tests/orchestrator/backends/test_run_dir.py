"""The bounded tmpfs of a sandbox's agent directory, mounted and unmounted for real (the
engine tier shows a sandbox hitting its bounds: test_docker_engine.py)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchard_env.orchestrator.backends import run_dir

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")


def _mounts_at(path: Path) -> int:
    with open("/proc/self/mountinfo") as source:
        return sum(line.split()[4] == str(path) for line in source)


def test_mount_is_bounded_idempotent_and_unmounts(tmp_path: Path) -> None:
    folder = tmp_path / "sb-1"
    folder.mkdir()
    assert run_dir.mount(folder)
    try:
        assert run_dir.mount(folder)  # already there: not mounted twice
        assert _mounts_at(folder) == 1
        fs = os.statvfs(folder)
        assert (fs.f_blocks * fs.f_frsize, fs.f_files) == (run_dir.SIZE_BYTES, run_dir.INODES)
        assert oct(folder.stat().st_mode & 0o777) == oct(0o777)
    finally:
        run_dir.unmount(folder)
    assert _mounts_at(folder) == 0
    run_dir.unmount(folder)  # nothing there: quiet
    run_dir.unmount(tmp_path / "gone")


PR_CAPBSET_DROP, CAP_SYS_ADMIN = 24, 21


def _without_sys_admin() -> None:
    """In the child before exec: no CAP_SYS_ADMIN after it (root keeps every other one)."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_CAPBSET_DROP, CAP_SYS_ADMIN, 0, 0, 0):
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def test_a_process_that_may_not_mount_is_told_so(tmp_path: Path) -> None:
    folder = tmp_path / "sb-2"
    folder.mkdir()
    code = (
        "import sys; from pathlib import Path; "
        "from orchard_env.orchestrator.backends import run_dir; "
        "print(run_dir.mount(Path(sys.argv[1])))"
    )
    unprivileged = subprocess.run(
        [sys.executable, "-c", code, str(folder)],
        preexec_fn=_without_sys_admin,
        capture_output=True,
        text=True,
        check=True,
    )
    assert unprivileged.stdout == "False\n"
    assert _mounts_at(folder) == 0
