"""Files (raw and base64), directories, and apply_patch."""

from __future__ import annotations

import base64

from tests.orchestrator.conftest import Service
from tests.orchestrator.test_sandboxes import detail

BINARY = bytes(range(256)) * 1024 + b"\x00\r\n\xff"

PATCH = """\
--- a/hello.txt
+++ b/hello.txt
@@ -1 +1 @@
-hello
+hello world
"""


async def read_raw(service: Service, sandbox_id: str, path: str) -> bytes:
    response = await service.http.get(f"/sandboxes/{sandbox_id}/files/raw", params={"path": path})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/octet-stream"
    # The size is announced (the agent's), not left to chunked encoding.
    assert response.headers["content-length"] == str(len(response.content))
    assert "transfer-encoding" not in response.headers
    return response.content


async def test_raw_round_trip_is_binary_safe(service: Service) -> None:
    sandbox_id = (await service.create())["sandbox_id"]
    response = await service.http.put(
        f"/sandboxes/{sandbox_id}/files/raw",
        params={"path": "data/blob.bin", "mode": "0755"},
        content=BINARY,
    )
    assert response.status_code == 200
    assert response.json() == {"success": True, "path": "data/blob.bin", "size": len(BINARY)}
    assert await read_raw(service, sandbox_id, "data/blob.bin") == BINARY
    mode = await service.exec(sandbox_id, "stat -c %a data/blob.bin")
    assert mode["stdout"] == "755\n"

    bad_mode = await service.http.put(
        f"/sandboxes/{sandbox_id}/files/raw", params={"path": "x", "mode": "9"}, content=b""
    )
    assert bad_mode.status_code == 400
    assert detail(bad_mode) == {
        "code": "invalid_request",
        "message": "mode '9' is not an octal file mode like 0644",
    }


async def test_base64_round_trip_is_binary_safe(service: Service) -> None:
    sandbox_id = (await service.create())["sandbox_id"]
    content = base64.b64encode(BINARY).decode()
    response = await service.http.post(
        f"/sandboxes/{sandbox_id}/files", json={"path": "b64.bin", "content": content}
    )
    assert response.status_code == 200
    assert response.json() == {"success": True, "path": "b64.bin", "size": len(BINARY)}
    downloaded = await service.http.get(
        f"/sandboxes/{sandbox_id}/files", params={"path": "b64.bin"}
    )
    assert downloaded.status_code == 200
    body = downloaded.json()
    assert body["path"] == "b64.bin" and body["size"] == len(BINARY)
    assert base64.b64decode(body["content"]) == BINARY

    bad = await service.http.post(
        f"/sandboxes/{sandbox_id}/files", json={"path": "x", "content": "not base64!"}
    )
    assert bad.status_code == 400
    assert detail(bad)["message"].startswith("content is not valid base64")


async def test_missing_files_and_directories(service: Service) -> None:
    sandbox_id = (await service.create())["sandbox_id"]
    for path in (f"/sandboxes/{sandbox_id}/files", f"/sandboxes/{sandbox_id}/files/raw"):
        response = await service.http.get(path, params={"path": "absent.txt"})
        assert response.status_code == 404
        assert detail(response)["code"] == "file_not_found"
        assert detail(response)["message"].endswith("/absent.txt does not exist")
    await service.http.post(f"/sandboxes/{sandbox_id}/files/mkdir", json={"path": "adir"})
    response = await service.http.get(f"/sandboxes/{sandbox_id}/files", params={"path": "adir"})
    assert response.status_code == 400
    assert detail(response)["message"].endswith("/adir is a directory")


async def test_list_delete_mkdir(service: Service) -> None:
    sandbox_id = (await service.create())["sandbox_id"]
    base = f"/sandboxes/{sandbox_id}/files"
    made = await service.http.post(f"{base}/mkdir", json={"path": "a/b/c"})
    assert made.status_code == 200 and made.json() == {"path": "a/b/c"}
    await service.http.put(f"{base}/raw", params={"path": "a/file.txt"}, content=b"12345")
    await service.http.put(f"{base}/raw", params={"path": "top.txt"}, content=b"")

    listed = await service.http.get(f"{base}/list")  # default: the workdir
    assert listed.status_code == 200
    assert listed.json()["path"] == "/workspace"
    assert [(e["name"], e["type"]) for e in listed.json()["files"]] == [
        ("a", "directory"),
        ("top.txt", "file"),
    ]
    inner = (await service.http.get(f"{base}/list", params={"path": "a"})).json()
    assert inner["path"] == "a"  # as asked (relative: in the workdir)
    files = inner["files"]
    assert [(e["name"], e["type"], e["size"]) for e in files if e["type"] == "file"] == [
        ("file.txt", "file", 5)
    ]
    assert all(set(e) == {"name", "type", "size", "modified"} for e in files)

    exists = await service.http.post(f"{base}/mkdir", json={"path": "a", "parents": False})
    assert exists.status_code == 409
    not_empty = await service.http.delete(base, params={"path": "a"})
    assert not_empty.status_code == 409
    assert detail(not_empty)["message"].endswith("is not empty (pass recursive=true)")
    deleted = await service.http.delete(base, params={"path": "a", "recursive": "true"})
    assert deleted.status_code == 200 and deleted.json() == {"deleted": "a"}
    remaining = (await service.http.get(f"{base}/list")).json()
    assert [e["name"] for e in remaining["files"]] == ["top.txt"]


async def test_apply_patch(service: Service) -> None:
    sandbox_id = (await service.create())["sandbox_id"]
    await service.http.put(
        f"/sandboxes/{sandbox_id}/files/raw", params={"path": "hello.txt"}, content=b"hello\n"
    )
    url = f"/sandboxes/{sandbox_id}/apply_patch"

    checked = (await service.http.post(url, json={"patch": PATCH, "check": True})).json()
    assert checked["success"] is True
    assert await read_raw(service, sandbox_id, "hello.txt") == b"hello\n"

    applied = (await service.http.post(url, json={"patch": PATCH})).json()
    assert applied == {"success": True, "stdout": "", "stderr": "", "exit_code": 0, "error": None}
    assert await read_raw(service, sandbox_id, "hello.txt") == b"hello world\n"

    again = (await service.http.post(url, json={"patch": PATCH})).json()
    assert again["success"] is False and again["exit_code"] == 1
    assert again["error"] == "git apply failed with exit code 1"
    assert "patch does not apply" in again["stderr"]

    reverted = (await service.http.post(url, json={"patch": PATCH, "reverse": True})).json()
    assert reverted["success"] is True
    assert await read_raw(service, sandbox_id, "hello.txt") == b"hello\n"


async def test_apply_patch_without_git_says_so(service: Service) -> None:
    sandbox = await service.create(env={"PATH": "/nonexistent"})
    response = await service.http.post(
        f"/sandboxes/{sandbox['sandbox_id']}/apply_patch", json={"patch": PATCH}
    )
    assert response.status_code == 200
    result = response.json()
    assert result["success"] is False and result["exit_code"] == 127
    assert result["error"] == (
        "git is not installed in image debian:12: install git in the image "
        "or apply the patch with files upload"
    )
