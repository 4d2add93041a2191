"""The SDK as a library others type-check and read: PEP 561's marker ships, and help() on
every public class documents every public method and property."""

from __future__ import annotations

import inspect
import pydoc
import tomllib
from pathlib import Path

import pytest

import orchard_env
from orchard_env import sdk

ROOT = Path(__file__).resolve().parents[2]
CLASSES = (
    sdk.SandboxClient,
    sdk.Sandbox,
    sdk.AsyncSandboxClient,
    sdk.AsyncSandbox,
    sdk.PtyProcess,
    sdk.AsyncPtyProcess,
)


def test_py_typed_ships_with_the_package() -> None:
    assert (Path(orchard_env.__file__).parent / "py.typed").is_file()
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in data["tool"]["setuptools"]["package-data"]["orchard_env"]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_every_public_member_has_a_docstring(cls: type) -> None:
    undocumented = [
        name
        for name, member in inspect.getmembers(cls)
        if not name.startswith("_")
        and (callable(member) or isinstance(member, property))
        and not inspect.getdoc(member)
    ]
    assert undocumented == []
    assert inspect.getdoc(cls)


def test_help_reads_the_same_on_the_sync_and_async_twins() -> None:
    sync_help = pydoc.render_doc(sdk.Sandbox.exec_stream, renderer=pydoc.plaintext)
    async_help = pydoc.render_doc(sdk.AsyncSandbox.upload_file, renderer=pydoc.plaintext)
    assert "cancel_on_interrupt" in sync_help
    assert sdk.Sandbox.upload_file.__doc__ and sdk.Sandbox.upload_file.__doc__ in async_help
