"""The tools payload's pieces that need no registry: version pins, profiles, launchers, the
build lock."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from orchard_env import errors
from orchard_env.tools import (
    HARNESSES,
    VERSIONS,
    check_harnesses,
    launchers,
    parse_harnesses,
    parse_versions,
    payload,
)


def test_versions_override_one_and_keep_the_rest() -> None:
    versions = parse_versions("codex=0.172.0, hermes=0.19.1")
    assert versions["codex"] == "0.172.0" and versions["hermes"] == "0.19.1"
    assert versions["claude"] == VERSIONS["claude"]


@pytest.mark.parametrize("text", ["codx=1.0", "codex", "codex=1.0;rm -rf /", "codex=@evil"])
def test_bad_version_override_is_named(text: str) -> None:
    with pytest.raises(ValueError, match=r"NAME=VERSION|not a package version"):
        parse_versions(text)


def test_profiles() -> None:
    assert parse_harnesses("all") == HARNESSES
    assert parse_harnesses("none") == ()
    assert parse_harnesses("hermes, codex") == ("codex", "hermes")  # payload order
    with pytest.raises(errors.InvalidRequest, match=r"unknown harness 'gemini' \(known: codex"):
        check_harnesses(["codex", "gemini"])


def _fake_payload(root: Path, glibc_interp: str) -> Path:
    """Launchers over tiny shell-script "harnesses" that print how they were started."""
    for name, (path, _) in launchers.ENTRIES.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(f'#!/bin/sh\necho "{name} $* SHELL=$SHELL PI=${{PI_PACKAGE_DIR:-}}"\n')
        target.chmod(0o755)
        (root / "bin").mkdir(exist_ok=True)
        (root / "bin" / name).write_text(launchers.launcher(name, glibc_interp, "ld.so"))
        (root / "bin" / name).chmod(0o755)
    loader = root / "glibc" / "ld.so"
    loader.parent.mkdir()
    loader.write_text('#!/bin/sh\necho "via-loader $*"\n')
    loader.chmod(0o755)
    return root


def test_launchers_find_the_payload_through_a_symlink(tmp_path: Path) -> None:
    root = _fake_payload(tmp_path / "tools", "/lib64/ld-linux-x86-64.so.2")
    links = tmp_path / "links"
    links.mkdir()
    (links / "codex").symlink_to(root / "bin" / "codex")
    out = subprocess.run(
        ["sh", "-c", "codex --version"],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": f"/usr/bin:/bin:{links}"},
    ).stdout
    assert out.startswith("codex --version")


def test_glibc_harness_runs_through_the_loader_when_the_image_has_none(tmp_path: Path) -> None:
    root = _fake_payload(tmp_path / "tools", str(tmp_path / "no-such-loader"))
    out = subprocess.run(
        [str(root / "bin" / "pi"), "-p", "hi"], capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith(
        f"via-loader --inhibit-cache --library-path {root}/glibc {root}/pi/pi -p hi"
    )


def test_pi_gets_its_package_dir_and_direct_exec_with_a_loader(tmp_path: Path) -> None:
    root = _fake_payload(tmp_path / "tools", "/bin/sh")  # an interp that exists
    out = subprocess.run(
        [str(root / "bin" / "pi")], capture_output=True, text=True, check=True, env={}
    ).stdout
    assert f"PI={root}/pi" in out and "via-loader" not in out
    # SHELL is set only where the image has no bash of its own.
    assert f"SHELL={'' if Path('/bin/bash').exists() else f'{root}/bash/bash'} " in out


def test_profile_appends_once(tmp_path: Path) -> None:
    script = tmp_path / "profile.sh"
    script.write_text(launchers.PROFILE_SH.format(bin="/opt/sandbox-tools/bin"))
    out = subprocess.run(
        ["sh", "-c", f". {script}; . {script}; echo $PATH"],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin"},
    ).stdout.strip()
    assert out == "/usr/bin:/bin:/opt/sandbox-tools/bin"


def test_concurrent_ensures_build_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    builds: list[int] = []

    def fake_build(
        out: Path,
        work: Path,
        harnesses: Sequence[str],
        versions: Mapping[str, str],
        progress: object,
    ) -> None:
        builds.append(1)
        out.mkdir(parents=True)
        (out / payload.MANIFEST).write_text("{}")

    monkeypatch.setattr(payload, "_build", fake_build)
    results: list[Path] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(payload.ensure_payload(("codex",), cache_dir=tmp_path))
        )
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(builds) == 1 and len(set(results)) == 1 and len(results) == 4
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    assert leftovers == sorted([results[0].name, f"{results[0].name}.lock"])


def test_a_failed_build_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(out: Path, *args: object) -> None:
        out.mkdir(parents=True)
        raise errors.OrchardError("npm said no")

    monkeypatch.setattr(payload, "_build", failing)
    with pytest.raises(errors.OrchardError, match="npm said no"):
        payload.ensure_payload(("codex",), cache_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_key_changes_with_versions_and_profile() -> None:
    base = payload.payload_key(("codex",), VERSIONS)
    assert base == payload.payload_key(("codex",), dict(VERSIONS))
    assert base != payload.payload_key(("codex",), parse_versions("codex=0.172.0"))
    assert base != payload.payload_key(("codex", "pi"), VERSIONS)
