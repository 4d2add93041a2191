"""`orchard images …`: the images Orchard runs."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from orchard_cli.console import JsonOpt, err, out
from orchard_cli.output import print_json

app = typer.Typer(help="Build, push and list the images Orchard uses.", no_args_is_help=True)

ProfileOpt = Annotated[
    Path | None,
    typer.Option(
        "--profile",
        help="Deployment profile: its registry, repository, image_tag and build settings.",
        dir_okay=False,
        show_default=False,
    ),
]
RegistryOpt = Annotated[
    str | None,
    typer.Option(
        "--registry",
        help="Registry host, e.g. myacr.azurecr.io (default: the profile's; none: local "
        "localhost/... references).",
        show_default=False,
    ),
]
TagOpt = Annotated[
    str | None,
    typer.Option(
        "--tag",
        help="Image tag (default: the profile's image_tag, else <version>-<git commit>).",
        show_default=False,
    ),
]
OnlyOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--only",
        help="Only this image: orchestrator, agent-injector, sandbox or tools (repeatable; "
        "tools, the agent harnesses, is built only when named).",
        show_default=False,
    ),
]
BuilderOpt = Annotated[
    str | None,
    typer.Option(
        "--builder",
        help="docker, podman or buildah (default: the first that works, in that order).",
        show_default=False,
    ),
]


@contextmanager
def _progress(what: str) -> Iterator[Callable[[str], None]]:
    """Builder output: the latest line beside a spinner on a terminal, every line otherwise
    (a CI log). Always on stderr."""
    if not err.is_terminal:
        yield lambda line: err.print(Text(line))
        return
    with err.status(what) as status:
        yield lambda line: status.update(Text(line[: max(20, err.width - 4)]))


@app.command()
def build(
    profile: ProfileOpt = None,
    registry: RegistryOpt = None,
    tag: TagOpt = None,
    only: OnlyOpt = None,
    builder: BuilderOpt = None,
    platform: Annotated[
        str | None,
        typer.Option("--platform", help="Target platform, e.g. linux/arm64.", show_default=False),
    ] = None,
    base_image: Annotated[
        list[str] | None,
        typer.Option(
            "--base-image",
            help="Replace a base image, ARG=IMAGE: BASE_IMAGE (orchestrator, sandbox), "
            "BUILDER_IMAGE or FINAL_IMAGE (agent-injector). Repeatable.",
            show_default=False,
        ),
    ] = None,
    ca_bundle: Annotated[
        Path | None,
        typer.Option(
            "--ca-bundle",
            help="CA certificates pip trusts during the build (a TLS-intercepting proxy's); "
            "not stored in the image.",
            dir_okay=False,
            show_default=False,
        ),
    ] = None,
) -> None:
    """Build the orchestrator, agent-injector and sandbox images; print their references."""
    from images.build import build_images, detect_builder, parse_base_images, resolve_refs
    from provision.profile import load_profile

    refs = resolve_refs(profile, registry=registry, tag=tag, only=only or ())
    bases = parse_base_images(base_image or ())
    if profile is not None:  # the options win over the profile's build settings
        settings = load_profile(profile).build
        bases = {**settings.base_images, **bases}
        if ca_bundle is None and settings.ca_bundle:
            ca_bundle = Path(settings.ca_bundle).expanduser()
    tool = detect_builder(builder)
    with _progress(f"building with {tool}") as progress:
        built = build_images(
            refs,
            builder=tool,
            platform=platform,
            base_images=bases,
            ca_bundle=ca_bundle,
            progress=progress,
        )
    for ref in built:
        out.print(ref)


@app.command()
def push(
    profile: ProfileOpt = None,
    registry: RegistryOpt = None,
    tag: TagOpt = None,
    only: OnlyOpt = None,
    builder: BuilderOpt = None,
    login: Annotated[
        bool,
        typer.Option(
            "--login/--no-login",
            help="Log in to Azure Container Registries first (ACR token exchange with your "
            "Azure identity).",
        ),
    ] = True,
) -> None:
    """Push the built images to the registry; print their references."""
    from images.build import detect_builder, push_images, resolve_refs
    from provision.profile import load_profile

    logging.getLogger("azure.identity").setLevel(logging.ERROR)  # its tries are our hint
    refs = resolve_refs(profile, registry=registry, tag=tag, only=only or ())
    plain_http = profile is not None and load_profile(profile).registry.plain_http
    tool = detect_builder(builder)
    with _progress(f"pushing with {tool}") as progress:
        pushed = push_images(
            refs, builder=tool, login=login, progress=progress, plain_http=plain_http
        )
    for ref in pushed:
        out.print(ref)


@app.command("list")
def list_(
    profile: ProfileOpt = None,
    registry: RegistryOpt = None,
    tag: TagOpt = None,
    only: OnlyOpt = None,
    builder: BuilderOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The image references a profile implies, and whether each exists locally."""
    from images.build import detect_builder, list_images, resolve_refs

    refs = resolve_refs(profile, registry=registry, tag=tag, only=only or ())
    found = list_images(refs, builder=detect_builder(builder))
    if as_json:
        print_json([asdict(image) for image in found])
        return
    table = Table(box=None)  # columns as wide as their values: a reference is never cut
    table.add_column("IMAGE", no_wrap=True, min_width=max(len(i.name) for i in found))
    table.add_column("LOCAL", min_width=5)
    table.add_column("REFERENCE", no_wrap=True, min_width=max(len(i.ref) for i in found))
    for image in found:
        table.add_row(image.name, "yes" if image.present else "no", image.ref)
    out.print(table)


