"""`orchard pool …`: warm pools of ready sandboxes (needs an admin key)."""

from __future__ import annotations

from typing import Annotated

import typer

from orchard_cli.console import (
    ApiKeyOpt,
    ContextOpt,
    CpuOpt,
    JsonOpt,
    MemoryOpt,
    OutputOpt,
    QuietOpt,
    UrlOpt,
    connect,
    err,
    out,
)
from orchard_cli.output import Column, emit_list, output_format, pairs, parse_pairs, print_json
from orchard_cli.sandbox import EnvOpt
from orchard_env.protocol import PoolInfo
from orchard_env.smoke import DEFAULT_IMAGE

app = typer.Typer(
    help="Warm pools: sandboxes kept ready per spec, taken by matching creates (admin key).",
    no_args_is_help=True,
)

NameArg = Annotated[str, typer.Argument(help="Pool name (DNS label).", show_default=False)]
SizeArg = Annotated[int, typer.Argument(help="Ready sandboxes to keep.", show_default=False)]


POOL_COLUMNS: tuple[Column[PoolInfo], ...] = (
    Column("NAME", lambda p: p.name),
    Column("SIZE", lambda p: str(p.size)),
    Column("READY", lambda p: str(p.ready)),
    Column("STARTING", lambda p: str(p.starting)),
    Column("IMAGE", lambda p: p.image),
    Column("CPU", lambda p: p.cpu),
    Column("MEMORY", lambda p: p.memory),
    Column("NETWORK", lambda p: "blocked" if p.block_network else "open"),
    Column("TTL", lambda p: f"{p.ttl_seconds}s", wide=True),
    Column("WORKDIR", lambda p: p.workdir, wide=True),
    Column("ENV", lambda p: pairs(p.env), wide=True),
    Column("ERROR", lambda p: p.error or ""),
)


@app.command()
def create(
    name: NameArg,
    size: SizeArg,
    image: Annotated[str, typer.Option("--image", "-i", help="Container image.")] = DEFAULT_IMAGE,
    cpu: CpuOpt = None,
    memory: MemoryOpt = None,
    network: Annotated[
        bool, typer.Option("--network/--no-network", help="Allow outbound network.")
    ] = False,
    env: EnvOpt = None,
    workdir: Annotated[str | None, typer.Option("--workdir", help="Working directory.")] = None,
    ttl: Annotated[
        int | None,
        typer.Option("--ttl", help="Seconds a sandbox waits unclaimed before it is replaced."),
    ] = None,
    json_: JsonOpt = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """Keep SIZE sandboxes of this spec ready; `orchard sandbox create` with the same image,
    cpu, memory, network, env and workdir (and no --id) takes one."""
    with connect(url, api_key, context) as client:
        pool = client.create_pool(
            name,
            image,
            size,
            block_network=not network,
            cpu=cpu,
            memory=memory,
            env=parse_pairs(env, "env"),
            workdir=workdir,
            ttl_seconds=ttl,
        )
    if json_:
        print_json(pool)
    else:
        out.print(pool.name)
        err.print(f"Pool {pool.name} fills to {pool.size} in the background.")


@app.command("list")
def list_(
    output: OutputOpt = None,
    quiet: QuietOpt = False,
    json_: JsonOpt = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """List pools: their size, how many are ready, and why a refill failed."""
    fmt = output_format(output, json_=json_, quiet=quiet)
    with connect(url, api_key, context) as client:
        pools = client.list_pools()
    emit_list(pools, POOL_COLUMNS, fmt, kind="pool", key=lambda pool: pool.name)


@app.command()
def resize(
    name: NameArg,
    size: SizeArg,
    json_: JsonOpt = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """Grow or shrink a pool (shrinking removes waiting sandboxes, never claimed ones)."""
    with connect(url, api_key, context) as client:
        pool = client.resize_pool(name, size)
    if json_:
        print_json(pool)
    else:
        err.print(f"Pool {pool.name}: size {pool.size} ({pool.ready} ready now).")


@app.command("rm")
def rm(
    name: NameArg,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """Remove a pool and the sandboxes waiting in it (claimed ones stay their owners')."""
    with connect(url, api_key, context) as client:
        client.delete_pool(name)
    err.print(f"Removed pool {name}.")
