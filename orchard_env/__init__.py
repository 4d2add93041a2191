"""Orchard: a sandbox environment layer for training and evaluating AI agents.

``import orchard_env`` stays cheap: the SDK (httpx, pydantic, websockets) is imported the
first time one of its names is used, e.g. ``from orchard_env import SandboxClient``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from orchard_env import errors

__version__ = "0.1.0"

if TYPE_CHECKING:
    from orchard_env.sdk import (
        AsyncContainerProcess,
        AsyncSandbox,
        AsyncSandboxClient,
        AsyncSandboxInstance,
        ContainerProcess,
        ExecResult,
        JobResult,
        Sandbox,
        SandboxClient,
        SandboxInstance,
    )

__all__ = [
    "AsyncContainerProcess",
    "AsyncSandbox",
    "AsyncSandboxClient",
    "AsyncSandboxInstance",
    "ContainerProcess",
    "ExecResult",
    "JobResult",
    "Sandbox",
    "SandboxClient",
    "SandboxInstance",
    "__version__",
    "errors",
]

_SDK_NAMES = frozenset(__all__) - {"__version__", "errors"}


def __getattr__(name: str) -> Any:
    if name in _SDK_NAMES:
        return getattr(importlib.import_module("orchard_env.sdk"), name)
    raise AttributeError(f"module 'orchard_env' has no attribute {name!r}")
