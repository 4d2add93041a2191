"""What `orchard bench` measures on this machine besides the API: the orchestrator's and the
engine's memory and CPU (found by the sockets they listen on), the host's available memory,
a sandbox's agent processes (its container found in the engine), and the engine alone creating
as many plain containers, as a same-run baseline.

Each of these only means something for a service on this host (an orchestrator process here,
sandboxes in this host's engine): :func:`find_service` and :func:`engine_container` say why
not otherwise (a remote service, a port-forward, a Kubernetes backend), and the benchmarks
report that instead of a figure.
"""

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


def find_service(url: str) -> int | str:
    """The pid of the orchestrator process of this host serving ``url``, or why there is none:
    the URL is not on this host, no process of this user listens on its port, or the one that
    does is no orchestrator (``kubectl port-forward`` to one in a cluster, a proxy)."""
    parts = urlsplit(url)
    if parts.hostname not in ("127.0.0.1", "localhost", "::1") or parts.port is None:
        return f"the service ({parts.netloc}) is not on this host"
    pid = listener_pid(parts.port)
    if pid is None:
        return f"no process of this user listens on port {parts.port}"
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return f"the process listening on port {parts.port} (pid {pid}) is gone"
    if pid == os.getpid() or _is_orchestrator(argv):
        return pid
    return (
        f"port {parts.port} is served by {Path(argv[0]).name} (pid {pid}), not an orchestrator: "
        "the service runs elsewhere (a port-forward to a cluster?)"
    )


def _is_orchestrator(argv: list[str]) -> bool:
    """`python -m orchard_env.orchestrator` (what `orchard up` starts) or `orchard serve`."""
    if "orchard_env.orchestrator" in argv:
        return True
    return "serve" in argv and any(Path(arg).name == "orchard" for arg in argv)


def engine_pid(engine_url: str) -> int | None:
    """The engine process listening on a ``unix://`` socket."""
    if not engine_url.startswith("unix://"):
        return None
    return _owner(_socket_inodes("unix", engine_url.removeprefix("unix://")))


@dataclass(frozen=True)
class Container:
    id: str
    pid: int  # its first process, in this host's pid namespace


def engine_container(engine_url: str | None, sandbox_id: str, backend: str) -> Container | str:
    """The sandbox's container in this host's engine, or why it is not there."""
    if backend != "docker":
        return f"the sandbox runs on the {backend} backend, not in this host's container engine"
    if engine_url is None:
        return "no container engine was found on this host"
    import docker

    from orchard_env.orchestrator.backends.docker_engine import LABEL_SANDBOX_ID

    try:
        engine = docker.DockerClient(base_url=engine_url)
        try:
            found = engine.containers.list(filters={"label": f"{LABEL_SANDBOX_ID}={sandbox_id}"})
        finally:
            engine.close()
    except docker.errors.DockerException as exc:
        return f"the engine at {engine_url} did not answer: {exc}"
    if len(found) != 1:
        return f"the sandbox's container is not in the engine at {engine_url} (another engine)"
    return Container(found[0].id, int(found[0].attrs["State"]["Pid"]))


def exec_run_samples(engine_url: str, container_id: str, n: int) -> list[float]:
    """Seconds of each of ``n`` engine ``exec_run``s of `true` in the container (after 3)."""
    import docker

    engine = docker.DockerClient(base_url=engine_url)
    try:
        container = engine.containers.get(container_id)
        for _ in range(3):
            container.exec_run(["true"])
        samples = []
        for _ in range(n):
            started = time.perf_counter()
            container.exec_run(["true"])
            samples.append(time.perf_counter() - started)
        return samples
    finally:
        engine.close()


def sandbox_processes(container_pid: int) -> dict[str, list[int]]:
    """A container's processes on this host by role, from /proc: ``monitor`` (the engine's
    per-container process, e.g. conmon: the parent of the container's first process),
    ``init`` (that first process), ``agent`` (whose command line runs the agent) and
    ``other`` (the rest of its tree)."""
    parents = {}
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit():
                parents[int(proc.name)] = int(stat_fields(int(proc.name))[1])
        except OSError:
            continue
    tree = {container_pid}
    grown = True
    while grown:
        before = len(tree)
        tree |= {pid for pid, parent in parents.items() if parent in tree}
        grown = len(tree) > before
    roles: dict[str, list[int]] = {"monitor": [], "init": [container_pid], "agent": [], "other": []}
    if parents.get(container_pid, 1) > 1:
        roles["monitor"].append(parents[container_pid])
    for pid in sorted(tree - {container_pid}):
        try:
            agent = b"/agent\0--listen" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        roles["agent" if agent else "other"].append(pid)
    return roles


def memory_listing(pids: list[int]) -> str:
    """``pid pss_kb rss_kb uss_kb`` per process still running, read from this host's /proc."""
    lines = []
    for pid in pids:
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
            pss = _kb(rollup, "Pss:")
            uss = _kb(rollup, "Private_Clean:") + _kb(rollup, "Private_Dirty:")
            rss = _kb(Path(f"/proc/{pid}/status").read_text(), "VmRSS:")
        except OSError:
            continue
        lines.append(f"{pid} {pss} {rss} {uss}")
    return "\n".join(lines)


def _kb(text: str, field: str) -> int:
    return next(int(line.split()[1]) for line in text.splitlines() if line.startswith(field))


def agent_memory(listing: str) -> dict[str, float]:
    """Sum the agent processes' PSS (their share of memory, the libraries they share with
    other sandboxes' agents split between them), RSS, and USS (their private memory: what
    one more sandbox adds), in MB."""
    pss = rss = uss = 0.0
    count = 0
    for line in listing.splitlines():
        parts = line.split()
        if len(parts) == 4:
            count += 1
            pss += float(parts[1]) / 1024
            rss += float(parts[2]) / 1024
            uss += float(parts[3]) / 1024
    if not count:
        raise RuntimeError(f"no agent process found under the sandbox's container: {listing!r}")
    return {
        "agent processes": count,
        "agent PSS MB": round(pss, 1),
        "agent RSS MB (sum)": round(rss, 1),
        "agent USS MB (private)": round(uss, 1),
    }


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
