"""``orchard cost report``: what a run cost, from usage records and/or a live cluster.

From the orchestrator's usage records (:class:`~orchard_env.protocol.UsageReport`):

- **node-hours needed**: replay the records as a timeline; at every moment the sandbox pool
  needs sum over sizes of ceil(running / per node) nodes (sizes are not mixed on a node, so
  with mixed sizes this is an upper bound); integrate over the period. That is the node time a
  perfect autoscaler would have paid for, priced at spot and at on-demand.
- **attribution**: each sandbox-hour costs the node price / sandboxes per node, summed by
  owner (API key), label, image or size.

From a cluster (``--kubeconfig``): its nodes by pool and priority (spot vs regular) with their
uptime and cost so far. With both, the sandbox nodes' uptime inside the period minus the
node-hours needed is the node time that sat idle. Only nodes that exist now are visible: nodes
the autoscaler already removed are not counted.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from orchard_env.cost.nodes import (
    DEFAULT_MAX_PODS,
    DaemonSetOverhead,
    check_max_pods,
    node_capacity,
)
from orchard_env.cost.packing import SandboxShape, per_node
from orchard_env.cost.prices import (
    PriceBook,
    PriceMode,
    PriceQuote,
    PriceSourceInfo,
    Priority,
    RetailPricesClient,
    is_vm_size_name,
    load_price_book,
    load_price_table,
)
from orchard_env.errors import ConfigError, InvalidRequest, PermissionDenied, Unavailable
from orchard_env.protocol import UsageRecord, UsageReport
from orchard_env.quantities import parse_cpu, parse_memory

POOL_LABELS = ("kubernetes.azure.com/agentpool", "agentpool")
PRIORITY_LABEL = "kubernetes.azure.com/scalesetpriority"
MODE_LABEL = "kubernetes.azure.com/mode"
INSTANCE_TYPE_LABELS = ("node.kubernetes.io/instance-type", "beta.kubernetes.io/instance-type")
REGION_LABELS = ("topology.kubernetes.io/region", "failure-domain.beta.kubernetes.io/region")
SANDBOX_LABEL = ("workload", "sandbox")

GroupBy = str  # "owner", "size", "image" or "label:<key>"


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


_RELATIVE_RE = re.compile(r"^(\d+(?:\.\d+)?)([mhd])$")
_UNIT_SECONDS = {"m": 60, "h": 3600, "d": 86400}


def parse_when(text: str, *, now: datetime | None = None, flag: str = "--since") -> datetime:
    """``2026-07-01``, ``2026-07-01T12:00:00Z`` (naive means UTC) or ``24h``/``7d``/``30m`` ago."""
    moment = now or datetime.now(UTC)
    match = _RELATIVE_RE.match(text.strip())
    if match:
        return moment - timedelta(seconds=float(match.group(1)) * _UNIT_SECONDS[match.group(2)])
    try:
        return _aware(datetime.fromisoformat(text.strip()))
    except ValueError as exc:
        raise InvalidRequest(
            f"{flag} {text!r} is not a date, a date-time or an age",
            hint="e.g. 2026-07-01, 2026-07-01T12:00:00Z, 24h or 7d",
        ) from exc


def load_usage_file(path: Path) -> UsageReport:
    """A :class:`UsageReport` saved as JSON (what ``GET /usage`` returns)."""
    try:
        return UsageReport.model_validate_json(path.read_text())
    except OSError as exc:
        raise InvalidRequest(f"cannot read {path}: {exc.strerror or exc}") from exc
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "the document"
        raise InvalidRequest(
            f"{path} is not a usage report: {where}: {error['msg']}",
            hint="save one with `curl -H 'X-API-Key: ...' $ORCHARD_URL/usage > usage.json`",
        ) from exc


# --- cluster nodes ---------------------------------------------------------------------------


class ClusterNode(BaseModel):
    name: str
    pool: str | None
    priority: Literal["spot", "regular"]
    role: Literal["system", "sandbox", "user"]
    vm_size: str | None
    region: str | None
    created_at: datetime
    allocatable_cpu: float | None = None
    allocatable_memory_bytes: int | None = None


def parse_node(item: Mapping[str, Any]) -> ClusterNode:
    """A Kubernetes Node (JSON, as the API serves it) as Orchard sees it."""
    metadata = item.get("metadata") or {}
    labels: dict[str, str] = metadata.get("labels") or {}
    allocatable = (item.get("status") or {}).get("allocatable") or {}

    def first(keys: Iterable[str]) -> str | None:
        return next((labels[key] for key in keys if labels.get(key)), None)

    if labels.get(MODE_LABEL) == "system":
        role: Literal["system", "sandbox", "user"] = "system"
    elif labels.get(SANDBOX_LABEL[0]) == SANDBOX_LABEL[1]:
        role = "sandbox"
    else:
        role = "user"
    cpu = allocatable.get("cpu")
    memory = allocatable.get("memory")
    try:
        return ClusterNode(
            name=str(metadata["name"]),
            pool=first(POOL_LABELS),
            priority="spot" if labels.get(PRIORITY_LABEL) == "spot" else "regular",
            role=role,
            vm_size=first(INSTANCE_TYPE_LABELS),
            region=first(REGION_LABELS),
            created_at=_aware(datetime.fromisoformat(str(metadata["creationTimestamp"]))),
            allocatable_cpu=None if cpu is None else parse_cpu(str(cpu)),
            allocatable_memory_bytes=None if memory is None else parse_memory(str(memory)),
        )
    except (KeyError, ValueError) as exc:
        raise Unavailable(f"the cluster returned a node Orchard cannot read: {exc}") from exc


def list_cluster_nodes(
    kubeconfig: Path | None = None, *, context: str | None = None, page_size: int = 500
) -> list[ClusterNode]:
    """Every node of the cluster ``kubeconfig`` points at (paged with limit/continue)."""
    try:
        from kubernetes import client as k8s_client
        from kubernetes import config as k8s_config
        from kubernetes.client.exceptions import ApiException
        from kubernetes.config.config_exception import ConfigException
        from urllib3.exceptions import HTTPError as TransportError
    except ImportError as exc:  # pragma: no cover - kubernetes is a core dependency
        raise ConfigError(
            "the kubernetes client is not installed", hint="pip install kubernetes"
        ) from exc
    where = str(kubeconfig) if kubeconfig else "the default kubeconfig"
    try:
        loader: Any = k8s_config.new_client_from_config  # untyped in the kubernetes package
        api_client = loader(config_file=str(kubeconfig) if kubeconfig else None, context=context)
    except (ConfigException, OSError) as exc:
        raise ConfigError(
            f"cannot load {where}: {exc}",
            hint="pass --kubeconfig with a readable kubeconfig (for AKS: `orchard up` writes one)",
        ) from exc
    nodes: list[ClusterNode] = []
    try:
        api = k8s_client.CoreV1Api(api_client)
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"limit": page_size, "_preload_content": False}
            if token:
                kwargs["_continue"] = token
            response: Any = api.list_node(**kwargs)  # raw (unparsed) with _preload_content
            body = json.loads(response.data)
            nodes.extend(parse_node(item) for item in body.get("items", []))
            token = (body.get("metadata") or {}).get("continue") or None
            if token is None:
                return nodes
    except ApiException as exc:
        if exc.status in (401, 403):
            raise PermissionDenied(
                f"the cluster refused to list nodes (HTTP {exc.status})",
                hint="the kubeconfig's user needs `list` on nodes (cluster scope)",
            ) from exc
        raise Unavailable(f"listing nodes failed: HTTP {exc.status} {exc.reason}") from exc
    except TransportError as exc:
        raise Unavailable(
            f"cannot reach the cluster in {where}: {exc}",
            hint="is the cluster running and the kubeconfig's server address reachable?",
        ) from exc
    finally:
        api_client.close()


class NodeCost(BaseModel):
    node: ClusterNode
    uptime_hours: float
    price: PriceQuote | None
    usd: float | None


class PoolCost(BaseModel):
    pool: str
    role: str
    priority: str
    vm_size: str | None
    nodes: int
    node_hours: float
    usd_per_hour: float | None
    usd: float | None


class ClusterCost(BaseModel):
    as_of: datetime
    nodes: list[NodeCost]
    pools: list[PoolCost]
    total_usd: float
    unpriced: list[str]


def _node_price(book: PriceBook, node: ClusterNode, region: str) -> PriceQuote | None:
    if node.vm_size is None:
        return None
    priority: Priority = "spot" if node.priority == "spot" else "on_demand"
    try:
        return book.vm_price(node.vm_size, node.region or region, priority)
    except ConfigError:
        return None


def cluster_cost(
    nodes: list[ClusterNode], book: PriceBook, *, region: str, now: datetime | None = None
) -> ClusterCost:
    """Uptime (creation until ``now``) and cost so far, per node and per pool."""
    moment = _aware(now or datetime.now(UTC))
    costs: list[NodeCost] = []
    for node in nodes:
        hours = max(0.0, (moment - node.created_at).total_seconds() / 3600)
        price = _node_price(book, node, region)
        costs.append(
            NodeCost(
                node=node,
                uptime_hours=hours,
                price=price,
                usd=None if price is None else price.usd_per_hour * hours,
            )
        )
    grouped: dict[tuple[str, str, str, str | None], list[NodeCost]] = defaultdict(list)
    for cost in costs:
        node = cost.node
        grouped[(node.pool or "(no pool)", node.role, node.priority, node.vm_size)].append(cost)
    pools = []
    for (pool, role, priority, vm_size), members in sorted(grouped.items(), key=str):
        priced = all(m.usd is not None for m in members)
        first = members[0].price
        pools.append(
            PoolCost(
                pool=pool,
                role=role,
                priority=priority,
                vm_size=vm_size,
                nodes=len(members),
                node_hours=sum(m.uptime_hours for m in members),
                usd_per_hour=first.usd_per_hour if priced and first else None,
                usd=sum(m.usd or 0.0 for m in members) if priced else None,
            )
        )
    unpriced = sorted(
        {f"{c.node.vm_size or 'unknown size'} ({c.node.priority})" for c in costs if c.usd is None}
    )
    return ClusterCost(
        as_of=moment,
        nodes=costs,
        pools=pools,
        total_usd=sum(c.usd or 0.0 for c in costs),
        unpriced=unpriced,
    )


# --- usage records ---------------------------------------------------------------------------


class SizeUsage(BaseModel):
    size: str
    sandboxes: int
    sandbox_hours: float
    per_node: int


class UsageGroup(BaseModel):
    group: str
    sandboxes: int
    sandbox_hours: float
    cpu_hours: float
    memory_gib_hours: float
    on_demand_usd: float
    spot_usd: float


class UsageCost(BaseModel):
    since: datetime
    until: datetime
    vm_size: str
    region: str
    sandboxes: int
    sandbox_hours: float
    sizes: list[SizeUsage]
    node_hours_needed: float
    peak_nodes: int
    on_demand: PriceQuote
    spot: PriceQuote
    needed_on_demand_usd: float
    needed_spot_usd: float
    group_by: GroupBy
    groups: list[UsageGroup]


class IdleSummary(BaseModel):
    """The sandbox nodes that ran (from the cluster) against the node-hours needed."""

    sandbox_node_hours: float
    actual_usd: float | None
    if_on_demand_usd: float
    if_spot_usd: float
    idle_node_hours: float
    idle_share: float
    idle_usd: float | None


class CostReport(BaseModel):
    usage: UsageCost | None
    cluster: ClusterCost | None
    idle: IdleSummary | None
    ran_on: Literal["spot", "on_demand"] | None
    actual_usd: float | None
    prices: PriceSourceInfo
    notes: list[str]


def _shape(record: UsageRecord) -> SandboxShape:
    return SandboxShape.of(record.cpu, record.memory_bytes)


def _window(record: UsageRecord, since: datetime, until: datetime) -> tuple[datetime, datetime]:
    start = max(_aware(record.started_at), since)
    end = min(_aware(record.ended_at) if record.ended_at else until, until)
    return start, end


def node_hours_needed(
    records: Iterable[UsageRecord],
    since: datetime,
    until: datetime,
    per_node_by_shape: Mapping[SandboxShape, int],
) -> tuple[float, int]:
    """Node-hours a perfect autoscaler would have run, and the peak node count."""
    since, until = _aware(since), _aware(until)
    events: list[tuple[datetime, int, SandboxShape]] = []
    for record in records:
        start, end = _window(record, since, until)
        if end > start:
            shape = _shape(record)
            events += [(start, 1, shape), (end, -1, shape)]
    events.sort(key=lambda event: event[0])
    running: Counter[SandboxShape] = Counter()
    node_hours, peak = 0.0, 0
    for index, (moment, delta, shape) in enumerate(events):
        running[shape] += delta
        if index + 1 < len(events) and events[index + 1][0] == moment:
            continue  # apply every event at this instant first
        nodes = sum(math.ceil(n / per_node_by_shape[s]) for s, n in running.items() if n > 0)
        peak = max(peak, nodes)
        if index + 1 < len(events):
            node_hours += nodes * (events[index + 1][0] - moment).total_seconds() / 3600
    return node_hours, peak


def _check_group_by(group_by: GroupBy) -> None:
    if group_by in ("owner", "size", "image") or (
        group_by.startswith("label:") and len(group_by) > len("label:")
    ):
        return
    raise InvalidRequest(
        f"cannot group by {group_by!r}", hint="use owner, size, image or label:<key>"
    )


def _group_key(record: UsageRecord, group_by: GroupBy) -> str:
    if group_by == "owner":
        return record.owner or "(no owner)"
    if group_by == "image":
        return record.image
    if group_by == "size":
        return _shape(record).describe()
    return record.labels.get(group_by.removeprefix("label:"), "(unlabelled)")


def usage_cost(
    usage: UsageReport,
    book: PriceBook,
    *,
    vm_size: str,
    region: str,
    group_by: GroupBy = "owner",
    max_pods: int = DEFAULT_MAX_PODS,
    daemonsets: DaemonSetOverhead | None = None,
) -> UsageCost:
    """Price the records on nodes of ``vm_size``: needed node-hours and attribution."""
    _check_group_by(group_by)
    capacity = node_capacity(book.sku(vm_size), max_pods=max_pods, daemonsets=daemonsets)
    shapes: dict[SandboxShape, int] = {}
    for record in usage.records:
        shape = _shape(record)
        if shape not in shapes:
            count, _ = per_node(capacity, shape)
            if count == 0:
                raise InvalidRequest(
                    f"sandbox {record.sandbox_id} ({shape.describe()}) does not fit on {vm_size}",
                    hint="pass the --vm-size the sandbox pool really used",
                )
            shapes[shape] = count
    on_demand = book.vm_price(vm_size, region, "on_demand")
    spot = book.vm_price(vm_size, region, "spot")
    needed, peak = node_hours_needed(usage.records, usage.since, usage.until, shapes)
    sizes: dict[SandboxShape, SizeUsage] = {}
    groups: dict[str, UsageGroup] = {}
    for record in usage.records:
        shape = _shape(record)
        hours = record.seconds / 3600
        size = sizes.setdefault(
            shape,
            SizeUsage(size=shape.describe(), sandboxes=0, sandbox_hours=0, per_node=shapes[shape]),
        )
        size.sandboxes += 1
        size.sandbox_hours += hours
        key = _group_key(record, group_by)
        group = groups.setdefault(
            key,
            UsageGroup(
                group=key,
                sandboxes=0,
                sandbox_hours=0,
                cpu_hours=0,
                memory_gib_hours=0,
                on_demand_usd=0,
                spot_usd=0,
            ),
        )
        group.sandboxes += 1
        group.sandbox_hours += hours
        group.cpu_hours += hours * record.cpu
        group.memory_gib_hours += hours * record.memory_bytes / 1024**3
        group.on_demand_usd += hours * on_demand.usd_per_hour / shapes[shape]
        group.spot_usd += hours * spot.usd_per_hour / shapes[shape]
    return UsageCost(
        since=_aware(usage.since),
        until=_aware(usage.until),
        vm_size=vm_size,
        region=region,
        sandboxes=len({record.sandbox_id for record in usage.records}),
        sandbox_hours=sum(record.seconds for record in usage.records) / 3600,
        sizes=list(sizes.values()),
        node_hours_needed=needed,
        peak_nodes=peak,
        on_demand=on_demand,
        spot=spot,
        needed_on_demand_usd=needed * on_demand.usd_per_hour,
        needed_spot_usd=needed * spot.usd_per_hour,
        group_by=group_by,
        groups=sorted(groups.values(), key=lambda g: -g.sandbox_hours),
    )


def _sandbox_nodes(nodes: list[ClusterNode]) -> list[ClusterNode]:
    """The sandbox pool: nodes labelled workload=sandbox, else every non-system node."""
    labelled = [node for node in nodes if node.role == "sandbox"]
    return labelled or [node for node in nodes if node.role == "user"]


def idle_summary(
    usage: UsageCost, cluster: ClusterCost, book: PriceBook, *, until: datetime | None = None
) -> IdleSummary:
    """Sandbox-node uptime inside the usage period, what it cost, and how much sat idle."""
    end = min(usage.until, _aware(until or cluster.as_of))
    sandbox_names = {node.name for node in _sandbox_nodes([c.node for c in cluster.nodes])}
    hours, actual, if_od, if_spot, priced = 0.0, 0.0, 0.0, 0.0, True
    for cost in cluster.nodes:
        if cost.node.name not in sandbox_names:
            continue
        start = max(cost.node.created_at, usage.since)
        node_hours = max(0.0, (end - start).total_seconds() / 3600)
        hours += node_hours
        if cost.price is None:
            priced = False
        else:
            actual += node_hours * cost.price.usd_per_hour
        if_od += node_hours * usage.on_demand.usd_per_hour
        if_spot += node_hours * usage.spot.usd_per_hour
    idle = max(0.0, hours - usage.node_hours_needed)
    per_hour = actual / hours if priced and hours else None
    return IdleSummary(
        sandbox_node_hours=hours,
        actual_usd=actual if priced else None,
        if_on_demand_usd=if_od,
        if_spot_usd=if_spot,
        idle_node_hours=idle,
        idle_share=idle / hours if hours else 0.0,
        idle_usd=None if per_hour is None else idle * per_hour,
    )


def _pick_vm_size(
    usage: UsageReport | None,
    nodes: list[ClusterNode] | None,
    book: PriceBook,
    region: str,
    max_pods: int,
    daemonsets: DaemonSetOverhead | None,
) -> tuple[str, str]:
    """The sandbox pool's size: the cluster's, else the cheapest candidate for these records."""
    sizes = Counter(n.vm_size for n in _sandbox_nodes(nodes or []) if n.vm_size)
    if sizes:
        return sizes.most_common(1)[0][0], "the cluster's sandbox nodes"
    best: tuple[float, str] | None = None
    for name in book.table.default_candidates:
        if not book.has_price(name, region) or usage is None:
            continue
        try:
            cost = usage_cost(
                usage, book, vm_size=name, region=region, max_pods=max_pods, daemonsets=daemonsets
            )
        except (InvalidRequest, ConfigError):
            continue
        if best is None or cost.needed_on_demand_usd < best[0]:
            best = (cost.needed_on_demand_usd, name)
    if best is None:
        raise ConfigError(
            f"no candidate VM size is priced in {region} and fits these sandboxes",
            hint="pass --vm-size (the size your sandbox pool used), or --live",
        )
    return best[1], "the cheapest size that fits (pass --vm-size for the real one)"


def cost_report(
    usage: UsageReport | None,
    book: PriceBook,
    *,
    nodes: list[ClusterNode] | None = None,
    vm_size: str | None = None,
    region: str = "eastus",
    ran_on: Literal["spot", "on_demand"] | None = None,
    group_by: GroupBy = "owner",
    max_pods: int = DEFAULT_MAX_PODS,
    daemonsets: DaemonSetOverhead | None = None,
    now: datetime | None = None,
) -> CostReport:
    """Combine usage records and/or cluster nodes into one report (either may be absent)."""
    check_max_pods(max_pods)
    if usage is None and nodes is None:
        raise InvalidRequest(
            "nothing to report on: give usage records, a cluster, or both",
            hint="--from-file usage.json, the orchestrator (default) or --kubeconfig",
        )
    notes: list[str] = []
    cluster = None if nodes is None else cluster_cost(nodes, book, region=region, now=now)
    if cluster is not None:
        notes.append("only nodes that exist now are counted: removed nodes are invisible")
        if cluster.unpriced:
            notes.append("no price for: " + ", ".join(cluster.unpriced) + " (try --live)")
    usage_part = idle = None
    actual: float | None = None
    if usage is not None and usage.records:
        size = vm_size
        if size is None:
            size, why = _pick_vm_size(usage, nodes, book, region, max_pods, daemonsets)
            notes.append(f"sandbox nodes priced as {size}: {why}")
        usage_part = usage_cost(
            usage,
            book,
            vm_size=size,
            region=region,
            group_by=group_by,
            max_pods=max_pods,
            daemonsets=daemonsets,
        )
        notes.append(
            "node-hours needed assume a perfect autoscaler and no mixing of sizes on a node"
        )
        if cluster is not None:
            idle = idle_summary(usage_part, cluster, book, until=now)
            actual = idle.actual_usd
            if idle.sandbox_node_hours < usage_part.node_hours_needed:
                notes.append(
                    "the visible sandbox nodes ran fewer hours than the records need: some "
                    "nodes were removed before now"
                )
        elif ran_on is not None:
            actual = (
                usage_part.needed_spot_usd if ran_on == "spot" else usage_part.needed_on_demand_usd
            )
    elif usage is not None:
        notes.append(f"no usage records between {usage.since} and {usage.until}")
    for quote in (usage_part.on_demand, usage_part.spot) if usage_part else ():
        if not quote.confirmed:
            kind = quote.priority.replace("_", "-")
            notes.append(f"{quote.sku} {kind} price is {quote.status}: {quote.note}")
    return CostReport(
        usage=usage_part,
        cluster=cluster,
        idle=idle,
        ran_on=ran_on,
        actual_usd=actual,
        prices=book.source_info(region),
        notes=notes,
    )


def build_cost_report(
    usage: UsageReport | None,
    *,
    kubeconfig: Path | None = None,
    kube_context: str | None = None,
    use_cluster: bool = False,
    vm_size: str | None = None,
    region: str | None = None,
    ran_on: Literal["spot", "on_demand"] | None = None,
    group_by: GroupBy = "owner",
    max_pods: int = DEFAULT_MAX_PODS,
    daemonsets: DaemonSetOverhead | None = None,
    prices: PriceMode = "auto",
    client: RetailPricesClient | None = None,
    now: datetime | None = None,
) -> CostReport:
    """List the cluster's nodes (if asked), load prices for what is there, and report."""
    nodes = None
    if use_cluster or kubeconfig is not None:
        nodes = list_cluster_nodes(kubeconfig, context=kube_context)
    table = load_price_table()
    node_regions = [n.region for n in nodes or [] if n.region]
    chosen_region = region or (node_regions[0] if node_regions else table.default_region)
    skus = [n.vm_size for n in nodes or [] if n.vm_size]
    skus += [vm_size] if vm_size else table.default_candidates
    names = [sku for sku in dict.fromkeys(skus) if is_vm_size_name(sku)]
    book = load_price_book(prices, chosen_region, names, client=client, now=now)
    return cost_report(
        usage,
        book,
        nodes=nodes,
        vm_size=vm_size,
        region=chosen_region,
        ran_on=ran_on,
        group_by=group_by,
        max_pods=max_pods,
        daemonsets=daemonsets,
        now=now,
    )
