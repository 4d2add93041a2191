"""`orchard pool …`: warm pools of ready sandboxes (needs an admin key)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from orchard_cli.console import (
    ApiKeyOpt,
    ContextOpt,
    JsonOpt,
    UrlOpt,
    connect,
    err,
    out,
    print_json,
)
from orchard_cli.sandbox import EnvOpt, _pairs
from orchard_env.protocol import PoolInfo
from orchard_env.smoke import DEFAULT_IMAGE

app = typer.Typer(
    help="Warm pools: sandboxes kept ready per spec, taken by matching creates (admin key).",
    no_args_is_help=True,
)

NameArg = Annotated[str, typer.Argument(help="Pool name (DNS label).", show_default=False)]
SizeArg = Annotated[int, typer.Argument(help="Ready sandboxes to keep.", show_default=False)]


def _table(pools: list[PoolInfo]) -> Table:
    table = Table("NAME", "SIZE", "READY", "STARTING", "IMAGE", "CPU", "MEMORY", "NETWORK", "ERROR")
    for pool in pools:
        table.add_row(
            pool.name,
            str(pool.size),
            str(pool.ready),
            str(pool.starting),
            pool.image,
            pool.cpu,
            pool.memory,
            "blocked" if pool.block_network else "open",
            pool.error or "",
        )
    return table


@app.command()
def create(
    name: NameArg,
    size: SizeArg,
    image: Annotated[str, typer.Option("--image", "-i", help="Container image.")] = DEFAULT_IMAGE,
    cpu: Annotated[str | None, typer.Option("--cpu", help="CPU cores, e.g. 2 or 500m.")] = None,
    memory: Annotated[str | None, typer.Option("--memory", help="Memory, e.g. 2Gi.")] = None,
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
            env=_pairs(env, "env"),
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
    json_: JsonOpt = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """List pools: their size, how many are ready, and why a refill failed."""
    with connect(url, api_key, context) as client:
        pools = client.list_pools()
    if json_:
        print_json(pools)
    else:
        out.print(_table(pools))


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
