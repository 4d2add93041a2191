"""`orchard bench` against a service that is not on this host, as a cluster's is: reached
through a TCP forwarder process (what `kubectl port-forward` is), the host-side figures
(the orchestrator's CPU and memory, the engine's exec_run, the agent's memory, the host's
memory per sandbox) are reported as not measured with the reason, never as the forwarder's."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from orchard_env import bench_host
from orchard_env.bench import bench_exec, bench_launch
from orchard_env.errors import OrchardError
from orchard_env.sdk import AsyncSandboxClient, SandboxClient
from tests.orchestrator.conftest import make_settings
from tests.orchestrator.fakes import AgentProcessBackend
from tests.servers import Live, fake_backend, live_service, printing_server

_FORWARDER = """
import asyncio, sys

async def pipe(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()

async def forward(reader, writer):
    upstream = await asyncio.open_connection("127.0.0.1", int(sys.argv[1]))
    await asyncio.gather(pipe(reader, upstream[1]), pipe(upstream[0], writer))

async def main():
    server = await asyncio.start_server(forward, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()

asyncio.run(main())
"""


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Live]:
    backend: AgentProcessBackend
    with (
        fake_backend() as backend,
        live_service(make_settings(tmp_path / "state"), key_name="bench", backend=backend) as up,
    ):
        yield up


@pytest.fixture
def forwarded(live: Live) -> Iterator[str]:
    """The service's URL through a forwarder process of its own."""
    port = live.url.rsplit(":", 1)[1]
    command = [sys.executable, "-c", _FORWARDER, port]
    with printing_server(command) as port:
        yield f"http://127.0.0.1:{port}"


def test_a_forwarder_is_no_orchestrator(live: Live, forwarded: str) -> None:
    pid = bench_host.listener_pid(int(forwarded.rsplit(":", 1)[1]))
    found = bench_host.find_service(forwarded)
    assert found == (
        f"port {forwarded.rsplit(':', 1)[1]} is served by {Path(sys.executable).name} "
        f"(pid {pid}), not an orchestrator: the service runs elsewhere (a port-forward to a "
        "cluster?)"
    )
    assert bench_host.find_service("http://orchard.example:80") == (
        "the service (orchard.example:80) is not on this host"
    )


def test_exec_through_a_forwarder_names_what_it_did_not_measure(live: Live, forwarded: str) -> None:
    with SandboxClient(base_url=forwarded, api_key=live.api_key) as client:
        result = bench_exec(client, image="debian:12", n=5, engine_url="unix:///nonexistent")
    assert result.stats["orchard exec"].n == 5
    assert "orchestrator CPU ms per exec" not in result.figures
    assert "ratio p50 (orchard / engine)" not in result.figures
    assert result.not_measured == {
        "orchestrator CPU per exec": bench_host.find_service(forwarded),
        "engine exec_run, the agent's CPU and memory": "the sandbox runs on the fake backend, "
        "not in this host's container engine",
    }
    assert (
        "- engine exec_run, the agent's CPU and memory: not measured (the sandbox runs on the "
        "fake backend" in result.markdown()
    )
    assert result.to_json()["not_measured"] == result.not_measured


def test_exec_in_this_process_measures_the_orchestrator(live: Live) -> None:
    with SandboxClient(base_url=live.url, api_key=live.api_key) as client:
        result = bench_exec(client, image="debian:12", n=5)
    assert result.figures["orchestrator CPU ms per exec"] > 0
    assert "orchestrator CPU per exec" not in result.not_measured


def test_launch_through_a_forwarder(live: Live, forwarded: str) -> None:
    make_client = partial(AsyncSandboxClient, base_url=forwarded, api_key=live.api_key)
    result = bench_launch(make_client, image="debian:12", n=2)
    assert result.figures["sandboxes succeeded"] == 2
    assert not any("RSS" in key or "host memory" in key for key in result.figures)
    assert result.not_measured == {
        "the orchestrator's memory and CPU": bench_host.find_service(forwarded),
        "host memory per sandbox": "the service's sandboxes are not in this host's container "
        "engine: its backend is fake",
    }
    with pytest.raises(OrchardError) as raised:
        bench_launch(make_client, image="debian:12", n=2, engine_url="unix:///nonexistent")
    assert raised.value.message == (
        "the engine-alone baseline times this host's container engine; the service's backend "
        "is fake"
    )
