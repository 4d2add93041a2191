"""`orchard bench …`: latency and throughput measured through the public API.

Every benchmark measures a baseline in the same run where one exists (the engine's own
``exec_run`` for exec; fresh creates beside forks), because this machine is shared and
noisy: ratios travel, absolute numbers do not.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from orchard_env.sdk import AsyncSandbox, AsyncSandboxClient, SandboxClient

Progress = Callable[[str], None]

# Finds the agent's processes without matching the shell that searches for them.
_AGENT_PSS = (
    "for p in /proc/[0-9]*; do "
    "if tr '\\0' ' ' <$p/cmdline 2>/dev/null | grep -q '/agen[t] --listen'; then "
    "echo ${p#/proc/} $(grep '^Pss:' $p/smaps_rollup | tr -s ' ' | cut -d' ' -f2) "
    "$(grep '^VmRSS:' $p/status | tr -s ' ' | cut -d' ' -f2); fi; done"
)


@dataclass(frozen=True)
class Stats:
    n: int
    mean: float
    p50: float
    p90: float
    p99: float
    min: float
    max: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Stats:
        if not samples:
            raise ValueError("no samples")
        ordered = sorted(samples)

        def pct(q: float) -> float:
            if len(ordered) == 1:
                return ordered[0]
            pos = q * (len(ordered) - 1)
            low = int(pos)
            high = min(low + 1, len(ordered) - 1)
            return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)

        return cls(
            n=len(ordered),
            mean=statistics.fmean(ordered),
            p50=pct(0.50),
            p90=pct(0.90),
            p99=pct(0.99),
            min=ordered[0],
            max=ordered[-1],
        )

    def ms(self) -> dict[str, float]:
        return {k: round(v * 1000, 2) for k, v in asdict(self).items() if k != "n"}


@dataclass
class BenchResult:
    name: str
    params: dict[str, Any]
    stats: dict[str, Stats] = field(default_factory=dict)
    figures: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "params": self.params,
            "stats_ms": {k: {"n": v.n, **v.ms()} for k, v in self.stats.items()},
            "figures": self.figures,
        }

    def markdown(self) -> str:
        lines = [f"### {self.name}", ""]
        lines.append("Parameters: " + ", ".join(f"{k}={v}" for k, v in self.params.items()))
        lines.append("")
        if self.stats:
            lines.append("| measure | n | p50 ms | p90 ms | p99 ms | mean ms | min ms | max ms |")
            lines.append("|---|---|---|---|---|---|---|---|")
            for key, st in self.stats.items():
                ms = st.ms()
                lines.append(
                    f"| {key} | {st.n} | {ms['p50']} | {ms['p90']} | {ms['p99']} | {ms['mean']} "
                    f"| {ms['min']} | {ms['max']} |"
                )
            lines.append("")
        for key, value in self.figures.items():
            lines.append(f"- {key}: {value:g}")
        return "\n".join(lines) + "\n"


def listener_pid(port: int) -> int | None:
    """The pid of the process on this host listening on TCP ``port`` (None if not found, e.g.
    the service is remote or another user's): from /proc/net/tcp{,6} and the fds in /proc."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as rows:
                next(rows)
                for row in rows:
                    fields = row.split()
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(f"socket:[{fields[9]}]")
        except OSError:
            continue
    for proc in Path("/proc").iterdir() if inodes else ():
        try:
            if proc.name.isdigit() and any(
                str(fd.readlink()) in inodes for fd in (proc / "fd").iterdir()
            ):
                return int(proc.name)
        except OSError:
            continue
    return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stat_fields(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (state first, then ppid)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def bench_exec(
    client: SandboxClient,
    *,
    image: str,
    n: int = 200,
    engine_url: str | None = None,
    orchestrator_pid: int | None = None,
    progress: Progress = lambda _m: None,
) -> BenchResult:
    """`true` through SDK → orchestrator → agent, beside the engine's own exec_run; with
    ``orchestrator_pid`` (a service on this host) also its CPU time per exec, which load on
    a shared machine disturbs far less than latency."""
    result = BenchResult("exec round trip", {"image": image, "n": n, "command": "['true']"})
    progress("creating a sandbox")
    with client.create_sandbox(image) as sandbox:
        for _ in range(10):
            sandbox.exec(["true"], check=True, shell=False)
        progress(f"timing {n} execs through Orchard")
        client_cpu = time.process_time()
        service_cpu = cpu_seconds(orchestrator_pid) if orchestrator_pid else 0.0
        samples = [
            _timed(lambda: sandbox.exec(["true"], check=True, shell=False)) for _ in range(n)
        ]
        result.stats["orchard exec"] = Stats.of(samples)
        result.figures["client CPU ms per exec"] = round(
            (time.process_time() - client_cpu) * 1000 / n, 2
        )
        if orchestrator_pid:
            result.figures["orchestrator CPU ms per exec"] = round(
                (cpu_seconds(orchestrator_pid) - service_cpu) * 1000 / n, 2
            )
        if engine_url is not None:
            progress(f"timing {n} execs through the engine's exec_run")
            engine = _engine_samples(engine_url, sandbox.sandbox_id, n)
            result.stats["engine exec_run"] = Stats.of(engine)
            result.figures["ratio p50 (orchard / engine)"] = round(
                result.stats["orchard exec"].p50 / result.stats["engine exec_run"].p50, 4
            )
        # The agent is non-dumpable, so its memory is unreadable from inside the sandbox:
        # read it from this host when the engine is local, else from inside (init only).
        listing = (
            host_agent_listing(engine_url, sandbox.sandbox_id)
            if engine_url is not None
            else sandbox.exec(["/bin/sh", "-c", _AGENT_PSS], shell=False).stdout
        )
        memory = _agent_memory(listing)
        result.figures.update(memory)
    return result


def _engine_samples(engine_url: str, sandbox_id: str, n: int) -> list[float]:
    import docker

    engine = docker.DockerClient(base_url=engine_url)
    try:
        (container,) = engine.containers.list(filters={"label": f"orchard.sandbox-id={sandbox_id}"})
        for _ in range(3):
            container.exec_run(["true"])
        return [_timed(lambda: container.exec_run(["true"])) for _ in range(n)]
    finally:
        engine.close()


def host_agent_listing(engine_url: str, sandbox_id: str) -> str:
    """``pid pss_kb rss_kb`` of the sandbox's agent processes, read from this host's /proc:
    the processes under the container's first one whose command line runs the agent."""
    import docker

    engine = docker.DockerClient(base_url=engine_url)
    try:
        (container,) = engine.containers.list(filters={"label": f"orchard.sandbox-id={sandbox_id}"})
        tree = {int(container.attrs["State"]["Pid"])}
    finally:
        engine.close()
    parents = {}
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit():
                parents[int(proc.name)] = int(stat_fields(int(proc.name))[1])
        except OSError:
            continue
    grown = True
    while grown:
        before = len(tree)
        tree |= {pid for pid, parent in parents.items() if parent in tree}
        grown = len(tree) > before
    lines = []
    for pid in sorted(tree):
        try:
            if b"/agent\0--listen" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            pss = _kb(Path(f"/proc/{pid}/smaps_rollup").read_text(), "Pss:")
            rss = _kb(Path(f"/proc/{pid}/status").read_text(), "VmRSS:")
        except OSError:
            continue
        lines.append(f"{pid} {pss} {rss}")
    return "\n".join(lines)


def _kb(text: str, field: str) -> int:
    return next(int(line.split()[1]) for line in text.splitlines() if line.startswith(field))


def _agent_memory(listing: str) -> dict[str, float]:
    """Sum the agent processes' PSS (their real share of memory) and RSS, in MB."""
    pss = rss = 0.0
    count = 0
    for line in listing.splitlines():
        parts = line.split()
        if len(parts) == 3:
            count += 1
            pss += float(parts[1]) / 1024
            rss += float(parts[2]) / 1024
    if not count:
        raise RuntimeError(f"no agent process found in the sandbox's /proc: {listing!r}")
    return {
        "agent processes": count,
        "agent PSS MB": round(pss, 1),
        "agent RSS MB (sum)": round(rss, 1),
    }


def bench_create(
    client: SandboxClient, *, image: str, n: int = 10, progress: Progress = lambda _m: None
) -> BenchResult:
    """Create → first successful exec, one sandbox at a time, image present."""
    result = BenchResult("create to first exec", {"image": image, "n": n})
    samples = []
    for i in range(n):
        progress(f"sandbox {i + 1}/{n}")
        started = time.perf_counter()
        sandbox = client.create_sandbox(image)
        sandbox.exec(["true"], check=True, shell=False)
        samples.append(time.perf_counter() - started)
        sandbox.delete()
    result.stats["create + first exec"] = Stats.of(samples)
    return result


LAUNCH_COMMANDS: tuple[str | list[str], ...] = (
    ["uname", "-a"],
    "ls /",
    "head -n 3 /etc/os-release",
    "echo $HOME",
)


def bench_launch(
    make_client: Callable[[], AsyncSandboxClient],
    *,
    image: str,
    n: int = 100,
    progress: Progress = lambda _m: None,
) -> BenchResult:
    """n sandboxes created concurrently, each running 4 commands, then deleted."""

    async def run() -> BenchResult:
        async with make_client() as client:
            return await _launch(client, image=image, n=n, progress=progress)

    return asyncio.run(run())


async def _launch(
    client: AsyncSandboxClient, *, image: str, n: int, progress: Progress
) -> BenchResult:
    result = BenchResult(
        "concurrent launch", {"image": image, "sandboxes": n, "commands each": len(LAUNCH_COMMANDS)}
    )
    creates: list[float] = []
    execs: list[float] = []
    failures: list[str] = []
    done = 0

    async def one(i: int) -> int:
        nonlocal done
        started = time.perf_counter()
        try:
            sandbox = await client.create_sandbox(image, labels={"bench": "launch"})
        except Exception as exc:  # a failed create is a data point, not a crash
            failures.append(f"create {i}: {exc}")
            return 0
        creates.append(time.perf_counter() - started)
        ok = 0
        try:
            for command in LAUNCH_COMMANDS:
                t0 = time.perf_counter()
                run = await sandbox.exec(command)
                execs.append(time.perf_counter() - t0)
                if run.exit_code == 0:
                    ok += 1
                else:
                    failures.append(f"exec {i} {command!r}: exit {run.exit_code}")
        finally:
            await sandbox.delete()
            done += 1
            progress(f"{done}/{n} sandboxes done")
        return ok

    started = time.perf_counter()
    oks = await asyncio.gather(*(one(i) for i in range(n)))
    total = time.perf_counter() - started
    commands = sum(oks)
    result.stats["create (concurrent)"] = Stats.of(creates) if creates else Stats.of([float("nan")])
    if execs:
        result.stats["exec (under load)"] = Stats.of(execs)
    result.figures.update(
        {
            "total seconds": round(total, 2),
            "sandboxes succeeded": len(creates),
            "success %": round(100 * len(creates) / n, 1),
            "commands succeeded": commands,
            "commands per second": round(commands / total, 1),
        }
    )
    result.params["failures"] = failures[:5]
    return result


def bench_fork(
    make_client: Callable[[], AsyncSandboxClient],
    *,
    image: str,
    k: int = 8,
    snapshots: int = 5,
    rounds: int = 3,
    workspace_mb: int = 100,
    progress: Progress = lambda _m: None,
) -> BenchResult:
    """From a sandbox with a ``workspace_mb`` MB workspace: snapshot latency, and fork k until
    all k are exec-able, beside creating k fresh sandboxes concurrently in the same run."""

    async def run() -> BenchResult:
        async with make_client() as client:
            return await _fork(
                client,
                image=image,
                k=k,
                snapshots=snapshots,
                rounds=rounds,
                workspace_mb=workspace_mb,
                progress=progress,
            )

    return asyncio.run(run())


async def _fork(
    client: AsyncSandboxClient,
    *,
    image: str,
    k: int,
    snapshots: int,
    rounds: int,
    workspace_mb: int,
    progress: Progress,
) -> BenchResult:
    labels = {"bench": "fork"}
    result = BenchResult(
        "snapshot and fork",
        {
            "image": image,
            "workspace MB": workspace_mb,
            "snapshots": snapshots,
            "k": k,
            "rounds": rounds,
        },
    )
    taken: list[str] = []
    progress(f"creating a sandbox with a {workspace_mb} MB workspace")
    source = await client.create_sandbox(image, labels=labels)
    try:
        await source.exec(
            f"head -c {workspace_mb}M /dev/urandom > /workspace/blob", check=True, timeout=600
        )
        snapshot_times, sizes = [], []
        for i in range(snapshots):
            progress(f"snapshot {i + 1}/{snapshots}")
            started = time.perf_counter()
            snapshot = await source.snapshot(labels=labels)
            snapshot_times.append(time.perf_counter() - started)
            taken.append(snapshot.snapshot_id)
            sizes.append(snapshot.size_bytes)
        result.stats["snapshot"] = Stats.of(snapshot_times)

        async def exec_able(sandbox: AsyncSandbox) -> None:
            await sandbox.exec(["true"], check=True, shell=False)

        async def fresh() -> AsyncSandbox:
            sandbox = await client.create_sandbox(image, labels=labels)
            await exec_able(sandbox)
            return sandbox

        fork_times: list[float] = []
        fresh_times: list[float] = []
        for round_ in range(rounds):
            for what in ("fork", "fresh") if round_ % 2 == 0 else ("fresh", "fork"):
                progress(f"round {round_ + 1}/{rounds}: {what} {k}")
                started = time.perf_counter()
                if what == "fork":
                    made = await source.fork(k, labels=labels)
                    await asyncio.gather(*(exec_able(sandbox) for sandbox in made))
                    fork_times.append(time.perf_counter() - started)
                    taken.append(str(made[0].info.source_snapshot))
                else:
                    made = list(await asyncio.gather(*(fresh() for _ in range(k))))
                    fresh_times.append(time.perf_counter() - started)
                await asyncio.gather(*(sandbox.delete() for sandbox in made))
        result.stats[f"fork {k}, until all {k} are exec-able"] = Stats.of(fork_times)
        result.stats[f"create {k} fresh, until all {k} are exec-able"] = Stats.of(fresh_times)
        result.figures.update(
            {
                "snapshot's own layer MB": round(statistics.median(sizes) / 1e6, 1),
                "fork / fresh (p50)": round(
                    statistics.median(fork_times) / statistics.median(fresh_times), 3
                ),
            }
        )
    finally:
        progress("cleaning up")
        await source.delete()
        for snapshot_id in taken:
            await client.delete_snapshot(snapshot_id)
    return result
