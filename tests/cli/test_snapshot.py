"""`orchard snapshot …` and `orchard sandbox fork` against a real orchestrator (the
service-tier fake backend), and the lineage tree on its own."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from datetime import UTC, datetime

import pytest
from rich.console import Console
from typer.testing import Result

from orchard_cli.snapshot import lineage_tree
from orchard_env import errors
from orchard_env.orchestrator import snapshots
from orchard_env.protocol import SandboxInfo, SandboxStatus, Snapshot
from tests.cli.conftest import ok
from tests.orchestrator.fakes import AgentProcessBackend


def test_snapshot_commands_end_to_end(orchard: Callable[..., Result]) -> None:
    source = ok(orchard("sandbox", "create", "--label", "run=r1")).strip()
    ok(orchard("sandbox", "exec", source, "--", "echo kept > state.txt"))
    snap_id = ok(orchard("snapshot", "create", source, "--name", "turn-1", "-l", "t=1")).strip()
    assert snap_id.startswith("snap-")

    shown = json.loads(ok(orchard("snapshot", "get", snap_id, "--json")))
    assert shown["name"] == "turn-1" and shown["source_sandbox"] == source
    listed = json.loads(ok(orchard("snapshot", "list", "--label", "t=1", "--json")))
    assert [s["snapshot_id"] for s in listed] == [snap_id]
    assert snap_id in ok(orchard("snapshot", "list"))

    restored = ok(orchard("snapshot", "restore", snap_id, "--id", "branch-a", "-l", "b=a")).strip()
    assert restored == "branch-a"
    assert ok(orchard("sandbox", "exec", restored, "--", "cat state.txt")) == "kept\n"
    info = json.loads(ok(orchard("sandbox", "get", restored, "--json")))
    assert info["labels"] == {"run": "r1", "b": "a"} and info["source_snapshot"] == snap_id

    forks = ok(orchard("sandbox", "fork", restored, "--count", "2")).split()
    assert len(forks) == 2 and all(f.startswith("sb-") for f in forks)
    fork_snapshot = json.loads(ok(orchard("sandbox", "get", forks[0], "--json")))["source_snapshot"]

    drawn = ok(orchard("snapshot", "tree"))
    lines = drawn.splitlines()
    top = next(i for i, line in enumerate(lines) if snap_id in line)
    assert "turn-1" in lines[top] and f"from {source}" in lines[top]
    below = "\n".join(lines[top + 1 :])
    assert f"sandbox {restored} (ready)" in below and fork_snapshot in below
    assert all(f"sandbox {f} (ready)" in below for f in forks)
    assert fork_snapshot in ok(orchard("snapshot", "tree", fork_snapshot)).splitlines()[0]

    refused = orchard("snapshot", "rm", snap_id)
    assert refused.exit_code == 1 and isinstance(refused.exception, errors.Conflict)
    assert fork_snapshot in refused.exception.message
    no_tty = orchard("snapshot", "rm", "--recursive", snap_id)
    assert no_tty.exit_code == 125 and "Rerun with --yes" in no_tty.output
    deleted = orchard("snapshot", "rm", "--recursive", "--yes", snap_id)
    assert deleted.exit_code == 0
    assert deleted.stderr.splitlines() == [f"deleted {fork_snapshot}", f"deleted {snap_id}"]
    assert json.loads(ok(orchard("snapshot", "list", "--json"))) == []
    assert "deleted" in ok(orchard("snapshot", "tree"))  # still remembered, drawn dim
    assert snap_id in ok(orchard("snapshot", "list", "--all"))


def test_fork_with_failures_exits_1_and_keeps_nothing_unless_asked(
    orchard: Callable[..., Result],
    backend: AgentProcessBackend,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source = ok(orchard("sandbox", "create")).strip()
    missing = orchard("sandbox", "fork", "nope", "--count", "2")
    assert isinstance(missing.exception, errors.SandboxNotFound)
    too_many = orchard("sandbox", "fork", source, "--count", "65")
    assert too_many.exit_code == 2 and "less than or equal to 64" in too_many.output

    names = iter(f"fork-{n}" for n in range(100))
    monkeypatch.setattr(snapshots, "new_sandbox_id", lambda: next(names))
    backend.fail_creates.update({"fork-1": "disk full", "fork-4": "disk full"})
    failed = orchard("sandbox", "fork", source, "--count", "3")
    assert failed.exit_code == 1 and isinstance(failed.exception, errors.OrchardError)
    assert "1 of 3 forks of sandbox" in failed.exception.message
    assert set(backend.sandboxes) == {source}  # the two that started were deleted
    partial = orchard("sandbox", "fork", source, "--count", "3", "--allow-partial")
    assert partial.exit_code == 1
    assert partial.stdout.split() == ["fork-3", "fork-5"]
    assert "1 of 3 forks failed" in partial.stderr
    forks = ok(orchard("sandbox", "fork", source, "--count", "2", "--json"))
    assert [f["sandbox_id"] for f in json.loads(forks)] == ["fork-6", "fork-7"]


def _snap(snapshot_id: str, parent: str | None, *, deleted: bool = False) -> Snapshot:
    when = datetime(2026, 1, 1, tzinfo=UTC)
    return Snapshot(
        snapshot_id=snapshot_id,
        source_sandbox="sb-src",
        parent_snapshot=parent,
        image=f"img:{snapshot_id}",
        size_bytes=1_500_000,
        cpu="1",
        memory="2Gi",
        block_network=True,
        workdir="/workspace",
        created_at=when,
        deleted_at=when if deleted else None,
    )


def _sandbox(sandbox_id: str, source: str) -> SandboxInfo:
    return SandboxInfo(
        sandbox_id=sandbox_id,
        namespace="test",
        image="img",
        pod_name=sandbox_id,
        block_network=True,
        cpu="1",
        memory="2Gi",
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
        ready=True,
        status=SandboxStatus.READY,
        timeout=120,
        source_snapshot=source,
    )


def _render(tree: object) -> str:
    console = Console(file=io.StringIO(), width=100, color_system=None)
    console.print(tree)
    assert isinstance(console.file, io.StringIO)
    return console.file.getvalue()


def test_lineage_tree_nests_children_and_sandboxes() -> None:
    snapshots = [
        _snap("snap-a", None, deleted=True),
        _snap("snap-b", "snap-a"),
        _snap("snap-c", "snap-b"),
        _snap("snap-d", "snap-gone"),  # its parent was forgotten: a root of its own
    ]
    sandboxes = [_sandbox("sb-1", "snap-b"), _sandbox("sb-2", "snap-c")]
    assert _render(lineage_tree(snapshots, sandboxes)) == (
        "snap-a  (from sb-src, 1.5 MB, deleted)\n"
        "└── snap-b  (from sb-src, 1.5 MB)\n"
        "    ├── sandbox sb-1 (ready)\n"
        "    └── snap-c  (from sb-src, 1.5 MB)\n"
        "        └── sandbox sb-2 (ready)\n"
        "snap-d  (from sb-src, 1.5 MB)\n"
    )
    assert _render(lineage_tree(snapshots, sandboxes, "snap-c")) == (
        "snap-c  (from sb-src, 1.5 MB)\n└── sandbox sb-2 (ready)\n"
    )
    with pytest.raises(errors.SnapshotNotFound, match="snapshot snap-x does not exist"):
        lineage_tree(snapshots, sandboxes, "snap-x")
