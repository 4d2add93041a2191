"""File routes (upstream's base64 ones and streamed raw ones) and ``apply_patch``."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import AfterValidator

from orchard_env.errors import InvalidRequest
from orchard_env.orchestrator.api.deps import CallerDep, OrchardDep
from orchard_env.protocol import (
    MAX_PATH_LENGTH,
    FileContent,
    FileDeleteResult,
    FileList,
    FileUpload,
    FileUploadResult,
    MkdirRequest,
    MkdirResult,
    PatchRequest,
    PatchResult,
    check_path,
)

router = APIRouter(tags=["files"])

PathQuery = Annotated[
    str,
    Query(
        min_length=1,
        max_length=MAX_PATH_LENGTH,
        description="absolute, or relative to the workdir; no NUL",
        json_schema_extra={"pattern": r"^[^\x00]+$"},
    ),
    AfterValidator(check_path),
]


def parse_mode(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        mode = int(value, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o7777:
        raise InvalidRequest(f"mode {value!r} is not an octal file mode like 0644")
    return mode


@router.post("/sandboxes/{sandbox_id}/apply_patch")
async def apply_patch(
    sandbox_id: str, request: PatchRequest, orchard: OrchardDep, caller: CallerDep
) -> PatchResult:
    return await orchard.files.apply_patch(sandbox_id, request, caller)


@router.post("/sandboxes/{sandbox_id}/files")
async def upload_file(
    sandbox_id: str, upload: FileUpload, orchard: OrchardDep, caller: CallerDep
) -> FileUploadResult:
    return await orchard.files.upload(sandbox_id, upload, caller)


@router.get("/sandboxes/{sandbox_id}/files", response_model=FileContent)
async def download_file(
    sandbox_id: str, path: PathQuery, orchard: OrchardDep, caller: CallerDep
) -> StreamingResponse:
    """Upstream's base64 download, streamed as it is encoded (any size; the raw route is
    a third smaller on the wire)."""
    body = await orchard.files.download(sandbox_id, path, caller)
    return StreamingResponse(body, media_type="application/json")


@router.delete("/sandboxes/{sandbox_id}/files")
async def delete_path(
    sandbox_id: str,
    path: PathQuery,
    orchard: OrchardDep,
    caller: CallerDep,
    recursive: bool = False,
) -> FileDeleteResult:
    return await orchard.files.delete(sandbox_id, path, recursive, caller)


@router.get("/sandboxes/{sandbox_id}/files/list")
async def list_files(
    sandbox_id: str,
    orchard: OrchardDep,
    caller: CallerDep,
    path: Annotated[
        str | None,
        Query(max_length=MAX_PATH_LENGTH, description="default: the sandbox's workdir"),
        AfterValidator(lambda v: None if v is None else check_path(v)),
    ] = None,
) -> FileList:
    return await orchard.files.list(sandbox_id, path, caller)


@router.post("/sandboxes/{sandbox_id}/files/mkdir")
async def mkdir(
    sandbox_id: str, request: MkdirRequest, orchard: OrchardDep, caller: CallerDep
) -> MkdirResult:
    return await orchard.files.mkdir(sandbox_id, request, caller)


@router.put(
    "/sandboxes/{sandbox_id}/files/raw",
    openapi_extra={"requestBody": {"content": {"application/octet-stream": {}}, "required": True}},
)
async def upload_raw(
    sandbox_id: str,
    path: PathQuery,
    request: Request,
    orchard: OrchardDep,
    caller: CallerDep,
    mode: Annotated[
        str | None,
        Query(description="octal, e.g. 0644", json_schema_extra={"pattern": "^0*[0-7]{1,4}$"}),
    ] = None,
) -> FileUploadResult:
    return await orchard.files.upload_raw(
        sandbox_id, path, request.stream(), parse_mode(mode), caller
    )


@router.get(
    "/sandboxes/{sandbox_id}/files/raw",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}},
)
async def download_raw(
    sandbox_id: str, path: PathQuery, orchard: OrchardDep, caller: CallerDep
) -> StreamingResponse:
    stream = await orchard.files.download_raw(sandbox_id, path, caller)
    headers = {} if stream.size is None else {"Content-Length": str(stream.size)}
    return StreamingResponse(stream, media_type="application/octet-stream", headers=headers)