@app.command("build-local")
def build_local(
    docker_host: Annotated[
        str | None, typer.Option("--docker-host", help="Engine socket (default: auto-detect).")
    ] = None,
    busybox: Annotated[
        bool, typer.Option("--busybox", help="Also build the busybox test image.")
    ] = False,
    tools: Annotated[
        bool,
        typer.Option(
            "--tools",
            help="Also build the tools payload (the harnesses of the tools setting, from "
            "npm, PyPI and Debian) into its cache; prints its folder.",
        ),
    ] = False,
    tools_version: Annotated[
        list[str] | None,
        typer.Option(
            "--tools-version",
            help="With --tools: NAME=VERSION over the pinned version (repeatable), e.g. "
            "codex=0.172.0.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Build the default sandbox image on this machine from Debian packages (no registry)."""
    import docker

    from images.local import ensure_busybox_image, ensure_sandbox_image
    from orchard_env.orchestrator.backends.docker_engine import find_engine

    client = docker.DockerClient(base_url=find_engine(docker_host))
    try:
        with _progress("building") as progress:
            built = [str(ensure_sandbox_image(client, progress=progress))]
            if busybox:
                built.append(ensure_busybox_image(client))
            if tools or tools_version:
                built.append(str(_build_tools(tools_version or [], progress)))
    finally:
        client.close()
    for tag in built:
        out.print(tag)


def _build_tools(overrides: list[str], progress: Callable[[str], None]) -> Path:
    """The tools payload of the service settings, with ``overrides`` over its versions."""
    from orchard_env import config, errors
    from orchard_env.tools import parse_versions
    from orchard_env.tools.payload import ensure_payload

    settings = config.service_settings()
    try:
        versions = parse_versions(",".join(overrides), settings.tools_versions)
    except ValueError as exc:
        raise errors.InvalidRequest(f"--tools-version: {exc}") from None
    if not settings.tools:
        raise errors.InvalidRequest(
            "the tools setting is none: there are no harnesses to build",
            hint="set ORCHARD_TOOLS=all (or a list such as codex,pi)",
        )
    return ensure_payload(
        settings.tools,
        versions,
        cache_dir=settings.tools_cache_dir,
        progress=progress,
    )
