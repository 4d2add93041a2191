"""The Orchard Python SDK: :class:`SandboxClient` (sync) and :class:`AsyncSandboxClient`.

Upstream Orchard Env's names work too (``SandboxInstance``, ``JobResult``,
``ContainerProcess`` ...), so its examples run unchanged::

    from orchard_env import SandboxClient

    with SandboxClient() as client:
        with client.create_sandbox("python:3.11-slim") as sandbox:
            print(sandbox.exec("echo hello").stdout)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orchard_env.sdk.aio import AsyncSandbox, AsyncSandboxClient, AsyncSandboxInstance
    from orchard_env.sdk.client import Sandbox, SandboxClient, SandboxInstance
    from orchard_env.sdk.pty import (
        AsyncContainerProcess,
        AsyncPtyProcess,
        ContainerProcess,
        PtyProcess,
    )
    from orchard_env.sdk.results import (
        ExecResult,
        FileEntry,
        Health,
        JobResult,
        PatchResult,
        UploadResult,
    )

# Where each name lives: a sync caller (the CLI) never loads the asyncio client, and nobody
# loads either before using a name.
_MODULES = {
    "AsyncSandbox": "aio",
    "AsyncSandboxClient": "aio",
    "AsyncSandboxInstance": "aio",
    "Sandbox": "client",
    "SandboxClient": "client",
    "SandboxInstance": "client",
    "AsyncContainerProcess": "pty",
    "AsyncPtyProcess": "pty",
    "ContainerProcess": "pty",
    "PtyProcess": "pty",
    "ExecResult": "results",
    "FileEntry": "results",
    "Health": "results",
    "JobResult": "results",
    "PatchResult": "results",
    "UploadResult": "results",
}


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'orchard_env.sdk' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"orchard_env.sdk.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return [*globals(), *_MODULES]


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
