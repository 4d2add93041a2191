"""`orchard images build|push|list`: data on stdout, builder output on stderr (fake builders on
PATH; the real builds are in test_image_builds.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchard_cli.main import app
from orchard_env.errors import ConfigError
from tests.images.conftest import FakeBuilders

runner = CliRunner()


@pytest.fixture
def podman(fake_builders: FakeBuilders) -> FakeBuilders:
    fake_builders.install("docker", "podman")
    fake_builders.fail("docker", "version")  # no daemon: podman is the builder
    return fake_builders


def test_list_shows_the_profile_refs_and_which_exist(podman: FakeBuilders, tmp_path: Path) -> None:
    profile = tmp_path / "profile.yaml"
    profile.write_text("name: demo\ntarget: aks\nimage_tag: v3\n")
    podman.present("demoacr.azurecr.io/orchard/sandbox:v3")
    result = runner.invoke(app, ["images", "list", "--profile", str(profile), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [
        {
            "name": "orchestrator",
            "ref": "demoacr.azurecr.io/orchard/orchestrator:v3",
            "present": False,
        },
        {
            "name": "agent-injector",
            "ref": "demoacr.azurecr.io/orchard/agent-injector:v3",
            "present": False,
        },
        {"name": "sandbox", "ref": "demoacr.azurecr.io/orchard/sandbox:v3", "present": True},
    ]
    table = runner.invoke(app, ["images", "list", "--tag", "v3", "--only", "sandbox"])
    header, row = table.stdout.splitlines()
    assert header.split() == ["IMAGE", "LOCAL", "REFERENCE"]
    assert row.split() == ["sandbox", "no", "localhost/orchard/sandbox:v3"]


def test_build_prints_the_refs_and_streams_the_builder_to_stderr(podman: FakeBuilders) -> None:
    result = runner.invoke(
        app,
        [
            "images",
            "build",
            "--registry",
            "r.example.com",
            "--tag",
            "t1",
            "--only",
            "sandbox",
            "--only",
            "orchestrator",
            "--platform",
            "linux/arm64",
            "--base-image",
            "BASE_IMAGE=debian:trixie-slim",
        ],
    )
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        "r.example.com/orchard/orchestrator:t1\nr.example.com/orchard/sandbox:t1\n"
    )
    assert "STEP 2/2: RUN something" in result.stderr
    builds = podman.args("build")
    assert len(builds) == 2
    assert all(b[b.index("--platform") + 1] == "linux/arm64" for b in builds)
    assert all("BASE_IMAGE=debian:trixie-slim" in b for b in builds)


def test_push_to_a_registry_that_is_not_acr(podman: FakeBuilders) -> None:
    result = runner.invoke(
        app, ["images", "push", "--registry", "ghcr.io/acme", "--tag", "t1", "--only", "sandbox"]
    )
    assert result.exit_code == 0, result.output
    assert result.stdout == "ghcr.io/acme/orchard/sandbox:t1\n"
    assert podman.args("push") == [["push", "ghcr.io/acme/orchard/sandbox:t1"]]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["build", "--only", "redis"], "unknown image 'redis'"),
        (["build", "--base-image", "python:3.11"], "base image 'python:3.11' is not ARG=IMAGE"),
        (["push", "--tag", "t1"], "localhost/orchard/orchestrator:t1 names no registry to push to"),
        (["list", "--builder", "kaniko"], "unknown image builder 'kaniko'"),
    ],
)
def test_mistakes_are_config_errors(podman: FakeBuilders, args: list[str], message: str) -> None:
    result = runner.invoke(app, ["images", *args])
    assert isinstance(result.exception, ConfigError)
    assert result.exception.message == message
    assert podman.args("build") == podman.args("push") == []
