"""Files: raw streamed uploads and downloads, listings, patches."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from orchard_env import errors
from orchard_env.sdk import Sandbox, SandboxClient
from orchard_env.sdk._handle import CHUNK
from tests.sdk.fakes import FakeService
from tests.sdk.test_retries import fail_first


@pytest.fixture
def sandbox(client: SandboxClient) -> Sandbox:
    return client.create_sandbox("python:3.11-slim")


def test_upload_file_streams_raw_bytes_with_its_mode(
    sandbox: Sandbox, service: FakeService, tmp_path: Path
) -> None:
    local = tmp_path / "run.sh"
    payload = os.urandom(2 * CHUNK + 17)
    local.write_bytes(payload)
    local.chmod(0o755)

    result = sandbox.upload_file(local, "/workspace/run.sh")

    (put,) = service.seen("PUT", f"/sandboxes/{sandbox.sandbox_id}/files/raw")
    assert put.content == payload  # raw, not base64
    assert put.headers["Content-Length"] == str(len(payload))
    assert put.headers["Content-Type"] == "application/octet-stream"
    assert dict(put.url.params) == {"path": "/workspace/run.sh", "mode": "0755"}
    assert (result.path, result.size, result["success"]) == (
        "/workspace/run.sh",
        len(payload),
        True,
    )


def test_upload_is_resent_whole_after_a_failure(
    sandbox: Sandbox, service: FakeService, tmp_path: Path
) -> None:
    local = tmp_path / "data.bin"
    local.write_bytes(b"x" * (CHUNK + 5))
    service.interceptors.append(fail_first("PUT", "/files/raw", httpx.WriteError("broken pipe")))
    sandbox.upload_file(str(local), "/workspace/data.bin")
    puts = service.seen("PUT", f"/sandboxes/{sandbox.sandbox_id}/files/raw")
    assert [len(p.content) for p in puts] == [CHUNK + 5, CHUNK + 5]


def test_upload_of_a_missing_or_odd_local_file(sandbox: Sandbox, tmp_path: Path) -> None:
    with pytest.raises(errors.FileNotFound, match=f"local file {tmp_path}/nope does not exist"):
        sandbox.upload_file(tmp_path / "nope", "/workspace/x")
    with pytest.raises(errors.InvalidRequest, match="is not a regular file"):
        sandbox.upload_file(tmp_path, "/workspace/x")


def test_upload_content_and_download_content(sandbox: Sandbox, service: FakeService) -> None:
    sandbox.upload_content("héllo\n", "/workspace/a.txt")
    sandbox.upload_content(b"\x00\xff", "/workspace/b.bin")
    (first, _) = service.seen("PUT", f"/sandboxes/{sandbox.sandbox_id}/files/raw")
    assert "mode" not in first.url.params
    assert sandbox.download_content("/workspace/a.txt") == "héllo\n".encode()
    assert sandbox.download_content("/workspace/b.bin") == b"\x00\xff"


def test_download_file_is_complete_or_absent(
    sandbox: Sandbox, service: FakeService, tmp_path: Path
) -> None:
    data = os.urandom(3 * CHUNK)
    service.files[(sandbox.sandbox_id, "/workspace/out.bin")] = data
    target = tmp_path / "out.bin"
    assert sandbox.download_file("/workspace/out.bin", target) == len(data)
    assert target.read_bytes() == data

    with pytest.raises(errors.FileNotFound, match="/workspace/missing does not exist"):
        sandbox.download_file("/workspace/missing", tmp_path / "missing")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]

    with pytest.raises(errors.FileNotFound, match=r"local directory .* does not exist"):
        sandbox.download_file("/workspace/out.bin", tmp_path / "no" / "dir")


def test_list_files_entries_work_both_ways(sandbox: Sandbox, service: FakeService) -> None:
    sandbox.upload_content(b"12345", "/workspace/five.txt")
    (entry,) = sandbox.list_files()
    assert (entry.name, entry.type, entry.size) == ("five.txt", "file", 5)
    assert (entry["name"], entry["type"], entry["size"]) == ("five.txt", "file", 5)
    assert entry.get("nope", "default") == "default"
    with pytest.raises(KeyError):
        entry["nope"]


def test_delete_file_and_mkdir(sandbox: Sandbox, service: FakeService) -> None:
    sandbox.upload_content(b"x", "/workspace/gone.txt")
    sandbox.delete_file("/workspace/gone.txt")
    sandbox.delete_file("/workspace/tree", recursive=True)
    sandbox.mkdir("/workspace/a/b")
    deletes = service.seen("DELETE", f"/sandboxes/{sandbox.sandbox_id}/files")
    assert [dict(d.url.params) for d in deletes] == [
        {"path": "/workspace/gone.txt", "recursive": "false"},
        {"path": "/workspace/tree", "recursive": "true"},
    ]
    (mkdir,) = service.seen("POST", f"/sandboxes/{sandbox.sandbox_id}/files/mkdir")
    assert json.loads(mkdir.content) == {"path": "/workspace/a/b", "parents": True}
    assert sandbox.list_files() == []


def test_apply_patch(sandbox: Sandbox, service: FakeService) -> None:
    result = sandbox.apply_patch("--- a/x\n+++ b/x\n", cwd="/src", three_way=True, timeout=5)
    assert result.success and result["success"]
    (post,) = service.seen("POST", f"/sandboxes/{sandbox.sandbox_id}/apply_patch")
    assert json.loads(post.content) == {
        "patch": "--- a/x\n+++ b/x\n",
        "timeout_seconds": 5,
        "cwd": "/src",
        "check": False,
        "three_way": True,
        "reverse": False,
    }
    bad = sandbox.apply_patch("garbage")
    assert not bad.success and bad.stderr == "corrupt patch"
