"""``orchard cost estimate``: an itemised AKS price for N sandboxes x H hours, spot and on-demand.

The model, line by line (every item carries the assumption behind it):

- **Sandbox nodes**: sandboxes per node after AKS reservations and DaemonSets
  (:mod:`orchard_env.cost.nodes`, :mod:`orchard_env.cost.packing`), nodes = ceil(N / per node),
  all up for the whole period (the floor a run of N concurrent sandboxes needs).
- **Spot eviction rework**: an optional surcharge (% of the spot sandbox nodes) for restarts and
  lost work.
- **System pool**: never spot (AKS forbids a spot System pool).
- **Control plane** by tier, **Standard load balancer**, **public IPs**.
- **OS disks**: ephemeral (free) where the size has a temp disk, else a managed P10 per node.
- **Registry** (ACR by the day). Log Analytics and egress are listed but not priced (by usage).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchard_env.cost.managed import ManagedQuote, Workload, managed_quotes
from orchard_env.cost.nodes import (
    DEFAULT_MAX_PODS,
    DaemonSetOverhead,
    NodeCapacity,
    daemonset_overhead,
    node_capacity,
)
from orchard_env.cost.packing import Packing, SandboxShape, pack, per_node
from orchard_env.cost.prices import (
    STALE_CACHE_DAYS,
    PriceBook,
    PriceMode,
    PriceQuote,
    PriceSourceInfo,
    Rate,
    RetailPricesClient,
    VmSku,
    cache_age_days,
    load_price_book,
    load_price_table,
)
from orchard_env.cost.profile import CostProfile, Tier
from orchard_env.errors import ConfigError, InvalidRequest
from orchard_env.quantities import parse_cpu, parse_memory

PricingMode = Literal["on-demand", "spot", "both"]
OsDisk = Literal["auto", "ephemeral", "managed"]
RegistrySku = Literal["basic", "standard", "premium"]

DEFAULT_SYSTEM_VM_SIZE = "Standard_D4as_v5"
DEFAULT_SYSTEM_NODES = 2


class EstimateRequest(BaseModel):
    """Everything an estimate depends on (flags > profile > these defaults)."""

    model_config = ConfigDict(extra="forbid")

    sandboxes: int = Field(ge=1)
    hours: float = Field(gt=0)
    cpu: float = Field(gt=0)
    memory_bytes: int = Field(gt=0)
    region: str = "eastus"
    vm_sizes: list[str] = Field(default_factory=list)
    pricing: PricingMode = "both"
    system_vm_size: str = DEFAULT_SYSTEM_VM_SIZE
    system_nodes: int = Field(default=DEFAULT_SYSTEM_NODES, ge=1)
    tier: Tier = "free"
    os_disk: OsDisk = "auto"
    max_pods: int = Field(default=DEFAULT_MAX_PODS, ge=10, le=250)
    daemonsets: DaemonSetOverhead = Field(default_factory=DaemonSetOverhead)
    eviction_overhead_pct: float = Field(default=0.0, ge=0, le=1000)
    public_ips: int = Field(default=1, ge=0)
    registry: RegistrySku = "basic"
    disk_gib: float | None = Field(default=None, gt=0)

    @property
    def shape(self) -> SandboxShape:
        return SandboxShape.of(self.cpu, self.memory_bytes)

    @property
    def sandbox_hours(self) -> float:
        return self.sandboxes * self.hours

    @property
    def wants_on_demand(self) -> bool:
        return self.pricing in ("on-demand", "both")

    @property
    def wants_spot(self) -> bool:
        return self.pricing in ("spot", "both")


_FLAG_OF = {
    "sandboxes": "--sandboxes",
    "hours": "--hours",
    "cpu": "--cpu",
    "memory_bytes": "--memory",
    "region": "--region",
    "vm_sizes": "--vm-size",
    "pricing": "--pricing",
    "system_vm_size": "--system-vm-size",
    "system_nodes": "--system-nodes",
    "tier": "--tier",
    "os_disk": "--os-disk",
    "max_pods": "--max-pods",
    "daemonsets": "--daemonset-cpu/--daemonset-memory/--daemonset-pods",
    "eviction_overhead_pct": "--eviction-overhead",
    "public_ips": "--public-ips",
    "registry": "--registry",
    "disk_gib": "--disk",
}


def _quantity(flag: str, value: str | None, parse: Any) -> Any:
    if value is None:
        return None
    try:
        return parse(value)
    except ValueError as exc:
        raise InvalidRequest(f"{flag}: {exc}") from exc


def build_request(
    options: Mapping[str, Any], profile: CostProfile | None = None
) -> EstimateRequest:
    """Merge CLI-style options (None = not given) over a profile over the defaults.

    ``cpu``, ``memory``, ``daemonset_cpu`` and ``daemonset_memory`` are Kubernetes quantity
    strings; the rest are :class:`EstimateRequest` fields.
    """
    values: dict[str, Any] = {}
    if profile is not None:
        profile_values = {
            "region": profile.region,
            "vm_sizes": profile.vm_sizes(),
            "pricing": None if profile.spot is None else ("spot" if profile.spot else "on-demand"),
            "system_vm_size": profile.system_vm_size,
            "system_nodes": profile.system_nodes,
            "tier": profile.tier,
            "os_disk": profile.os_disk,
            "max_pods": profile.max_pods,
        }
        values.update({k: v for k, v in profile_values.items() if v is not None})
    given = {k: v for k, v in options.items() if v is not None and v != []}
    cpu = _quantity("--cpu", given.pop("cpu", None), parse_cpu)
    memory = _quantity("--memory", given.pop("memory", None), parse_memory)
    values["daemonsets"] = daemonset_overhead(
        given.pop("daemonset_cpu", None),
        given.pop("daemonset_memory", None),
        given.pop("daemonset_pods", None),
    )
    values.update(given)
    values["cpu"] = cpu if cpu is not None else 1.0
    values["memory_bytes"] = memory if memory is not None else 2 * 1024**3
    try:
        return EstimateRequest.model_validate(values)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = str(error["loc"][0]) if error["loc"] else ""
        flag = _FLAG_OF.get(field, field or "options")
        raise InvalidRequest(f"{flag}: {error['msg']}") from exc


# --- results ---------------------------------------------------------------------------------


class LineItem(BaseModel):
    key: str
    item: str
    on_demand_usd: float | None
    spot_usd: float | None
    assumption: str


class SkuOption(BaseModel):
    """One candidate VM size for the sandbox pool, priced (or why it was not)."""

    sku: str
    vcpus: int
    memory_gib: float
    per_node: int
    limited_by: str
    nodes: int | None = None
    os_disk: Literal["ephemeral", "managed"]
    on_demand: PriceQuote | None = None
    spot: PriceQuote | None = None
    on_demand_usd: float | None = None
    spot_usd: float | None = None
    viable: bool
    reason: str | None = None
    hint: str | None = Field(default=None, exclude=True)


class PriceUse(BaseModel):
    """One price the estimate used, with its status and source (the "Prices used" table)."""

    item: str
    price: str
    status: str
    source: str
    as_of: str | None = None
    note: str | None = None


class Estimate(BaseModel):
    request: EstimateRequest
    chosen: SkuOption
    capacity: NodeCapacity
    packing: Packing
    options: list[SkuOption]
    line_items: list[LineItem]
    total_on_demand_usd: float | None
    total_spot_usd: float | None
    per_sandbox_hour_on_demand_usd: float | None
    per_sandbox_hour_spot_usd: float | None
    idle_floor_usd_per_hour: float
    managed: list[ManagedQuote]
    prices: PriceSourceInfo
    prices_used: list[PriceUse]
    warnings: list[str]


# --- the model -------------------------------------------------------------------------------


def _rate_per_hour(rate: Rate, hours_per_month: float) -> float:
    if rate.per == "hour":
        return rate.usd
    if rate.per == "day":
        return rate.usd / 24
    if rate.per == "month":
        return rate.usd / hours_per_month
    raise ValueError(f"a per-{rate.per} rate has no hourly equivalent")


def _os_disk_for(sku: VmSku, wanted: OsDisk) -> Literal["ephemeral", "managed"]:
    if wanted == "managed":
        return "managed"
    if sku.supports_ephemeral_os_disk:
        return "ephemeral"
    if wanted == "ephemeral":
        raise ConfigError(
            f"{sku.name} has no temp disk, so it cannot use an ephemeral OS disk",
            hint="choose a size with a 'd' (e.g. Standard_D8ads_v5) or --os-disk managed",
        )
    return "managed"


def _option(book: PriceBook, request: EstimateRequest, name: str, *, strict: bool) -> SkuOption:
    """Price one candidate size; ``strict`` raises instead of marking it not viable."""
    sku = book.sku(name)
    capacity = node_capacity(sku, max_pods=request.max_pods, daemonsets=request.daemonsets)
    count, limit = per_node(capacity, request.shape)
    base: dict[str, Any] = {
        "sku": name,
        "vcpus": sku.vcpus,
        "memory_gib": sku.memory_gib,
        "per_node": count,
        "limited_by": limit,
    }
    try:
        os_disk = _os_disk_for(sku, request.os_disk)
    except ConfigError:
        if strict:
            raise
        return SkuOption(
            **base, os_disk="managed", viable=False, reason="no temp disk for an ephemeral OS disk"
        )
    if count == 0:
        if strict:
            pack(request.sandboxes, request.shape, capacity)  # raises with the details
        return SkuOption(
            **base,
            os_disk=os_disk,
            viable=False,
            reason=f"too small for a {request.shape.describe()} sandbox ({limit})",
        )
    nodes = -(-request.sandboxes // count)
    try:
        on_demand = book.vm_price(name, request.region, "on_demand")
        spot = book.vm_price(name, request.region, "spot") if request.wants_spot else None
    except ConfigError as exc:
        if strict:
            raise
        return SkuOption(
            **base,
            nodes=nodes,
            os_disk=os_disk,
            viable=False,
            reason=exc.message.replace(f" for {name} ", " "),
            hint=exc.hint,
        )
    table = book.table
    disk = 0.0
    if os_disk == "managed":
        disk = nodes * _rate_per_hour(table.services.managed_os_disk, table.hours_per_month)
    hours = request.hours
    return SkuOption(
        **base,
        nodes=nodes,
        os_disk=os_disk,
        on_demand=on_demand,
        spot=spot,
        on_demand_usd=(nodes * on_demand.usd_per_hour + disk) * hours,
        spot_usd=None if spot is None else (nodes * spot.usd_per_hour + disk) * hours,
        viable=True,
    )


def _choose(options: list[SkuOption], request: EstimateRequest) -> SkuOption:
    viable = [option for option in options if option.viable]
    if not viable:
        by_reason: dict[str, list[str]] = {}
        for option in options:
            by_reason.setdefault(option.reason or "not usable", []).append(option.sku)
        reasons = "; ".join(f"{why}: {', '.join(skus)}" for why, skus in by_reason.items())
        hints = dict.fromkeys(option.hint for option in options if option.hint)
        raise ConfigError(
            f"no VM size can run {request.sandboxes} x {request.shape.describe()} in "
            f"{request.region} ({reasons})",
            hint="; ".join(hints) or "choose another --vm-size",
        )

    def cost(option: SkuOption) -> float:
        value = option.spot_usd if request.pricing == "spot" else option.on_demand_usd
        return value if value is not None else float("inf")

    return min(viable, key=cost)


class _Ledger:
    """Collects every price used (with status and source) and warns about unconfirmed ones."""

    def __init__(self, book: PriceBook) -> None:
        self.table = book.table
        self.uses: list[PriceUse] = []
        self.warnings: list[str] = []

    def _add(self, use: PriceUse, confirmed: bool) -> None:
        if use in self.uses:
            return
        self.uses.append(use)
        if not confirmed:
            self.warnings.append(
                f"{use.item} {use.price} is {use.status}: {use.note or use.source}"
            )

    def quote(self, quote: PriceQuote) -> str:
        kind = quote.priority.replace("_", "-")
        price = f"${quote.usd_per_hour:g}/h"
        use = PriceUse(
            item=f"{quote.sku} {kind} ({quote.region})",
            price=price,
            status=quote.status,
            source=quote.source,
            as_of=quote.as_of,
            note=quote.note,
        )
        self._add(use, quote.confirmed)
        return f"{kind} {price} ({quote.status})"

    def rate(self, item: str, rate: Rate) -> str:
        price = f"${rate.usd:g}/{rate.per}"
        use = PriceUse(
            item=item,
            price=price,
            status=rate.status,
            source=self.table.source_text(rate.source),
            note=rate.note,
        )
        self._add(use, rate.status == "sourced" or rate.usd == 0)
        return price


def _sandbox_items(
    request: EstimateRequest, chosen: SkuOption, packing: Packing, ledger: _Ledger
) -> list[LineItem]:
    if chosen.on_demand is None or chosen.nodes is None:
        raise ValueError(f"{chosen.sku} was chosen without a price")
    hours = request.hours
    nodes = chosen.nodes
    on_demand = nodes * chosen.on_demand.usd_per_hour * hours
    spot_pool = None if chosen.spot is None else nodes * chosen.spot.usd_per_hour * hours
    prices = [ledger.quote(chosen.on_demand)]
    if chosen.spot is not None:
        prices.append(ledger.quote(chosen.spot))
    items = [
        LineItem(
            key="sandbox_nodes",
            item=f"Sandbox nodes: {nodes} x {chosen.sku}",
            on_demand_usd=on_demand if request.wants_on_demand else None,
            spot_usd=spot_pool,
            assumption=(
                f"{packing.describe()} after AKS reservations and DaemonSets; all {nodes} "
                f"nodes up for {hours:g} h; " + "; ".join(prices)
            ),
        )
    ]
    if spot_pool is not None:
        pct = request.eviction_overhead_pct
        items.append(
            LineItem(
                key="eviction_rework",
                item="Spot eviction rework",
                on_demand_usd=0.0 if request.wants_on_demand else None,
                spot_usd=spot_pool * pct / 100,
                assumption=(
                    f"{pct:g}% of the spot sandbox nodes for restarts and lost work "
                    "(--eviction-overhead)"
                ),
            )
        )
    return items


def _fixed_items(
    book: PriceBook, request: EstimateRequest, chosen: SkuOption, ledger: _Ledger
) -> list[LineItem]:
    services = book.table.services
    hours = request.hours
    hpm = book.table.hours_per_month

    def item(key: str, label: str, amount: float | None, assumption: str) -> LineItem:
        return LineItem(
            key=key,
            item=label,
            on_demand_usd=amount if request.wants_on_demand else None,
            spot_usd=amount if request.wants_spot else None,
            assumption=assumption,
        )

    system = book.sku(request.system_vm_size)
    system_price = book.vm_price(system.name, request.region, "on_demand")
    tier = services.control_plane[request.tier]
    lb, ip = services.load_balancer, services.public_ip
    items = [
        item(
            "system_nodes",
            f"System pool: {request.system_nodes} x {system.name} (regular)",
            request.system_nodes * system_price.usd_per_hour * hours,
            f"a System pool cannot be spot; {ledger.quote(system_price)}",
        ),
        item(
            "control_plane",
            f"Control plane: {request.tier.capitalize()} tier",
            tier.usd * hours,
            f"{ledger.rate(f'AKS {request.tier} tier', tier)}; {tier.note}",
        ),
        item(
            "load_balancer",
            "Standard load balancer",
            lb.usd * hours,
            f"{ledger.rate('Standard load balancer', lb)}; {lb.note}",
        ),
        item(
            "public_ips",
            f"Public IPs: {request.public_ips}",
            request.public_ips * ip.usd * hours,
            f"{ledger.rate('Public IP', ip)} each; {ip.note}",
        ),
    ]
    disk = services.managed_os_disk
    disk_per_node = _rate_per_hour(disk, hpm) * hours
    pools = (
        ("sandbox", chosen.sku, chosen.nodes or 0, chosen.os_disk),
        ("system", system.name, request.system_nodes, _os_disk_for(system, "auto")),
    )
    for key, sku_name, count, kind in pools:
        if kind == "managed":
            forced = key == "sandbox" and request.os_disk == "managed"
            reason = "--os-disk managed" if forced else f"{sku_name} has no temp disk"
            price = ledger.rate("Managed OS disk (P10, 128 GiB)", disk)
            amount = count * disk_per_node
            why = (
                f"managed P10 at {price} of {hpm:g} h = ${disk_per_node:.2f} per node for "
                f"{hours:g} h ({reason})"
            )
        else:
            amount, why = 0.0, f"ephemeral OS disk on the {sku_name} temp disk: no charge"
        items.append(item(f"os_disks_{key}", f"OS disks: {count} {key} nodes", amount, why))
    registry = services.registry[request.registry]
    price = ledger.rate(f"ACR {request.registry.capitalize()}", registry)
    items.append(
        item(
            "registry",
            f"Container registry: ACR {request.registry.capitalize()}",
            _rate_per_hour(registry, hpm) * hours,
            f"{price} for {hours / 24:g} days" + (f"; {registry.note}" if registry.note else ""),
        )
    )
    la, egress = services.log_analytics, services.egress
    items.append(
        LineItem(
            key="usage_based",
            item="Log Analytics, egress",
            on_demand_usd=None,
            spot_usd=None,
            assumption=(
                f"by usage, not included: ~${la.usd:g}/GB ingested ({la.status}); egress "
                f"~${egress.usd:g}/GB {egress.note} ({egress.status})"
            ),
        )
    )
    return items


_FIXED_KEYS = frozenset(
    {"system_nodes", "control_plane", "load_balancer", "public_ips", "os_disks_system", "registry"}
)


def estimate(request: EstimateRequest, book: PriceBook) -> Estimate:
    """Price ``request`` with ``book``: pick the sandbox VM size, itemise, compare."""
    names = list(dict.fromkeys(request.vm_sizes or book.table.default_candidates))
    strict = len(names) == 1
    options = [_option(book, request, name, strict=strict) for name in names]
    chosen = _choose(options, request)
    capacity = node_capacity(
        book.sku(chosen.sku), max_pods=request.max_pods, daemonsets=request.daemonsets
    )
    packing = pack(request.sandboxes, request.shape, capacity)
    ledger = _Ledger(book)
    items = _sandbox_items(request, chosen, packing, ledger)
    items += _fixed_items(book, request, chosen, ledger)
    total_od = sum(i.on_demand_usd or 0.0 for i in items) if request.wants_on_demand else None
    total_spot = sum(i.spot_usd or 0.0 for i in items) if request.wants_spot else None
    idle_floor = sum(
        (i.on_demand_usd if i.on_demand_usd is not None else i.spot_usd) or 0.0
        for i in items
        if i.key in _FIXED_KEYS
    )
    workload = Workload(
        sandboxes=request.sandboxes,
        hours=request.hours,
        cpu=request.cpu,
        memory_gib=request.memory_bytes / 1024**3,
        disk_gib=request.disk_gib,
    )
    sandbox_hours = request.sandbox_hours
    return Estimate(
        request=request,
        chosen=chosen,
        capacity=capacity,
        packing=packing,
        options=options,
        line_items=items,
        total_on_demand_usd=total_od,
        total_spot_usd=total_spot,
        per_sandbox_hour_on_demand_usd=None if total_od is None else total_od / sandbox_hours,
        per_sandbox_hour_spot_usd=None if total_spot is None else total_spot / sandbox_hours,
        idle_floor_usd_per_hour=idle_floor / request.hours,
        managed=managed_quotes(workload),
        prices=book.source_info(request.region),
        prices_used=ledger.uses,
        warnings=ledger.warnings,
    )


def estimate_cost(
    request: EstimateRequest,
    *,
    prices: PriceMode = "auto",
    client: RetailPricesClient | None = None,
    now: datetime | None = None,
) -> Estimate:
    """Load prices (shipped, cached or live) for ``request`` and estimate it.

    Cached prices older than 30 days add a warning; ``prices="live"`` fetches every candidate
    size and the system size from the Retail Prices API and refreshes the cache.
    """
    table = load_price_table()
    skus = [*(request.vm_sizes or table.default_candidates), request.system_vm_size]
    for name in skus:
        table.sku(name)  # unknown sizes fail before any request
    book = load_price_book(prices, request.region, skus, client=client, now=now)
    result = estimate(request, book)
    age = cache_age_days(result.prices, now)
    if age is not None and age > STALE_CACHE_DAYS:
        result.warnings.append(
            f"cached prices are {age:.0f} days old (fetched {result.prices.fetched_at:%Y-%m-%d}); "
            "--live refreshes them"
        )
    return result
