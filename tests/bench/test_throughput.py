"""The throughput benchmark at small scale against a live orchestrator on the fake backend
(real agents as host processes): every sandbox keeps an exec in flight for the window."""

from __future__ import annotations

from functools import partial

from orchard_env.bench_throughput import bench_throughput
from orchard_env.sdk import AsyncSandboxClient, SandboxClient
from tests.servers import Live


def test_throughput_counts_every_exec_of_the_window_and_deletes_its_sandboxes(live: Live) -> None:
    make_client = partial(AsyncSandboxClient, base_url=live.url, api_key=live.api_key)
    result = bench_throughput(make_client, image="debian:12", sandboxes=3, seconds=1.0)
    (stats,) = result.stats.values()
    figures = result.figures
    assert stats.n >= 3  # each of the 3 ran at least once in the window
    assert 0 < figures["execs per second"] <= stats.n / 1.0
    # The orchestrator runs in this process: found by the port it listens on.
    assert figures["orchestrator CPU ms per exec"] > 0
    with SandboxClient(base_url=live.url, api_key=live.api_key) as client:
        assert client.list_sandboxes() == []
