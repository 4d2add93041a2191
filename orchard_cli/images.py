"""`orchard images …`: the images Orchard runs."""

from __future__ import annotations

from typing import Annotated

import typer

from orchard_cli.console import err, out

app = typer.Typer(help="Build the images Orchard uses.", no_args_is_help=True)


@app.command("build-local")
def build_local(
    docker_host: Annotated[
        str | None, typer.Option("--docker-host", help="Engine socket (default: auto-detect).")
    ] = None,
    busybox: Annotated[
        bool, typer.Option("--busybox", help="Also build the busybox test image.")
    ] = False,
) -> None:
    """Build the default sandbox image on this machine from Debian packages (no registry)."""
    import docker

    from images.local import ensure_busybox_image, ensure_sandbox_image
    from orchard_env.orchestrator.backends.docker_engine import find_engine

    client = docker.DockerClient(base_url=find_engine(docker_host))
    try:
        with err.status("building") as status:
            built = [ensure_sandbox_image(client, progress=status.update)]
            if busybox:
                built.append(ensure_busybox_image(client))
    finally:
        client.close()
    for tag in built:
        out.print(tag)
