"""Fixtures of the image tests. Fake image builders: executables named docker, podman or
buildah on PATH that record each invocation (argv and stdin) and answer like the real ones,
or fail on chosen subcommands."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

_SCRIPT = """#!{python}
import json, os, sys
name = os.path.basename(sys.argv[0])
args = sys.argv[1:]
stdin = sys.stdin.read() if "--password-stdin" in args else None
with open(os.environ["FAKE_BUILDER_LOG"], "a") as log:
    log.write(json.dumps({{"builder": name, "args": args, "stdin": stdin}}) + "\\n")
failing = os.environ.get("FAKE_" + name.upper() + "_FAIL", "").split(",")
command = args[0] if args else ""
if command in failing:
    print("step 1 of the work", flush=True)
    sys.stderr.write(name + ": " + command + " failed on purpose\\n")
    sys.exit(3)
if command == "build":
    print("STEP 1/2: FROM base")
    print("STEP 2/2: RUN something")
    print("Successfully tagged " + args[args.index("--tag") + 1])
elif command == "version":
    print("4.3.1")
elif command in ("image", "inspect"):
    present = os.environ.get("FAKE_PRESENT", "").split(",")
    sys.exit(0 if args[-1] in present else 1)
"""


@dataclass
class FakeBuilders:
    """The folder of fake builders (first on PATH) and the log of their invocations."""

    bin_dir: Path
    log: Path
    monkeypatch: pytest.MonkeyPatch

    def install(self, *names: str) -> None:
        for name in names:
            path = self.bin_dir / name
            path.write_text(_SCRIPT.format(python=sys.executable))
            path.chmod(0o755)

    def fail(self, builder: str, *commands: str) -> None:
        self.monkeypatch.setenv(f"FAKE_{builder.upper()}_FAIL", ",".join(commands))

    def present(self, *refs: str) -> None:
        self.monkeypatch.setenv("FAKE_PRESENT", ",".join(refs))

    def calls(self) -> list[dict[str, object]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def args(self, command: str) -> list[list[str]]:
        """The arguments of every call of one subcommand (``build``, ``push``, ``login``)."""
        found = []
        for call in self.calls():
            args = call["args"]
            assert isinstance(args, list)
            if args and args[0] == command:
                found.append([str(arg) for arg in args])
        return found


@pytest.fixture
def fake_builders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeBuilders:
    """An empty folder first on PATH for fake builders (PATH keeps the rest, git included,
    so install fakes of every builder a test must not find for real)."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    log = tmp_path / "builder-calls.jsonl"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("FAKE_BUILDER_LOG", str(log))
    for name in ("DOCKER", "PODMAN", "BUILDAH"):
        monkeypatch.delenv(f"FAKE_{name}_FAIL", raising=False)
    monkeypatch.delenv("FAKE_PRESENT", raising=False)
    return FakeBuilders(bin_dir, log, monkeypatch)
