"""Snapshots, restore and fork through the SDK.

Against the real orchestrator (the service-tier fake backend: a snapshot is a copy of the
sandbox's workspace) for behaviour, and against the SDK's fake service for what only a fake
can stage: a fork with failures, and answers lost on the way back.
"""

from __future__ import annotations

import json

import httpx
import pytest

from orchard_env import errors
from orchard_env.sdk import AsyncSandboxClient, SandboxClient, _cleanup
from tests.orchestrator.fakes import AgentProcessBackend
from tests.sdk.fakes import FakeService
from tests.sdk.test_retries import fail_first
from tests.servers import Live


def test_snapshot_restore_and_fork_with_the_sync_client(
    live: Live, backend: AgentProcessBackend
) -> None:
    url, key = live
    with SandboxClient(base_url=url, api_key=key) as client:
        sandbox = client.create_sandbox("debian:12", labels={"run": "r1"}, env={"MODE": "eval"})
        sandbox.exec("echo turn-3 > state.txt", check=True)
        snap = sandbox.snapshot(name="turn-3", labels={"turn": "3"})
        assert snap.source_sandbox == sandbox.sandbox_id and snap.name == "turn-3"
        assert snap.sandbox_labels == {"run": "r1"} and snap.env == {"MODE": "eval"}
        sandbox.exec("echo turn-4 > state.txt", check=True)

        restored = client.restore(snap.snapshot_id, labels={"branch": "b"})
        assert restored.status.value == "ready"
        assert restored.info.source_snapshot == snap.snapshot_id
        assert restored.info.labels == {"run": "r1", "branch": "b"}
        assert restored.exec("cat state.txt; echo $MODE").stdout == "turn-3\neval\n"

        forks = restored.fork(3, labels={"k": "3"})
        assert len(forks) == 3
        for index, fork in enumerate(forks):
            assert fork.info.labels == {"run": "r1", "branch": "b", "k": "3"}
            fork.exec(f"echo fork-{index} > state.txt", check=True)
        assert [f.exec("cat state.txt").stdout for f in forks] == [f"fork-{i}\n" for i in range(3)]
        parent = forks[0].info.source_snapshot
        assert parent is not None and client.get_snapshot(parent).parent_snapshot == (
            snap.snapshot_id
        )

        [listed] = client.list_snapshots(labels={"turn": "3"})
        assert listed.snapshot_id == snap.snapshot_id
        with pytest.raises(errors.Conflict, match=f"has 1 child snapshot\\(s\\): {parent}"):
            client.delete_snapshot(snap.snapshot_id)
        created = {sandbox.sandbox_id, restored.sandbox_id, *(f.sandbox_id for f in forks)}
        assert set(client._core.created()) == created  # restores and forks are tracked
    # Leaving ``with`` deleted every sandbox, restored and forked ones included.
    assert not backend.sandboxes
    with SandboxClient(base_url=url, api_key=key) as client:
        assert client.delete_snapshot(snap.snapshot_id, recursive=True) == [
            parent,
            snap.snapshot_id,
        ]
        assert client.list_snapshots() == []
        assert len(client.list_snapshots(include_deleted=True)) == 2
        with pytest.raises(errors.SnapshotNotFound, match="was deleted"):
            client.restore(snap.snapshot_id)
    assert backend.snapshots == {}


async def test_snapshot_restore_and_fork_with_the_async_client(
    asgi_app: tuple[httpx.ASGITransport, str],
) -> None:
    transport, key = asgi_app
    async with AsyncSandboxClient(
        base_url="http://orchard", api_key=key, transport=transport
    ) as client:
        sandbox = await client.create_sandbox("debian:12")
        await sandbox.exec("echo async > state.txt", check=True)
        snap = await sandbox.snapshot(ttl_seconds=3600)
        assert snap.expires_at is not None
        restored = await client.restore(snap.snapshot_id, sandbox_id="restored-1")
        assert restored.sandbox_id == "restored-1"
        assert (await restored.exec("cat state.txt")).stdout == "async\n"
        forks = await sandbox.fork(2)
        assert len({f.sandbox_id for f in forks}) == 2
        assert (await client.get_snapshot(snap.snapshot_id)).snapshot_id == snap.snapshot_id
        listed = [s.snapshot_id for s in await client.list_snapshots()]
        assert listed == [snap.snapshot_id, forks[0].info.source_snapshot]
        assert await client.delete_snapshot(snap.snapshot_id) == [snap.snapshot_id]
        assert len(client._core.created()) == 4


# --- against the SDK's fake service -------------------------------------------------------


