"""Cost: spot-vs-on-demand estimates before a run, reports after it.

- :func:`estimate_cost` / :func:`estimate`: an itemised AKS price for N sandboxes x H hours,
  with the managed services (E2B, Daytona, Modal, Runloop, Morph) side by side.
- :func:`build_cost_report` / :func:`cost_report`: what a run cost, from the orchestrator's
  usage records and/or a live cluster's nodes.
- :class:`PriceBook` / :func:`load_price_book`: the shipped price table, the Azure Retail
  Prices API client (``--live``) and its cache.
"""

from orchard_env.cost.estimate import (
    Estimate,
    EstimateRequest,
    LineItem,
    build_request,
    estimate,
    estimate_cost,
)
from orchard_env.cost.managed import ManagedQuote, Workload, managed_quotes
from orchard_env.cost.markdown import estimate_markdown, report_markdown
from orchard_env.cost.nodes import DaemonSetOverhead, NodeCapacity, node_capacity
from orchard_env.cost.packing import Packing, SandboxShape, pack
from orchard_env.cost.prices import (
    PriceBook,
    PriceQuote,
    RetailPricesClient,
    classify_vm_items,
    load_price_book,
    load_price_table,
)
from orchard_env.cost.profile import CostProfile, load_profile
from orchard_env.cost.report import (
    ClusterNode,
    CostReport,
    build_cost_report,
    cost_report,
    list_cluster_nodes,
)

__all__ = [
    "ClusterNode",
    "CostProfile",
    "CostReport",
    "DaemonSetOverhead",
    "Estimate",
    "EstimateRequest",
    "LineItem",
    "ManagedQuote",
    "NodeCapacity",
    "Packing",
    "PriceBook",
    "PriceQuote",
    "RetailPricesClient",
    "SandboxShape",
    "Workload",
    "build_cost_report",
    "build_request",
    "classify_vm_items",
    "cost_report",
    "estimate",
    "estimate_cost",
    "estimate_markdown",
    "list_cluster_nodes",
    "load_price_book",
    "load_price_table",
    "load_profile",
    "managed_quotes",
    "node_capacity",
    "pack",
    "report_markdown",
]
