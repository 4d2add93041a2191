"""`orchard pool …` and `orchard bench create --pool|--tools` against a real orchestrator (the
service-tier fake backend)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from typer.testing import Result

from orchard_env import errors
from tests.cli.conftest import ok


def pool_json(orchard: Callable[..., Result]) -> list[dict[str, object]]:
    listed: list[dict[str, object]] = json.loads(ok(orchard("pool", "list", "--json")))
    return listed


def until_ready(orchard: Callable[..., Result], ready: int) -> None:
    deadline = time.monotonic() + 30
    while pool_json(orchard)[0]["ready"] != ready:
        assert time.monotonic() < deadline, pool_json(orchard)
        time.sleep(0.05)


def test_pool_commands_end_to_end(orchard: Callable[..., Result]) -> None:
    made = ok(orchard("pool", "create", "warm", "2", "--memory", "256Mi", "-e", "MODE=eval"))
    assert made.strip() == "warm"
    until_ready(orchard, 2)
    table = ok(orchard("pool", "list"))
    assert table.split("\n")[1].split()[:4] == ["warm", "2", "2", "0"] and "256Mi" in table
    assert "MODE=eval" in ok(orchard("pool", "list", "-o", "wide"))
    assert ok(orchard("pool", "list", "-q")) == "warm\n"
    claimed = ok(orchard("sandbox", "create", "--memory", "256Mi", "-e", "MODE=eval", "--json"))
    info = json.loads(claimed)
    assert info["status"] == "ready" and info["env"] == {"MODE": "eval"}
    assert ok(orchard("sandbox", "exec", info["sandbox_id"], "--", "echo $MODE")) == "eval\n"
    resized = orchard("pool", "resize", "warm", "1")
    assert resized.exit_code == 0 and "size 1" in resized.stderr
    until_ready(orchard, 1)
    removed = orchard("pool", "rm", "warm")
    assert removed.exit_code == 0 and "Removed pool warm." in removed.stderr
    assert pool_json(orchard) == []
    missing = orchard("pool", "rm", "warm")
    assert missing.exit_code == 1 and isinstance(missing.exception, errors.PoolNotFound)
    bad = orchard("pool", "create", "x", "2", "--env", "novalue")
    assert bad.exit_code == 1 and "env 'novalue' is not KEY=VALUE" in str(bad.exception)


def test_bench_create_with_a_pool_reports_cold_and_pooled(orchard: Callable[..., Result]) -> None:
    result = json.loads(ok(orchard("bench", "create", "--pool", "--n", "2", "--json")))
    stats = result["stats_ms"]
    assert stats["create + first exec (cold)"]["n"] == 2
    assert stats["create + first exec (from a warm pool)"]["n"] == 2
    assert result["figures"]["pooled samples not served by the pool"] == 0
    assert pool_json(orchard) == []  # the run's pool is removed afterwards


def test_bench_create_with_tools_alternates_with_and_without(
    orchard: Callable[..., Result],
) -> None:
    result = json.loads(ok(orchard("bench", "create", "--tools", "--n", "2", "--json")))
    stats = result["stats_ms"]
    assert stats["create + first exec (every harness mounted)"]["n"] == 2
    assert stats["create + first exec (tools: false)"]["n"] == 2
    assert result["figures"]["ratio p50 (harnesses / none)"] > 0
    both = orchard("bench", "create", "--tools", "--pool")
    assert both.exit_code == 1
    assert str(both.exception) == "measure the pool or the tools payload, not both in one run"
