"""`orchard cost …` through Typer's CliRunner, mounted the way the lead mounts it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner, Result

from orchard_cli.cost import app as cost_app
from orchard_env.cost.prices import cache_file
from orchard_env.errors import ConfigError, InvalidRequest, Unavailable
from orchard_env.protocol import UsageRecord, UsageReport
from tests.cost.fakes import (
    NOW,
    FakeKubeApi,
    FakePricesServer,
    _JsonHandler,
    cluster_nodes,
    price_row,
    serving,
    write_kubeconfig,
)

root = typer.Typer()
root.add_typer(cost_app, name="cost")


@root.callback()
def _root() -> None:
    """The mount point, as in orchard_cli.main."""


REFERENCE = ["--sandboxes", "128", "--hours", "240", "--cpu", "2", "--memory", "8Gi"]


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(root, ["cost", *args], env={"COLUMNS": "200", **(env or {})})


def ok(*args: str, env: dict[str, str] | None = None) -> Result:
    result = invoke(*args, env=env)
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def test_estimate_json_reference_workload() -> None:
    data = json.loads(ok("estimate", *REFERENCE, "--json").stdout)
    assert data["chosen"]["sku"] == "Standard_D32as_v5"
    assert round(data["total_on_demand_usd"], 2) == 3134.87
    assert round(data["total_spot_usd"], 2) == 790.13
    assert [round(q["compute_usd"], 2) for q in data["managed"]] == [
        7077.89,
        7077.89,
        10304.96,
        12828.67,
        3072.0,
    ]
    assert data["prices"]["mode"] == "shipped"


def test_estimate_rich_output_has_the_table_chart_and_warnings() -> None:
    out = ok("estimate", *REFERENCE, "--vm-size", "Standard_D8as_v5").stdout
    assert "128 sandboxes x 240 h at 2 CPU / 8Gi in eastus: Standard_D8as_v5, 3 per node" in out
    assert "$3,933.11" in out and "$1,132.45" in out
    assert "Orchard on AKS, spot" in out and "█" in out
    assert "Session limit" in out
    assert "! Public IP $0.005/hour is unconfirmed" in out


def test_estimate_markdown() -> None:
    out = ok("estimate", *REFERENCE, "--vm-size", "Standard_D8as_v5", "--markdown").stdout
    assert out.startswith("## Cost estimate: 128 sandboxes x 240 h at 2 CPU / 8Gi (eastus)\n")
    assert "| **Total** | **$3,933.11** | **$1,132.45** |  |" in out
    assert "| Sandbox nodes: 43 x Standard_D8as_v5 | $3,550.08 | $749.42 |" in out


def test_estimate_with_a_profile(tmp_path: Path) -> None:
    profile = tmp_path / "profile.yaml"
    profile.write_text(
        "azure:\n  tier: Standard\nsandbox_pool:\n  vm_size: Standard_D16as_v5\n  spot: true\n"
    )
    data = json.loads(ok("estimate", *REFERENCE, "--profile", str(profile), "--json").stdout)
    assert data["chosen"]["sku"] == "Standard_D16as_v5"
    assert data["total_on_demand_usd"] is None
    items = {item["key"]: item for item in data["line_items"]}
    assert items["control_plane"]["spot_usd"] == pytest.approx(24.0)
    profile.write_text("zone: 1\n")
    result = invoke("estimate", *REFERENCE, "--profile", str(profile))
    assert isinstance(result.exception, ConfigError)
    assert result.exception.message == f"profile {profile}: unknown key 'zone'"
    assert result.exception.hint == "`orchard init --print` shows every key with its default"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--live", "--shipped"], "--live and --shipped exclude each other"),
        (["--json", "--markdown"], "--json and --markdown exclude each other"),
        (["--cpu", "lots"], "--cpu: cpu 'lots' is not a quantity (examples: 2, 0.5, 500m)"),
    ],
)
def test_estimate_usage_errors(args: list[str], message: str) -> None:
    result = invoke("estimate", *REFERENCE, *args)
    assert isinstance(result.exception, InvalidRequest)
    assert result.exception.message == message


@pytest.fixture
def prices_api() -> Iterator[tuple[FakePricesServer, str]]:
    server = FakePricesServer(
        {
            "Standard_D8as_v5": [
                price_row(retailPrice=0.35),
                price_row(meterName="D8as v5 Spot", skuName="D8as v5 Spot", retailPrice=0.07),
                price_row(meterName="D8as v5 Low Priority", retailPrice=0.06),
                price_row(productName="Virtual Machines Dasv5 Series Windows", retailPrice=0.7),
            ],
            "Standard_D4as_v5": [price_row(armSkuName="Standard_D4as_v5", retailPrice=0.18)],
        }
    )
    with serving(server) as url:
        yield server, f"{url}/api/retail/prices"


def test_estimate_live_fetches_caches_and_reuses(
    prices_api: tuple[FakePricesServer, str], tmp_path: Path
) -> None:
    server, url = prices_api
    env = {"ORCHARD_RETAIL_PRICES_URL": url}
    args = ["estimate", *REFERENCE, "--vm-size", "Standard_D8as_v5", "--json"]
    data = json.loads(ok(*args, "--live", env=env).stdout)
    assert data["prices"]["mode"] == "live"
    assert data["chosen"]["on_demand"]["usd_per_hour"] == 0.35
    assert data["chosen"]["spot"]["usd_per_hour"] == 0.07
    assert round(data["total_spot_usd"], 2) == round(
        43 * 240 * 0.07 + 2 * 240 * 0.18 + 7.2 + 45 * 6.48 + 1.67, 2
    )
    assert len(server.paths) == 3  # two pages for the D8as_v5, one for the system D4as_v5
    assert cache_file("eastus", tmp_path / "cache" / "orchard" / "prices").exists()
    again = ok(*args)
    assert json.loads(again.stdout)["prices"]["mode"] == "cached"
    assert "Using prices cached from the Azure Retail Prices API" in again.stderr
    assert json.loads(ok(*args, "--shipped").stdout)["prices"]["mode"] == "shipped"


def test_estimate_live_failure_suggests_the_shipped_table(
    prices_api: tuple[FakePricesServer, str],
) -> None:
    server, url = prices_api
    server.fail_status = 500
    result = invoke("estimate", *REFERENCE, "--live", env={"ORCHARD_RETAIL_PRICES_URL": url})
    assert isinstance(result.exception, Unavailable)
    assert result.exception.message.startswith("the Azure Retail Prices API answered HTTP 500")
    assert result.exception.hint == (
        "check your connection and retry, or drop --live to use the shipped price table"
    )


# --- report ----------------------------------------------------------------------------------


def usage_report(now: datetime = NOW) -> UsageReport:
    def ago(hours: float) -> datetime:
        return now - timedelta(hours=hours)

    def rec(sandbox_id: str, start: float, end: float, owner: str) -> UsageRecord:
        return UsageRecord(
            sandbox_id=sandbox_id,
            owner=owner,
            image="python:3.12",
            cpu=2,
            memory_bytes=8 * 1024**3,
            labels={"exp": owner},
            started_at=ago(start),
            ended_at=ago(end),
            seconds=(start - end) * 3600,
        )

    return UsageReport(
        since=ago(4),
        until=now,
        records=[
            rec("a", 4, 2, "alice"),
            rec("b", 4, 2, "alice"),
            rec("c", 4, 2, "bob"),
            rec("d", 3, 1, "bob"),
        ],
    )


def test_report_from_file(tmp_path: Path) -> None:
    path = tmp_path / "usage.json"
    path.write_text(usage_report().model_dump_json())
    args = ["report", "--from-file", str(path), "--vm-size", "Standard_D8as_v5", "--ran-on", "spot"]
    data = json.loads(ok(*args, "--json").stdout)
    assert data["usage"]["node_hours_needed"] == 4.0
    assert data["actual_usd"] == pytest.approx(4 * 0.072618)
    markdown = ok(*args, "--by", "label:exp", "--markdown").stdout
    assert "| Node-hours needed (perfect autoscaling) | 4.00 | $1.38 | $0.29 |" in markdown
    assert "| alice | 2 | 4.00 | 8.00 | 32.00 | $0.46 | $0.10 |" in markdown
    rich = ok(*args).stdout
    assert "What it cost on the nodes it used: $0.29" in rich
    result = invoke("report", "--from-file", str(path), "--since", "1d")
    assert isinstance(result.exception, InvalidRequest)
    assert result.exception.message == "--since/--until do not apply to --from-file"


def test_report_from_file_and_a_cluster_over_http(tmp_path: Path) -> None:
    # The CLI measures uptime until the real now, so the fake cluster is built around it.
    now = datetime.now(UTC)
    path = tmp_path / "usage.json"
    path.write_text(usage_report(now).model_dump_json())
    with serving(FakeKubeApi(cluster_nodes(now))) as url:
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", url)
        args = ["report", "--from-file", str(path), "--kubeconfig", str(kubeconfig)]
        data = json.loads(ok(*args, "--json").stdout)
        rich = ok("report", "--no-usage", "--kubeconfig", str(kubeconfig)).stdout
    assert data["usage"]["vm_size"] == "Standard_D8as_v5"  # the cluster's sandbox pool
    idle = data["idle"]
    # creationTimestamp has whole seconds: allow the second it rounds away
    assert idle["sandbox_node_hours"] == pytest.approx(6.0, abs=0.01)
    assert idle["idle_node_hours"] == pytest.approx(2.0, abs=0.01)
    assert idle["actual_usd"] == pytest.approx(6 * 0.072618, abs=0.001)
    pools = {pool["pool"]: pool for pool in data["cluster"]["pools"]}
    assert pools["sbx"]["priority"] == "spot" and pools["sys"]["role"] == "system"
    assert "Cluster nodes as of" in rich and "sbx" in rich and "spot" in rich


def test_report_reads_usage_through_the_sdk(tmp_path: Path) -> None:
    seen: list[tuple[str, str | None]] = []
    body = json.loads(usage_report().model_dump_json())

    class Handler(_JsonHandler):
        def do_GET(self) -> None:
            seen.append((self.path, self.headers.get("X-API-Key")))
            self._send(200, body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    with serving(server) as url:
        result = ok(
            "report",
            "--url",
            url,
            "--api-key",
            "k-1",
            "--since",
            "2026-07-31T00:00:00Z",
            "--vm-size",
            "Standard_D8as_v5",
            "--json",
        )
    assert seen == [("/usage?since=2026-07-31T00%3A00%3A00%2B00%3A00", "k-1")]
    assert json.loads(result.stdout)["usage"]["sandbox_hours"] == 8.0


def test_every_option_has_help() -> None:
    group: Any = typer.main.get_command(root).commands["cost"]  # type: ignore[attr-defined]
    assert set(group.commands) == {"estimate", "report"}
    for name, sub in group.commands.items():
        assert sub.help, name
        options = [param for param in sub.params if param.param_type_name == "option"]
        assert len(options) > 10
        for param in options:
            assert param.help, f"{name} {param.opts}"
    help_text = ok("estimate", "--help").stdout
    assert "--sandboxes" in help_text and "--live" in help_text
