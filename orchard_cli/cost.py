"""`orchard cost …`: spot-vs-on-demand estimates before a run, reports after it."""

from __future__ import annotations

import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.bar import Bar
from rich.console import Group
from rich.table import Table
from rich.text import Text

from orchard_cli.console import ApiKeyOpt, ContextOpt, JsonOpt, UrlOpt, connect, err, out
from orchard_cli.output import print_json
from orchard_env.cost.estimate import Estimate, build_request, estimate_cost
from orchard_env.cost.markdown import (
    estimate_markdown,
    price_source_line,
    rate,
    report_markdown,
    usd,
)
from orchard_env.cost.nodes import DEFAULT_MAX_PODS, daemonset_overhead
from orchard_env.cost.prices import PriceMode
from orchard_env.cost.profile import CostProfile, load_profile
from orchard_env.cost.report import CostReport, build_cost_report, load_usage_file, parse_when
from orchard_env.errors import InvalidRequest
from orchard_env.protocol import UsageReport
from orchard_env.quantities import format_memory

app = typer.Typer(
    help="What sandboxes cost on AKS, spot vs on-demand, next to managed services.",
    no_args_is_help=True,
)


class Pricing(StrEnum):
    BOTH = "both"
    SPOT = "spot"
    ON_DEMAND = "on-demand"


class TierChoice(StrEnum):
    FREE = "free"
    STANDARD = "standard"
    PREMIUM = "premium"


class OsDiskChoice(StrEnum):
    AUTO = "auto"
    EPHEMERAL = "ephemeral"
    MANAGED = "managed"


class RegistryChoice(StrEnum):
    BASIC = "basic"
    STANDARD = "standard"
    PREMIUM = "premium"


class RanOn(StrEnum):
    SPOT = "spot"
    ON_DEMAND = "on-demand"


RegionOpt = Annotated[
    str | None,
    typer.Option("--region", help="Azure region (ARM name). Default: the profile's, else eastus."),
]
ProfileOpt = Annotated[
    Path | None,
    typer.Option(
        "--profile",
        help="Deployment profile (what `orchard init` writes): its region, tier, pools, spot and "
        "OS disk. Flags win over it.",
        exists=False,
        dir_okay=False,
    ),
]
LiveOpt = Annotated[
    bool,
    typer.Option(
        "--live",
        help="Fetch prices from the Azure Retail Prices API now and cache them "
        "(~/.cache/orchard/prices/).",
    ),
]
ShippedOpt = Annotated[
    bool,
    typer.Option("--shipped", help="Use only the shipped price table, ignoring any cached prices."),
]
MarkdownOpt = Annotated[
    bool, typer.Option("--markdown", help="Print Markdown to stdout (to paste into a report).")
]
MaxPodsOpt = Annotated[
    int | None,
    typer.Option(
        "--max-pods", help="Max pods per sandbox node; sets AKS's memory reservation. Default: 30."
    ),
]
DsCpuOpt = Annotated[
    str | None,
    typer.Option(
        "--daemonset-cpu",
        help="CPU the DaemonSets request on each node (kubectl describe node shows it). "
        " Default: 400m.",
    ),
]
DsMemoryOpt = Annotated[
    str | None,
    typer.Option(
        "--daemonset-memory", help="Memory the DaemonSets request on each node. Default: 750Mi."
    ),
]
DsPodsOpt = Annotated[
    int | None,
    typer.Option(
        "--daemonset-pods", help="DaemonSet pods on each node (they use pod slots). Default: 10."
    ),
]


def _price_mode(live: bool, shipped: bool) -> PriceMode:
    if live and shipped:
        raise InvalidRequest("--live and --shipped exclude each other", hint="pick one")
    return "live" if live else "shipped" if shipped else "auto"


def _output_mode(json_: bool, markdown: bool) -> Literal["json", "markdown", "rich"]:
    if json_ and markdown:
        raise InvalidRequest("--json and --markdown exclude each other", hint="pick one")
    return "json" if json_ else "markdown" if markdown else "rich"


# --- estimate --------------------------------------------------------------------------------


