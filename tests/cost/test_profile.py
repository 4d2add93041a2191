"""`--profile` reads the deployment profile `orchard up` reads; hourly cost of its cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchard_env.cost.profile import CostProfile, hourly_cost, load_profile
from orchard_env.errors import ConfigError
from provision.profile import DeploymentProfile, parse_profile


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "profile.yaml"
    path.write_text(text)
    return path


def test_the_cost_values_of_a_deployment_profile(tmp_path: Path) -> None:
    profile = load_profile(
        write(
            tmp_path,
            "azure:\n  location: westus2\n  tier: Standard\n"
            "system_pool:\n  vm_size: Standard_D8as_v5\n  min_nodes: 2\n"
            "sandbox_pool:\n  vm_size: Standard_D8ads_v5\n  spot: false\n  os_disk: Managed\n"
            "  max_pods: 50\n",
        )
    )
    assert profile == CostProfile(
        region="westus2",
        sandbox_vm_size="Standard_D8ads_v5",
        spot=False,
        system_vm_size="Standard_D8as_v5",
        system_nodes=2,
        tier="standard",
        os_disk="managed",
        max_pods=50,
    )
    assert profile.vm_sizes() == ["Standard_D8ads_v5"]


def test_an_empty_profile_is_the_default_deployment(tmp_path: Path) -> None:
    profile = load_profile(write(tmp_path, ""))
    assert profile.region == "eastus"
    assert profile.vm_sizes() == ["Standard_D16as_v5"]
    assert (profile.spot, profile.system_nodes, profile.tier, profile.os_disk) == (
        True,
        1,
        "free",
        "auto",
    )


def test_a_bad_key_is_named_with_the_deployment_profile_message(tmp_path: Path) -> None:
    path = write(tmp_path, "sandbox_pool:\n  max_nodes: 0\n")
    with pytest.raises(ConfigError) as caught:
        load_profile(path)
    assert caught.value.message == (
        f"profile {path}: sandbox_pool.max_nodes: Input should be greater than or equal to 1"
    )
    with pytest.raises(ConfigError, match="unknown key 'regoin'"):
        load_profile(write(tmp_path, "regoin: eastus\n"))
    with pytest.raises(ConfigError, match="cannot read profile"):
        load_profile(tmp_path / "missing.yaml")


def test_hourly_cost_spans_both_pools_from_min_to_max() -> None:
    profile = parse_profile(
        {
            "system_pool": {"vm_size": "Standard_D4as_v5", "min_nodes": 1, "max_nodes": 2},
            "sandbox_pool": {
                "vm_size": "Standard_D8as_v5",
                "min_nodes": 0,
                "max_nodes": 4,
                "spot": True,
            },
        },
        source="test",
    )
    cost = hourly_cost(profile, prices="shipped")
    assert cost.pricing == "spot"
    # D8as_v5 spot $0.072618/h + a managed P10 ($19.71 / 730 h): no temp disk, so no
    # ephemeral OS disk; D4as_v5 on-demand $0.172/h + the same disk.
    disk = 19.71 / 730
    assert cost.sandbox_node_usd == pytest.approx(0.072618 + disk)
    assert cost.system_node_usd == pytest.approx(0.172 + disk)
    # Free tier $0 + load balancer $0.025/h + one public IP $0.005/h + ACR Basic $0.167/day
    assert cost.fixed_usd == pytest.approx(0.025 + 0.005 + 0.167 / 24)
    assert (cost.system_nodes, cost.sandbox_nodes) == ((1, 2), (0, 4))
    assert cost.min_usd == pytest.approx(cost.fixed_usd + cost.system_node_usd)
    assert cost.max_usd == pytest.approx(
        cost.fixed_usd + 2 * cost.system_node_usd + 4 * cost.sandbox_node_usd
    )
    assert cost.sandboxes_per_node == 7  # 1 CPU sandboxes: 8 vCPUs less reservations, ~7.4


def test_hourly_cost_on_demand_when_the_profile_says_regular() -> None:
    profile = DeploymentProfile.model_validate(
        {"sandbox_pool": {"vm_size": "Standard_D8as_v5", "spot": False}}
    )
    cost = hourly_cost(profile, prices="shipped")
    assert cost.pricing == "on-demand"
    assert cost.sandbox_node_usd == pytest.approx(0.344 + 19.71 / 730)
