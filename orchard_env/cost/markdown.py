"""Markdown for estimates and reports (``--markdown``), to paste into a write-up."""

from __future__ import annotations

from orchard_env.cost.estimate import Estimate
from orchard_env.cost.report import CostReport
from orchard_env.quantities import format_memory


def usd(value: float | None) -> str:
    """``$3,134.87``; a dash for "not priced"."""
    return "-" if value is None else f"${value:,.2f}"


def rate(value: float | None) -> str:
    """A small per-hour amount with the digits it needs: ``$0.2304``, ``$0.335448``."""
    if value is None:
        return "-"
    text = f"{value:.6f}".rstrip("0")
    whole, _, decimals = text.partition(".")
    return f"${whole}.{decimals.ljust(4, '0')}"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[str]], right: set[int] | None = None) -> list[str]:
    right = right or set()
    align = ["---:" if index in right else "---" for index in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(_cell(cell) for cell in row) + " |" for row in rows]
    return lines


def price_source_line(estimate_or_report: Estimate | CostReport) -> str:
    info = estimate_or_report.prices
    if info.mode == "shipped":
        return f"Prices: shipped table (as of {info.table_as_of}), region {info.region}."
    fetched = info.fetched_at.strftime("%Y-%m-%d %H:%M UTC") if info.fetched_at else "?"
    return (
        f"Prices: Azure Retail Prices API ({info.mode}, fetched {fetched}), region "
        f"{info.region}; shipped table (as of {info.table_as_of}) for the rest."
    )


def estimate_markdown(estimate: Estimate) -> str:
    request = estimate.request
    chosen, packing = estimate.chosen, estimate.packing
    size = f"{request.cpu:g} CPU / {format_memory(request.memory_bytes)}"
    lines = [
        f"## Cost estimate: {request.sandboxes} sandboxes x {request.hours:g} h at {size} "
        f"({request.region})",
        "",
        f"Sandbox nodes: {chosen.sku}, {packing.describe()}, {packing.nodes} nodes "
        f"({packing.spare_slots} spare slots). {estimate.capacity.describe()}.",
        "",
        price_source_line(estimate),
        "",
    ]
    rows = [
        [item.item, usd(item.on_demand_usd), usd(item.spot_usd), item.assumption]
        for item in estimate.line_items
    ]
    rows.append(
        [
            "**Total**",
            f"**{usd(estimate.total_on_demand_usd)}**",
            f"**{usd(estimate.total_spot_usd)}**",
            "",
        ]
    )
    rows.append(
        [
            "Per sandbox-hour",
            rate(estimate.per_sandbox_hour_on_demand_usd),
            rate(estimate.per_sandbox_hour_spot_usd),
            f"{request.sandbox_hours:,.0f} sandbox-hours",
        ]
    )
    lines += _table(["Item", "On-demand", "Spot", "Assumption"], rows, {1, 2})
    lines += [
        "",
        f"Idle floor (sandbox pool at zero nodes): ${estimate.idle_floor_usd_per_hour:.4f}/h.",
    ]
    if packing.next_fit_hint:
        lines.append(f"Packing: {packing.next_fit_hint}.")
    lines += ["", "### VM sizes considered", ""]
    option_rows = []
    for option in sorted(estimate.options, key=lambda o: o.on_demand_usd or float("inf")):
        option_rows.append(
            [
                option.sku + (" (chosen)" if option.sku == chosen.sku else ""),
                str(option.per_node),
                "-" if option.nodes is None else str(option.nodes),
                usd(option.on_demand_usd),
                usd(option.spot_usd),
                option.reason
                or ", ".join(
                    f"{q.priority.replace('_', '-')} {q.status}"
                    for q in (option.on_demand, option.spot)
                    if q is not None
                ),
            ]
        )
    lines += _table(
        ["VM size", "Per node", "Nodes", "On-demand", "Spot", "Prices / why not"],
        option_rows,
        {1, 2, 3, 4},
    )
    lines.append("")
    lines.append("On-demand and spot here are the sandbox nodes plus their OS disks.")
    lines += ["", "### Managed services, same workload (list prices, compute on allocation)", ""]
    managed_rows = [
        [
            quote.service,
            quote.formula,
            rate(quote.usd_per_sandbox_hour),
            usd(quote.compute_usd),
            usd(quote.disk_usd),
            usd(quote.plan_usd),
            usd(quote.total_usd),
            quote.session_limit,
            f"{quote.source}; as of {quote.as_of}",
        ]
        for quote in estimate.managed
    ]
    lines += _table(
        [
            "Service",
            "Billing formula",
            "$/sandbox-h",
            "Compute",
            "Disk",
            "Plan fees",
            "Total",
            "Session limit",
            "Source",
        ],
        managed_rows,
        {2, 3, 4, 5, 6},
    )
    notes = [f"- {q.service}: {note}" for q in estimate.managed for note in q.notes]
    if notes:
        lines += ["", *notes]
    lines += ["", "### Prices used", ""]
    lines += _table(
        ["Item", "Price", "Status", "Source", "As of"],
        [
            [use.item, use.price, use.status, use.source, use.as_of or "not recorded"]
            for use in estimate.prices_used
        ],
    )
    if estimate.warnings:
        lines += ["", "### Warnings", "", *(f"- {warning}" for warning in estimate.warnings)]
    return "\n".join(lines) + "\n"


