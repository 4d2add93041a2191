"""images/build.py without an engine: references, tags, builder detection, build contexts and
the builder command lines (fake builders on PATH record them)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from images import build
from images.build import (
    SourceInfo,
    assemble_context,
    build_command,
    build_images,
    default_tag,
    detect_builder,
    image_refs,
    parse_base_images,
    public_url,
    registry_of,
    resolve_refs,
    source_info,
)
from orchard_env import __version__
from orchard_env.errors import ConfigError, EngineNotFound, OrchardError
from provision.profile import DeploymentProfile
from tests.images.conftest import FakeBuilders

# --- references and tags ----------------------------------------------------------------


def test_image_refs_name_every_image_under_registry_and_repository() -> None:
    assert image_refs("myacr.azurecr.io", "orchard", "1.2.3") == {
        "orchestrator": "myacr.azurecr.io/orchard/orchestrator:1.2.3",
        "agent-injector": "myacr.azurecr.io/orchard/agent-injector:1.2.3",
        "sandbox": "myacr.azurecr.io/orchard/sandbox:1.2.3",
        "tools": "myacr.azurecr.io/orchard/tools:1.2.3",
    }
    assert image_refs("ghcr.io/acme/", "ml/orchard", "t")["sandbox"] == (
        "ghcr.io/acme/ml/orchard/sandbox:t"
    )
    assert image_refs("localhost:5000", "o", "t")["sandbox"] == "localhost:5000/o/sandbox:t"
    assert image_refs(None, "orchard", "t")["orchestrator"] == "localhost/orchard/orchestrator:t"


@pytest.mark.parametrize(
    ("registry", "repository", "tag", "message"),
    [
        ("https://myacr.azurecr.io", "orchard", "t", "registry 'https://myacr.azurecr.io' is "),
        ("r.io", "Orchard", "t", "repository 'Orchard' is not a valid image repository path"),
        ("r.io", "orchard//x", "t", "repository 'orchard//x' is not a valid image repository"),
        ("r.io/Acme", "orchard", "t", "registry path 'Acme' is not a valid image repository"),
        ("r.io", "orchard", "-t", "image tag '-t' is not valid"),
        ("r.io", "orchard", "a+b", "image tag 'a+b' is not valid"),
        ("r.io", "orchard", "x" * 129, "image tag 'xxxx"),
    ],
)
def test_image_refs_refuse_invalid_parts(
    registry: str, repository: str, tag: str, message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        image_refs(registry, repository, tag)
    assert caught.value.message.startswith(message)


def test_registry_of_a_reference() -> None:
    assert registry_of("myacr.azurecr.io/orchard/sandbox:t") == "myacr.azurecr.io"
    assert registry_of("localhost:5000/o/sandbox:t") == "localhost:5000"
    assert registry_of("localhost/orchard/sandbox:t") == "localhost"
    assert registry_of("library/busybox:1.36") is None  # Docker Hub
    assert registry_of("busybox") is None


@pytest.mark.parametrize(
    ("remote", "url"),
    [
        ("git@github.com:acme/orchard.git", "https://github.com/acme/orchard"),
        ("https://github.com/acme/orchard.git", "https://github.com/acme/orchard"),
        ("https://bot:ghp_secret@github.com/acme/orchard", "https://github.com/acme/orchard"),
        ("ssh://git@git.example.com:2222/acme/orchard.git", "https://git.example.com/acme/orchard"),
        ("/srv/git/orchard.git", None),
        ("file:///srv/git/orchard.git", None),
    ],
)
def test_public_url_of_a_git_remote_drops_credentials(remote: str, url: str | None) -> None:
    assert public_url(remote) == url


def _git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    _git(root, "init", "-q")
    (root / "tracked.txt").write_text("one\n")
    _git(root, "add", "tracked.txt")
    _git(root, "commit", "-q", "-m", "first")
    return root


def test_default_tag_is_version_and_commit_and_dirty_only_for_tracked_changes(repo: Path) -> None:
    short = _git(repo, "rev-parse", "--short", "HEAD")
    info = source_info(repo)
    assert info.commit == _git(repo, "rev-parse", "HEAD") and info.url is None
    assert default_tag(info) == f"{__version__}-{short}"
    (repo / "untracked.txt").write_text("new\n")
    assert default_tag(source_info(repo)) == f"{__version__}-{short}"
    (repo / "tracked.txt").write_text("two\n")
    assert default_tag(source_info(repo)) == f"{__version__}-{short}-dirty"
    _git(repo, "remote", "add", "origin", "https://bot:token@example.com/acme/orchard.git")
    assert source_info(repo).url == "https://example.com/acme/orchard"


def test_default_tag_outside_git_is_the_version(tmp_path: Path) -> None:
    info = source_info(tmp_path)
    assert info == SourceInfo(version=__version__)
    assert default_tag(info) == __version__
    assert default_tag(SourceInfo(version="1.0+local.2")) == "1.0-local.2"


def test_default_tag_of_this_checkout() -> None:
    tag = default_tag()
    assert re.fullmatch(re.escape(__version__) + r"-[0-9a-f]{7,40}(-dirty)?", tag)
    assert resolve_refs()["sandbox"] == f"localhost/orchard/sandbox:{tag}"


def _profile(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "profile.yaml"
    path.write_text(text)
    return path


def test_resolve_refs_from_a_profile(tmp_path: Path) -> None:
    aks = _profile(tmp_path, "name: demo\ntarget: aks\nimage_tag: v7\n")
    assert resolve_refs(aks)["orchestrator"] == "demoacr.azurecr.io/orchard/orchestrator:v7"
    assert resolve_refs(aks, tag="v8", only=["sandbox"]) == {
        "sandbox": "demoacr.azurecr.io/orchard/sandbox:v8"
    }
    custom = _profile(
        tmp_path,
        "target: kubeconfig\nimage_tag: v7\nregistry:\n  server: reg.example.com:5000\n"
        "  repository: team/orchard\n",
    )
    assert resolve_refs(custom)["sandbox"] == "reg.example.com:5000/team/orchard/sandbox:v7"
    other = resolve_refs(custom, registry="other.io")
    assert other["sandbox"] == "other.io/team/orchard/sandbox:v7"
    local = _profile(tmp_path, "target: kubeconfig\nimage_tag: v7\n")
    assert resolve_refs(local)["sandbox"] == "localhost/orchard/sandbox:v7"


def test_resolve_refs_refuses_an_unknown_image() -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_refs(tag="t", only=["sandbox", "redis"])
    assert caught.value.message == "unknown image 'redis'"
    assert caught.value.hint == "the images are orchestrator, agent-injector, sandbox, tools"


# --- builder detection --------------------------------------------------------------------


def test_detect_builder_prefers_docker_then_podman_then_buildah(
    fake_builders: FakeBuilders,
) -> None:
    fake_builders.install("docker", "podman", "buildah")
    assert detect_builder() == "docker"
    fake_builders.fail("docker", "version")  # a docker CLI without a reachable daemon
    assert detect_builder() == "podman"
    (fake_builders.bin_dir / "podman").unlink()
    fake_builders.monkeypatch.setenv("PATH", str(fake_builders.bin_dir))
    assert detect_builder() == "buildah"
    assert detect_builder("buildah") == "buildah"
    assert len(fake_builders.args("version")) == len(fake_builders.calls()) == 6


def test_detect_builder_explains_why_none_works(
    fake_builders: FakeBuilders, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(fake_builders.bin_dir))
    fake_builders.install("docker")
    fake_builders.fail("docker", "version")
    with pytest.raises(EngineNotFound) as caught:
        detect_builder()
    assert caught.value.message == (
        "no image builder works here (docker: docker: version failed on purpose; "
        "podman: not installed; buildah: not installed)"
    )
    assert caught.value.hint is not None and "apt-get install podman" in caught.value.hint
    with pytest.raises(EngineNotFound) as preferred:
        detect_builder("podman")
    assert preferred.value.message == "no image builder works here (podman: not installed)"
    with pytest.raises(ConfigError) as unknown:
        detect_builder("kaniko")
    assert unknown.value.message == "unknown image builder 'kaniko'"


# --- contexts and commands ----------------------------------------------------------------


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_the_orchestrator_context_holds_the_dockerfile_and_the_source(tmp_path: Path) -> None:
    assemble_context("orchestrator", tmp_path / "ctx")
    files = _files(tmp_path / "ctx")
    assert {
        "Dockerfile",
        "src/pyproject.toml",
        "src/README.md",
        "src/orchard_env/agent/daemon/server.py",
        "src/orchard_cli/main.py",
        "src/images/agent-injector/Dockerfile",
        "src/images/sandbox/packages.txt",
    } <= files
    assert not [f for f in files if "__pycache__" in f or f.endswith(".pyc")]
    assert not [f for f in files if f.startswith(("src/tests/", "src/docs/", "src/.git"))]


def test_the_sandbox_context_is_its_folder_without_python(tmp_path: Path) -> None:
    assemble_context("sandbox", tmp_path / "ctx")
    assert _files(tmp_path / "ctx") == {"Dockerfile", "packages.txt"}


def test_a_source_context_needs_a_source_tree(tmp_path: Path) -> None:
    with pytest.raises(OrchardError) as caught:
        assemble_context("agent-injector", tmp_path / "ctx", root=tmp_path)
    assert caught.value.message == (
        "the orchestrator and agent-injector images are built from Orchard's source tree, "
        f"and {tmp_path} is not one (no usable pyproject.toml)"
    )


def test_build_command_of_each_builder(tmp_path: Path) -> None:
    command = build_command(
        "podman",
        ref="r.io/o/sandbox:t",
        context=tmp_path,
        build_args={"BASE_IMAGE": "debian:bookworm"},
        labels={"b": "2", "a": "1"},
        platform="linux/arm64",
        secrets={"ca-bundle": Path("/etc/ca.pem")},
    )
    assert command == [
        "podman",
        "build",
        "--file",
        f"{tmp_path}/Dockerfile",
        "--tag",
        "r.io/o/sandbox:t",
        "--platform",
        "linux/arm64",
        "--build-arg",
        "BASE_IMAGE=debian:bookworm",
        "--label",
        "a=1",
        "--label",
        "b=2",
        "--secret",
        "id=ca-bundle,src=/etc/ca.pem",
        str(tmp_path),
    ]
    assert build_command("docker", ref="x:t", context=tmp_path)[:2] == ["docker", "build"]
    assert build_command("buildah", ref="x:t", context=tmp_path)[:3] == [
        "buildah",
        "build",
        "--layers",
    ]


def test_base_images_are_checked_against_the_dockerfiles() -> None:
    assert parse_base_images(["BASE_IMAGE=python:3.11-slim", "FINAL_IMAGE=busybox:1.36"]) == {
        "BASE_IMAGE": "python:3.11-slim",
        "FINAL_IMAGE": "busybox:1.36",
    }
    with pytest.raises(ConfigError) as malformed:
        parse_base_images(["python:3.11"])
    assert malformed.value.message == "base image 'python:3.11' is not ARG=IMAGE"
    with pytest.raises(ConfigError) as unknown:
        parse_base_images(["RUNTIME_IMAGE=x"])
    assert unknown.value.message == "no Dockerfile declares the build argument RUNTIME_IMAGE"
    assert unknown.value.hint == "the Dockerfiles take BASE_IMAGE, BUILDER_IMAGE, FINAL_IMAGE"


def _arg_defaults(name: str) -> dict[str, str]:
    text = build.dockerfile(name).read_text()
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))


def test_dockerfiles_default_to_public_base_images() -> None:
    assert _arg_defaults("orchestrator") == {"BASE_IMAGE": "python:3.11-slim"}
    assert _arg_defaults("agent-injector") == {
        "BUILDER_IMAGE": "debian:bookworm-slim",
        "FINAL_IMAGE": "busybox:1.36",
    }
    assert _arg_defaults("sandbox") == {"BASE_IMAGE": "debian:bookworm-slim"}


def test_the_injector_final_stage_holds_only_the_bundle() -> None:
    text = build.dockerfile("agent-injector").read_text().replace("\\\n", " ")
    final = text.rsplit("\nFROM ", 1)[1]
    steps = [line.split()[0] for line in final.splitlines()[1:] if line and line[0] != "#"]
    assert final.startswith("${FINAL_IMAGE}\n")
    assert steps == ["COPY", "ENTRYPOINT"]
    assert "COPY --from=bundle /orchard-agent /orchard-agent\n" in final


def test_the_sandbox_dockerfile_installs_packages_txt() -> None:
    text = build.dockerfile("sandbox").read_text()
    assert "--mount=type=bind,source=packages.txt,target=/tmp/packages.txt" in text
    assert "apt-get install -y --no-install-recommends $packages;" in text


# --- builds through a fake builder ----------------------------------------------------------


def test_build_images_runs_one_build_per_image(fake_builders: FakeBuilders, tmp_path: Path) -> None:
    fake_builders.install("podman")
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    refs = image_refs("r.io", "orchard", "t1")
    lines: list[str] = []
    built = build_images(
        {"orchestrator": refs["orchestrator"], "agent-injector": refs["agent-injector"]},
        builder="podman",
        platform="linux/amd64",
        base_images={"BASE_IMAGE": "py:local", "FINAL_IMAGE": "bb:local"},
        ca_bundle=ca,
        progress=lines.append,
    )
    assert built == ["r.io/orchard/orchestrator:t1", "r.io/orchard/agent-injector:t1"]
    orchestrator, injector = fake_builders.args("build")
    info = source_info()
    for args, name in ((orchestrator, "orchestrator"), (injector, "agent-injector")):
        context = Path(args[-1])
        assert not context.exists()  # the temporary context is gone after the build
        assert args[args.index("--tag") + 1] == f"r.io/orchard/{name}:t1"
        assert args[args.index("--platform") + 1] == "linux/amd64"
        assert args[args.index("--secret") + 1] == f"id=ca-bundle,src={ca}"
        labels = [args[i + 1] for i, arg in enumerate(args) if arg == "--label"]
        assert f"org.opencontainers.image.version={__version__}" in labels
        assert f"org.opencontainers.image.revision={info.commit}" in labels
        assert f"org.opencontainers.image.title=orchard-{name}" in labels
    assert [orchestrator[i + 1] for i, a in enumerate(orchestrator) if a == "--build-arg"] == [
        "BASE_IMAGE=py:local"
    ]
    assert [injector[i + 1] for i, a in enumerate(injector) if a == "--build-arg"] == [
        "FINAL_IMAGE=bb:local"
    ]
    assert lines[0] == "building r.io/orchard/orchestrator:t1"
    assert "STEP 2/2: RUN something" in lines
    assert re.fullmatch(r"built r\.io/orchard/agent-injector:t1 in \d+\.\ds", lines[-1])


def test_a_failed_build_shows_the_end_of_its_log(fake_builders: FakeBuilders) -> None:
    fake_builders.install("podman")
    fake_builders.fail("podman", "build")
    with pytest.raises(OrchardError) as caught:
        build_images({"sandbox": "r.io/orchard/sandbox:t"}, builder="podman")
    assert caught.value.message == (
        "podman could not build r.io/orchard/sandbox:t (exit 3):\n"
        "step 1 of the work\npodman: build failed on purpose"
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"refs": {"redis": "r.io/o/redis:t"}}, "unknown image 'redis'"),
        ({"platform": "arm64"}, "platform 'arm64' is not os/arch[/variant]"),
        ({"base_images": {"BASE": "x"}}, "no Dockerfile declares the build argument BASE"),
        ({"ca_bundle": Path("/nonexistent/ca.pem")}, "CA bundle /nonexistent/ca.pem is not a file"),
    ],
)
def test_build_images_checks_its_arguments_before_building(
    fake_builders: FakeBuilders, kwargs: dict[str, object], message: str
) -> None:
    fake_builders.install("podman")
    arguments: dict[str, object] = {"refs": {"sandbox": "r.io/o/sandbox:t"}, **kwargs}
    with pytest.raises(ConfigError) as caught:
        build_images(builder="podman", **arguments)  # type: ignore[arg-type]
    assert caught.value.message == message
    assert fake_builders.calls() == []


def test_the_tools_image_is_built_only_when_named() -> None:
    refs = image_refs("r.io", "orchard", "t")
    assert "tools" not in build.select(refs, ())
    assert build.select(refs, ["tools"]) == {"tools": "r.io/orchard/tools:t"}


def test_a_deployment_has_the_tools_image_only_when_its_profile_asks() -> None:
    plain = build.deployment_refs(DeploymentProfile(target="kubeconfig"), "r.io", "t")
    assert list(plain) == ["orchestrator", "agent-injector", "sandbox"]
    with_tools = DeploymentProfile(target="kubeconfig", tools=True)
    assert build.deployment_refs(with_tools, "r.io", "t")["tools"] == "r.io/orchard/tools:t"


def test_the_tools_context_links_the_payload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    payload = tmp_path / "payload"
    (payload / "bin").mkdir(parents=True)
    (payload / "bin" / "codex").write_text("#!/bin/sh\n")
    monkeypatch.setenv("ORCHARD_TOOLS_DIR", str(payload))
    build.assemble_context("tools", tmp_path / "ctx")
    linked = tmp_path / "ctx" / "payload" / "bin" / "codex"
    assert linked.stat().st_ino == (payload / "bin" / "codex").stat().st_ino  # not copied
    assert "COPY payload /opt/sandbox-tools" in (tmp_path / "ctx" / "Dockerfile").read_text()
