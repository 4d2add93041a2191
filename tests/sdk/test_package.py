"""The package surface: upstream's names, and an ``import orchard_env`` that stays cheap."""

from __future__ import annotations

import subprocess
import sys

import pytest

import orchard_env


def test_import_orchard_env_loads_no_sdk_or_server_code() -> None:
    probe = (
        "import sys, orchard_env; "
        "print(orchard_env.errors.SandboxNotFound.code); "
        "heavy = [m for m in ('httpx', 'pydantic', 'websockets', 'fastapi', 'docker', "
        "'kubernetes', 'orchard_env.sdk') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["sandbox_not_found", "[]"]


def test_upstream_names_are_exported() -> None:
    from orchard_env.sdk import (
        AsyncContainerProcess,
        AsyncPtyProcess,
        AsyncSandbox,
        AsyncSandboxClient,
        AsyncSandboxInstance,
        ContainerProcess,
        ExecResult,
        JobResult,
        PtyProcess,
        Sandbox,
        SandboxClient,
        SandboxInstance,
    )

    assert orchard_env.SandboxClient is SandboxClient
    assert orchard_env.AsyncSandboxClient is AsyncSandboxClient
    assert orchard_env.SandboxInstance is SandboxInstance is Sandbox
    assert orchard_env.AsyncSandboxInstance is AsyncSandboxInstance is AsyncSandbox
    assert orchard_env.JobResult is JobResult is ExecResult
    assert (ContainerProcess, AsyncContainerProcess) == (PtyProcess, AsyncPtyProcess)
    assert orchard_env.__version__ == "0.1.0"
    assert set(orchard_env.__all__) >= {"SandboxClient", "AsyncSandboxClient", "errors"}


def test_unknown_attribute() -> None:
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        orchard_env.NoSuchThing  # noqa: B018
