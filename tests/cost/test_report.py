"""Reports from usage records (hand-computed timelines) and from a cluster served over real HTTP."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from orchard_env.cost.packing import SandboxShape
from orchard_env.cost.prices import PriceBook, load_price_table
from orchard_env.cost.report import (
    cluster_cost,
    cost_report,
    list_cluster_nodes,
    load_usage_file,
    node_hours_needed,
    parse_node,
    parse_when,
    usage_cost,
)
from orchard_env.errors import ConfigError, InvalidRequest, PermissionDenied, Unavailable
from orchard_env.protocol import UsageRecord, UsageReport
from tests.cost.fakes import NODES, NOW, FakeKubeApi, hours_ago, write_kubeconfig

BOOK = PriceBook(load_price_table())
GIB = 1024**3
OD, SPOT = 0.344, 0.072618  # Standard_D8as_v5, eastus


def record(
    sandbox_id: str,
    start: float,
    end: float | None,
    *,
    owner: str | None = "alice",
    cpu: float = 2,
    memory_gib: int = 8,
    labels: dict[str, str] | None = None,
    seconds: float | None = None,
) -> UsageRecord:
    """A sandbox that ran from ``start`` to ``end`` hours ago (None: still running)."""
    ended = None if end is None else hours_ago(end)
    return UsageRecord(
        sandbox_id=sandbox_id,
        owner=owner,
        image="python:3.12",
        cpu=cpu,
        memory_bytes=memory_gib * GIB,
        labels=labels or {},
        started_at=hours_ago(start),
        ended_at=ended,
        seconds=seconds if seconds is not None else (start - (end or 0)) * 3600,
    )


def run_records() -> UsageReport:
    """Three sandboxes 4h..2h ago and one 3h..1h ago, on D8as_v5 (3 per node):
    nodes needed = 1 (4h..3h) + 2 (3h..2h) + 1 (2h..1h) = 4 node-hours, peak 2."""
    return UsageReport(
        since=hours_ago(4),
        until=NOW,
        records=[
            record("a", 4, 2, labels={"exp": "x"}),
            record("b", 4, 2, labels={"exp": "y"}),
            record("c", 4, 2, owner="bob"),
            record("d", 3, 1, owner="bob", labels={"exp": "x"}),
        ],
    )


def test_node_hours_needed_replays_the_timeline() -> None:
    usage = run_records()
    shape = SandboxShape.of(2, 8 * GIB)
    assert node_hours_needed(usage.records, usage.since, usage.until, {shape: 3}) == (4.0, 2)


def test_usage_cost_by_owner() -> None:
    cost = usage_cost(run_records(), BOOK, vm_size="Standard_D8as_v5", region="eastus")
    assert (cost.sandboxes, cost.sandbox_hours, cost.node_hours_needed, cost.peak_nodes) == (
        4,
        8.0,
        4.0,
        2,
    )
    assert cost.needed_on_demand_usd == pytest.approx(4 * OD)
    assert cost.needed_spot_usd == pytest.approx(4 * SPOT)
    groups = {g.group: g for g in cost.groups}
    assert set(groups) == {"alice", "bob"}
    assert groups["alice"].sandbox_hours == 4.0
    assert groups["alice"].cpu_hours == 8.0
    assert groups["alice"].memory_gib_hours == 32.0
    assert groups["alice"].on_demand_usd == pytest.approx(4 * OD / 3)
    assert groups["bob"].spot_usd == pytest.approx(4 * SPOT / 3)
    assert [(s.size, s.per_node, s.sandbox_hours) for s in cost.sizes] == [("2 CPU / 8Gi", 3, 8.0)]


@pytest.mark.parametrize(
    ("group_by", "expected"),
    [
        ("label:exp", {"x": 4.0, "y": 2.0, "(unlabelled)": 2.0}),
        ("size", {"2 CPU / 8Gi": 8.0}),
        ("image", {"python:3.12": 8.0}),
    ],
)
def test_usage_groupings(group_by: str, expected: dict[str, float]) -> None:
    cost = usage_cost(
        run_records(), BOOK, vm_size="Standard_D8as_v5", region="eastus", group_by=group_by
    )
    assert {g.group: g.sandbox_hours for g in cost.groups} == expected


def test_bad_grouping_and_oversized_records() -> None:
    with pytest.raises(InvalidRequest, match="cannot group by 'team'"):
        usage_cost(
            run_records(), BOOK, vm_size="Standard_D8as_v5", region="eastus", group_by="team"
        )
    huge = UsageReport(since=hours_ago(1), until=NOW, records=[record("z", 1, 0, cpu=16)])
    with pytest.raises(
        InvalidRequest, match=r"sandbox z \(16 CPU / 8Gi\) does not fit on Standard_D8as_v5"
    ):
        usage_cost(huge, BOOK, vm_size="Standard_D8as_v5", region="eastus")


def test_timeline_clips_to_the_period_and_counts_running_sandboxes() -> None:
    shape = SandboxShape.of(2, 8 * GIB)
    records = [record("early", 6, 3), record("running", 1, None)]  # 6h..3h ago; 1h ago..now
    assert node_hours_needed(records, hours_ago(4), NOW, {shape: 3}) == (2.0, 1)


def test_mixed_sizes_do_not_share_nodes() -> None:
    small, big = SandboxShape.of(2, 8 * GIB), SandboxShape.of(4, 16 * GIB)
    records = [record("s1", 2, 0), record("s2", 2, 0), record("b1", 1, 0, cpu=4, memory_gib=16)]
    # 2h..1h: ceil(2/3) = 1 node; 1h..0h: 1 + ceil(1/1) = 2 nodes
    assert node_hours_needed(records, hours_ago(2), NOW, {small: 3, big: 1}) == (3.0, 2)


def test_report_without_cluster_prices_what_the_nodes_ran_as() -> None:
    report = cost_report(run_records(), BOOK, vm_size="Standard_D8as_v5", ran_on="spot", now=NOW)
    assert report.actual_usd == pytest.approx(4 * SPOT)
    assert report.idle is None and report.cluster is None
    # D4as_v5 (1 per node, 8 node-hours x $0.172) ties D8as_v5 (4 x $0.344): first listed wins.
    auto = cost_report(run_records(), BOOK, now=NOW)
    assert auto.usage is not None and auto.usage.vm_size == "Standard_D4as_v5"
    assert auto.usage.needed_on_demand_usd == pytest.approx(8 * 0.172)
    assert auto.actual_usd is None
    assert (
        "sandbox nodes priced as Standard_D4as_v5: the cheapest size that fits "
        "(pass --vm-size for the real one)" in auto.notes
    )
    with pytest.raises(InvalidRequest, match="nothing to report on"):
        cost_report(None, BOOK)
    empty = cost_report(UsageReport(since=hours_ago(1), until=NOW, records=[]), BOOK)
    assert empty.usage is None and empty.notes[-1].startswith("no usage records between")


# --- cluster nodes ---------------------------------------------------------------------------


def test_parse_node_reads_pool_priority_role_size_and_allocatable() -> None:
    node = parse_node(NODES[1])
    assert (node.name, node.pool, node.priority, node.role) == (
        "aks-sbx-0",
        "sbx",
        "spot",
        "sandbox",
    )
    assert (node.vm_size, node.region, node.created_at) == (
        "Standard_D8as_v5",
        "eastus",
        hours_ago(4),
    )
    assert (node.allocatable_cpu, node.allocatable_memory_bytes) == (7.42, 31268 * 1024**2)
    legacy = parse_node(NODES[3])
    assert (legacy.pool, legacy.priority, legacy.role) == ("odd", "regular", "user")
    assert parse_node(NODES[0]).role == "system"
    with pytest.raises(Unavailable, match="a node Orchard cannot read"):
        parse_node({"metadata": {"name": "x"}})


def test_cluster_cost_by_pool() -> None:
    cost = cluster_cost([parse_node(n) for n in NODES], BOOK, region="eastus", now=NOW)
    pools = {p.pool: p for p in cost.pools}
    assert (pools["sys"].nodes, pools["sys"].node_hours, pools["sys"].usd) == (
        1,
        10.0,
        pytest.approx(1.72),
    )
    assert pools["sys"].priority == "regular"
    assert (pools["sbx"].nodes, pools["sbx"].node_hours) == (2, 6.0)
    assert pools["sbx"].usd == pytest.approx(6 * SPOT)
    assert pools["odd"].usd is None
    assert cost.total_usd == pytest.approx(1.72 + 6 * SPOT)
    assert cost.unpriced == ["Standard_Weird_v9 (regular)"]


def test_usage_and_cluster_give_idle_node_time() -> None:
    nodes = [parse_node(n) for n in NODES]
    report = cost_report(run_records(), BOOK, nodes=nodes, now=NOW)
    assert report.usage is not None and report.usage.vm_size == "Standard_D8as_v5"
    idle = report.idle
    assert idle is not None
    assert (idle.sandbox_node_hours, idle.idle_node_hours) == (6.0, 2.0)
    assert idle.idle_share == pytest.approx(1 / 3)
    assert idle.actual_usd == pytest.approx(6 * SPOT)
    assert idle.if_on_demand_usd == pytest.approx(6 * OD)
    assert idle.idle_usd == pytest.approx(2 * SPOT)
    assert report.actual_usd == pytest.approx(6 * SPOT)
    assert "only nodes that exist now are counted: removed nodes are invisible" in report.notes


# --- a Kubernetes API over real HTTP ----------------------------------------------------------


def test_list_cluster_nodes_pages_through_a_real_http_api(
    kube_api: FakeKubeApi, tmp_path: Path
) -> None:
    kubeconfig = write_kubeconfig(
        tmp_path / "kubeconfig", f"http://127.0.0.1:{kube_api.server_port}"
    )
    nodes = list_cluster_nodes(kubeconfig, page_size=3)
    assert [node.name for node in nodes] == ["aks-sys-0", "aks-sbx-0", "aks-sbx-1", "aks-odd-0"]
    assert kube_api.paths == ["/api/v1/nodes?limit=3", "/api/v1/nodes?continue=3&limit=3"]
    assert nodes[1].priority == "spot"


def test_list_cluster_nodes_errors(kube_api: FakeKubeApi, tmp_path: Path) -> None:
    server = f"http://127.0.0.1:{kube_api.server_port}"
    kube_api.deny = True
    with pytest.raises(PermissionDenied) as caught:
        list_cluster_nodes(write_kubeconfig(tmp_path / "k1", server))
    assert caught.value.message == "the cluster refused to list nodes (HTTP 403)"
    with pytest.raises(ConfigError, match="cannot load"):
        list_cluster_nodes(tmp_path / "missing")
    (tmp_path / "bad").write_text("apiVersion: v1\nkind: Config\n")
    with pytest.raises(ConfigError, match="cannot load"):
        list_cluster_nodes(tmp_path / "bad")


def test_list_cluster_nodes_unreachable(tmp_path: Path) -> None:
    probe = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = probe.server_port
    probe.server_close()  # nothing listens on this port now
    with pytest.raises(Unavailable, match="cannot reach the cluster"):
        list_cluster_nodes(write_kubeconfig(tmp_path / "k", f"http://127.0.0.1:{port}"))


# --- inputs ----------------------------------------------------------------------------------


def test_parse_when() -> None:
    assert parse_when("24h", now=NOW) == hours_ago(24)
    assert parse_when("7d", now=NOW) == NOW - timedelta(days=7)
    assert parse_when("30m", now=NOW) == NOW - timedelta(minutes=30)
    assert parse_when("2026-07-01") == datetime(2026, 7, 1, tzinfo=UTC)
    assert parse_when("2026-07-01T12:00:00Z") == datetime(2026, 7, 1, 12, tzinfo=UTC)
    with pytest.raises(InvalidRequest) as caught:
        parse_when("yesterday", flag="--until")
    assert caught.value.message == "--until 'yesterday' is not a date, a date-time or an age"


def test_load_usage_file(tmp_path: Path) -> None:
    path = tmp_path / "usage.json"
    path.write_text(run_records().model_dump_json())
    assert load_usage_file(path) == run_records()
    path.write_text(json.dumps({"since": "2026-01-01T00:00:00Z", "records": []}))
    with pytest.raises(InvalidRequest, match=r"is not a usage report: until: Field required"):
        load_usage_file(path)
    with pytest.raises(InvalidRequest, match="cannot read"):
        load_usage_file(tmp_path / "nope.json")
