"""Snapshots, restore and fork over the wire, on the fake backend (a snapshot is a copy of the
sandbox's workspace; a restore starts a fresh agent on a copy of that copy)."""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Any

import pytest

from orchard_env.orchestrator.backends.base import Capability
from tests.orchestrator.conftest import FakeClock, Service, StartService
from tests.orchestrator.fakes import AgentProcessBackend
from tests.orchestrator.test_sandboxes import detail


async def read(service: Service, sandbox_id: str, path: str = "state.txt") -> str:
    job = await service.exec(sandbox_id, f"cat {path}")
    assert job["exit_code"] == 0, job
    return str(job["stdout"])


async def snapshot(service: Service, sandbox_id: str, **body: Any) -> dict[str, Any]:
    response = await service.http.post(f"/sandboxes/{sandbox_id}/snapshot", json=body)
    assert response.status_code == 201, response.text
    snap: dict[str, Any] = response.json()
    return snap


async def restore(service: Service, snapshot_id: str, **body: Any) -> dict[str, Any]:
    response = await service.http.post(f"/snapshots/{snapshot_id}/restore", json=body)
    assert response.status_code == 201, response.text
    info: dict[str, Any] = response.json()
    return info


async def test_snapshot_records_the_source_and_restore_gets_its_files_and_settings(
    service: Service, backend: AgentProcessBackend
) -> None:
    await service.create(
        sandbox_id="origin",
        cpu="500m",
        memory="512Mi",
        env={"MODE": "train", "SEED": "1"},
        labels={"team": "rl", "turn": "3"},
        workdir="/srv/app",
    )
    await service.exec("origin", "echo v1 > state.txt")
    snap = await snapshot(service, "origin", name="turn-3", labels={"run": "a"}, ttl_seconds=600)
    assert re.fullmatch(r"snap-[0-9a-f]{12}", snap["snapshot_id"])
    assert snap["name"] == "turn-3" and snap["labels"] == {"run": "a"}
    assert snap["source_sandbox"] == "origin" and snap["parent_snapshot"] is None
    assert snap["image"] == f"fake/snapshots:{snap['snapshot_id']}"
    assert snap["size_bytes"] == len("v1\n")
    assert snap["owner"] == service.admin.key_id if service.admin else None
    assert (snap["cpu"], snap["memory"], snap["workdir"]) == ("0.5", "512Mi", "/srv/app")
    assert snap["env"] == {"MODE": "train", "SEED": "1"}
    assert snap["sandbox_labels"] == {"team": "rl", "turn": "3"}
    assert snap["block_network"] is True and snap["deleted_at"] is None
    assert snap["expires_at"] is not None

    await service.exec("origin", "echo v2 > state.txt")  # after the snapshot: not in it
    restored = await restore(
        service, snap["snapshot_id"], env={"SEED": "2"}, labels={"turn": "4", "branch": "b"}
    )
    assert restored["status"] == "ready" and restored["ready"] is True  # ready on return
    assert restored["source_snapshot"] == snap["snapshot_id"]
    assert restored["image"] == snap["image"]
    assert (restored["cpu"], restored["memory"], restored["workdir"]) == (
        "0.5",
        "512Mi",
        "/srv/app",
    )
    assert restored["env"] == {"MODE": "train", "SEED": "2"}
    assert restored["labels"] == {"team": "rl", "turn": "4", "branch": "b"}
    new_id = restored["sandbox_id"]
    assert await read(service, new_id) == "v1\n"
    assert (await service.exec(new_id, "echo $MODE-$SEED"))["stdout"] == "train-2\n"
    assert await read(service, "origin") == "v2\n"
    shown = (await service.http.get(f"/snapshots/{snap['snapshot_id']}")).json()
    assert shown == snap


