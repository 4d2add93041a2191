"""What `orchard bench launch` measures on this machine besides the API: the orchestrator's
and the engine's memory (found by the sockets they listen on), the host's available memory,
and the engine alone creating as many plain containers, as a same-run baseline."""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

ENGINE_ALONE_THREADS = 8
ENGINE_ALONE_LABEL = "orchard.bench-engine-alone"


def _socket_inodes(table: str, match: str) -> set[str]:
    """Inodes of listening sockets in /proc/net/<table> whose address field ``match``es."""
    inodes: set[str] = set()
    try:
        lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
    except OSError:
        return inodes
    for line in lines:
        fields = line.split()
        if table == "unix":
            if len(fields) >= 8 and fields[7] == match:
                inodes.add(fields[6])
        elif len(fields) >= 10 and fields[3] == "0A" and fields[1].endswith(match):
            inodes.add(fields[9])
    return inodes


def _owner(inodes: set[str]) -> int | None:
    """The process holding one of these socket inodes open."""
    wanted = {f"socket:[{inode}]" for inode in inodes}
    if not wanted:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if str(fd.readlink()) in wanted:
                    return int(proc.name)
        except OSError:
            continue
    return None


def listener_pid(port: int) -> int | None:
    """The pid of the process on this host listening on TCP ``port`` (None if not found, e.g.
    the service is remote or another user's): from /proc/net/tcp{,6} and the fds in /proc."""
    match = f":{port:04X}"
    return _owner(_socket_inodes("tcp", match) | _socket_inodes("tcp6", match))


def service_pid(url: str) -> int | None:
    """The local process listening on ``url``'s port (None if not on this machine)."""
    parts = urlsplit(url)
    if parts.hostname not in ("127.0.0.1", "localhost", "::1") or parts.port is None:
        return None
    return listener_pid(parts.port)


def engine_pid(engine_url: str) -> int | None:
    """The engine process listening on a ``unix://`` socket."""
    if not engine_url.startswith("unix://"):
        return None
    return _owner(_socket_inodes("unix", engine_url.removeprefix("unix://")))


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stat_fields(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (state first, then ppid)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _cpu(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        return cpu_seconds(pid)
    except OSError:
        return None


def available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


@dataclass
class HostSample:
    available_mb: float
    orchestrator_mb: float | None
    engine_mb: float | None
    orchestrator_cpu: float | None = None
    engine_cpu: float | None = None


def sample(orchestrator: int | None, engine: int | None) -> HostSample:
    return HostSample(
        available_mb(),
        rss_mb(orchestrator),
        rss_mb(engine),
        _cpu(orchestrator),
        _cpu(engine),
    )


def engine_alone(engine_url: str, image: str, n: int) -> float:
    """Seconds the engine takes to create and start ``n`` plain containers of ``image``
    (``sleep``, no limits, no mounts) from ENGINE_ALONE_THREADS threads; they are removed."""
    import docker

    from orchard_env.orchestrator.backends.docker_engine import API_VERSION

    client = docker.DockerClient(
        base_url=engine_url, version=API_VERSION, max_pool_size=ENGINE_ALONE_THREADS
    )
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    names = [f"orchard-bench-alone-{tag}-{i}" for i in range(n)]

    def one(name: str) -> None:
        created = client.api.create_container(
            image,
            name=name,
            command=["sleep", "600"],
            labels={ENGINE_ALONE_LABEL: tag},
            host_config=client.api.create_host_config(network_mode="none", init=True),
        )
        client.api.start(created["Id"])

    def remove(name: str) -> None:
        with contextlib.suppress(docker.errors.NotFound):
            client.api.remove_container(name, force=True)

    try:
        with ThreadPoolExecutor(ENGINE_ALONE_THREADS) as pool:
            started = time.perf_counter()
            list(pool.map(one, names))
            return time.perf_counter() - started
    finally:
        with ThreadPoolExecutor(ENGINE_ALONE_THREADS) as pool:
            list(pool.map(remove, names))
        client.close()