def _fork_answer(service: FakeService, ok: int, failed: list[str]) -> httpx.Response:
    """A fork answer: ``ok`` sandboxes made in the fake service, ``failed`` ids not."""
    made = []
    for _ in range(ok):
        created = service._create({"image": "fake/snapshots:snap-0123456789ab"}).json()
        made.append({**created, "ready": True, "status": "ready"})
    snapshot = {
        "snapshot_id": "snap-0123456789ab",
        "source_sandbox": "parent",
        "image": "fake/snapshots:snap-0123456789ab",
        "size_bytes": 0,
        "cpu": "1",
        "memory": "2Gi",
        "block_network": True,
        "workdir": "/workspace",
        "created_at": "2026-01-01T00:00:00Z",
    }
    failures = [
        {"sandbox_id": sid, "code": "image_not_found", "message": f"{sid}: image gone"}
        for sid in failed
    ]
    return httpx.Response(201, json={"snapshot": snapshot, "sandboxes": made, "failures": failures})


def _intercept_fork(service: FakeService, ok: int, failed: list[str]) -> list[httpx.Request]:
    seen: list[httpx.Request] = []

    def intercept(request: httpx.Request) -> httpx.Response | None:
        if request.method == "POST" and request.url.path.endswith("/fork"):
            seen.append(request)
            return _fork_answer(service, ok, failed)
        return None

    service.interceptors.append(intercept)
    return seen


def test_a_fork_with_failures_deletes_the_started_ones_and_names_every_failure(
    client: SandboxClient, service: FakeService
) -> None:
    parent = client.create_sandbox("debian:12")
    _intercept_fork(service, ok=2, failed=["sb-x", "sb-y"])
    with pytest.raises(errors.ImageNotFound) as raised:
        parent.fork(4)
    assert raised.value.message == (
        "2 of 4 forks of sandbox sb-00000000 failed (sb-x: sb-x: image gone; sb-y: sb-y: image "
        "gone); the 2 that started were deleted (snapshot snap-0123456789ab is kept)"
    )
    assert raised.value.hint == "fork(..., allow_partial=True) keeps the forks that started"
    assert sorted(service.deleted) == ["sb-00000001", "sb-00000002"]
    assert client._core.created() == [parent.sandbox_id]


def test_allow_partial_returns_the_forks_that_started(
    client: SandboxClient, service: FakeService, caplog: pytest.LogCaptureFixture
) -> None:
    parent = client.create_sandbox("debian:12")
    _intercept_fork(service, ok=1, failed=["sb-x"])
    [fork] = parent.fork(2, allow_partial=True)
    assert fork.sandbox_id == "sb-00000001" and not service.deleted
    assert "1 of 2 forks of sandbox sb-00000000 failed: sb-x: sb-x: image gone" in caplog.text
    assert fork.sandbox_id in client._core.created()


def test_with_a_prefix_the_client_names_the_forks(
    make_client: object, service: FakeService
) -> None:
    client: SandboxClient = make_client(prefix="rl")  # type: ignore[operator]
    parent = client.create_sandbox("debian:12")
    seen = _intercept_fork(service, ok=0, failed=[])
    assert parent.fork(3) == []
    body = json.loads(seen[0].content)
    assert body["count"] == 3 and len(set(body["sandbox_ids"])) == 3
    assert all(sid.startswith("rl-") and len(sid) == 11 for sid in body["sandbox_ids"])


def test_snapshot_and_fork_are_never_sent_twice(
    client: SandboxClient, service: FakeService
) -> None:
    parent = client.create_sandbox("debian:12")
    for path, call in (
        ("/snapshot", lambda: parent.snapshot()),
        ("/fork", lambda: parent.fork(2)),
    ):
        service.interceptors.append(fail_first("POST", path, httpx.ReadError("reset")))
        with pytest.raises(errors.ServiceUnreachable, match="not retried"):
            call()
        assert len(service.seen("POST", f"/sandboxes/{parent.sandbox_id}{path}")) == 1


def test_a_restore_whose_answer_was_lost_finds_the_sandbox_it_made(
    client: SandboxClient, service: FakeService
) -> None:
    made: list[str] = []

    def restore(request: httpx.Request) -> httpx.Response | None:
        if not request.url.path.endswith("/restore"):
            return None
        body = json.loads(request.content)
        if made:  # the retry: the first attempt made it
            raise errors.SandboxExists(f"sandbox {body['sandbox_id']} already exists")
        created = service._create({"image": "img", "sandbox_id": body.get("sandbox_id")})
        made.append(created.json()["sandbox_id"])
        service.sandboxes[made[-1]]["source_snapshot"] = "snap-0123456789ab"
        raise httpx.ReadError("connection reset")

    def answer(request: httpx.Request) -> httpx.Response | None:
        try:
            return restore(request)
        except errors.OrchardError as exc:
            return httpx.Response(exc.http_status, json=exc.to_wire())

    service.interceptors.append(answer)
    sandbox = client.restore("snap-0123456789ab", sandbox_id="mine")
    assert sandbox.sandbox_id == "mine" == made[0]
    assert client._core.created() == ["mine"]
    # Without a chosen id a lost answer is not retried: the sandbox may exist.
    made.clear()
    with pytest.raises(errors.ServiceUnreachable, match="not retried"):
        client.restore("snap-0123456789ab")
    client.delete_sandbox("mine")
    for sandbox_id in made:
        client.delete_sandbox(sandbox_id)
    assert not _cleanup.pending()
