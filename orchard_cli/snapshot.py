"""`orchard snapshot …`: take, list, show, delete and restore snapshots; draw their lineage."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Annotated

import typer
from rich.text import Text
from rich.tree import Tree

from orchard_cli.console import (
    ApiKeyOpt,
    ContextOpt,
    JsonOpt,
    OutputOpt,
    QuietOpt,
    UrlOpt,
    YesOpt,
    complete_sandbox_ids,
    complete_snapshot_ids,
    confirm,
    connect,
    err,
    out,
)
from orchard_cli.output import (
    Column,
    emit_list,
    emit_one,
    output_format,
    pairs,
    parse_pairs,
    print_json,
    when,
)
from orchard_cli.sandbox import EnvOpt, LabelOpt
from orchard_env.errors import SnapshotNotFound

if TYPE_CHECKING:
    from orchard_env.protocol import SandboxInfo, Snapshot

app = typer.Typer(
    help="Snapshots of sandboxes' filesystems: take, restore, list, delete, draw the tree.",
    no_args_is_help=True,
)

SnapshotArg = Annotated[
    str,
    typer.Argument(
        help="Snapshot id (snap-…).", show_default=False, autocompletion=complete_snapshot_ids
    ),
]


def _size(size: int) -> str:
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


@app.command()
def create(
    sandbox_id: Annotated[
        str,
        typer.Argument(
            help="The sandbox to snapshot.",
            show_default=False,
            autocompletion=complete_sandbox_ids,
        ),
    ],
    name: Annotated[str | None, typer.Option("--name", help="A name for people.")] = None,
    label: LabelOpt = None,
    ttl: Annotated[
        int | None, typer.Option("--ttl", help="Delete it after this many seconds.")
    ] = None,
    json_: JsonOpt = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """Snapshot a sandbox's filesystem (running processes are not part of it); print its id."""
    with connect(url, api_key, context) as client, err.status(f"snapshotting {sandbox_id}"):
        snap = client.get_sandbox(sandbox_id).snapshot(
            name=name, labels=parse_pairs(label, "label"), ttl_seconds=ttl
        )
    if json_:
        print_json(snap)
    else:
        out.print(snap.snapshot_id)


SNAPSHOT_COLUMNS: tuple[Column[Snapshot], ...] = (
    Column("ID", lambda snap: snap.snapshot_id),
    Column("NAME", lambda snap: snap.name or ""),
    Column("SOURCE", lambda snap: snap.source_sandbox),
    Column("PARENT", lambda snap: snap.parent_snapshot or ""),
    Column("SIZE", lambda snap: _size(snap.size_bytes)),
    Column("LABELS", lambda snap: pairs(snap.labels)),
    Column("CREATED", lambda snap: when(snap.created_at)),
    Column("EXPIRES", lambda snap: when(snap.expires_at), wide=True),
    Column("CPU", lambda snap: snap.cpu, wide=True),
    Column("MEMORY", lambda snap: snap.memory, wide=True),
    Column("OWNER", lambda snap: snap.owner or "", wide=True),
    Column("IMAGE", lambda snap: snap.image, wide=True),
)
DELETED: Column[Snapshot] = Column("DELETED", lambda snap: when(snap.deleted_at))


