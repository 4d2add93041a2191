"""The launch benchmark at small n: `bench launch` (cold and from a pool) against a live
orchestrator on the fake backend, and the host measurements (the engine's on the real one)."""

from __future__ import annotations

import os
from functools import partial

import docker
import pytest

from orchard_env import bench_host
from orchard_env.bench import bench_launch
from orchard_env.orchestrator.backends.docker_engine import find_engine
from orchard_env.sdk import AsyncSandboxClient, SandboxClient
from tests.servers import Live


@pytest.mark.parametrize("pool", [False, True])
def test_launch_reports_counts_rates_and_memory(live: Live, pool: bool) -> None:
    make_client = partial(AsyncSandboxClient, base_url=live.url, api_key=live.api_key)
    result = bench_launch(make_client, image="debian:12", n=3, pool=pool, cpu="0.5", memory="256Mi")
    figures = result.figures
    assert result.params["failures"] == []
    assert (figures["sandboxes succeeded"], figures["commands succeeded"]) == (3, 12)
    assert figures["creates per second (until the last was ready)"] > 0
    assert result.stats["exec (under load)"].n == 12
    # The orchestrator runs in this process: found by the port it listens on.
    assert figures["orchestrator RSS MB (all alive)"] > 0
    assert ("pool fill seconds (before the timed launch)" in figures) is pool
    with SandboxClient(base_url=live.url, api_key=live.api_key) as client:
        assert client.list_sandboxes() == [] and client.list_pools() == []


def test_the_service_is_found_by_its_port(live: Live) -> None:
    assert bench_host.find_service(live.url) == os.getpid()


def test_memory_figures_against_before() -> None:
    from orchard_env.bench import _memory_figures

    before = bench_host.HostSample(available_mb=10_000, orchestrator_mb=90, engine_mb=60)
    peak = bench_host.HostSample(available_mb=8_000, orchestrator_mb=110, engine_mb=160)
    figures = _memory_figures(before, peak, 100)
    assert figures["host memory used per sandbox MB (MemAvailable drop / n)"] == 20
    assert figures["engine service's share of the host memory used %"] == 5
    assert figures["orchestrator RSS MB (all alive)"] == 110


@pytest.mark.engine
def test_the_engine_alone_baseline_leaves_nothing(
    docker_client: docker.DockerClient, busybox_image: str
) -> None:
    url = find_engine(None)
    assert (bench_host.rss_mb(bench_host.engine_pid(url)) or 0) > 0
    assert bench_host.engine_alone(url, busybox_image, 2) > 0
    label = bench_host.ENGINE_ALONE_LABEL
    mine = [  # this process's: a benchmark may run beside the tests
        c
        for c in docker_client.containers.list(all=True, filters={"label": label})
        if c.labels[label].startswith(f"{os.getpid()}-")
    ]
    assert mine == []