@app.command()
def estimate(
    sandboxes: Annotated[
        int,
        typer.Option(
            "--sandboxes", "-n", help="Sandboxes running at the same time.", show_default=False
        ),
    ],
    hours: Annotated[
        float, typer.Option("--hours", help="How long they run, in hours.", show_default=False)
    ],
    cpu: Annotated[
        str | None,
        typer.Option("--cpu", help="CPU request per sandbox, e.g. 2 or 500m. Default: 1."),
    ] = None,
    memory: Annotated[
        str | None,
        typer.Option("--memory", help="Memory request per sandbox, e.g. 8Gi. Default: 2Gi."),
    ] = None,
    region: RegionOpt = None,
    vm_size: Annotated[
        list[str] | None,
        typer.Option(
            "--vm-size",
            help="Candidate VM size for the sandbox pool (repeatable). Default: auto, the cheapest "
            "shipped size that fits.",
        ),
    ] = None,
    pricing: Annotated[
        Pricing | None,
        typer.Option("--pricing", help="Columns to price: both, spot or on-demand. Default: both."),
    ] = None,
    system_vm_size: Annotated[
        str | None,
        typer.Option(
            "--system-vm-size", help="VM size of the System pool. Default: Standard_D4as_v5."
        ),
    ] = None,
    system_nodes: Annotated[
        int | None, typer.Option("--system-nodes", help="Nodes in the System pool. Default: 2.")
    ] = None,
    tier: Annotated[
        TierChoice | None,
        typer.Option(
            "--tier", help="AKS control-plane tier: free, standard or premium. Default: free."
        ),
    ] = None,
    os_disk: Annotated[
        OsDiskChoice | None,
        typer.Option(
            "--os-disk",
            help="Sandbox nodes' OS disk: auto (ephemeral where the size has a temp disk), "
            "ephemeral or managed. Default: auto.",
        ),
    ] = None,
    max_pods: MaxPodsOpt = None,
    daemonset_cpu: DsCpuOpt = None,
    daemonset_memory: DsMemoryOpt = None,
    daemonset_pods: DsPodsOpt = None,
    eviction_overhead: Annotated[
        float | None,
        typer.Option(
            "--eviction-overhead",
            help="Surcharge on spot sandbox nodes for restarts and lost work, in %. Default: 0.",
        ),
    ] = None,
    public_ips: Annotated[
        int | None, typer.Option("--public-ips", help="Public IPs of the cluster. Default: 1.")
    ] = None,
    registry: Annotated[
        RegistryChoice | None,
        typer.Option("--registry", help="ACR tier: basic, standard or premium. Default: basic."),
    ] = None,
    disk: Annotated[
        float | None,
        typer.Option(
            "--disk",
            help="Disk per sandbox in GiB, for the managed services that bill disk (Daytona, "
            "Runloop, Morph). Default: not billed.",
        ),
    ] = None,
    profile: ProfileOpt = None,
    live: LiveOpt = False,
    shipped: ShippedOpt = False,
    json_: JsonOpt = False,
    markdown: MarkdownOpt = False,
) -> None:
    """Estimate what N sandboxes for H hours cost on AKS, spot and on-demand, itemised."""
    mode = _price_mode(live, shipped)
    output = _output_mode(json_, markdown)
    cost_profile: CostProfile | None = load_profile(profile) if profile else None
    request = build_request(
        {
            "sandboxes": sandboxes,
            "hours": hours,
            "cpu": cpu,
            "memory": memory,
            "region": region,
            "vm_sizes": vm_size,
            "pricing": pricing.value if pricing else None,
            "system_vm_size": system_vm_size,
            "system_nodes": system_nodes,
            "tier": tier.value if tier else None,
            "os_disk": os_disk.value if os_disk else None,
            "max_pods": max_pods,
            "daemonset_cpu": daemonset_cpu,
            "daemonset_memory": daemonset_memory,
            "daemonset_pods": daemonset_pods,
            "eviction_overhead_pct": eviction_overhead,
            "public_ips": public_ips,
            "registry": registry.value if registry else None,
            "disk_gib": disk,
        },
        cost_profile,
    )
    if mode == "live":
        with err.status(f"Fetching Azure retail prices for {request.region}…"):
            result = estimate_cost(request, prices=mode)
    else:
        result = estimate_cost(request, prices=mode)
    if result.prices.mode == "cached":
        err.print(
            f"Using prices cached from the Azure Retail Prices API ({result.prices.cache_file})."
        )
    if output == "json":
        print_json(result)
    elif output == "markdown":
        sys.stdout.write(estimate_markdown(result))
    else:
        _render_estimate(result)


