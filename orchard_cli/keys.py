"""`orchard keys …`: API keys (admin only)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from orchard_cli.console import (
    ApiKeyOpt,
    ContextOpt,
    JsonOpt,
    OutputOpt,
    QuietOpt,
    UrlOpt,
    connect,
    err,
    out,
)
from orchard_cli.output import Column, emit_list, output_format, print_json, when

if TYPE_CHECKING:
    from orchard_env.protocol import KeyInfo

app = typer.Typer(
    help="Create, list and revoke API keys (needs an admin key).", no_args_is_help=True
)


@app.command()
def create(
    name: Annotated[str, typer.Argument(help="A name for the key, e.g. who uses it.")],
    admin: Annotated[
        bool, typer.Option("--admin", help="May manage keys and see every sandbox.")
    ] = False,
    local: Annotated[
        bool,
        typer.Option(
            "--local",
            help="Write the key straight into this machine's service database "
            "(bootstraps the first key of `orchard serve`; needs no key).",
        ),
    ] = False,
    state_dir: Annotated[
        str | None, typer.Option("--state-dir", help="With --local: the service's state directory.")
    ] = None,
    max_sandboxes: Annotated[
        int | None, typer.Option("--max-sandboxes", help="Live sandboxes it may have at once.")
    ] = None,
    max_cpu: Annotated[
        float | None, typer.Option("--max-cpu", help="CPU cores its live sandboxes may hold.")
    ] = None,
    max_memory: Annotated[
        str | None, typer.Option("--max-memory", help="Memory its live sandboxes may hold (8Gi).")
    ] = None,
    json_: JsonOpt = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """Create a key. Its secret is printed once, to stdout; store it now. Without --max-*, a
    non-admin key gets the service's per-key limits (key_max_* settings)."""
    if local:
        from orchard_env.config import service_settings
        from orchard_env.orchestrator.keys import create_key_sync

        created = create_key_sync(
            service_settings(state_dir=state_dir),
            name,
            admin=admin,
            max_sandboxes=max_sandboxes,
            max_cpu=max_cpu,
            max_memory=max_memory,
        )
    else:
        with connect(url, api_key, context) as client:
            created = client.create_key(
                name,
                admin=admin,
                max_sandboxes=max_sandboxes,
                max_cpu=max_cpu,
                max_memory=max_memory,
            )
    if json_:
        print_json(created)
    else:
        out.print(created.api_key)
        err.print(
            f"Created key {created.key_id} ({created.name}). The secret above is not shown again."
        )


def _quota(key: KeyInfo) -> str:
    limits = [
        f"{key.max_sandboxes} sandboxes" if key.max_sandboxes else "",
        f"{key.max_cpu:g} cpu" if key.max_cpu else "",
        f"{key.max_memory} memory" if key.max_memory else "",
    ]
    return ", ".join(limit for limit in limits if limit) or "service default"


KEY_COLUMNS: tuple[Column[KeyInfo], ...] = (
    Column("KEY ID", lambda key: key.key_id),
    Column("NAME", lambda key: key.name),
    Column("ADMIN", lambda key: "yes" if key.admin else ""),
    Column("QUOTA", lambda key: _quota(key)),
    Column("CREATED", lambda key: when(key.created_at)),
    Column("REVOKED", lambda key: when(key.revoked_at)),
)


@app.command("list")
def list_(
    output: OutputOpt = None,
    quiet: QuietOpt = False,
    json_: JsonOpt = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """List keys (never their secrets)."""
    fmt = output_format(output, json_=json_, quiet=quiet)
    with connect(url, api_key, context) as client:
        keys = client.list_keys()
    emit_list(keys, KEY_COLUMNS, fmt, kind="key", key=lambda key: key.key_id)


@app.command()
def revoke(
    key_id: Annotated[str, typer.Argument(help="The key id (from `orchard keys list`).")],
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """Revoke a key: requests with it are refused from now on."""
    with connect(url, api_key, context) as client:
        client.revoke_key(key_id)
    err.print(f"Revoked {key_id}.")