@app.command("list")
def list_(
    label: LabelOpt = None,
    all_: Annotated[
        bool, typer.Option("--all", help="Include deleted snapshots still remembered.")
    ] = False,
    output: OutputOpt = None,
    quiet: QuietOpt = False,
    json_: JsonOpt = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """List snapshots, oldest first, filtered by label."""
    fmt = output_format(output, json_=json_, quiet=quiet)
    with connect(url, api_key, context) as client:
        snapshots = client.list_snapshots(parse_pairs(label, "label") or None, include_deleted=all_)
    columns = (*SNAPSHOT_COLUMNS, DELETED) if all_ else SNAPSHOT_COLUMNS
    emit_list(snapshots, columns, fmt, kind="snapshot", key=lambda snap: snap.snapshot_id)


@app.command()
def get(
    snapshot_id: SnapshotArg,
    output: OutputOpt = None,
    json_: JsonOpt = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """Show one snapshot."""
    fmt = output_format(output, json_=json_)
    with connect(url, api_key, context) as client:
        snap = client.get_snapshot(snapshot_id)
    emit_one(snap, fmt, kind="snapshot", key=snap.snapshot_id)


@app.command()
def rm(
    snapshot_ids: Annotated[
        list[str],
        typer.Argument(
            help="Snapshot ids.", show_default=False, autocompletion=complete_snapshot_ids
        ),
    ],
    recursive: Annotated[
        bool, typer.Option("--recursive", "-r", help="Delete their descendants too.")
    ] = False,
    yes: YesOpt = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """Delete snapshots (--recursive: with everything under them).

    Sandboxes restored from them keep running; their images go once no sandbox uses them.
    A snapshot with child snapshots is refused without --recursive.
    """
    with connect(url, api_key, context) as client:
        if recursive:
            confirm(
                f"Delete {', '.join(snapshot_ids)} and every snapshot under them at "
                f"{client.base_url}?",
                yes=yes,
            )
        for snapshot_id in snapshot_ids:
            for deleted in client.delete_snapshot(snapshot_id, recursive=recursive):
                err.print(f"deleted {deleted}")


@app.command()
def restore(
    snapshot_id: SnapshotArg,
    sandbox_id: Annotated[
        str | None, typer.Option("--id", help="Id of the new sandbox (DNS label).")
    ] = None,
    label: LabelOpt = None,
    env: EnvOpt = None,
    ttl: Annotated[int | None, typer.Option("--ttl", help="Lifetime cap in seconds.")] = None,
    idle_timeout: Annotated[
        int | None, typer.Option("--idle-timeout", help="Idle expiry in seconds.")
    ] = None,
    json_: JsonOpt = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """Create a sandbox from a snapshot, wait until it is ready and print its id.

    It gets the snapshot's files and the source sandbox's resources, env and labels (--env
    and --label are added over them); processes are not carried over.
    """
    with connect(url, api_key, context) as client, err.status(f"restoring {snapshot_id}"):
        sandbox = client.restore(
            snapshot_id,
            sandbox_id,
            labels=parse_pairs(label, "label"),
            env=parse_pairs(env, "env"),
            ttl_seconds=ttl,
            idle_timeout_seconds=idle_timeout,
        )
    if json_:
        print_json(sandbox.info)
    else:
        out.print(sandbox.sandbox_id)


def lineage_tree(
    snapshots: Iterable[Snapshot], sandboxes: Iterable[SandboxInfo], root: str | None = None
) -> Tree:
    """Snapshots under their parents, and the live sandboxes restored from each under it.
    ``root``: only that snapshot's subtree; otherwise every snapshot whose parent is unknown
    starts a tree of its own."""
    known = {snap.snapshot_id: snap for snap in snapshots}
    children: dict[str | None, list[Snapshot]] = {}
    for snap in known.values():
        parent = snap.parent_snapshot if snap.parent_snapshot in known else None
        children.setdefault(parent, []).append(snap)
    restored: dict[str, list[SandboxInfo]] = {}
    for sandbox in sandboxes:
        if sandbox.source_snapshot is not None:
            restored.setdefault(sandbox.source_snapshot, []).append(sandbox)

    def label(snap: Snapshot) -> Text:
        text = Text(snap.snapshot_id, style="dim" if snap.deleted_at else "bold")
        if snap.name:
            text.append(f" {snap.name}")
        details = [f"from {snap.source_sandbox}", _size(snap.size_bytes)]
        if snap.deleted_at:
            details.append("deleted")
        text.append(f"  ({', '.join(details)})", style="dim")
        return text

    def grow(node: Tree, snap: Snapshot) -> None:
        for sandbox in restored.get(snap.snapshot_id, []):
            node.add(Text(f"sandbox {sandbox.sandbox_id} ({sandbox.status.value})", style="cyan"))
        for child in children.get(snap.snapshot_id, []):
            grow(node.add(label(child)), child)

    if root is not None:
        if root not in known:
            raise SnapshotNotFound(
                f"snapshot {root} does not exist", hint="`orchard snapshot list` shows them"
            )
        tree = Tree(label(known[root]))
        grow(tree, known[root])
        return tree
    tree = Tree(Text("snapshots", style="bold"), hide_root=True)
    for top in children.get(None, []):
        grow(tree.add(label(top)), top)
    return tree


@app.command()
def tree(
    snapshot_id: Annotated[
        str | None, typer.Argument(help="Draw only this snapshot's subtree.", show_default=False)
    ] = None,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """Draw the lineage of snapshots and the sandboxes restored from them.

    Each snapshot hangs under the one its source sandbox was restored from, with the live
    sandboxes restored from it; deleted snapshots still remembered are dim.
    """
    with connect(url, api_key, context) as client:
        snapshots = client.list_snapshots(include_deleted=True)
        sandboxes = client.list_sandboxes()
    if not snapshots:
        err.print("No snapshots.")
        return
    out.print(lineage_tree(snapshots, sandboxes, snapshot_id))
