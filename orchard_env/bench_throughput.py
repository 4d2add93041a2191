"""`orchard bench throughput`: execs per second sustained across many ready sandboxes.

Every sandbox keeps one exec of ``true`` in flight for the whole measured window, so the
service has as many commands in flight as there are sandboxes; what it sustains (execs per
second), how long each exec takes under that load, and what each costs the orchestrator in
CPU (a service on this host) are what it reports.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

from orchard_env import bench_host
from orchard_env.bench import BenchResult, Progress, Stats
from orchard_env.sdk import AsyncSandbox, AsyncSandboxClient

CREATES_AT_ONCE = 16  # the sandboxes are made before the measured window, this many at a time


def bench_throughput(
    make_client: Callable[[], AsyncSandboxClient],
    *,
    image: str,
    sandboxes: int = 100,
    seconds: float = 20.0,
    progress: Progress = lambda _m: None,
) -> BenchResult:
    """``sandboxes`` ready sandboxes, each running ``true`` back to back for ``seconds``."""

    async def run() -> BenchResult:
        async with make_client() as client:
            return await _throughput(
                client, image=image, sandboxes=sandboxes, seconds=seconds, progress=progress
            )

    return asyncio.run(run())


async def _throughput(
    client: AsyncSandboxClient, *, image: str, sandboxes: int, seconds: float, progress: Progress
) -> BenchResult:
    result = BenchResult(
        "sustained exec throughput",
        {"image": image, "sandboxes": sandboxes, "seconds": seconds, "command": "['true']"},
    )
    made: list[AsyncSandbox] = []
    at_once = asyncio.Semaphore(CREATES_AT_ONCE)

    async def make() -> None:
        async with at_once:
            sandbox = await client.create_sandbox(image, labels={"bench": "throughput"})
        made.append(sandbox)
        progress(f"{len(made)}/{sandboxes} sandboxes ready")

    try:
        await asyncio.gather(*(make() for _ in range(sandboxes)))
        await asyncio.gather(*(s.exec(["true"], check=True, shell=False) for s in made))
        latencies, window = await _measure(client, made, seconds, result, progress)
    finally:
        progress("deleting the sandboxes")
        await asyncio.gather(*(s.delete() for s in made), return_exceptions=True)
    result.stats["exec (every sandbox one in flight)"] = Stats.of(latencies)
    result.figures["execs per second"] = round(len(latencies) / window, 1)
    return result


async def _measure(
    client: AsyncSandboxClient,
    sandboxes: list[AsyncSandbox],
    seconds: float,
    result: BenchResult,
    progress: Progress,
) -> tuple[list[float], float]:
    """Run the window; its latencies and its length, with CPU figures put in ``result``."""
    service = bench_host.find_service(client.base_url)
    orchestrator = service if isinstance(service, int) else None
    latencies: list[float] = []
    progress(f"{len(sandboxes)} sandboxes running `true` back to back for {seconds:g} s")
    load_before = os.getloadavg()[0]
    service_cpu = bench_host.cpu_seconds(orchestrator) if orchestrator else 0.0
    client_cpu = time.process_time()
    started = time.perf_counter()
    deadline = started + seconds

    async def loop(sandbox: AsyncSandbox) -> None:
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            await sandbox.exec(["true"], check=True, shell=False)
            latencies.append(time.perf_counter() - t0)

    await asyncio.gather(*(loop(s) for s in sandboxes))
    window = time.perf_counter() - started
    execs = len(latencies)
    result.figures["client CPU ms per exec (this process, same machine)"] = round(
        (time.process_time() - client_cpu) * 1000 / execs, 2
    )
    if orchestrator:
        used = bench_host.cpu_seconds(orchestrator) - service_cpu
        result.figures["orchestrator CPU ms per exec"] = round(used * 1000 / execs, 2)
        result.figures["orchestrator CPU, % of one core"] = round(100 * used / window, 1)
    else:
        result.not_measured["orchestrator CPU per exec"] = str(service)
    result.figures["load average before"] = round(load_before, 1)
    result.figures["load average after"] = round(os.getloadavg()[0], 1)
    return latencies, window