async def test_restore_with_a_chosen_id_and_without_a_body(service: Service) -> None:
    await service.create(sandbox_id="src")
    snap = await service.http.post("/sandboxes/src/snapshot")  # no body: all defaults
    assert snap.status_code == 201
    snapshot_id = snap.json()["snapshot_id"]
    # No TTL asked for: the service's default, snapshot_ttl_seconds (7 days).
    created, expires = (
        datetime.fromisoformat(snap.json()[k]) for k in ("created_at", "expires_at")
    )
    assert expires - created == timedelta(days=7)
    chosen = await restore(service, snapshot_id, sandbox_id="branch-1")
    assert chosen["sandbox_id"] == "branch-1"
    again = await service.http.post(
        f"/snapshots/{snapshot_id}/restore", json={"sandbox_id": "branch-1"}
    )
    assert again.status_code == 409 and detail(again)["code"] == "sandbox_exists"
    plain = await service.http.post(f"/snapshots/{snapshot_id}/restore")
    assert plain.status_code == 201 and plain.json()["sandbox_id"].startswith("sb-")


async def test_lineage_forms_a_tree(service: Service) -> None:
    await service.create(sandbox_id="root-box")
    first = await snapshot(service, "root-box")
    child_box = await restore(service, first["snapshot_id"])
    second = await snapshot(service, child_box["sandbox_id"])
    grandchild_box = await restore(service, second["snapshot_id"])
    third = await snapshot(service, grandchild_box["sandbox_id"])
    sibling = await snapshot(service, child_box["sandbox_id"])
    assert second["parent_snapshot"] == first["snapshot_id"]
    assert third["parent_snapshot"] == second["snapshot_id"]
    assert sibling["parent_snapshot"] == first["snapshot_id"]
    listed = (await service.http.get("/snapshots")).json()["snapshots"]
    assert [s["snapshot_id"] for s in listed] == [
        first["snapshot_id"],
        second["snapshot_id"],
        third["snapshot_id"],
        sibling["snapshot_id"],
    ]


async def test_fork_makes_count_independent_ready_sandboxes(
    service: Service, backend: AgentProcessBackend
) -> None:
    await service.create(sandbox_id="parent", labels={"team": "rl"}, env={"K": "v"})
    await service.exec("parent", "echo turn-7 > state.txt")
    response = await service.http.post(
        "/sandboxes/parent/fork", json={"count": 3, "labels": {"branch": "x"}}
    )
    assert response.status_code == 201, response.text
    result = response.json()
    assert result["failures"] == []
    forks = result["sandboxes"]
    assert len(forks) == 3 and len({f["sandbox_id"] for f in forks}) == 3
    snapshot_id = result["snapshot"]["snapshot_id"]
    assert result["snapshot"]["source_sandbox"] == "parent"
    for index, fork in enumerate(forks):
        assert fork["status"] == "ready" and fork["source_snapshot"] == snapshot_id
        assert fork["labels"] == {"team": "rl", "branch": "x"} and fork["env"] == {"K": "v"}
        assert await read(service, fork["sandbox_id"]) == "turn-7\n"
        await service.exec(fork["sandbox_id"], f"echo branch-{index} > state.txt")
    for index, fork in enumerate(forks):  # each changed only its own copy
        assert await read(service, fork["sandbox_id"]) == f"branch-{index}\n"
    assert await read(service, "parent") == "turn-7\n"


async def test_fork_reports_each_failure_and_keeps_the_others(
    service: Service, backend: AgentProcessBackend
) -> None:
    await service.create(sandbox_id="parent")
    backend.fail_creates["fork-b"] = "no space left on device"
    response = await service.http.post(
        "/sandboxes/parent/fork",
        json={"count": 3, "sandbox_ids": ["fork-a", "fork-b", "fork-c"]},
    )
    assert response.status_code == 201
    result = response.json()
    assert [s["sandbox_id"] for s in result["sandboxes"]] == ["fork-a", "fork-c"]
    assert result["failures"] == [
        {
            "sandbox_id": "fork-b",
            "code": "internal",
            "message": "the engine could not create sandbox 'fork-b': no space left on device",
        }
    ]
    assert (await service.http.get("/sandboxes/fork-b")).status_code == 404
    assert (await service.exec("fork-c", "true"))["exit_code"] == 0


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"count": 0}, "count: Input should be greater than or equal to 1"),
        ({"count": 65}, "count: Input should be less than or equal to 64"),
        ({"count": 2, "sandbox_ids": ["a"]}, "sandbox_ids names 1 sandboxes but count is 2"),
        ({"count": 2, "sandbox_ids": ["a", "a"]}, "sandbox_ids must not repeat an id"),
    ],
)
async def test_fork_requests_are_validated(
    service: Service, body: dict[str, Any], message: str
) -> None:
    await service.create(sandbox_id="parent")
    response = await service.http.post("/sandboxes/parent/fork", json=body)
    assert response.status_code == 400
    assert message in detail(response)["message"]


