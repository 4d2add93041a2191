"""The relocatable bundle: built from this host's interpreter, checked, reused, and run."""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from images.local import _is_static_elf64
from orchard_env import errors
from orchard_env.agent import bundle
from orchard_env.agent.client import AgentClient
from tests.agent.conftest import TOKEN, collect, start_agent, stop_agent

MAX_BUNDLE_BYTES = 40 * 1024 * 1024
MAX_IDLE_RSS_KB = 20 * 1024
HOST_PYTHON = os.path.realpath(sys.executable)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bundle.build_bundle(tmp_path_factory.mktemp("bundle") / "agent")


def test_layout_and_manifest(built: Path) -> None:
    loader = bundle.loader_name()
    assert (built / "bin" / "python3").is_file()
    assert (built / "lib" / loader).is_file()
    assert (built / "lib" / "libc.so.6").is_file()
    stdlib = next(built.glob("lib/python3.*"))
    assert (stdlib / "os.py").is_file() and (stdlib / "asyncio").is_dir()
    assert (stdlib / "lib-dynload").is_dir()
    modules = {p.stem for p in bundle.daemon_sources()}
    package = built / "agent" / bundle.DAEMON_PACKAGE
    assert {p.name for p in package.iterdir()} == {f"{m}.pyc" for m in modules}  # no sources
    assert (built / "agent" / "__main__.pyc").is_file()
    assert json.loads((built / bundle.MANIFEST).read_text())["daemon_sha256"] == (
        bundle.daemon_digest()
    )
    manifest = json.loads((built / bundle.MANIFEST).read_text())
    assert manifest["format"] == bundle.BUNDLE_FORMAT
    assert manifest["loader"] == loader
    assert built.stat().st_mode & 0o777 == 0o755


def test_pruned(built: Path) -> None:
    stdlib = next(built.glob("lib/python3.*"))
    for folder in ("test", "idlelib", "tkinter", "ensurepip", "lib2to3", "unittest"):
        assert not (stdlib / folder).exists(), folder
    dynload = {p.name.split(".")[0] for p in (stdlib / "lib-dynload").iterdir()}
    assert not dynload & {"_ssl", "_hashlib", "_sqlite3", "_testcapi"}
    assert not list((built / "lib").glob("libcrypto*"))
    assert not list(stdlib.glob("config-3*"))
    assert bundle.bundle_size(built) < MAX_BUNDLE_BYTES


def test_launch_argv() -> None:
    assert bundle.launch_argv("/m", "tcp:0.0.0.0:9090", machine="aarch64") == [
        "/m/lib/ld-linux-aarch64.so.1",
        "--inhibit-cache",
        "--library-path",
        "/m/lib",
        "/m/bin/python3",
        "-I",
        "-S",
        "/m/agent",
        "--listen",
        "tcp:0.0.0.0:9090",
    ]
    assert bundle.launch_argv(machine="x86_64")[0] == "/opt/orchard-agent/lib/ld-linux-x86-64.so.2"
    assert bundle.launch_argv(machine="x86_64")[-1] == "unix:/run/orchard/agent.sock"
    with pytest.raises(errors.NotSupported, match="no agent bundle for machine 'riscv64'"):
        bundle.launch_argv(machine="riscv64")
    assert bundle.launch_env("/m") == {"ORCHARD_AGENT_SUBREAPER": "/m/bin/orchard-subreaper"}


def test_the_subreaper_is_static(built: Path) -> None:
    """It must run in an image without any libc (it is the first process of every command)."""
    subreaper = built / bundle.SUBREAPER
    assert os.access(subreaper, os.X_OK)
    assert _is_static_elf64(subreaper.read_bytes())


def test_a_bundle_needs_a_c_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bundle.shutil, "which", lambda name: None)
    with pytest.raises(errors.NotSupported, match="needs a C compiler") as caught:
        bundle.build_subreaper(tmp_path / "orchard-subreaper")
    assert caught.value.hint is not None and "gcc" in caught.value.hint


def test_verify_catches_a_library_taken_from_the_host(built: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(built, broken, symlinks=True)
    (broken / "lib" / "libz.so.1").unlink()
    with pytest.raises(errors.OrchardError, match=r"loaded from outside the bundle: .*libz"):
        bundle.verify_bundle(broken)


def test_existing_destination_is_a_conflict(built: Path) -> None:
    with pytest.raises(errors.Conflict, match="already exists"):
        bundle.build_bundle(built)
    assert not [p for p in built.parent.iterdir() if ".tmp-" in p.name]


def test_bad_interpreter_is_named(tmp_path: Path) -> None:
    with pytest.raises(errors.InvalidRequest, match="is not an executable file"):
        bundle.build_bundle(tmp_path / "b", python=tmp_path / "python9")


def test_ensure_bundle_builds_once_even_when_racing(tmp_path: Path) -> None:
    results: list[Path] = []
    failures: list[BaseException] = []

    def build() -> None:
        try:
            results.append(bundle.ensure_bundle(tmp_path))
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    assert len(set(results)) == 1
    manifest = results[0] / bundle.MANIFEST
    before = manifest.stat().st_ino
    assert bundle.ensure_bundle(tmp_path) == results[0]
    assert manifest.stat().st_ino == before  # reused, not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]  # no temporary leftovers


@pytest.fixture
async def bundled_agent(built: Path, tmp_path: Path, short_dir: Path) -> AsyncIterator[AgentClient]:
    """The agent started exactly as in a container, from the bundle, on this host."""
    socket = short_dir / "agent.sock"
    argv = bundle.launch_argv(str(built), f"unix:{socket}")
    process = start_agent(argv[:-2], f"unix:{socket}", {}, tmp_path)
    async with AgentClient(token=TOKEN, uds=str(socket)) as client:
        await client.wait_ready(15)
        yield client
    assert stop_agent(process) == 0


async def test_bundled_agent_runs_and_leaks_nothing(bundled_agent: AgentClient) -> None:
    result = await collect(bundled_agent.exec("env", ["env"]))
    names = {line.split("=", 1)[0] for line in result.stdout.decode().splitlines()}
    assert names == {"PATH"}  # exactly what it was started with, minus its own settings
    info = await bundled_agent.health()
    status = await collect(bundled_agent.exec("rss", ["cat", f"/proc/{info['pid']}/status"]))
    assert vm_rss_kb(status.stdout) <= MAX_IDLE_RSS_KB
    maps = await collect(bundled_agent.exec("maps", ["cat", f"/proc/{info['pid']}/maps"]))
    assert b"libssl" not in maps.stdout and b"libcrypto" not in maps.stdout
    assert HOST_PYTHON.encode() not in maps.stdout


def vm_rss_kb(proc_status: bytes) -> int:
    """VmRSS (kB) from the text of /proc/<pid>/status."""
    line = next(line for line in proc_status.decode().splitlines() if line.startswith("VmRSS"))
    return int(line.split()[1])
