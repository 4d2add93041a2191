"""The cost-relevant part of a deployment profile, and what a profile's cluster costs per hour.

``orchard cost --profile FILE`` reads the same file ``orchard up`` does
(:class:`provision.profile.DeploymentProfile`) and takes from it: ``azure.location`` (the
region), ``azure.tier``, ``system_pool.vm_size`` and ``system_pool.min_nodes``,
``sandbox_pool.vm_size``, ``sandbox_pool.spot``, ``sandbox_pool.os_disk`` and
``sandbox_pool.max_pods``. Flags win over the file.

:func:`hourly_cost` prices the cluster a profile describes per hour, from its smallest
(both pools at their minimum) to its largest (both at their maximum): what
``orchard up --plan`` prints.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from orchard_env.cost.prices import PriceMode, PriceSourceInfo, RetailPricesClient
from provision.profile import DeploymentProfile
from provision.profile import load_profile as load_deployment_profile

Tier = Literal["free", "standard", "premium"]
OsDisk = Literal["auto", "ephemeral", "managed"]


class CostProfile(BaseModel):
    """The values an estimate or report takes from a profile (None: not given)."""

    model_config = ConfigDict(extra="forbid")

    region: str | None = None
    sandbox_vm_size: str | None = None
    spot: bool | None = None
    system_vm_size: str | None = None
    system_nodes: int | None = Field(default=None, ge=1)
    tier: Tier | None = None
    os_disk: OsDisk | None = None
    max_pods: int | None = Field(default=None, ge=10, le=250)

    def vm_sizes(self) -> list[str] | None:
        return [self.sandbox_vm_size] if self.sandbox_vm_size else None


def cost_profile(profile: DeploymentProfile) -> CostProfile:
    """The cost view of a deployment profile."""
    tier: Tier = "standard" if profile.azure.tier == "Standard" else "free"
    if profile.azure.tier == "Premium":
        tier = "premium"
    os_disk: OsDisk = "auto"
    if profile.sandbox_pool.os_disk == "Managed":
        os_disk = "managed"
    elif profile.sandbox_pool.os_disk == "Ephemeral":
        os_disk = "ephemeral"
    return CostProfile(
        region=profile.azure.location,
        sandbox_vm_size=profile.sandbox_pool.vm_size,
        spot=profile.sandbox_pool.spot,
        system_vm_size=profile.system_pool.vm_size,
        system_nodes=max(1, profile.system_pool.min_nodes),  # a System pool keeps one node
        tier=tier,
        os_disk=os_disk,
        max_pods=profile.sandbox_pool.max_pods,
    )


def load_profile(path: Path) -> CostProfile:
    """Read and validate a deployment profile; any problem is a ConfigError naming the key."""
    return cost_profile(load_deployment_profile(path))


class HourlyCost(BaseModel):
    """What a profile's AKS cluster costs per hour, at its smallest and at its largest."""

    pricing: Literal["spot", "on-demand"]
    region: str
    sandbox_vm_size: str
    system_vm_size: str
    sandboxes_per_node: int = Field(description="default-size sandboxes (limits) per node")
    sandbox_node_usd: float = Field(description="one sandbox node per hour, OS disk included")
    system_node_usd: float = Field(description="one system node per hour, OS disk included")
    fixed_usd: float = Field(description="control plane, load balancer, public IP, registry")
    system_nodes: tuple[int, int]
    sandbox_nodes: tuple[int, int]
    min_usd: float
    max_usd: float
    prices: PriceSourceInfo
    warnings: list[str]


_FIXED = ("control_plane", "load_balancer", "public_ips", "registry")


def hourly_cost(
    profile: DeploymentProfile,
    *,
    prices: PriceMode = "auto",
    client: RetailPricesClient | None = None,
    now: datetime | None = None,
) -> HourlyCost:
    """Price one hour of the profile's cluster with the estimate model.

    The sandbox pool is priced spot or on-demand as the profile says; the system pool is
    always on-demand. Log Analytics and egress are by usage and not included.
    """
    from orchard_env.cost.estimate import build_request, estimate_cost

    view = cost_profile(profile)
    pricing: Literal["spot", "on-demand"] = "spot" if profile.sandbox_pool.spot else "on-demand"
    request = build_request(
        {
            "sandboxes": 1,
            "hours": 1,
            "cpu": profile.limits.default_cpu,
            "memory": profile.limits.default_memory,
            "pricing": pricing,
            "system_nodes": 1,
        },
        view,
    )
    result = estimate_cost(request, prices=prices, client=client, now=now)
    column = {
        item.key: (item.spot_usd if pricing == "spot" else item.on_demand_usd) or 0.0
        for item in result.line_items
    }
    sandbox_node = column["sandbox_nodes"] + column["os_disks_sandbox"]
    system_node = column["system_nodes"] + column["os_disks_system"]
    fixed = sum(column[key] for key in _FIXED)
    system_nodes = (max(1, profile.system_pool.min_nodes), profile.system_pool.max_nodes)
    sandbox_nodes = (profile.sandbox_pool.min_nodes, profile.sandbox_pool.max_nodes)
    return HourlyCost(
        pricing=pricing,
        region=request.region,
        sandbox_vm_size=result.chosen.sku,
        system_vm_size=request.system_vm_size,
        sandboxes_per_node=result.chosen.per_node,
        sandbox_node_usd=sandbox_node,
        system_node_usd=system_node,
        fixed_usd=fixed,
        system_nodes=system_nodes,
        sandbox_nodes=sandbox_nodes,
        min_usd=fixed + system_nodes[0] * system_node + sandbox_nodes[0] * sandbox_node,
        max_usd=fixed + system_nodes[1] * system_node + sandbox_nodes[1] * sandbox_node,
        prices=result.prices,
        warnings=result.warnings,
    )
