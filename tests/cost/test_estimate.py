"""The itemised estimate against hand-computed values (eastus, shipped prices)."""

from __future__ import annotations

from typing import Any

import pytest

from orchard_env.cost.estimate import Estimate, build_request, estimate, estimate_cost
from orchard_env.cost.prices import PriceBook, RetailPricesClient, load_price_table
from orchard_env.cost.profile import CostProfile
from orchard_env.errors import ConfigError, InvalidRequest

BOOK = PriceBook(load_price_table())
WORKLOAD = {"sandboxes": 128, "hours": 240, "cpu": "2", "memory": "8Gi"}


def run(profile: CostProfile | None = None, **options: Any) -> Estimate:
    return estimate(build_request({**WORKLOAD, **options}, profile), BOOK)


def items(result: Estimate) -> dict[str, tuple[float | None, float | None]]:
    return {
        item.key: (
            None if item.on_demand_usd is None else round(item.on_demand_usd, 2),
            None if item.spot_usd is None else round(item.spot_usd, 2),
        )
        for item in result.line_items
    }


def test_d8as_v5_base_case_line_by_line() -> None:
    result = run(vm_sizes=["Standard_D8as_v5"])
    assert (result.packing.per_node, result.packing.nodes) == (3, 43)
    assert items(result) == {
        "sandbox_nodes": (3550.08, 749.42),  # 43 x 240 x 0.344 / 0.072618
        "eviction_rework": (0.0, 0.0),
        "system_nodes": (82.56, 82.56),  # 2 x 240 x 0.172, never spot
        "control_plane": (0.0, 0.0),
        "load_balancer": (6.0, 6.0),  # 240 x 0.025
        "public_ips": (1.2, 1.2),  # 240 x 0.005
        "os_disks_sandbox": (278.64, 278.64),  # 43 x 19.71 x 240 / 730 (no temp disk)
        "os_disks_system": (12.96, 12.96),
        "registry": (1.67, 1.67),  # 10 days x 0.167
        "usage_based": (None, None),
    }
    assert round(result.total_on_demand_usd or 0, 2) == 3933.11
    assert round(result.total_spot_usd or 0, 2) == 1132.45
    assert result.per_sandbox_hour_on_demand_usd == pytest.approx(3933.11 / 30720, abs=1e-6)
    # 2 x 0.172 + 0.025 + 0.005 + 0.167 / 24 + 2 x 19.71 / 730
    assert result.idle_floor_usd_per_hour == pytest.approx(0.43496, abs=1e-5)


def test_trimmed_requests_reproduce_the_four_per_node_row() -> None:
    result = run(vm_sizes=["Standard_D8as_v5"], cpu="1.8", memory="7.5Gi")
    assert result.packing.nodes == 32
    assert items(result)["sandbox_nodes"] == (2641.92, 557.71)


def test_auto_picks_the_cheapest_fitting_size_and_lists_the_rest() -> None:
    result = run()
    options = {o.sku: (o.per_node, o.nodes) for o in result.options}
    assert options["Standard_D16as_v5"] == (7, 19)
    assert options["Standard_D32as_v5"] == (15, 9)
    assert result.chosen.sku == "Standard_D32as_v5"
    assert items(result)["sandbox_nodes"][0] == 2972.16  # 9 x 240 x 1.376
    d16 = next(o for o in result.options if o.sku == "Standard_D16as_v5")
    assert d16.on_demand_usd == pytest.approx(3137.28 + 19 * 19.71 * 240 / 730)
    assert any(
        w.startswith("Standard_D32as_v5 on-demand (eastus) $1.376/h is derived")
        for w in result.warnings
    )
    assert any(
        w.startswith("Standard_D32as_v5 spot (eastus) $0.290472/h is assumed")
        for w in result.warnings
    )


def test_spot_only_picks_by_spot_and_prices_no_on_demand_column() -> None:
    result = run(pricing="spot")
    assert result.total_on_demand_usd is None
    assert all(item.on_demand_usd is None for item in result.line_items)
    assert result.total_spot_usd is not None
    on_demand_only = run(pricing="on-demand", vm_sizes=["Standard_D8as_v5"])
    assert on_demand_only.total_spot_usd is None
    assert "eviction_rework" not in items(on_demand_only)


def test_ephemeral_os_disks_cost_nothing_and_need_a_temp_disk() -> None:
    result = run(vm_sizes=["Standard_D8ads_v5"])
    assert items(result)["os_disks_sandbox"] == (0.0, 0.0)
    assert any("D8ads_v5 on-demand (eastus) $0.402/h is unconfirmed" in w for w in result.warnings)
    with pytest.raises(ConfigError) as caught:
        run(vm_sizes=["Standard_D8as_v5"], os_disk="ephemeral")
    assert caught.value.message == (
        "Standard_D8as_v5 has no temp disk, so it cannot use an ephemeral OS disk"
    )
    auto_ephemeral = run(os_disk="ephemeral")
    assert auto_ephemeral.chosen.sku == "Standard_D8ads_v5"


