"""The Orchard Python SDK: :class:`SandboxClient` (sync) and :class:`AsyncSandboxClient`.

Upstream Orchard Env's names work too (``SandboxInstance``, ``JobResult``,
``ContainerProcess`` ...), so its examples run unchanged::

    from orchard_env import SandboxClient

    with SandboxClient() as client:
        with client.create_sandbox("python:3.11-slim") as sandbox:
            print(sandbox.exec("echo hello").stdout)
"""

from orchard_env.sdk.aio import AsyncSandbox, AsyncSandboxClient, AsyncSandboxInstance
from orchard_env.sdk.client import Sandbox, SandboxClient, SandboxInstance
from orchard_env.sdk.pty import AsyncContainerProcess, AsyncPtyProcess, ContainerProcess, PtyProcess
from orchard_env.sdk.results import (
    ExecResult,
    FileEntry,
    Health,
    JobResult,
    PatchResult,
    UploadResult,
)

__all__ = [
    "AsyncContainerProcess",
    "AsyncPtyProcess",
    "AsyncSandbox",
    "AsyncSandboxClient",
    "AsyncSandboxInstance",
    "ContainerProcess",
    "ExecResult",
    "FileEntry",
    "Health",
    "JobResult",
    "PatchResult",
    "PtyProcess",
    "Sandbox",
    "SandboxClient",
    "SandboxInstance",
    "UploadResult",
]