async def test_deleting_a_snapshot_with_children_is_refused_unless_recursive(
    service: Service, backend: AgentProcessBackend
) -> None:
    await service.create(sandbox_id="a")
    top = await snapshot(service, "a")
    box = await restore(service, top["snapshot_id"])
    left = await snapshot(service, box["sandbox_id"])
    right = await snapshot(service, box["sandbox_id"])
    refused = await service.http.delete(f"/snapshots/{top['snapshot_id']}")
    assert refused.status_code == 409
    assert detail(refused) == {
        "code": "conflict",
        "message": f"snapshot {top['snapshot_id']} has 2 child snapshot(s): "
        f"{left['snapshot_id']}, {right['snapshot_id']}; delete them first, or delete the "
        "whole subtree with recursive=true",
        "hint": f"`orchard snapshot tree {top['snapshot_id']}` shows the subtree; "
        f"`orchard snapshot rm --recursive {top['snapshot_id']}` deletes it",
    }
    await service.http.delete(f"/sandboxes/{box['sandbox_id']}")
    deleted = await service.http.delete(
        f"/snapshots/{top['snapshot_id']}", params={"recursive": "true"}
    )
    assert deleted.status_code == 200
    assert deleted.json() == {
        "deleted": [right["snapshot_id"], left["snapshot_id"], top["snapshot_id"]]
    }
    assert backend.snapshots == {}  # nothing used them: their images went at once
    assert (await service.http.get("/snapshots")).json() == {"snapshots": []}
    gone = await service.http.get(f"/snapshots/{top['snapshot_id']}")
    assert gone.json()["deleted_at"] is not None  # kept a while, like deleted sandboxes
    listed = await service.http.get("/snapshots", params={"include_deleted": "true"})
    assert len(listed.json()["snapshots"]) == 3
    again = await service.http.delete(f"/snapshots/{top['snapshot_id']}")
    assert again.status_code == 404 and detail(again)["code"] == "snapshot_not_found"
    restored = await service.http.post(f"/snapshots/{top['snapshot_id']}/restore")
    assert restored.status_code == 404
    assert detail(restored)["message"] == (
        f"snapshot {top['snapshot_id']} was deleted (deleted by request)"
    )


async def test_an_image_in_use_waits_for_its_sandboxes(
    service: Service, backend: AgentProcessBackend, clock: FakeClock
) -> None:
    await service.create(sandbox_id="src")
    await service.exec("src", "echo v1 > state.txt")
    snap = await snapshot(service, "src")
    box = await restore(service, snap["snapshot_id"])
    response = await service.http.delete(f"/snapshots/{snap['snapshot_id']}")
    assert response.json() == {"deleted": [snap["snapshot_id"]]}
    assert snap["image"] in backend.snapshots  # the restored sandbox still runs on it
    assert await read(service, box["sandbox_id"]) == "v1\n"  # and keeps working
    await service.orchard.reaper.run_pass()
    assert snap["image"] in backend.snapshots
    await service.http.delete(f"/sandboxes/{box['sandbox_id']}")
    await service.orchard.reaper.run_pass()
    assert snap["image"] not in backend.snapshots
    # The record is forgotten after the retention period.
    clock.advance(service.orchard.settings.job_retention_seconds + 1)
    await service.orchard.reaper.run_pass()
    assert (await service.http.get(f"/snapshots/{snap['snapshot_id']}")).status_code == 404


