"""`orchard bench scale`: what the orchestrator's own work costs as the sandboxes and jobs it
holds grow (100, 1,000 and 10,000 by default).

The orchestrator is the subject, so the containers are left out. It runs in this process (the
real app, store, services and reaper, called through httpx's ASGI transport, so the HTTP
server's fixed cost per request is not in the figures) on :class:`FleetBackend`, whose
sandboxes are real agents (:class:`~orchard_env.agent.daemon.server.Agent`: enrollment,
request MACs, answer proofs and commands all real) served by a few fleet processes,
thousands each, on unix sockets: no engine, no container, no interpreter per sandbox.

At each level, after creating sandboxes up to it (and running ``true`` once in each, so there
are as many jobs): the first page of ``GET /sandboxes?limit=100``, walking every page, the
whole list in one answer, ``GET /jobs/{id}``, an exec of ``true``, one reaper pass, and this
process's RSS (so the memory per live sandbox between levels). Last, ``--running-jobs``
commands that stay running (``sleep``), for the Python heap they hold (traced while they
start) and a reaper pass while they run.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import random
import resource
import shutil
import signal
import sys
import tempfile
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from orchard_env.bench import BenchResult, Progress, Stats
from orchard_env.bench_host import rss_mb
from orchard_env.config import default_service_settings
from orchard_env.errors import NotSupported, OrchardError
from orchard_env.orchestrator.backends.base import (
    AgentEndpoint,
    BackendSandbox,
    Capability,
    Capacity,
    SandboxSpec,
    SandboxState,
    SnapshotImage,
)
from orchard_env.protocol import NodeResources, ResourceAmounts

AGENTS_PER_FLEET = 2500  # each holds two fds per agent (its socket, the kept-alive link)
CONCURRENCY = 64  # creates (and their first exec) in flight at once
SAMPLES = 50  # timed requests of each kind per level
_FLEET = r"""
import json, os, resource, sys, threading
from orchard_env.agent.daemon.http import listen_socket
from orchard_env.agent.daemon.loop import Loop
from orchard_env.agent.daemon.procs import Processes
from orchard_env.agent.daemon.server import Agent

def stop(agent, sock):
    agent.loop.remove_reader(sock.fileno())
    sock.close()
    agent.jobs.kill_all()

def orders(procs):
    served = {}
    for line in sys.stdin:
        order = json.loads(line)
        if order["op"] == "start":
            agent = Agent(order["workdir"], procs)  # one loop and child table for all
            os.makedirs(order["workdir"], exist_ok=True)
            sock = listen_socket("unix", order["socket"], 0)
            procs.loop.call(procs.loop.serve, sock, agent.handle)
            served[order["id"]] = (agent, sock)
        elif order["id"] in served:
            procs.loop.call(stop, *served.pop(order["id"]))
        sys.stdout.write(json.dumps({"id": order["id"]}) + "\n")
        sys.stdout.flush()

    def end():  # the end of orders: no command outlives the fleet
        for agent, sock in served.values():
            stop(agent, sock)
        procs.loop.stopping = True

    procs.loop.call(end)

hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
procs = Processes(Loop())
threading.Thread(target=orders, args=(procs,), daemon=True).start()
procs.loop.run()
"""


class _Fleet:
    """One fleet process and the orders in flight to it (answered in any order, by id)."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.waiting: dict[str, asyncio.Future[None]] = {}
        self.agents = 0
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        assert self.process.stdout is not None
        while line := await self.process.stdout.readline():
            future = self.waiting.pop(json.loads(line)["id"], None)
            if future is not None and not future.done():
                future.set_result(None)
        for future in self.waiting.values():
            if not future.done():
                future.set_exception(OrchardError("a benchmark fleet process exited"))

    async def order(self, **order: str) -> None:
        assert self.process.stdin is not None
        future = asyncio.get_running_loop().create_future()
        self.waiting[order["id"]] = future
        self.process.stdin.write(json.dumps(order).encode() + b"\n")
        await self.process.stdin.drain()
        await future

    async def close(self) -> None:
        """End the orders (the fleet then kills its commands and exits); kill it if it does
        not within 30 s."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            await asyncio.wait_for(self.process.wait(), 30)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGKILL)
            await self.process.wait()
        self.reader.cancel()


class FleetBackend:
    """A Backend whose sandboxes are agents in fleet processes (see the module's docstring).
    Lifecycle only, as every backend: no snapshots, no PTY."""

    name = "bench-fleet"
    capabilities: frozenset[Capability] = frozenset()

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sandboxes: dict[str, BackendSandbox] = {}
        self.fleets: list[_Fleet] = []
        self._home: dict[str, _Fleet] = {}

    async def _fleet(self) -> _Fleet:
        """The fleet with the fewest agents; a new one when they all have their share."""
        if not self.fleets or len(self._home) >= AGENTS_PER_FLEET * len(self.fleets):
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                _FLEET,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,  # a line per agent enrolled
            )
            self.fleets.append(_Fleet(process))
        return min(self.fleets, key=lambda fleet: fleet.agents)

    async def create(self, spec: SandboxSpec) -> BackendSandbox:
        fleet = await self._fleet()
        fleet.agents += 1
        self._home[spec.sandbox_id] = fleet
        where = self.root / spec.sandbox_id
        socket = str(where / "agent.sock")
        where.mkdir()
        await fleet.order(
            op="start", id=spec.sandbox_id, socket=socket, workdir=str(where / "workspace")
        )
        sandbox = BackendSandbox(
            sandbox_id=spec.sandbox_id,
            state=SandboxState.RUNNING,
            agent=AgentEndpoint(token=spec.agent_token, uds=socket),
            created_at=datetime.now(UTC),
            record_annotation=spec.record_annotation,
        )
        self.sandboxes[spec.sandbox_id] = sandbox
        return sandbox

    async def inspect(self, sandbox_id: str) -> BackendSandbox | None:
        return self.sandboxes.get(sandbox_id)

    async def list(self) -> list[BackendSandbox]:
        return list(self.sandboxes.values())

    async def delete(self, sandbox_id: str) -> None:
        fleet = self._home.pop(sandbox_id, None)
        if self.sandboxes.pop(sandbox_id, None) is not None and fleet is not None:
            fleet.agents -= 1
            await fleet.order(op="stop", id=sandbox_id)

    async def snapshot(
        self, sandbox_id: str, snapshot_id: str, *, parent: str | None = None
    ) -> SnapshotImage:
        raise NotSupported("the benchmark's fleet backend takes no snapshots")

    async def delete_snapshot(self, ref: str) -> bool:
        return True

    async def capacity(self) -> Capacity:
        amounts = ResourceAmounts(cpu=1e6, memory_bytes=2**60)
        return Capacity(nodes=[NodeResources(name="fleet", capacity=amounts, allocatable=amounts)])

    def is_snapshot_image(self, image: str) -> bool:
        return False

    async def close(self) -> None:
        await asyncio.gather(*(fleet.close() for fleet in self.fleets))


async def _timed(call: Callable[[], Awaitable[object]]) -> float:
    started = time.perf_counter()
    await call()
    return time.perf_counter() - started


async def _samples(call: Callable[[], Awaitable[object]], n: int) -> Stats:
    return Stats.of([await _timed(call) for _ in range(n)])


def _ok(response: httpx.Response) -> Any:
    if response.is_error:
        raise OrchardError(
            f"{response.request.method} {response.request.url.path}: "
            f"{response.status_code} {response.text[:300]}"
        )
    return response.json()


def _rss() -> float:
    gc.collect()
    return rss_mb(os.getpid()) or 0.0


@contextlib.asynccontextmanager
async def _orchestrator(root: Path, most: int) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """The real app on a fleet backend, and an admin client for it."""
    from orchard_env.orchestrator.app import create_app
    from orchard_env.orchestrator.keys import create_key

    settings = default_service_settings(
        state_dir=root / "state",
        instance="bench-scale",
        max_sandboxes=most,
        reap_interval_seconds=86400,  # passes are run (and timed) by the benchmark
        ready_timeout_seconds=120,
    )
    backend = FleetBackend(root / "sandboxes")
    backend.root.mkdir(parents=True)
    app = create_app(settings, backend=backend)
    try:
        async with app.router.lifespan_context(app):
            orchard = app.state.orchard
            key = await create_key(orchard.store, "bench", admin=True)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport,
                base_url="http://orchard",
                headers={"X-API-Key": key.api_key},
                timeout=600,
            ) as http:
                yield http, orchard
    finally:
        await backend.close()


async def _grow(
    http: httpx.AsyncClient, sandboxes: list[str], jobs: list[str], target: int
) -> float:
    """Create sandboxes up to ``target``, each running ``true`` once; seconds it took."""
    todo = iter(range(target - len(sandboxes)))

    async def worker() -> None:
        for _ in todo:
            info = _ok(await http.post("/sandboxes", json={"image": "fleet", "memory": "64Mi"}))
            sandboxes.append(info["sandbox_id"])
            job = _ok(
                await http.post(
                    f"/sandboxes/{info['sandbox_id']}/exec", json={"command": "true", "wait": True}
                )
            )
            jobs.append(job["job_id"])

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return time.perf_counter() - started


async def _walk(http: httpx.AsyncClient) -> int:
    """Every page of the sandbox list, 100 at a time; how many sandboxes it held."""
    seen, token = 0, None
    while True:
        params: dict[str, Any] = {"limit": 100}
        if token:
            params["continue"] = token
        page = _ok(await http.get("/sandboxes", params=params))
        seen += len(page["sandboxes"])
        token = page.get("continue")
        if not token:
            return seen


async def _level(
    http: httpx.AsyncClient, orchard: Any, sandboxes: list[str], jobs: list[str]
) -> dict[str, Stats]:
    n = len(sandboxes)
    stats = {
        "list, first page of 100": await _samples(
            lambda: http.get("/sandboxes", params={"limit": 100}), SAMPLES
        ),
        "job lookup": await _samples(lambda: http.get(f"/jobs/{random.choice(jobs)}"), SAMPLES),
        "exec of true": await _samples(
            lambda: http.post(
                f"/sandboxes/{random.choice(sandboxes)}/exec",
                json={"command": "true", "wait": True},
            ),
            SAMPLES,
        ),
        "list, every page of 100": await _samples(lambda: _walk(http), 3),
        "list, all in one answer": await _samples(lambda: http.get("/sandboxes"), 3),
        "reaper pass": await _samples(orchard.reaper.run_pass, 3),
    }
    counted = await _walk(http)
    if counted < n:
        raise OrchardError(f"the paged list showed {counted} of {n} sandboxes")
    return {f"{key} @ {n}": value for key, value in stats.items()}


async def _bench(levels: Sequence[int], running_jobs: int, progress: Progress) -> BenchResult:
    result = BenchResult(
        "orchestrator scale",
        {"levels": ",".join(map(str, levels)), "running_jobs": running_jobs},
    )
    root = Path(tempfile.mkdtemp(prefix="orchard-scale-"))
    sandboxes: list[str] = []
    jobs: list[str] = []
    try:
        async with _orchestrator(root, levels[-1] + running_jobs) as (http, orchard):
            base = _rss()
            result.figures["orchestrator RSS with no sandboxes, MB"] = base
            previous = (0, base)
            for level in levels:
                progress(f"creating sandboxes up to {level}")
                took = await _grow(http, sandboxes, jobs, level)
                result.figures[f"creates (and a first exec) per second, to {level}"] = round(
                    (level - previous[0]) / took, 1
                )
                progress(f"measuring at {level} sandboxes")
                result.stats.update(await _level(http, orchard, sandboxes, jobs))
                rss = _rss()
                result.figures[f"orchestrator RSS at {level} sandboxes, MB"] = rss
                result.figures[f"RSS per live sandbox ({previous[0]} to {level}), KB"] = round(
                    (rss - previous[1]) * 1024 / (level - previous[0]), 1
                )
                previous = (level, rss)
            if running_jobs:
                progress(f"starting {running_jobs} commands that keep running")
                # Traced, not RSS: the heap freed by the measurements above (a 10,000-sandbox
                # answer) is reused first, so the RSS would not show what the jobs hold.
                gc.collect()
                tracemalloc.start()
                for sandbox_id in sandboxes[:running_jobs]:
                    _ok(
                        await http.post(
                            f"/sandboxes/{sandbox_id}/exec", json={"command": "sleep 3600"}
                        )
                    )
                gc.collect()
                held, _ = tracemalloc.get_traced_memory()
                tracemalloc.stop()
                result.figures[f"Python heap per running job ({running_jobs} running), KB"] = round(
                    held / 1024 / running_jobs, 1
                )
                result.stats[
                    f"reaper pass @ {len(sandboxes)}, {running_jobs} jobs running"
                ] = await _samples(orchard.reaper.run_pass, 3)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return result


def bench_scale(
    levels: Sequence[int] = (100, 1000, 10000),
    *,
    running_jobs: int = 1000,
    progress: Progress = lambda _: None,
) -> BenchResult:
    if list(levels) != sorted(set(levels)) or levels[0] < 1:
        raise OrchardError(
            f"levels {list(levels)}: give rising counts of sandboxes, e.g. 100,1000,10000"
        )
    if running_jobs > levels[-1]:
        raise OrchardError(
            f"--running-jobs {running_jobs} is more than the {levels[-1]} sandboxes",
            hint="one running command per sandbox: lower it or raise the last level",
        )
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a kept-alive link per sandbox
    if hard < levels[-1] + 1000:
        raise OrchardError(
            f"this process may open {hard} files; {levels[-1]} sandboxes need about "
            f"{levels[-1] + 1000}",
            hint="raise the hard limit (ulimit -Hn) or lower the last level",
        )
    return asyncio.run(_bench(levels, running_jobs, progress))
