"""`orchard bench …`: measured performance, printed as Markdown for docs/performance.md."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Annotated

import typer

from orchard_cli.console import (
    ApiKeyOpt,
    ContextOpt,
    CpuOpt,
    JsonOpt,
    MemoryOpt,
    UrlOpt,
    connect,
    err,
    out,
)
from orchard_cli.output import print_json
from orchard_env.bench import (
    BenchResult,
    bench_create,
    bench_exec,
    bench_fork,
    bench_launch,
)
from orchard_env.contexts import client_settings
from orchard_env.sdk import AsyncSandboxClient
from orchard_env.smoke import DEFAULT_IMAGE

app = typer.Typer(
    help="Benchmarks through the public API (results: docs/performance.md).", no_args_is_help=True
)

ImageOpt = Annotated[str, typer.Option("--image", help="Image to benchmark with.")]


def _async_clients(
    url: str | None, api_key: str | None, context: str | None
) -> Callable[[], AsyncSandboxClient]:
    """Makes async clients for the resolved service (resolved once, here, so a bad context
    fails before any benchmark starts)."""
    settings = client_settings(url, api_key, context)
    return partial(AsyncSandboxClient, base_url=settings.url, api_key=settings.api_key, timeout=600)


def _emit(result: BenchResult, json_: bool) -> None:
    if json_:
        print_json(result.to_json())
    else:
        out.print(result.markdown(), markup=False)


@app.command()
def harness(
    n: Annotated[int, typer.Option("--n", help="Calls each way (batches of 20).", min=20)] = 400,
    json_: JsonOpt = False,
) -> None:
    """The model gateway's added latency per call (agent relay + gateway, recording) over a
    direct call to the local fake model, in the same run. Needs no service."""
    from orchard_env.bench_harness import bench_harness

    with err.status("harness benchmark"):
        result = bench_harness(n)
    _emit(result, json_)


@app.command("exec")
def exec_(
    n: Annotated[int, typer.Option("--n", help="Number of timed execs.")] = 200,
    image: ImageOpt = DEFAULT_IMAGE,
    engine: Annotated[
        bool,
        typer.Option(
            "--engine/--no-engine",
            help="Also time the engine's own exec_run (a service on this host's engine).",
        ),
    ] = True,
    docker_host: Annotated[str | None, typer.Option("--docker-host", help="Engine socket.")] = None,
    json_: JsonOpt = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """Exec round trip of `true`; for a service on this host's engine also the engine's
    exec_run beside it, the agent's memory and the orchestrator's CPU per exec (elsewhere
    they are reported as not measured, with the reason)."""
    from orchard_env.errors import EngineNotFound
    from orchard_env.orchestrator.backends.docker_engine import find_engine

    try:
        engine_url: str | None = find_engine(docker_host)
    except EngineNotFound:
        if docker_host:  # asked for by name
            raise
        engine_url = None  # the sandbox is then not in this host's engine: said so
    with connect(url, api_key, context) as client, err.status("exec benchmark") as status:
        result = bench_exec(
            client,
            image=image,
            n=n,
            engine_url=engine_url,
            engine_baseline=engine,
            progress=status.update,
        )
    _emit(result, json_)


@app.command()
def create(
    n: Annotated[int, typer.Option("--n", help="Number of sandboxes, one after another.")] = 10,
    image: ImageOpt = DEFAULT_IMAGE,
    pool: Annotated[
        bool,
        typer.Option(
            "--pool", help="Also from a warm pool made for the run, beside cold (admin key)."
        ),
    ] = False,
    tools: Annotated[
        bool,
        typer.Option(
            "--tools",
            help="Alternate creates with every harness mounted and with none (tools: false).",
        ),
    ] = False,
    cpu: CpuOpt = None,
    memory: MemoryOpt = None,
    json_: JsonOpt = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """Create to first successful exec, image present (with --pool: cold and pooled; with
    --tools: with and without the harness payload). Sandboxes of the service's default size
    unless --cpu/--memory say."""
    with connect(url, api_key, context) as client, err.status("create benchmark") as status:
        result = bench_create(
            client,
            image=image,
            n=n,
            pool=pool,
            tools=tools,
            cpu=cpu,
            memory=memory,
            progress=status.update,
        )
    _emit(result, json_)


@app.command()
def launch(
    n: Annotated[int, typer.Option("--n", help="Sandboxes created concurrently.")] = 100,
    image: ImageOpt = DEFAULT_IMAGE,
    pool: Annotated[
        bool, typer.Option("--pool", help="From a warm pool of n, filled first (admin key).")
    ] = False,
    engine: Annotated[
        bool,
        typer.Option(
            "--engine/--no-engine",
            help="Also time the engine alone creating n plain containers (local only).",
        ),
    ] = False,
    docker_host: Annotated[str | None, typer.Option("--docker-host", help="Engine socket.")] = None,
    cpu: CpuOpt = None,
    memory: MemoryOpt = None,
    json_: JsonOpt = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """n sandboxes at once, 4 commands each: total time, creates/s, commands/s, success rate,
    and (a service on this host's engine) the orchestrator's, the engine's and the host's
    memory. Sandboxes of the service's default size unless --cpu/--memory say (on a
    cluster n of them must fit its nodes)."""
    make_client = _async_clients(url, api_key, context)
    engine_url = None
    if engine:
        from orchard_env.orchestrator.backends.docker_engine import find_engine

        engine_url = find_engine(docker_host)
    with err.status("launch benchmark") as status:
        result = bench_launch(
            make_client,
            image=image,
            n=n,
            pool=pool,
            engine_url=engine_url,
            cpu=cpu,
            memory=memory,
            progress=status.update,
        )
    _emit(result, json_)


@app.command()
def throughput(
    sandboxes: Annotated[
        int, typer.Option("--sandboxes", help="Ready sandboxes, each one exec in flight.", min=1)
    ] = 100,
    seconds: Annotated[
        float, typer.Option("--seconds", help="Length of the measured window.", min=1)
    ] = 20.0,
    image: ImageOpt = DEFAULT_IMAGE,
    json_: JsonOpt = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """Execs per second sustained across many ready sandboxes (each runs `true` back to back),
    their latency under that load, and (a local service) the orchestrator's CPU per exec."""
    from orchard_env.bench_throughput import bench_throughput

    make_client = _async_clients(url, api_key, context)
    with err.status("throughput benchmark") as status:
        result = bench_throughput(
            make_client, image=image, sandboxes=sandboxes, seconds=seconds, progress=status.update
        )
    _emit(result, json_)