async def test_ttl_expires_snapshots_and_removes_their_images(
    service: Service, backend: AgentProcessBackend, clock: FakeClock
) -> None:
    await service.create(sandbox_id="src", ttl_seconds=10**6, idle_timeout_seconds=10**6)
    short = await snapshot(service, "src", ttl_seconds=100)
    kept = await snapshot(service, "src")
    clock.advance(50)
    await service.orchard.reaper.run_pass()
    assert short["image"] in backend.snapshots
    clock.advance(51)
    await service.orchard.reaper.run_pass()
    assert short["image"] not in backend.snapshots and kept["image"] in backend.snapshots
    listed = (await service.http.get("/snapshots")).json()["snapshots"]
    assert [s["snapshot_id"] for s in listed] == [kept["snapshot_id"]]
    expired = await service.http.post(f"/snapshots/{short['snapshot_id']}/restore")
    assert detail(expired)["message"] == (
        f"snapshot {short['snapshot_id']} was deleted "
        "(expired: its lifetime of 100 s (ttl_seconds) ran out)"
    )


async def test_a_parent_record_outlives_the_retention_while_it_has_children(
    service: Service, clock: FakeClock
) -> None:
    await service.create(sandbox_id="src", ttl_seconds=10**6, idle_timeout_seconds=10**6)
    parent = await snapshot(service, "src", ttl_seconds=10)
    box = await restore(service, parent["snapshot_id"], ttl_seconds=10**6)
    child = await snapshot(service, box["sandbox_id"])
    await service.http.delete(f"/sandboxes/{box['sandbox_id']}")
    clock.advance(service.orchard.settings.job_retention_seconds + 100)
    await service.orchard.reaper.run_pass()
    shown = (await service.http.get(f"/snapshots/{parent['snapshot_id']}")).json()
    assert shown["deleted_at"] is not None  # expired, image gone, record kept for the tree
    assert (await service.http.get(f"/snapshots/{child['snapshot_id']}")).status_code == 200


async def test_list_filters_by_label(service: Service) -> None:
    await service.create(sandbox_id="src")
    a = await snapshot(service, "src", labels={"run": "a", "turn": "1"})
    await snapshot(service, "src", labels={"run": "b"})
    listed = await service.http.get("/snapshots", params=[("label", "run=a"), ("label", "turn=1")])
    assert [s["snapshot_id"] for s in listed.json()["snapshots"]] == [a["snapshot_id"]]
    bad = await service.http.get("/snapshots", params={"label": "novalue"})
    assert bad.status_code == 400


async def test_snapshots_belong_to_the_key_that_took_them(service: Service) -> None:
    alice = service.as_key(await service.new_key("alice"))
    bob = service.as_key(await service.new_key("bob"))
    created = await alice.post("/sandboxes", json={"image": "debian:12", "sandbox_id": "alices"})
    assert created.status_code == 201
    await alice.get("/sandboxes/alices/wait", params={"timeout": 30})
    taken = await alice.post("/sandboxes/alices/snapshot", json={})
    assert taken.status_code == 201
    snapshot_id = taken.json()["snapshot_id"]
    assert (await bob.post("/sandboxes/alices/snapshot", json={})).status_code == 404
    assert (await bob.post("/sandboxes/alices/fork", json={"count": 1})).status_code == 404
    for response in (
        await bob.get(f"/snapshots/{snapshot_id}"),
        await bob.post(f"/snapshots/{snapshot_id}/restore"),
        await bob.delete(f"/snapshots/{snapshot_id}"),
    ):
        assert response.status_code == 404
        assert detail(response)["code"] == "snapshot_not_found"
    assert (await bob.get("/snapshots")).json() == {"snapshots": []}
    assert len((await alice.get("/snapshots")).json()["snapshots"]) == 1
    assert len((await service.http.get("/snapshots")).json()["snapshots"]) == 1  # admin
    restored = await alice.post(f"/snapshots/{snapshot_id}/restore")
    assert restored.status_code == 201
    assert restored.json()["owner"] == taken.json()["owner"]


