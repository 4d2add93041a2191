"""The shared validators: the SDK, CLI and server reject the same inputs the same way."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from orchard_env import protocol, quantities


@pytest.mark.parametrize(
    ("value", "cores"), [("2", 2.0), ("500m", 0.5), (1, 1.0), (0.25, 0.25), ("1.5", 1.5)]
)
def test_cpu_quantities(value: str | float, cores: float) -> None:
    assert quantities.parse_cpu(value) == cores


@pytest.mark.parametrize("value", ["two", "-1", "0", "5x", True])
def test_bad_cpu_quantities(value: str | bool) -> None:
    with pytest.raises(ValueError, match="cpu"):
        quantities.parse_cpu(value)


@pytest.mark.parametrize(
    ("value", "size"),
    [
        ("512Mi", 512 * 1024**2),
        ("8Gi", 8 * 1024**3),
        ("1G", 10**9),
        ("1.5Gi", 3 * 512 * 1024**2),
        (42, 42),
    ],
)
def test_memory_quantities(value: str | int, size: int) -> None:
    assert quantities.parse_memory(value) == size


@pytest.mark.parametrize("value", ["lots", "8GB", "0", "-1Gi"])
def test_bad_memory_quantities(value: str) -> None:
    with pytest.raises(ValueError, match="memory"):
        quantities.parse_memory(value)


def test_format_memory_picks_the_largest_exact_unit() -> None:
    assert quantities.format_memory(8 * 1024**3) == "8Gi"
    assert quantities.format_memory(1536 * 1024**2) == "1536Mi"
    assert quantities.format_memory(1000) == "1000"


@pytest.mark.parametrize(
    "image",
    [
        "python:3.11-slim",
        "localhost/orchard/sandbox:latest",
        "ghcr.io/org/repo/img@sha256:" + "a" * 64,
        "registry:5000/x/y:1.0",
    ],
)
def test_valid_images(image: str) -> None:
    assert protocol.CreateSandboxRequest(image=image).image == image


@pytest.mark.parametrize("image", ["", "Python:3.11", "img:tag with space", "a//b"])
def test_invalid_images_name_the_value(image: str) -> None:
    with pytest.raises(ValidationError, match="is not a valid image reference"):
        protocol.CreateSandboxRequest(image=image)


@pytest.mark.parametrize("sandbox_id", ["Upper", "-lead", "trail-", "a" * 64, "under_score"])
def test_sandbox_ids_must_be_dns_labels(sandbox_id: str) -> None:
    with pytest.raises(ValidationError, match="is not a DNS label"):
        protocol.CreateSandboxRequest(image="busybox", sandbox_id=sandbox_id)


def test_unknown_fields_are_refused() -> None:
    with pytest.raises(ValidationError, match="imgae"):
        protocol.CreateSandboxRequest.model_validate({"image": "busybox", "imgae": "x"})


def test_labels_and_workdir_are_checked() -> None:
    with pytest.raises(ValidationError, match="label key"):
        protocol.CreateSandboxRequest(image="busybox", labels={"bad key": "v"})
    with pytest.raises(ValidationError, match="must be an absolute path"):
        protocol.CreateSandboxRequest(image="busybox", workdir="relative")


def test_exec_request_rejects_empty_commands() -> None:
    with pytest.raises(ValidationError, match="command is empty"):
        protocol.ExecRequest(command="  ")
    with pytest.raises(ValidationError, match="command is empty"):
        protocol.ExecRequest(command=[])


def test_a_list_command_is_joined_and_an_argv_is_kept_exact() -> None:
    joined = protocol.ExecRequest(command=["ls", "*.py", ">", "out"])
    assert (joined.agent_command, joined.text) == ("ls *.py > out", "ls *.py > out")
    exact = protocol.ExecRequest(argv=["printf", "%s", "a b"])
    assert exact.agent_command == ["printf", "%s", "a b"]
    assert exact.text == "printf %s 'a b'"
    assert protocol.ExecRequest(command="echo hi | wc").text == "echo hi | wc"


@pytest.mark.parametrize(
    "body",
    [{}, {"command": "true", "argv": ["true"]}, {"command": ["", " "]}, {"argv": []}],
)
def test_exec_needs_exactly_one_non_empty_command(body: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        protocol.ExecRequest.model_validate(body)


def test_job_status_done() -> None:
    assert not protocol.JobStatus.RUNNING.done
    assert protocol.JobStatus.FAILED.done
    # Upstream's clients poll until succeeded/failed: no other final status exists.
    assert [s.value for s in protocol.JobStatus] == ["queued", "running", "succeeded", "failed"]


def test_null_means_the_default_where_upstreams_sdk_sends_it() -> None:
    # Upstream's SDK sends every exec field, null when the caller gave none.
    request = protocol.ExecRequest.model_validate(
        {"command": "ls", "timeout_seconds": None, "cwd": None, "env": None, "login_shell": False}
    )
    assert (request.timeout_seconds, request.env, request.cwd) == (300, {}, None)
    init = protocol.PtyInit.model_validate(
        {"type": "init", "cmd": ["bash"], "env": None, "cwd": None, "rows": None, "cols": None}
    )
    assert (init.env, init.rows, init.cols) == ({}, 24, 80)
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        protocol.ExecRequest(command="ls", timeout_seconds=0)


def test_sandbox_and_job_times_travel_as_epoch_seconds() -> None:
    created = datetime(2026, 1, 1, 12, 0, 0, 250000, tzinfo=UTC)
    job = protocol.Job(
        job_id="j", sandbox_id="s", command="ls", status="succeeded", created_at=created
    )
    wire = json.loads(job.model_dump_json())
    assert wire["created_at"] == created.timestamp() and wire["started_at"] is None
    assert protocol.Job.model_validate(wire).created_at == created  # read back as a datetime
    beat = protocol.HeartbeatResponse(sandbox_id="s", expires_at=created)
    assert json.loads(beat.model_dump_json())["expires_at"] == created.timestamp()
