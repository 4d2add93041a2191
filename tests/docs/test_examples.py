"""The examples of the docs run, as a user would run them, against a real orchestrator.

A ```python or ```bash block preceded by ``<!-- doctest: run -->`` is written to a file and
run with ``python`` (or ``bash -e -o pipefail``, the ``orchard`` command on ``PATH``) in a
fresh directory, with ``ORCHARD_URL`` and ``ORCHARD_API_KEY`` pointing at the orchestrator (so
``SandboxClient()`` and the CLI find it, as after ``orchard up``; ``URL`` and ``KEY`` too, for
``curl``). The orchestrator is the
real app under uvicorn on 127.0.0.1 with the service-tier fake backend: every sandbox is the
real agent as a host process (so exec, files, streams and PTY are real; the container around
it, and with it isolation and limits, is not). A ```text block preceded by
``<!-- doctest: output -->`` right after a runnable block is its expected stdout (``...``
matches anything). An example must delete every sandbox it creates.

Blocks that cannot run here say why: ``<!-- doctest: skip: <reason> -->``. In docs/ and
README.md every Python and bash block carries one of the two markers (docs/cost.md has its
own test; docs/cli.md is generated, its ``console`` blocks are usage, not examples).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from provision.profile import DeploymentProfile
from tests.docs.markdown import DOCS, Block, blocks, markdown_files
from tests.orchestrator.conftest import make_settings
from tests.servers import Live, fake_backend, live_service

SELF_TESTED = {DOCS / "cost.md"}  # tests/cost/test_docs.py runs its examples
_SKIP = re.compile(r"^skip: \S.*$")
EXAMPLE_TIMEOUT = 120
RUNNABLE = {"python": [sys.executable], "bash": ["bash", "-e", "-o", "pipefail"]}


@dataclass(frozen=True)
class Example:
    block: Block
    output: str | None  # the expected stdout, if the doc shows it

    @property
    def location(self) -> str:
        return self.block.location


def _examples() -> list[Example]:
    found = []
    for path in markdown_files():
        if path in SELF_TESTED:
            continue
        found_blocks = blocks(path)
        for index, block in enumerate(found_blocks):
            if block.lang not in RUNNABLE or block.marker != "run":
                continue
            following = found_blocks[index + 1] if index + 1 < len(found_blocks) else None
            output = following.code if following and following.marker == "output" else None
            found.append(Example(block, output))
    return found


EXAMPLES = _examples()


def test_markers_are_known_and_python_blocks_in_docs_are_marked() -> None:
    problems = []
    for path in markdown_files():
        if path in SELF_TESTED:
            continue
        found = blocks(path)
        for index, block in enumerate(found):
            marker = block.marker
            if marker == "output":
                previous = found[index - 1] if index else None
                if previous is None or previous.marker != "run" or block.lang != "text":
                    problems.append(f"{block.location}: an output block follows a run block")
            elif marker is not None and marker != "run" and not _SKIP.match(marker):
                problems.append(f"{block.location}: unknown marker {marker!r}")
            elif marker == "run" and block.lang not in RUNNABLE:
                problems.append(f"{block.location}: only python and bash blocks can run")
            elif block.lang in RUNNABLE and marker is None:
                problems.append(
                    f"{block.location}: mark it <!-- doctest: run --> "
                    "or <!-- doctest: skip: <reason> -->"
                )
    assert not problems, "\n".join(problems)


def test_the_sdk_guide_is_tested() -> None:
    assert sum(example.block.path == DOCS / "sdk.md" for example in EXAMPLES) >= 10


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """The orchestrator under uvicorn on a free loopback port, with an admin key."""
    settings = make_settings(tmp_path_factory.mktemp("docs-service") / "state")
    with (
        fake_backend() as backend,
        live_service(
            settings, key_name="docs", backend=backend, thread_name="uvicorn-docs"
        ) as running,
    ):
        yield running


def _matches(expected: str, actual: str) -> bool:
    pattern = ".*?".join(re.escape(part) for part in expected.rstrip().split("..."))
    return re.fullmatch(pattern, actual.rstrip(), re.DOTALL) is not None


def _left_behind(live: Live) -> list[str]:
    """Delete the sandboxes still alive; return their ids."""
    headers = {"X-API-Key": live.api_key}
    with httpx.Client(base_url=live.url, headers=headers, timeout=30) as http:
        alive = [sb["sandbox_id"] for sb in http.get("/sandboxes").json()["sandboxes"]]
        for sandbox_id in alive:
            http.delete(f"/sandboxes/{sandbox_id}")
    return alive


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda example: example.location)
def test_example_runs(example: Example, live: Live, tmp_path: Path) -> None:
    script = tmp_path / f"example.{example.block.lang}"
    script.write_text(example.block.code)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ORCHARD_", "SANDBOX_"))}
    env.update(
        ORCHARD_URL=live.url,
        ORCHARD_API_KEY=live.api_key,
        ORCHARD_CONFIG=str(tmp_path / "no-config.toml"),
        URL=live.url,
        KEY=live.api_key,
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    done = subprocess.run(
        [*RUNNABLE[example.block.lang], str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=EXAMPLE_TIMEOUT,
        check=False,
    )
    left = _left_behind(live)
    report = f"--- stdout\n{done.stdout}--- stderr\n{done.stderr}"
    assert done.returncode == 0, f"{example.location} failed (exit {done.returncode})\n{report}"
    if example.output is not None:
        assert _matches(example.output, done.stdout), (
            f"{example.location} printed something else than the doc shows\n"
            f"--- the doc\n{example.output}{report}"
        )
    assert not left, f"{example.location} left sandboxes alive: {left}"


def test_profile_fragments_in_the_deployment_guide_are_valid_profiles() -> None:
    """The YAML blocks of docs/deployment.md are deployment profiles (or parts of one)."""
    found = [b for b in blocks(DOCS / "deployment.md") if b.lang == "yaml"]
    assert found
    for block in found:
        profile = DeploymentProfile.model_validate(yaml.safe_load(block.code))
        assert profile is not None, block.location
