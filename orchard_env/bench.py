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
from typing import Any

from orchard_env import bench_host
from orchard_env.bench_host import cpu_seconds
from orchard_env.errors import OrchardError
from orchard_env.protocol import SandboxStatus
from orchard_env.sdk import AsyncSandbox, AsyncSandboxClient, SandboxClient

Progress = Callable[[str], None]


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
    # What was not measured in this run, and why (e.g. host figures of a remote service).
    not_measured: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "params": self.params,
            "stats_ms": {k: {"n": v.n, **v.ms()} for k, v in self.stats.items()},
            "figures": self.figures,
            "not_measured": self.not_measured,
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
        for key, why in self.not_measured.items():
            lines.append(f"- {key}: not measured ({why})")
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
    engine_baseline: bool = True,
    progress: Progress = lambda _m: None,
) -> BenchResult:
    """`true` through SDK → orchestrator → agent. For a service on this host also its CPU
    time per exec (which load on a shared machine disturbs far less than latency); for a
    sandbox in this host's engine (``engine_url``) the engine's own exec_run beside it (with
    ``engine_baseline``) and the agent's memory, read from this host's /proc (the agent is
    non-dumpable: nothing in the sandbox can read it). Elsewhere (a remote service, a
    cluster) those are reported as not measured, with the reason."""
    result = BenchResult("exec round trip", {"image": image, "n": n, "command": "['true']"})
    service = bench_host.find_service(client.base_url)
    progress("creating a sandbox")
    with client.create_sandbox(image) as sandbox:
        container = bench_host.engine_container(
            engine_url, sandbox.sandbox_id, sandbox.info.backend
        )
        for _ in range(10):
            sandbox.exec(["true"], check=True, shell=False)
        processes = (
            {} if isinstance(container, str) else bench_host.sandbox_processes(container.pid)
        )
        agents = processes.get("agent", [])
        progress(f"timing {n} execs through Orchard")
        client_cpu = time.process_time()
        service_cpu = cpu_seconds(service) if isinstance(service, int) else 0.0
        agent_cpu = sum(map(cpu_seconds, agents))
        samples = [
            _timed(lambda: sandbox.exec(["true"], check=True, shell=False)) for _ in range(n)
        ]
        result.stats["orchard exec"] = Stats.of(samples)
        result.figures["client CPU ms per exec"] = round(
            (time.process_time() - client_cpu) * 1000 / n, 2
        )
        if isinstance(service, int):
            result.figures["orchestrator CPU ms per exec"] = round(
                (cpu_seconds(service) - service_cpu) * 1000 / n, 2
            )
        else:
            result.not_measured["orchestrator CPU per exec"] = service
        if isinstance(container, str):
            result.not_measured["engine exec_run, the agent's CPU and memory"] = container
            return result
        result.figures["agent CPU ms per exec (the commands' own not counted)"] = round(
            (sum(map(cpu_seconds, agents)) - agent_cpu) * 1000 / n, 2
        )
        if engine_baseline and engine_url is not None:
            progress(f"timing {n} execs through the engine's exec_run")
            engine = bench_host.exec_run_samples(engine_url, container.id, n)
            result.stats["engine exec_run"] = Stats.of(engine)
            result.figures["ratio p50 (orchard / engine)"] = round(
                result.stats["orchard exec"].p50 / result.stats["engine exec_run"].p50, 4
            )
        whole = bench_host.memory_listing([pid for pids in processes.values() for pid in pids])
        of_agents = [line for line in whole.splitlines() if int(line.split()[0]) in agents]
        result.figures.update(bench_host.agent_memory("\n".join(of_agents)))
        result.figures["the sandbox's processes on the host, PSS MB (monitor, init, agent)"] = (
            round(sum(float(line.split()[1]) for line in whole.splitlines()) / 1024, 1)
        )
    return result