async def test_snapshots_need_a_ready_sandbox(service: Service) -> None:
    missing = await service.http.post("/sandboxes/nope/snapshot", json={})
    assert missing.status_code == 404 and detail(missing)["code"] == "sandbox_not_found"
    await service.create(sandbox_id="gone")
    await service.http.delete("/sandboxes/gone")
    deleted = await service.http.post("/sandboxes/gone/snapshot", json={})
    assert deleted.status_code == 404
    assert detail(deleted)["message"] == "sandbox gone was deleted: deleted by request"
    unknown = await service.http.get("/snapshots/snap-000000000000")
    assert unknown.status_code == 404
    assert detail(unknown) == {
        "code": "snapshot_not_found",
        "message": "snapshot snap-000000000000 does not exist",
        "hint": "`orchard snapshot list` shows your snapshots",
    }


async def test_a_backend_without_snapshots_answers_501(
    start_service: StartService, backend: AgentProcessBackend
) -> None:
    backend.capabilities = frozenset({Capability.PTY})
    service = await start_service()
    await service.create(sandbox_id="box")
    for response in (
        await service.http.post("/sandboxes/box/snapshot", json={}),
        await service.http.post("/sandboxes/box/fork", json={"count": 2}),
    ):
        assert response.status_code == 501
        assert detail(response) == {
            "code": "not_supported",
            "message": "the fake backend cannot snapshot sandboxes, so snapshot, restore and "
            "fork are not available on this service",
            "hint": "the local engine backend (ORCHARD_BACKEND=docker) supports them",
        }
    assert (await service.http.get("/snapshots")).json() == {"snapshots": []}


async def test_snapshots_survive_a_restart(
    start_service: StartService, backend: AgentProcessBackend
) -> None:
    first = await start_service()
    await first.create(sandbox_id="src")
    await first.exec("src", "echo kept > state.txt")
    snap = await snapshot(first, "src", name="before-restart")
    await first.stop()
    second = await start_service()
    shown = (await second.http.get(f"/snapshots/{snap['snapshot_id']}")).json()
    assert shown == snap
    restored = await restore(second, snap["snapshot_id"])
    assert await read(second, restored["sandbox_id"]) == "kept\n"


async def test_a_snapshot_image_by_name_starts_only_for_the_key_that_owns_it(
    service: Service,
) -> None:
    alice = service.as_key(await service.new_key("alice"))
    bob = service.as_key(await service.new_key("bob"))
    await alice.post("/sandboxes", json={"image": "debian:12", "sandbox_id": "alices"})
    await alice.get("/sandboxes/alices/wait", params={"timeout": 30})
    await alice.post("/sandboxes/alices/exec", json={"command": "echo secret > s", "wait": True})
    snap = (await alice.post("/sandboxes/alices/snapshot", json={})).json()
    missing = "fake/snapshots:snap-000000000000"
    answers = [
        await bob.post("/sandboxes", json={"image": image}) for image in (snap["image"], missing)
    ]
    for response, image in zip(answers, (snap["image"], missing), strict=True):
        assert response.status_code == 404, response.text
        assert detail(response)["code"] == "snapshot_not_found"
        assert detail(response)["message"] == f"image {image!r} is not a snapshot of yours"
    assert (await bob.get("/sandboxes")).json()["sandboxes"] == []
    # The owner may name the image: it is a restore of that snapshot.
    own = await alice.post("/sandboxes", json={"image": snap["image"], "sandbox_id": "again"})
    assert own.status_code == 201, own.text
    assert own.json()["source_snapshot"] == snap["snapshot_id"]
    await alice.get("/sandboxes/again/wait", params={"timeout": 30})
    job = await alice.post("/sandboxes/again/exec", json={"command": "cat s", "wait": True})
    assert job.json()["stdout"] == "secret\n"
    # Once deleted, not even its owner can start from it by name.
    await alice.delete("/sandboxes/again")
    await alice.delete(f"/snapshots/{snap['snapshot_id']}")
    gone = await alice.post("/sandboxes", json={"image": snap["image"]})
    assert gone.status_code == 404 and detail(gone)["code"] == "snapshot_not_found"
