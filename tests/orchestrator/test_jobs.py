"""Exec and jobs: results, idempotency, waits, streaming, cancel, timeouts, output caps."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from orchard_env.agent.client import Exit, Output
from orchard_env.orchestrator.jobs import JobRun, Stream, skip_seen
from orchard_env.orchestrator.records import JobRecord
from orchard_env.protocol import ExecRequest
from tests.orchestrator.conftest import Service, StartService, eventually
from tests.orchestrator.test_sandboxes import detail

# Blocks until the file "go" exists in the workdir: lets a test hold a command running
# without sleeping for wall-clock time.
UNTIL_GO = "while [ ! -e go ]; do sleep 0.02; done; echo released"


async def release(service: Service, sandbox_id: str) -> None:
    response = await service.http.put(
        f"/sandboxes/{sandbox_id}/files/raw", params={"path": "go"}, content=b""
    )
    assert response.status_code == 200, response.text


async def job_status(service: Service, job_id: str) -> str:
    status: str = (await service.http.get(f"/jobs/{job_id}")).json()["status"]
    return status


async def test_exec_wait_returns_the_finished_job(service: Service) -> None:
    sandbox = await service.create()
    job = await service.exec(sandbox["sandbox_id"], "echo out; echo err >&2; exit 3")
    assert job["status"] == "failed"
    assert job["exit_code"] == 3
    assert (job["stdout"], job["stderr"]) == ("out\n", "err\n")
    assert job["timed_out"] is False and job["truncated"] is False
    assert job["started_at"] and job["completed_at"]
    ok = await service.exec(sandbox["sandbox_id"], None, argv=["printf", "%s|", "a b", "c"])
    assert ok["status"] == "succeeded" and ok["exit_code"] == 0
    assert ok["stdout"] == "a b|c|"
    assert ok["command"] == "printf '%s|' 'a b' c"


async def test_env_cwd_and_stdin(service: Service) -> None:
    sandbox_id = (await service.create())["sandbox_id"]
    await service.http.post(f"/sandboxes/{sandbox_id}/files/mkdir", json={"path": "sub"})
    job = await service.exec(
        sandbox_id, 'echo "$GREETING"; basename "$PWD"', env={"GREETING": "hi"}, cwd="sub"
    )
    assert job["stdout"] == "hi\nsub\n"
    piped = await service.exec(sandbox_id, "tr a-z A-Z", stdin="quiet\n")
    assert piped["stdout"] == "QUIET\n"
    missing = await service.exec(sandbox_id, "true", cwd="nowhere")
    assert missing["status"] == "failed"
    assert missing["error"].startswith("cwd ") and missing["error"].endswith("does not exist")
    unknown = await service.exec(sandbox_id, None, argv=["no-such-program"])
    assert (unknown["status"], unknown["exit_code"]) == ("failed", 127)
    assert unknown["error"] == "command not found: no-such-program"
    through_bash = await service.exec(sandbox_id, ["no-such-program"])
    assert (through_bash["status"], through_bash["exit_code"]) == ("failed", 127)
    assert "no-such-program: command not found" in through_bash["stderr"]


async def test_same_job_id_runs_once(service: Service) -> None:
    sandbox_id = (await service.create())["sandbox_id"]
    body = {"command": "echo ran >> count.txt; cat count.txt", "job_id": "append-1", "wait": True}
    first = await service.http.post(f"/sandboxes/{sandbox_id}/exec", json=body)
    second = await service.http.post(f"/sandboxes/{sandbox_id}/exec", json=body)
    assert first.status_code == second.status_code == 200
    assert first.json() == second.json()
    assert first.json()["stdout"] == "ran\n"

    # Concurrent submissions of one new id: still one run.
    body = {"command": "echo ran >> count.txt", "job_id": "append-2"}
    responses = await asyncio.gather(
        *(service.http.post(f"/sandboxes/{sandbox_id}/exec", json=body) for _ in range(5))
    )
    assert {r.json()["job_id"] for r in responses} == {"append-2"}
    await service.http.get("/jobs/append-2/wait", params={"timeout": 10})
    content = await service.http.get(
        f"/sandboxes/{sandbox_id}/files/raw", params={"path": "count.txt"}
    )
    assert content.content == b"ran\nran\n"


async def test_a_retry_gets_its_job_back_after_the_sandbox_is_deleted(service: Service) -> None:
    sandbox_id = (await service.create())["sandbox_id"]
    body = {"command": "echo once", "job_id": "kept", "wait": True}
    first = await service.http.post(f"/sandboxes/{sandbox_id}/exec", json=body)
    assert (await service.http.delete(f"/sandboxes/{sandbox_id}")).status_code == 200
    again = await service.http.post(f"/sandboxes/{sandbox_id}/exec", json=body)
    assert again.status_code == 200
    assert again.json() == first.json()
    new = await service.http.post(
        f"/sandboxes/{sandbox_id}/exec", json={**body, "job_id": "after-delete"}
    )
    assert new.status_code == 404
    assert detail(new)["message"] == f"sandbox {sandbox_id} was deleted: deleted by request"


async def test_an_exec_that_ends_at_once_reads_no_job_and_writes_it_twice(
    service: Service,
) -> None:
    """What the store does per exec (the orchestrator's CPU per exec): the job inserted, then
    written once when it ends (no "running" row when the exit is the agent's first event),
    never read back; the sandbox's activity set in place, not read and rewritten."""
    sandbox_id = (await service.create())["sandbox_id"]
    await service.exec(sandbox_id, "true")
    statements: list[str] = []
    db = service.orchard.store._db  # type: ignore[attr-defined]
    db.set_trace_callback(statements.append)
    try:
        job = await service.exec(sandbox_id, "true", job_id="quick")

        async def activity_written() -> bool:
            return any(s.startswith("UPDATE sandboxes SET record = json_set(") for s in statements)

        await eventually(activity_written)
    finally:
        db.set_trace_callback(None)
    assert job["status"] == "succeeded"
    job_writes = [s for s in statements if s.startswith(("INSERT", "UPDATE")) and " jobs " in s]
    inserted, ended = ("INSERT OR IGNORE INTO jobs", "INSERT INTO jobs")
    assert [s.split(" (")[0] for s in job_writes] == [inserted, ended]
    assert not [s for s in statements if s.startswith("SELECT") and " FROM jobs " in s]
    sandbox_writes = [s for s in statements if "INTO sandboxes" in s or "UPDATE sandboxes" in s]
    assert len(sandbox_writes) == 1


async def test_a_job_id_of_another_sandbox_is_409(service: Service) -> None:
    one = (await service.create())["sandbox_id"]
    two = (await service.create())["sandbox_id"]
    await service.exec(one, "true", job_id="shared")
    response = await service.http.post(
        f"/sandboxes/{two}/exec", json={"command": "true", "job_id": "shared"}
    )
    assert response.status_code == 409
    assert detail(response) == {
        "code": "conflict",
        "message": "job id shared is already used by another sandbox's job",
        "hint": "job ids must be unique: leave job_id out to get a fresh one",
    }


async def test_a_job_id_reused_for_another_command_is_409(service: Service) -> None:
    sandbox_id = (await service.create())["sandbox_id"]
    await service.exec(sandbox_id, "echo first", job_id="once")
    response = await service.http.post(
        f"/sandboxes/{sandbox_id}/exec", json={"command": "echo second", "job_id": "once"}
    )
    assert response.status_code == 409
    assert detail(response) == {
        "code": "conflict",
        "message": "job id once already ran another command: 'echo first'",
        "hint": "a retry must resend the same command; use a new job_id for a new one",
    }


async def test_wait_semantics(service: Service) -> None:
    sandbox_id = (await service.create())["sandbox_id"]
    submitted = await service.http.post(
        f"/sandboxes/{sandbox_id}/exec", json={"command": UNTIL_GO, "wait": False}
    )
    job = submitted.json()
    assert job["status"] in ("queued", "running")
    # A wait that runs out answers 200 with the job as it is (never 408).
    waited = await service.http.get(f"/jobs/{job['job_id']}/wait", params={"timeout": 0.1})
    assert waited.status_code == 200
    assert waited.json()["status"] in ("queued", "running")
    # Commands in one sandbox run concurrently: a second one finishes while the first blocks.
    other = await service.exec(sandbox_id, "echo alongside")
    assert other["stdout"] == "alongside\n"
    await release(service, sandbox_id)
    done = await service.http.get(f"/jobs/{job['job_id']}/wait", params={"timeout": 10})
    assert done.json()["status"] == "succeeded"
    assert done.json()["stdout"] == "released\n"
    jobs = (await service.http.get(f"/sandboxes/{sandbox_id}/jobs")).json()
    assert [j["job_id"] for j in jobs] == [other["job_id"], job["job_id"]]  # newest first
    unknown = await service.http.get("/jobs/nope")
    assert unknown.status_code == 404
    assert detail(unknown) == {
        "code": "job_not_found",
        "message": "job nope does not exist",
        "hint": "job ids are kept for a day",
    }


async def test_streamed_exec_is_ndjson_and_replays(service: Service) -> None:
    sandbox_id = (await service.create())["sandbox_id"]
    body = {"command": "echo a; echo b >&2; echo c", "job_id": "streamed"}

    async def stream() -> list[dict[str, Any]]:
        response = await service.http.post(f"/sandboxes/{sandbox_id}/exec/stream", json=body)
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/x-ndjson"
        return [json.loads(line) for line in response.text.splitlines()]

    events = await stream()
    assert events[0] == {"event": "started", "job_id": "streamed"}
    assert events[-1]["event"] == "exit"
    assert events[-1]["job"]["status"] == "succeeded"
    text = {
        name: "".join(e["data"] for e in events if e["event"] == name)
        for name in ("stdout", "stderr")
    }
    assert text == {"stdout": "a\nc\n", "stderr": "b\n"}
    replay = await stream()  # same job id: the same output again, nothing re-run
    assert replay[-1]["job"] == events[-1]["job"]
    assert "".join(e["data"] for e in replay if e["event"] == "stdout") == "a\nc\n"


async def test_cancel_kills_the_command(service: Service) -> None:
    sandbox_id = (await service.create())["sandbox_id"]
    job = (
        await service.http.post(
            f"/sandboxes/{sandbox_id}/exec", json={"command": "sleep 60", "job_id": "sleepy"}
        )
    ).json()

    async def running() -> bool:
        return await job_status(service, job["job_id"]) == "running"

    await eventually(running)
    response = await service.http.post("/jobs/sleepy/cancel")
    assert response.status_code == 200
    cancelled = response.json()
    # Upstream's clients poll until succeeded/failed: a cancelled job is failed, and says why.
    assert (cancelled["status"], cancelled["cancelled"]) == ("failed", True)
    assert cancelled["error"] == "cancelled" and cancelled["timed_out"] is False
    again = await service.http.post("/jobs/sleepy/cancel")
    assert (again.json()["status"], again.json()["cancelled"]) == ("failed", True)


async def test_a_cancel_right_after_the_submission_is_never_lost(service: Service) -> None:
    # At each delay the cancel meets the job at another stage: queued, its exec on its way to
    # the agent (which may see the cancel first), or running. Each time the job ends
    # cancelled, and one cancelled before it started never ran.
    sandbox_id = (await service.create())["sandbox_id"]
    ended = {}
    for n, delay in enumerate((0, 0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)):
        submitted = await service.http.post(
            f"/sandboxes/{sandbox_id}/exec",
            json={"command": f"touch ran-{n}; sleep 60", "job_id": f"hasty-{n}"},
        )
        assert submitted.status_code == 200, submitted.text
        await asyncio.sleep(delay)
        job = (await service.http.post(f"/jobs/hasty-{n}/cancel")).json()
        assert (job["status"], job["cancelled"]) == ("failed", True), job
        ended[n] = job["error"]
    listing = await service.exec(sandbox_id, "ls")
    ran = {int(name.removeprefix("ran-")) for name in listing["stdout"].split()}
    never = {"cancelled before it ran", "cancelled before it started"}
    assert not {n for n, error in ended.items() if error in never} & ran, (ended, ran)


async def test_timeout_is_distinct_from_exit_124(service: Service) -> None:
    sandbox_id = (await service.create())["sandbox_id"]
    timed = await service.exec(sandbox_id, "echo started; sleep 30", timeout_seconds=1)
    assert (timed["status"], timed["timed_out"], timed["cancelled"]) == ("failed", True, False)
    assert (timed["exit_code"], timed["error"]) == (124, "Command timed out after 1s")
    assert (timed["stdout"], timed["stderr"]) == ("started\n", "Command timed out after 1s\n")
    partial = await service.exec(sandbox_id, "printf oops >&2; sleep 30", timeout_seconds=1)
    assert partial["stderr"] == "oops\nCommand timed out after 1s\n"
    exited = await service.exec(sandbox_id, "exit 124")
    assert (exited["status"], exited["exit_code"], exited["timed_out"]) == ("failed", 124, False)
    [stored] = await service.orchard.store.find_jobs(timed["job_id"])
    assert stored.timed_out and stored.status == "failed"


async def test_output_is_capped_and_marked_truncated(start_service: StartService) -> None:
    service = await start_service(max_output_bytes=64)
    sandbox_id = (await service.create())["sandbox_id"]
    asked = await service.exec(sandbox_id, "seq -s ' ' 1 1000; echo end", max_output_bytes=10)
    # The head and the tail (the end of a log is what graders read), the cut marked between.
    assert asked["stdout"] == "1 2 3\n[... 3887 bytes truncated ...]\n\nend\n"
    assert asked["truncated"] is True and asked["status"] == "succeeded"
    capped = await service.exec(
        sandbox_id, "head -c 1000 /dev/zero | tr '\\0' y; echo", max_output_bytes=10_000
    )
    assert capped["stdout"] == "y" * 32 + "\n[... 937 bytes truncated ...]\n" + "y" * 31 + "\n"
    assert capped["truncated"] is True
    small = await service.exec(sandbox_id, "echo fits")
    assert small["truncated"] is False


async def test_exec_on_a_pending_sandbox_is_409(service: Service) -> None:
    await service.http.post(
        "/sandboxes", json={"image": "hang/image", "sandbox_id": "waiting", "timeout": 60}
    )
    service.orchard.sandboxes.ready_gate_seconds = 0.1
    response = await service.http.post("/sandboxes/waiting/exec", json={"command": "true"})
    assert response.status_code == 409
    assert detail(response) == {
        "code": "sandbox_not_ready",
        "message": "sandbox waiting is not ready yet (status pending)",
        "hint": "wait for it: GET /sandboxes/waiting/wait",
    }


async def test_queued_jobs_wait_for_a_slot_and_cancel_without_running(service: Service) -> None:
    service.orchard.jobs.slots = asyncio.Semaphore(1)
    sandbox_id = (await service.create())["sandbox_id"]
    url = f"/sandboxes/{sandbox_id}/exec"
    first = (await service.http.post(url, json={"command": UNTIL_GO})).json()
    second = (await service.http.post(url, json={"command": "touch ran", "job_id": "later"})).json()
    assert second["status"] == "queued"
    cancelled = (await service.http.post("/jobs/later/cancel")).json()
    assert (cancelled["status"], cancelled["cancelled"]) == ("failed", True)
    assert cancelled["error"] == "cancelled before it ran"
    assert cancelled["exit_code"] is None and cancelled["started_at"] is None
    await release(service, sandbox_id)
    done = (await service.http.get(f"/jobs/{first['job_id']}/wait", params={"timeout": 10})).json()
    assert done["status"] == "succeeded"
    listing = (await service.http.get(f"/sandboxes/{sandbox_id}/files/list")).json()
    assert "ran" not in [entry["name"] for entry in listing["files"]]


async def test_a_replayed_stream_skips_what_was_delivered() -> None:
    replayed: list[Output | Exit] = [
        Output("stdout", b"abc"),
        Output("stderr", b"E1"),
        Output("stdout", b"def"),
        Output("stderr", b"E2"),
        Output("stdout", b"gh"),
        Exit(0, None, False, False, False, None, 0.1),
    ]

    async def replay() -> AsyncIterator[Output | Exit]:
        for event in replayed:
            yield event

    seen: dict[Stream, int] = {"stdout": 4, "stderr": 2}  # "abcd" and "E1" came before the break
    events = [event async for event in skip_seen(replay(), seen)]
    assert events == [
        Output("stdout", b"ef"),
        Output("stderr", b"E2"),
        Output("stdout", b"gh"),
        replayed[-1],
    ]


def job_run(cap: int) -> JobRun:
    request = ExecRequest(command="true")
    record = JobRecord(
        job_id="j", sandbox_id="s", command="true", request=request, created_at=datetime.now(UTC)
    )
    return JobRun(record, cap)


def test_output_past_the_cap_keeps_the_head_and_the_tail_with_the_cut_marked() -> None:
    run = job_run(10)
    for chunk in (b"0123", b"456789abcdef", b"ghijKLMNO"):
        run.add("stdout", chunk)
    run.add("stderr", b"short")
    assert run.snapshot().stdout == "01234"  # live readers get the head as it comes
    run.flush()
    run.flush()  # once only
    record = run.snapshot()
    assert record.stdout == "01234\n[... 15 bytes truncated ...]\nKLMNO"
    assert (record.stderr, record.truncated) == ("short", True)


def test_the_cut_counts_what_the_agent_dropped_and_never_splits_a_character() -> None:
    run = job_run(8)  # a head of 4 bytes, a tail of 4
    run.add("stdout", "héé".encode())  # the head ends inside the second "é"
    run.add("stdout", "llo wörld".encode())  # the tail starts inside "ö"
    run.flush({"stdout": 100, "stderr": 0})  # the agent dropped 100 bytes before
    # 15 bytes came, "hé" and "rld" (6) are shown whole: 9 dropped here, 100 by the agent
    assert run.snapshot().stdout == "hé\n[... 109 bytes truncated ...]\nrld"


def test_output_between_half_the_cap_and_the_cap_is_kept_whole() -> None:
    run = job_run(10)
    run.add("stdout", b"abcdefgh")
    run.add("stdout", "é".encode())
    run.flush()
    assert (run.snapshot().stdout, run.truncated) == ("abcdefghé", False)