@app.command()
def fork(
    k: Annotated[int, typer.Option("--k", help="Sandboxes per fork (and fresh batch).")] = 8,
    snapshots: Annotated[int, typer.Option("--snapshots", help="Timed snapshots.")] = 5,
    rounds: Annotated[int, typer.Option("--rounds", help="Forks (and fresh batches) timed.")] = 3,
    workspace_mb: Annotated[
        int, typer.Option("--workspace-mb", help="Random data written to /workspace first.")
    ] = 100,
    image: ImageOpt = DEFAULT_IMAGE,
    json_: JsonOpt = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """Snapshot latency and fork k until all are exec-able, beside k fresh creates."""
    make_client = _async_clients(url, api_key, context)
    with err.status("fork benchmark") as status:
        result = bench_fork(
            make_client,
            image=image,
            k=k,
            snapshots=snapshots,
            rounds=rounds,
            workspace_mb=workspace_mb,
            progress=status.update,
        )
    _emit(result, json_)


@app.command()
def scale(
    levels: Annotated[
        str, typer.Option("--levels", help="Rising counts of sandboxes to measure at.")
    ] = "100,1000,10000",
    running_jobs: Annotated[
        int, typer.Option("--running-jobs", help="Commands left running at the end.", min=0)
    ] = 1000,
    json_: JsonOpt = False,
) -> None:
    """The orchestrator's cost as its sandboxes and jobs grow: lists (paged and whole), job
    lookup, exec, the reaper's pass and memory per sandbox and per running job, on an
    orchestrator of its own in this process whose sandboxes are real agents without
    containers (no service or engine is used)."""
    from orchard_env.bench_scale import bench_scale

    try:
        counts = [int(part) for part in levels.split(",")]
    except ValueError:
        raise typer.BadParameter(f"{levels!r}: give counts like 100,1000,10000") from None
    with err.status("scale benchmark") as status:
        result = bench_scale(counts, running_jobs=running_jobs, progress=status.update)
    _emit(result, json_)


@app.command()
def cli(
    n: Annotated[int, typer.Option("--n", help="Runs of each command.", min=1)] = 20,
    json_: JsonOpt = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """Start-up of `orchard --version`, `orchard sandbox list` (its quick path, and `--json`,
    which the full command serves) and a TAB completion of a sandbox id, each as a p50 ratio
    to a bare `python -c pass` timed in the same run."""
    from orchard_env.bench_startup import bench_startup

    settings = client_settings(url, api_key, context)
    script = Path(sys.executable).with_name("orchard")
    orchard = [str(script)] if script.is_file() else [sys.executable, "-m", "orchard_cli.main"]
    env = {**os.environ, "ORCHARD_URL": settings.url}
    if settings.api_key:
        env["ORCHARD_API_KEY"] = settings.api_key
    completion = {"_ORCHARD_COMPLETE": "complete_bash", "COMP_WORDS": "orchard sandbox get "}
    commands = {
        "orchard --version": [*orchard, "--version"],
        "orchard sandbox list": [*orchard, "sandbox", "list"],
        "orchard sandbox list --json (the full command)": [*orchard, "sandbox", "list", "--json"],
        "orchard sandbox get <TAB>": [
            "env",
            *(f"{k}={v}" for k, v in {**completion, "COMP_CWORD": "3"}.items()),
            *orchard,
        ],
    }
    with err.status("CLI start-up benchmark") as status:
        result = bench_startup(commands, n=n, env=env, progress=status.update)
    _emit(result, json_)