def _bar_chart(title: str, rows: list[tuple[str, float, str]]) -> Table:
    """Horizontal bars (Rich blocks) scaled to the largest amount."""
    top = max((amount for _, amount, _ in rows), default=0.0) or 1.0
    chart = Table.grid(padding=(0, 1))
    chart.title = title
    chart.title_justify = "left"
    chart.add_column(justify="right", no_wrap=True)
    chart.add_column(width=40, no_wrap=True)
    chart.add_column(justify="right", no_wrap=True)
    for label, amount, color in sorted(rows, key=lambda row: row[1]):
        chart.add_row(label, Bar(top, 0, amount, width=40, color=color), usd(amount))
    return chart


def _render_estimate(result: Estimate) -> None:
    request, packing, chosen = result.request, result.packing, result.chosen
    size = f"{request.cpu:g} CPU / {format_memory(request.memory_bytes)}"
    out.print(
        Text.assemble(
            (f"{request.sandboxes} sandboxes x {request.hours:g} h at {size}", "bold"),
            f" in {request.region}: {chosen.sku}, {packing.describe()}, {packing.nodes} nodes",
        )
    )
    out.print(Text(result.capacity.describe(), style="dim"))
    out.print(Text(price_source_line(result), style="dim"))
    items = Table(title="Line items", title_justify="left")
    items.add_column("Item")
    items.add_column("On-demand", justify="right")
    items.add_column("Spot", justify="right")
    items.add_column("Assumption", style="dim", ratio=1)
    for index, item in enumerate(result.line_items):
        items.add_row(
            item.item,
            usd(item.on_demand_usd),
            usd(item.spot_usd),
            item.assumption,
            end_section=index == len(result.line_items) - 1,
        )
    total_od, total_spot = result.total_on_demand_usd, result.total_spot_usd
    items.add_row(Text("Total", style="bold"), usd(total_od), usd(total_spot), "", style="bold")
    items.add_row(
        "Per hour, whole cluster",
        usd(None if total_od is None else total_od / request.hours),
        usd(None if total_spot is None else total_spot / request.hours),
        f"{request.hours:g} h",
    )
    items.add_row(
        "Per sandbox-hour",
        rate(result.per_sandbox_hour_on_demand_usd),
        rate(result.per_sandbox_hour_spot_usd),
        f"{request.sandbox_hours:,.0f} sandbox-hours",
    )
    out.print(items)
    out.print(f"Idle floor (sandbox pool at zero nodes): ${result.idle_floor_usd_per_hour:.4f}/h")
    if packing.next_fit_hint:
        out.print(f"Packing: {packing.next_fit_hint}.")
    rows: list[tuple[str, float, str]] = []
    if result.total_spot_usd is not None:
        rows.append(("Orchard on AKS, spot", result.total_spot_usd, "green"))
    if result.total_on_demand_usd is not None:
        rows.append(("Orchard on AKS, on-demand", result.total_on_demand_usd, "cyan"))
    rows += [(quote.service, quote.total_usd, "magenta") for quote in result.managed]
    out.print()
    out.print(_bar_chart("Same workload, total incl. required plan fees", rows))
    out.print()
    options = Table(title="VM sizes considered (sandbox nodes + OS disks)", title_justify="left")
    for column in ("VM size", "Per node", "Nodes", "On-demand", "Spot", "Prices / why not"):
        options.add_column(
            column,
            justify="right" if column in ("Per node", "Nodes", "On-demand", "Spot") else "left",
        )
    for option in sorted(result.options, key=lambda o: o.on_demand_usd or float("inf")):
        statuses = ", ".join(
            f"{q.priority.replace('_', '-')} {q.status}"
            for q in (option.on_demand, option.spot)
            if q
        )
        options.add_row(
            option.sku + (" ✓" if option.sku == chosen.sku else ""),
            str(option.per_node),
            "-" if option.nodes is None else str(option.nodes),
            usd(option.on_demand_usd),
            usd(option.spot_usd),
            option.reason or statuses,
        )
    out.print(options)
    managed = Table(title="Managed services, same workload (list prices)", title_justify="left")
    for column in (
        "Service",
        "$/sandbox-h",
        "Compute",
        "Disk",
        "Plan fees",
        "Total",
        "Session limit",
    ):
        managed.add_column(
            column, justify="left" if column in ("Service", "Session limit") else "right"
        )
    for quote in result.managed:
        managed.add_row(
            quote.service,
            rate(quote.usd_per_sandbox_hour),
            usd(quote.compute_usd),
            usd(quote.disk_usd),
            usd(quote.plan_usd),
            usd(quote.total_usd),
            quote.session_limit
            + (
                f" ({quote.restarts_per_sandbox} restarts each)"
                if quote.restarts_per_sandbox
                else ""
            ),
        )
    out.print(managed)
    for quote in result.managed:
        out.print(
            Text(
                f"{quote.service}: {quote.formula}. Source: {quote.source}; as of {quote.as_of}.",
                style="dim",
            )
        )
        for note in quote.notes:
            out.print(Text(f"  - {note}", style="dim"))
    used = Table(title="Prices used", title_justify="left")
    for column in ("Item", "Price", "Status", "Source", "As of"):
        used.add_column(column)
    for use in result.prices_used:
        style = "" if use.status in ("sourced", "live", "cached") else "yellow"
        used.add_row(
            use.item,
            use.price,
            Text(use.status, style=style),
            use.source,
            use.as_of or "not recorded",
        )
    out.print(used)
    if result.warnings:
        out.print(Group(*(Text(f"! {warning}", style="yellow") for warning in result.warnings)))


