"""Files and patches: proxied to the sandbox's agent, streamed, never via the backend.

Relative paths are resolved by the agent against the sandbox's working directory.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import AsyncIterable, AsyncIterator

from orchard_env.agent.client import AgentClient, Exit, FileStream
from orchard_env.errors import InvalidRequest
from orchard_env.orchestrator.agents import AgentPool
from orchard_env.orchestrator.auth import Caller
from orchard_env.orchestrator.records import SandboxRecord
from orchard_env.orchestrator.sandboxes import SandboxService
from orchard_env.protocol import (
    FileDeleteResult,
    FileList,
    FileUpload,
    FileUploadResult,
    MkdirRequest,
    MkdirResult,
    PatchRequest,
    PatchResult,
)

MAX_PATCH_OUTPUT = 1024 * 1024


async def base64_json(path: str, chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """``{"path", "content": base64, "size"}`` (:class:`FileContent`), a chunk at a time."""
    yield b'{"path":' + json.dumps(path).encode() + b',"content":"'
    size = 0
    rest = b""
    async for chunk in chunks:
        size += len(chunk)
        data = rest + chunk
        whole = len(data) - len(data) % 3  # base64 of whole 3-byte groups has no padding
        yield base64.b64encode(data[:whole])
        rest = data[whole:]
    yield base64.b64encode(rest) + b'","size":' + str(size).encode() + b"}"


class FileService:
    def __init__(self, sandboxes: SandboxService, agents: AgentPool) -> None:
        self.sandboxes = sandboxes
        self.agents = agents

    async def _agent(self, sandbox_id: str, caller: Caller) -> tuple[SandboxRecord, AgentClient]:
        record = await self.sandboxes.require_ready(sandbox_id, caller)
        await self.sandboxes.touch(sandbox_id)
        return record, self.agents.client(record)

    # --- upstream's base64 routes ----------------------------------------------------------

    async def upload(self, sandbox_id: str, upload: FileUpload, caller: Caller) -> FileUploadResult:
        try:
            data = base64.b64decode(upload.content, validate=True)
        except ValueError as exc:  # binascii.Error, or a character that is not ASCII
            raise InvalidRequest(f"content is not valid base64: {exc}") from exc
        _, agent = await self._agent(sandbox_id, caller)
        size = await agent.write_file(upload.path, data, upload.mode)
        return FileUploadResult(path=upload.path, size=size)

    async def download(self, sandbox_id: str, path: str, caller: Caller) -> AsyncIterator[bytes]:
        """Upstream's :class:`FileContent` as JSON text, encoded while the file streams from
        the agent, so a download holds a chunk in memory, whatever the file's size. A missing
        file is an error (404) here, before any byte."""
        _, agent = await self._agent(sandbox_id, caller)
        return base64_json(path, await agent.open_file(path))

    # --- streamed routes -------------------------------------------------------------------

    async def upload_raw(
        self,
        sandbox_id: str,
        path: str,
        body: AsyncIterator[bytes],
        mode: int | None,
        caller: Caller,
    ) -> FileUploadResult:
        _, agent = await self._agent(sandbox_id, caller)
        size = await agent.write_file(path, body, mode)
        return FileUploadResult(path=path, size=size)

    async def download_raw(self, sandbox_id: str, path: str, caller: Caller) -> FileStream:
        """The open download from the agent: its size, then its bytes as they come. A missing
        file is an error (404) here, rather than a broken 200 stream."""
        _, agent = await self._agent(sandbox_id, caller)
        return await agent.open_file(path)

    async def list(self, sandbox_id: str, path: str | None, caller: Caller) -> FileList:
        record, agent = await self._agent(sandbox_id, caller)
        entries = await agent.list_dir(path or ".")  # relative: in the sandbox's workdir
        return FileList(path=path or record.workdir, files=entries)

    async def delete(
        self, sandbox_id: str, path: str, recursive: bool, caller: Caller
    ) -> FileDeleteResult:
        _, agent = await self._agent(sandbox_id, caller)
        await agent.delete_path(path, recursive=recursive)
        return FileDeleteResult(deleted=path)

    async def mkdir(self, sandbox_id: str, request: MkdirRequest, caller: Caller) -> MkdirResult:
        _, agent = await self._agent(sandbox_id, caller)
        await agent.mkdir(request.path, parents=request.parents)
        return MkdirResult(path=request.path)

    # --- patches ---------------------------------------------------------------------------

    async def apply_patch(
        self, sandbox_id: str, request: PatchRequest, caller: Caller
    ) -> PatchResult:
        """``git apply`` in the sandbox (the patch on stdin), with --check/--3way/--reverse.

        A patch whose last line lacks its newline gets one (git calls it corrupt otherwise;
        upstream's heredoc added it, and its documented example relies on that).
        """
        record, agent = await self._agent(sandbox_id, caller)
        patch = request.patch if request.patch.endswith("\n") else request.patch + "\n"
        argv = ["git", "apply"]
        if request.check:
            argv.append("--check")
        if request.three_way:
            argv.append("--3way")
        if request.reverse:
            argv.append("--reverse")
        output: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        final: Exit | None = None
        async with self.sandboxes.in_use(sandbox_id):
            async for event in agent.exec(
                f"patch-{uuid.uuid4().hex}",
                argv,
                cwd=request.cwd,
                env={},
                timeout=request.timeout_seconds,
                login_shell=False,
                stdin=patch.encode(),
                max_output_bytes=MAX_PATCH_OUTPUT,
            ):
                if isinstance(event, Exit):
                    final = event
                else:
                    output[event.stream].append(event.data)
        stdout = b"".join(output["stdout"]).decode(errors="replace")
        stderr = b"".join(output["stderr"]).decode(errors="replace")
        if final is None:
            return PatchResult(
                success=False,
                stdout=stdout,
                stderr=stderr,
                exit_code=None,
                error="the agent ended the command before it exited",
            )
        error = final.error
        if final.exit_code == 127 and error is not None and "git" in error:
            error = (
                f"git is not installed in image {record.image}: install git in the image "
                "or apply the patch with files upload"
            )
        elif final.timed_out:
            error = f"git apply timed out after {request.timeout_seconds} s"
        elif final.exit_code != 0 and error is None:
            error = f"git apply failed with exit code {final.exit_code}"
        return PatchResult(
            success=final.exit_code == 0 and not final.timed_out,
            stdout=stdout,
            stderr=stderr,
            exit_code=final.exit_code,
            error=error,
        )