def bench_create(
    client: SandboxClient,
    *,
    image: str,
    n: int = 10,
    pool: bool = False,
    tools: bool = False,
    cpu: str | None = None,
    memory: str | None = None,
    progress: Progress = lambda _m: None,
) -> BenchResult:
    """Create → first successful exec, one sandbox at a time, image present. With ``pool``
    (admin key), also from a warm pool made for the run, each pooled sample right after a
    cold one of the same spec (cold: a create naming its own id, which no pool serves). With
    ``tools``, creates with every harness of the service's tools payload alternate with
    creates without any (``tools: false``): what the payload costs a create."""
    if pool and tools:
        raise OrchardError("measure the pool or the tools payload, not both in one run")
    params = {"image": image, "n": n, "pool": pool, "tools": tools, "cpu": cpu, "memory": memory}
    result = BenchResult("create to first exec", params)

    def sample(sandbox_id: str | None, harnesses: bool | None = None) -> tuple[float, float, bool]:
        """(seconds to the create's answer, to the first exec's, served by the pool)"""
        started = time.perf_counter()
        sandbox = client.create_sandbox(
            image, sandbox_id=sandbox_id, cpu=cpu, memory=memory, tools=harnesses
        )
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
    client.create_pool(name, image, POOL_BENCH_SIZE, cpu=cpu, memory=memory)
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
    cpu: str | None = None,
    memory: str | None = None,
    progress: Progress = lambda _m: None,
) -> BenchResult:
    """n sandboxes created concurrently, each running 4 commands; once all are done (all n
    alive at once) the host's memory is sampled, then they are deleted. ``pool``: from a warm
    pool of n filled first (admin key). ``engine_url`` (local engine): also time the engine
    alone creating n plain containers, as a same-run baseline. ``cpu``, ``memory``: each
    sandbox's (default: the service's)."""

    async def run() -> BenchResult:
        async with make_client() as client:
            return await _launch(
                client,
                image=image,
                n=n,
                pool=pool,
                engine_url=engine_url,
                size=Size(cpu, memory),
                progress=progress,
            )

    return asyncio.run(run())


@dataclass(frozen=True)
class Size:
    cpu: str | None
    memory: str | None


async def _fill_pool(
    client: AsyncSandboxClient, image: str, n: int, size: Size, progress: Progress
) -> str:
    name = f"bench-launch-{secrets.token_hex(3)}"
    await client.create_pool(name, image, n, cpu=size.cpu, memory=size.memory)
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
    size: Size,
    progress: Progress,
) -> BenchResult:
    result = BenchResult(
        "concurrent launch",
        {
            "image": image,
            "sandboxes": n,
            "commands each": len(LAUNCH_COMMANDS),
            "from a warm pool": pool,
            "cpu": size.cpu,
            "memory": size.memory,
        },
    )
    backend = (await client.health()).backend
    if engine_url is not None and backend != "docker":
        raise OrchardError(
            f"the engine-alone baseline times this host's container engine; the service's "
            f"backend is {backend}",
            hint="rerun without --engine",
        )
    service = bench_host.find_service(client.base_url)
    orchestrator = service if isinstance(service, int) else None
    if orchestrator is None:
        result.not_measured["the orchestrator's memory and CPU"] = str(service)
    on_host = orchestrator is not None and backend == "docker"
    if not on_host:  # this host's MemAvailable would move with anything but the sandboxes
        where = f"its backend is {backend}" if backend != "docker" else "it is not on this host"
        result.not_measured["host memory per sandbox"] = (
            f"the service's sandboxes are not in this host's container engine: {where}"
        )
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
        pool_name = await _fill_pool(client, image, n, size, progress)
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
            sandbox = await client.create_sandbox(
                image, cpu=size.cpu, memory=size.memory, labels={"bench": "launch"}
            )
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
    result.figures.update(_memory_figures(before, peak, len(creates) if on_host else 0))
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
    """Memory with all sandboxes alive, against before the launch (MB); ``alive``: the
    sandboxes in this host's engine (0: none, so no host figure)."""
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