def test_knobs_tier_eviction_registry_ips() -> None:
    result = run(
        vm_sizes=["Standard_D8as_v5"],
        tier="standard",
        eviction_overhead_pct=10,
        registry="premium",
        public_ips=2,
    )
    got = items(result)
    assert got["control_plane"] == (24.0, 24.0)
    assert got["eviction_rework"] == (0.0, 74.94)  # 10% of 749.42
    assert got["registry"] == (16.67, 16.67)
    assert got["public_ips"] == (2.4, 2.4)


def test_a_sandbox_too_big_for_the_only_size() -> None:
    with pytest.raises(InvalidRequest, match="does not fit on Standard_D4as_v5"):
        run(vm_sizes=["Standard_D4as_v5"], cpu="4")
    with pytest.raises(ConfigError, match=r"no VM size can run 128 x 64 CPU / 8Gi in eastus \(too"):
        run(cpu="64")


def test_regions_without_prices_fail_with_a_live_hint() -> None:
    with pytest.raises(ConfigError) as caught:
        run(region="westus2", vm_sizes=["Standard_D8as_v5", "Standard_D16as_v5"])
    assert caught.value.message == (
        "no VM size can run 128 x 2 CPU / 8Gi in westus2 (no on-demand price in westus2: "
        "Standard_D8as_v5, Standard_D16as_v5)"
    )
    assert caught.value.hint == (
        "the shipped table covers eastus for a few sizes only; rerun with --live to fetch "
        "westus2 prices"
    )
    with pytest.raises(ConfigError) as single:
        run(region="westus2", vm_sizes=["Standard_D8as_v5"])
    assert single.value.message == "no on-demand price for Standard_D8as_v5 in westus2"


def test_mixed_reasons_are_grouped() -> None:
    with pytest.raises(ConfigError) as caught:
        run(cpu="12", vm_sizes=["Standard_D4as_v5", "Standard_D8as_v5", "Standard_D16ads_v5"])
    assert caught.value.message == (
        "no VM size can run 128 x 12 CPU / 8Gi in eastus (too small for a 12 CPU / 8Gi sandbox "
        "(cpu): Standard_D4as_v5, Standard_D8as_v5; no on-demand price in eastus: "
        "Standard_D16ads_v5)"
    )


def test_managed_services_are_priced_for_the_same_workload() -> None:
    result = run()
    assert [round(q.compute_usd, 2) for q in result.managed] == [
        7077.89,
        7077.89,
        10304.96,
        12828.67,
        3072.0,
    ]


def test_flags_override_the_profile_which_overrides_defaults() -> None:
    profile = CostProfile(
        region="eastus",
        sandbox_vm_size="Standard_D16as_v5",
        spot=True,
        system_nodes=1,
        tier="standard",
    )
    result = run(profile)
    assert result.chosen.sku == "Standard_D16as_v5"
    assert result.request.pricing == "spot"
    assert result.request.system_nodes == 1
    assert result.request.tier == "standard"
    flagged = run(profile, vm_sizes=["Standard_D8as_v5"], pricing="both", system_nodes=3)
    assert (flagged.chosen.sku, flagged.request.pricing, flagged.request.system_nodes) == (
        "Standard_D8as_v5",
        "both",
        3,
    )


def test_defaults_are_the_orchestrators_default_sandbox_size() -> None:
    request = build_request({"sandboxes": 1, "hours": 1})
    assert (request.cpu, request.memory_bytes) == (1.0, 2 * 1024**3)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"sandboxes": 0}, "--sandboxes: Input should be greater than or equal to 1"),
        ({"hours": -1}, "--hours: Input should be greater than 0"),
        ({"cpu": "two"}, "--cpu: cpu 'two' is not a quantity (examples: 2, 0.5, 500m)"),
        (
            {"memory": "8 gigs"},
            "--memory: memory '8 gigs' is not a quantity (examples: 512Mi, 8Gi, 1G)",
        ),
        ({"pricing": "cheap"}, "--pricing: Input should be 'on-demand', 'spot' or 'both'"),
        ({"max_pods": 5}, "--max-pods: Input should be greater than or equal to 10"),
    ],
)
def test_bad_options_name_their_flag(options: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        build_request({**WORKLOAD, **options})
    assert caught.value.message == message


def test_unknown_size_in_the_profile_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown VM size 'Standard_Nope'"):
        run(CostProfile(sandbox_vm_size="Standard_Nope"))


def test_estimate_cost_rejects_unknown_sizes_before_fetching() -> None:
    class NoNetwork(RetailPricesClient):
        def items(self, odata_filter: str) -> list[dict[str, Any]]:
            raise AssertionError("no request expected")

    request = build_request({**WORKLOAD, "vm_sizes": ["Standard_Nope"]})
    with pytest.raises(ConfigError, match="unknown VM size 'Standard_Nope'"):
        estimate_cost(request, prices="live", client=NoNetwork())