# --- report ----------------------------------------------------------------------------------


@app.command()
def report(
    from_file: Annotated[
        Path | None,
        typer.Option(
            "--from-file",
            help="Read usage records from a JSON file (what GET /usage returns) instead of the "
            "orchestrator.",
            dir_okay=False,
        ),
    ] = None,
    usage: Annotated[
        bool,
        typer.Option(
            "--usage/--no-usage", help="Include usage records (--no-usage: the cluster only)."
        ),
    ] = True,
    since: Annotated[
        str | None,
        typer.Option(
            "--since", help="Start of the period: 2026-07-01, 2026-07-01T12:00Z, 24h or 7d ago."
        ),
    ] = None,
    until: Annotated[
        str | None, typer.Option("--until", help="End of the period (same forms). Default: now.")
    ] = None,
    kubeconfig: Annotated[
        Path | None,
        typer.Option(
            "--kubeconfig",
            help="Also list this cluster's nodes: pools, spot vs regular, uptime, cost so far.",
            dir_okay=False,
        ),
    ] = None,
    kube_context: Annotated[
        str | None,
        typer.Option(
            "--kube-context", help="Context in the kubeconfig (default: its current one)."
        ),
    ] = None,
    vm_size: Annotated[
        str | None,
        typer.Option(
            "--vm-size",
            help="VM size the sandbox nodes used. Default: the cluster's, the profile's, else the "
            "cheapest that fits.",
        ),
    ] = None,
    region: RegionOpt = None,
    ran_on: Annotated[
        RanOn | None,
        typer.Option(
            "--ran-on",
            help="What the sandbox nodes ran as (spot or on-demand) when no --kubeconfig tells. "
            "Default: the profile's spot setting.",
        ),
    ] = None,
    by: Annotated[
        str,
        typer.Option("--by", help="Attribute cost by owner (API key), size, image or label:<key>."),
    ] = "owner",
    max_pods: MaxPodsOpt = None,
    daemonset_cpu: DsCpuOpt = None,
    daemonset_memory: DsMemoryOpt = None,
    daemonset_pods: DsPodsOpt = None,
    profile: ProfileOpt = None,
    live: LiveOpt = False,
    shipped: ShippedOpt = False,
    json_: JsonOpt = False,
    markdown: MarkdownOpt = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """Report what a run cost: usage priced spot and on-demand, idle node time, cluster nodes."""
    mode = _price_mode(live, shipped)
    output = _output_mode(json_, markdown)
    cost_profile = load_profile(profile) if profile else CostProfile()
    records: UsageReport | None = None
    if from_file is not None:
        if since or until:
            raise InvalidRequest(
                "--since/--until do not apply to --from-file",
                hint="the file carries its own period",
            )
        records = load_usage_file(from_file)
    elif usage:
        start = parse_when(since, flag="--since") if since else None
        end = parse_when(until, flag="--until") if until else None
        with (
            err.status("Reading usage records from the orchestrator…"),
            connect(url, api_key, context) as client,
        ):
            records = client.usage(since=start, until=end)
    ran_on_value: Literal["spot", "on_demand"] | None = None
    if ran_on is not None:
        ran_on_value = "spot" if ran_on is RanOn.SPOT else "on_demand"
    elif cost_profile.spot is not None:
        ran_on_value = "spot" if cost_profile.spot else "on_demand"
    profile_sizes = cost_profile.vm_sizes()
    result = build_cost_report(
        records,
        kubeconfig=kubeconfig,
        kube_context=kube_context,
        use_cluster=kubeconfig is not None or kube_context is not None,
        vm_size=vm_size or (profile_sizes[0] if profile_sizes else None),
        region=region or cost_profile.region,
        ran_on=ran_on_value,
        group_by=by,
        max_pods=DEFAULT_MAX_PODS if max_pods is None else max_pods,
        daemonsets=daemonset_overhead(daemonset_cpu, daemonset_memory, daemonset_pods),
        prices=mode,
    )
    if output == "json":
        print_json(result)
    elif output == "markdown":
        sys.stdout.write(report_markdown(result))
    else:
        _render_report(result)


def _render_report(result: CostReport) -> None:
    out.print(Text(price_source_line(result), style="dim"))
    usage = result.usage
    if usage is not None:
        out.print(
            Text.assemble(
                (f"Usage {usage.since:%Y-%m-%d %H:%M} → {usage.until:%Y-%m-%d %H:%M} UTC", "bold"),
                f": {usage.sandboxes} sandboxes, {usage.sandbox_hours:,.2f} sandbox-hours on "
                f"{usage.vm_size} ({usage.region}), peak {usage.peak_nodes} nodes",
            )
        )
        summary = Table(title="Node time", title_justify="left")
        for column in ("", "Node-hours", "On-demand", "Spot"):
            summary.add_column(column, justify="left" if not column else "right")
        summary.add_row(
            "Needed (perfect autoscaling)",
            f"{usage.node_hours_needed:,.2f}",
            usd(usage.needed_on_demand_usd),
            usd(usage.needed_spot_usd),
        )
        rows: list[tuple[str, float, str]] = [
            ("needed, on-demand", usage.needed_on_demand_usd, "cyan"),
            ("needed, spot", usage.needed_spot_usd, "green"),
        ]
        idle = result.idle
        if idle is not None:
            summary.add_row(
                "Sandbox nodes that ran",
                f"{idle.sandbox_node_hours:,.2f}",
                usd(idle.if_on_demand_usd),
                usd(idle.if_spot_usd),
            )
            summary.add_row(f"Idle ({idle.idle_share:.0%})", f"{idle.idle_node_hours:,.2f}", "", "")
            rows += [
                ("ran, on-demand", idle.if_on_demand_usd, "cyan"),
                ("ran, spot", idle.if_spot_usd, "green"),
            ]
        if result.actual_usd is not None:
            rows.append(("what it cost", result.actual_usd, "yellow"))
        out.print(summary)
        if result.actual_usd is not None:
            out.print(
                Text(f"What it cost on the nodes it used: {usd(result.actual_usd)}", style="bold")
            )
        out.print(_bar_chart("This run", rows))
        groups = Table(title=f"By {usage.group_by}", title_justify="left")
        for column in (
            usage.group_by,
            "Sandboxes",
            "Sandbox-h",
            "CPU-h",
            "GiB-h",
            "On-demand",
            "Spot",
        ):
            groups.add_column(column, justify="left" if column == usage.group_by else "right")
        for group in usage.groups:
            groups.add_row(
                group.group,
                str(group.sandboxes),
                f"{group.sandbox_hours:,.2f}",
                f"{group.cpu_hours:,.2f}",
                f"{group.memory_gib_hours:,.2f}",
                usd(group.on_demand_usd),
                usd(group.spot_usd),
            )
        out.print(groups)
    cluster = result.cluster
    if cluster is not None:
        pools = Table(
            title=f"Cluster nodes as of {cluster.as_of:%Y-%m-%d %H:%M} UTC",
            title_justify="left",
            show_footer=True,
        )
        for column, footer in (
            ("Pool", "Total"),
            ("Role", ""),
            ("Priority", ""),
            ("VM size", ""),
            ("Nodes", str(sum(p.nodes for p in cluster.pools))),
            ("Node-hours", f"{sum(p.node_hours for p in cluster.pools):,.2f}"),
            ("$/h", ""),
            ("Cost so far", usd(cluster.total_usd)),
        ):
            pools.add_column(
                column,
                footer=footer,
                justify="right"
                if column in ("Nodes", "Node-hours", "$/h", "Cost so far")
                else "left",
            )
        for pool in cluster.pools:
            pools.add_row(
                pool.pool,
                pool.role,
                Text(pool.priority, style="green" if pool.priority == "spot" else ""),
                pool.vm_size or "?",
                str(pool.nodes),
                f"{pool.node_hours:,.2f}",
                "-" if pool.usd_per_hour is None else f"${pool.usd_per_hour:g}",
                usd(pool.usd),
            )
        out.print(pools)
    for note in result.notes:
        out.print(Text(f"- {note}", style="dim"))
