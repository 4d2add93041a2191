"""`orchard bench harness`: what the model gateway adds to a call, against the fake model.

The path of a harness's call is timed hop for hop as it runs, each part in its own process
as in a sandbox: the agent's relay (:mod:`orchard_env.agent.daemon.model`: loopback TCP to
a unix socket), the gateway (:class:`~orchard_env.orchestrator.gateway.proxy.ModelGateway`
in this process, recording into SQLite) and the fake model (:mod:`orchard_env.fake_model`).
A client process makes the same streamed Chat Completions call (a tool call, 8 SSE events)
directly to the fake model and through relay and gateway, alternating in batches, on
keep-alive connections, so both are measured in the same run.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from orchard_env.bench import BenchResult, Stats

BATCH = 20
_RELAY = r"""
import sys
from orchard_env.agent.daemon import model
from orchard_env.agent.daemon.loop import Loop
loop = Loop()
model.start({"listen": sys.argv[1], "socket": sys.argv[2]}, loop)
print("ready", flush=True)
loop.run()
"""
_CLIENT = r"""
import http.client, json, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}],
    "tools": [{"type": "function", "function": {"name": "bash", "parameters": {}}}],
    "stream_options": {"include_usage": True}})
conn = http.client.HTTPConnection(host, port)
headers = {"content-type": "application/json", "authorization": "Bearer " + sys.argv[4]}
out = []
for _ in range(n + 1):
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, headers)
    answer = conn.getresponse()
    data = answer.read()
    assert answer.status == 200 and data.endswith(b"data: [DONE]\n\n"), (answer.status, data[:200])
    out.append(time.perf_counter() - start)
print(json.dumps(out[1:]))
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def _client(port: int, n: int, key: str) -> list[float]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _CLIENT,
        "127.0.0.1",
        str(port),
        str(n),
        key,
        stdout=subprocess.PIPE,
    )
    stdout, _ = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"the benchmark client failed (exit {process.returncode})")
    samples: list[float] = json.loads(stdout)
    return samples


async def _bench(n: int) -> BenchResult:
    from orchard_env.orchestrator.gateway.endpoints import Endpoint, Endpoints
    from orchard_env.orchestrator.gateway.proxy import ModelGateway
    from orchard_env.orchestrator.records import GatewayRecord
    from orchard_env.orchestrator.store import SQLiteStore

    key = "sk-bench-" + os.urandom(8).hex()
    fake_port = _free_port()
    fake = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "orchard_env.fake_model",
        "--port",
        str(fake_port),
        "--key",
        key,
        stdout=subprocess.PIPE,
    )
    with tempfile.TemporaryDirectory(prefix="orchard-bench-") as tmp:
        try:
            assert fake.stdout is not None
            await asyncio.wait_for(fake.stdout.readline(), 30)  # it is listening
            store = SQLiteStore(Path(tmp) / "orchard.db")
            await store.open()
            (Path(tmp) / "sb-bench").mkdir()
            os.environ["ORCHARD_BENCH_MODEL_KEY"] = key
            fake_url = f"http://127.0.0.1:{fake_port}"
            endpoint = Endpoint(
                "fake", "openai", f"{fake_url}/v1", key_env="ORCHARD_BENCH_MODEL_KEY"
            )
            gateway = ModelGateway(
                Endpoints({"fake": endpoint}, {"openai": "fake"}), store, Path(tmp)
            )
            await gateway.attach("sb-bench", GatewayRecord(openai="fake", dummy_key="dummy"))
            relay_port = _free_port()
            relay = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                _RELAY,
                f"127.0.0.1:{relay_port}",
                f"{tmp}/sb-bench/model.sock",
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
            assert relay.stdout is not None
            await asyncio.wait_for(relay.stdout.readline(), 30)
            direct: list[float] = []
            through: list[float] = []
            for _ in range(max(1, n // BATCH)):
                direct += await _client(fake_port, BATCH, key)
                through += await _client(relay_port, BATCH, "dummy")
            relay.terminate()
            await relay.wait()
            await gateway.close()
            recorded = len(await store.list_model_calls("sb-bench", limit=100000))
            await store.close()
        finally:
            fake.terminate()
            await fake.wait()
    d, g = Stats.of(direct), Stats.of(through)
    return BenchResult(
        name="harness",
        params={"n": len(through), "call": "chat.completions, streamed, 8 SSE events"},
        stats={"direct": d, "gateway": g},
        figures={
            "added_p50_ms": round((g.p50 - d.p50) * 1000, 3),
            "added_p90_ms": round((g.p90 - d.p90) * 1000, 3),
            "recorded_calls": recorded,
        },
    )


def bench_harness(n: int = 400) -> BenchResult:
    """``n`` calls each way (rounded to batches of 20); see the module's docstring."""
    return asyncio.run(_bench(n))
