"""`orchard bench …`: latency and throughput measured through the public API.

Every benchmark measures a baseline in the same run where one exists (the engine's own
``exec_run`` for exec; fresh creates beside forks), because this machine is shared and
noisy: ratios travel, absolute numbers do not.
"""

from __future__ import annotations

import asyncio
import secrets
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from orchard_env import bench_host
from orchard_env.bench_host import cpu_seconds, stat_fields
from orchard_env.errors import OrchardError
from orchard_env.protocol import SandboxStatus
from orchard_env.sdk import AsyncSandbox, AsyncSandboxClient, SandboxClient

Progress = Callable[[str], None]

# Finds the agent's processes without matching the shell that searches for them.
_AGENT_PSS = (
    "for p in /proc/[0-9]*; do "
    "if tr '\\0' ' ' <$p/cmdline 2>/dev/null | grep -q '/agen[t] --listen'; then "
    "echo ${p#/proc/} $(grep '^Pss:' $p/smaps_rollup | tr -s ' ' | cut -d' ' -f2) "
    "$(grep '^VmRSS:' $p/status | tr -s ' ' | cut -d' ' -f2) "
    "$(awk '/^Private_(Clean|Dirty):/ {s += $2} END {print s}' $p/smaps_rollup); fi; done"
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
        on_host = (
            host_sandbox_processes(engine_url, sandbox.sandbox_id) if engine_url is not None else {}
        )
        agents = on_host.get("agent", [])
        progress(f"timing {n} execs through Orchard")
        client_cpu = time.process_time()
        service_cpu = cpu_seconds(orchestrator_pid) if orchestrator_pid else 0.0
        agent_cpu = sum(map(cpu_seconds, agents))
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
        if agents:
            result.figures["agent CPU ms per exec (the commands' own not counted)"] = round(
                (sum(map(cpu_seconds, agents)) - agent_cpu) * 1000 / n, 2
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
            memory_listing(agents)
            if agents
            else sandbox.exec(["/bin/sh", "-c", _AGENT_PSS], shell=False).stdout
        )
        result.figures.update(_agent_memory(listing))
        if on_host:
            whole = memory_listing([pid for pids in on_host.values() for pid in pids])
            result.figures["the sandbox's processes on the host, PSS MB (monitor, init, agent)"] = (
                round(sum(float(line.split()[1]) for line in whole.splitlines()) / 1024, 1)
            )
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


def host_sandbox_processes(engine_url: str, sandbox_id: str) -> dict[str, list[int]]:
    """The sandbox's processes on this host by role, from /proc: ``monitor`` (the engine's
    per-container process, e.g. conmon: the parent of the container's first process),
    ``init`` (that first process), ``agent`` (whose command line runs the agent) and
    ``other`` (the rest of the container's tree)."""
    import docker

    engine = docker.DockerClient(base_url=engine_url)
    try:
        (container,) = engine.containers.list(filters={"label": f"orchard.sandbox-id={sandbox_id}"})
        init = int(container.attrs["State"]["Pid"])
    finally:
        engine.close()
    parents = {}
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit():
                parents[int(proc.name)] = int(stat_fields(int(proc.name))[1])
        except OSError:
            continue
    tree = {init}
    grown = True
    while grown:
        before = len(tree)
        tree |= {pid for pid, parent in parents.items() if parent in tree}
        grown = len(tree) > before
    roles: dict[str, list[int]] = {"monitor": [], "init": [init], "agent": [], "other": []}
    if parents.get(init, 1) > 1:
        roles["monitor"].append(parents[init])
    for pid in sorted(tree - {init}):
        try:
            agent = b"/agent\0--listen" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        roles["agent" if agent else "other"].append(pid)
    return roles


def memory_listing(pids: Sequence[int]) -> str:
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


def _agent_memory(listing: str) -> dict[str, float]:
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
        raise RuntimeError(f"no agent process found in the sandbox's /proc: {listing!r}")
    return {
        "agent processes": count,
        "agent PSS MB": round(pss, 1),
        "agent RSS MB (sum)": round(rss, 1),
        "agent USS MB (private)": round(uss, 1),
    }


def bench_create(
    client: SandboxClient,
    *,
    image: str,
    n: int = 10,
    pool: bool = False,
    tools: bool = False,
    progress: Progress = lambda _m: None,
) -> BenchResult:
    """Create → first successful exec, one sandbox at a time, image present. With ``pool``
    (admin key), also from a warm pool made for the run, each pooled sample right after a
    cold one of the same spec (cold: a create naming its own id, which no pool serves). With
    ``tools``, creates with every harness of the service's tools payload alternate with
    creates without any (``tools: false``): what the payload costs a create."""
    if pool and tools:
        raise OrchardError("measure the pool or the tools payload, not both in one run")
    params = {"image": image, "n": n, "pool": pool, "tools": tools}
    result = BenchResult("create to first exec", params)

    def sample(sandbox_id: str | None, harnesses: bool | None = None) -> tuple[float, float, bool]:
        """(seconds to the create's answer, to the first exec's, served by the pool)"""
        started = time.perf_counter()
        sandbox = client.create_sandbox(image, sandbox_id=sandbox_id, tools=harnesses)
        answered = time.perf_counter() - started
        sandbox.exec(["true"], check=True, shell=False)
        elapsed = time.perf_counter() - started
        from_pool = sandbox.info.status is SandboxStatus.READY and sandbox_id is None
        sandbox.delete()
        return answered, elapsed, from_pool

    if tools:
        with_tools: list[float] = []
        without: list[float] = []
        for i in range(n):
            progress(f"sandbox pair {i + 1}/{n}")
            with_tools.append(sample(None, True)[1])
            without.append(sample(None, False)[1])
        result.stats["create + first exec (every harness mounted)"] = Stats.of(with_tools)
        result.stats["create + first exec (tools: false)"] = Stats.of(without)
        result.figures["ratio p50 (harnesses / none)"] = round(
            Stats.of(with_tools).p50 / Stats.of(without).p50, 4
        )
        return result
    if not pool:
        samples = []
        for i in range(n):
            progress(f"sandbox {i + 1}/{n}")
            samples.append(sample(None)[1])
        result.stats["create + first exec"] = Stats.of(samples)
        return result
    name = f"bench-{secrets.token_hex(3)}"
    client.create_pool(name, image, POOL_BENCH_SIZE)
    cold: list[float] = []
    warm: list[float] = []
    warm_create: list[float] = []
    missed = 0
    try:
        for i in range(n):
            progress(f"cold sandbox {i + 1}/{n}")
            cold.append(sample(f"bench-cold-{secrets.token_hex(4)}")[1])
            progress(f"waiting for pool {name} to refill")
            _wait_pool_full(client, name)
            progress(f"pooled sandbox {i + 1}/{n}")
            answered, elapsed, from_pool = sample(None)
            warm_create.append(answered)
            warm.append(elapsed)
            missed += not from_pool
    finally:
        client.delete_pool(name)
    result.stats["create + first exec (cold)"] = Stats.of(cold)
    result.stats["create + first exec (from a warm pool)"] = Stats.of(warm)
    result.stats["create's answer alone (from a warm pool)"] = Stats.of(warm_create)
    result.figures["pooled samples not served by the pool"] = missed
    result.figures["ratio p50 (pool / cold)"] = round(
        result.stats["create + first exec (from a warm pool)"].p50
        / result.stats["create + first exec (cold)"].p50,
        4,
    )
    return result


POOL_BENCH_SIZE = 2


def _wait_pool_full(client: SandboxClient, name: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        info = client.get_pool(name)
        if info.ready >= info.size:
            return
        if info.error or time.monotonic() > deadline:
            raise OrchardError(
                f"pool {name} did not fill: {info.error or f'{info.ready}/{info.size} ready'}"
            )
        time.sleep(0.05)


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
    pool: bool = False,
    engine_url: str | None = None,
    progress: Progress = lambda _m: None,
) -> BenchResult:
    """n sandboxes created concurrently, each running 4 commands; once all are done (all n
    alive at once) the host's memory is sampled, then they are deleted. ``pool``: from a warm
    pool of n filled first (admin key). ``engine_url`` (local engine): also time the engine
    alone creating n plain containers, as a same-run baseline."""

    async def run() -> BenchResult:
        async with make_client() as client:
            return await _launch(
                client, image=image, n=n, pool=pool, engine_url=engine_url, progress=progress
            )

    return asyncio.run(run())


async def _fill_pool(client: AsyncSandboxClient, image: str, n: int, progress: Progress) -> str:
    name = f"bench-launch-{secrets.token_hex(3)}"
    await client.create_pool(name, image, n)
    while True:
        info = await client.get_pool(name)
        progress(f"pool {name}: {info.ready}/{n} ready")
        if info.ready >= n:
            return name
        if info.error:
            await client.delete_pool(name)
            raise OrchardError(f"pool {name} did not fill: {info.error}")
        await asyncio.sleep(0.5)


async def _launch(
    client: AsyncSandboxClient,
    *,
    image: str,
    n: int,
    pool: bool,
    engine_url: str | None,
    progress: Progress,
) -> BenchResult:
    result = BenchResult(
        "concurrent launch",
        {
            "image": image,
            "sandboxes": n,
            "commands each": len(LAUNCH_COMMANDS),
            "from a warm pool": pool,
        },
    )
    orchestrator = bench_host.service_pid(client.base_url)
    engine = bench_host.engine_pid(engine_url) if engine_url else None
    if engine_url is not None:
        progress(f"the engine alone: {n} plain containers")
        alone = await asyncio.to_thread(bench_host.engine_alone, engine_url, image, n)
        result.figures["engine alone: seconds for n plain containers"] = round(alone, 2)
        result.figures["engine alone: creates per second"] = round(n / alone, 1)
    before = bench_host.sample(orchestrator, engine)
    pool_name = None
    if pool:
        started = time.perf_counter()
        pool_name = await _fill_pool(client, image, n, progress)
        result.figures["pool fill seconds (before the timed launch)"] = round(
            time.perf_counter() - started, 1
        )
    creates: list[float] = []
    execs: list[float] = []
    failures: list[str] = []
    finished = 0
    peak = before
    last_ready = 0.0
    launched = bench_host.sample(orchestrator, engine)
    client_cpu = time.process_time()
    started = time.perf_counter()

    def one_finished() -> None:
        nonlocal finished, peak
        finished += 1
        progress(f"{finished}/{n} sandboxes done")
        if finished == n:
            peak = bench_host.sample(orchestrator, engine)

    async def one(i: int) -> tuple[int, AsyncSandbox | None]:
        nonlocal last_ready
        t0 = time.perf_counter()
        try:
            sandbox = await client.create_sandbox(image, labels={"bench": "launch"})
        except Exception as exc:  # a failed create is a data point, not a crash
            failures.append(f"create {i}: {exc}")
            one_finished()
            return 0, None
        creates.append(time.perf_counter() - t0)
        last_ready = max(last_ready, time.perf_counter() - started)
        ok = 0
        try:
            for command in LAUNCH_COMMANDS:
                t1 = time.perf_counter()
                run = await sandbox.exec(command)
                execs.append(time.perf_counter() - t1)
                if run.exit_code == 0:
                    ok += 1
                else:
                    failures.append(f"exec {i} {command!r}: exit {run.exit_code}")
        except Exception as exc:
            failures.append(f"exec {i}: {exc}")
        one_finished()
        return ok, sandbox

    try:
        outcomes = await asyncio.gather(*(one(i) for i in range(n)))
        total = time.perf_counter() - started
        client_cpu = time.process_time() - client_cpu
        progress("deleting them")
        deleting = time.perf_counter()
        await asyncio.gather(
            *(sandbox.delete() for _, sandbox in outcomes if sandbox is not None),
            return_exceptions=True,
        )
        deleted = time.perf_counter() - deleting
    finally:
        if pool_name is not None:
            await client.delete_pool(pool_name)
    commands = sum(ok for ok, _ in outcomes)
    result.stats["create (concurrent)"] = Stats.of(creates) if creates else Stats.of([float("nan")])
    if execs:
        result.stats["exec (under load)"] = Stats.of(execs)
    result.figures.update(
        {
            "total seconds (all created and their commands done)": round(total, 2),
            "sandboxes succeeded": len(creates),
            "success %": round(100 * len(creates) / n, 1),
            "creates per second (until the last was ready)": round(
                len(creates) / last_ready if last_ready else 0.0, 1
            ),
            "commands succeeded": commands,
            "commands per second": round(commands / total, 1),
            "delete all seconds": round(deleted, 2),
            "benchmark client CPU seconds (this process, same machine)": round(client_cpu, 2),
        }
    )
    result.figures.update(_memory_figures(before, peak, len(creates)))
    for what, then, now in (
        ("orchestrator", launched.orchestrator_cpu, peak.orchestrator_cpu),
        ("engine service", launched.engine_cpu, peak.engine_cpu),
    ):
        if then is not None and now is not None:
            result.figures[f"{what} CPU seconds during the launch"] = round(now - then, 2)
    result.params["failures"] = failures[:5]
    return result


def _memory_figures(
    before: bench_host.HostSample, peak: bench_host.HostSample, alive: int
) -> dict[str, float]:
    """Memory with all sandboxes alive, against before the launch (MB)."""
    figures: dict[str, float] = {}
    used = before.available_mb - peak.available_mb
    if alive:
        figures["host memory used per sandbox MB (MemAvailable drop / n)"] = round(used / alive, 1)
    for what, then, now in (
        ("orchestrator", before.orchestrator_mb, peak.orchestrator_mb),
        ("engine service", before.engine_mb, peak.engine_mb),
    ):
        if then is not None and now is not None:
            figures[f"{what} RSS MB (all alive)"] = now
            figures[f"{what} RSS MB (before)"] = then
            if alive and what == "engine service" and used > 0:
                figures["engine service's share of the host memory used %"] = round(
                    100 * (now - then) / used, 1
                )
    return figures


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
    """From a sandbox with a ``workspace_mb`` MB workspace: the first snapshot's latency,
    then that of ``snapshots - 1`` more with 1 MB written before each (what each stores),
    and fork k until all k are exec-able, beside creating k fresh sandboxes concurrently in
    the same run."""

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
            if i:  # a turn's worth of change between two snapshots
                await source.exec(f"head -c 1M /dev/urandom > /workspace/turn-{i}", check=True)
            started = time.perf_counter()
            snapshot = await source.snapshot(labels=labels)
            snapshot_times.append(time.perf_counter() - started)
            taken.append(snapshot.snapshot_id)
            sizes.append(snapshot.size_bytes)
        result.stats["first snapshot (the whole workspace)"] = Stats.of(snapshot_times[:1])
        if snapshots > 1:
            result.stats["next snapshots, 1 MB written before each"] = Stats.of(snapshot_times[1:])

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
                "first snapshot's own layer MB": round(sizes[0] / 1e6, 1),
                "next snapshots' own layer MB (p50)": round(
                    statistics.median(sizes[1:] or [0]) / 1e6, 2
                ),
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