def report_markdown(report: CostReport) -> str:
    lines = ["## Cost report", "", price_source_line(report), ""]
    usage = report.usage
    if usage is not None:
        lines += [
            f"### Usage {usage.since:%Y-%m-%d %H:%M} to {usage.until:%Y-%m-%d %H:%M} UTC",
            "",
            f"{usage.sandboxes} sandboxes, {usage.sandbox_hours:,.2f} sandbox-hours on "
            f"{usage.vm_size} ({usage.region}); peak {usage.peak_nodes} nodes.",
            "",
        ]
        rows = [
            [
                "Node-hours needed (perfect autoscaling)",
                f"{usage.node_hours_needed:,.2f}",
                usd(usage.needed_on_demand_usd),
                usd(usage.needed_spot_usd),
            ]
        ]
        if report.idle is not None:
            idle = report.idle
            rows.append(
                [
                    "Sandbox nodes that ran (cluster)",
                    f"{idle.sandbox_node_hours:,.2f}",
                    usd(idle.if_on_demand_usd),
                    usd(idle.if_spot_usd),
                ]
            )
            rows.append(
                [
                    f"Idle node time ({idle.idle_share:.0%})",
                    f"{idle.idle_node_hours:,.2f}",
                    "",
                    "",
                ]
            )
        lines += _table(["", "Node-hours", "On-demand", "Spot"], rows, {1, 2, 3})
        if report.actual_usd is not None:
            lines += ["", f"**What it cost on the nodes it used: {usd(report.actual_usd)}**"]
        lines += ["", f"By {usage.group_by}:", ""]
        lines += _table(
            [usage.group_by, "Sandboxes", "Sandbox-h", "CPU-h", "GiB-h", "On-demand", "Spot"],
            [
                [
                    group.group,
                    str(group.sandboxes),
                    f"{group.sandbox_hours:,.2f}",
                    f"{group.cpu_hours:,.2f}",
                    f"{group.memory_gib_hours:,.2f}",
                    usd(group.on_demand_usd),
                    usd(group.spot_usd),
                ]
                for group in usage.groups
            ],
            {1, 2, 3, 4, 5, 6},
        )
    cluster = report.cluster
    if cluster is not None:
        lines += ["", f"### Cluster nodes as of {cluster.as_of:%Y-%m-%d %H:%M} UTC", ""]
        lines += _table(
            ["Pool", "Role", "Priority", "VM size", "Nodes", "Node-hours", "$/h", "Cost so far"],
            [
                [
                    pool.pool,
                    pool.role,
                    pool.priority,
                    pool.vm_size or "?",
                    str(pool.nodes),
                    f"{pool.node_hours:,.2f}",
                    "-" if pool.usd_per_hour is None else f"${pool.usd_per_hour:g}",
                    usd(pool.usd),
                ]
                for pool in cluster.pools
            ],
            {4, 5, 6, 7},
        )
        lines += ["", f"**Cluster cost so far: {usd(cluster.total_usd)}** (priced nodes only)"]
    if report.notes:
        lines += ["", "Notes:", "", *(f"- {note}" for note in report.notes)]
    return "\n".join(lines) + "\n"
