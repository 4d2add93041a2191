"""How many sandboxes of one size fit on a node, and how many nodes a workload needs.

The scheduler places a pod where its *requests* fit into what is left of the node's
allocatable resources, so sandboxes per node = min over CPU, memory and pod slots of
floor(free / request). Sandboxes of one size are identical, so packing is exact: nodes =
ceil(sandboxes / per node).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from orchard_env.cost.nodes import MIB, NodeCapacity
from orchard_env.errors import InvalidRequest
from orchard_env.quantities import format_memory

Limit = Literal["cpu", "memory", "pods"]


class SandboxShape(BaseModel):
    """A sandbox's requests, in the units the scheduler compares."""

    model_config = ConfigDict(frozen=True)

    cpu_millicores: int = Field(gt=0)
    memory_bytes: int = Field(gt=0)

    @classmethod
    def of(cls, cpu: float, memory_bytes: int) -> SandboxShape:
        return cls(cpu_millicores=round(cpu * 1000), memory_bytes=memory_bytes)

    @property
    def cpu(self) -> float:
        return self.cpu_millicores / 1000

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / 1024**3

    def describe(self) -> str:
        return f"{self.cpu:g} CPU / {format_memory(self.memory_bytes)}"


class Packing(BaseModel):
    """Sandboxes of one shape on nodes of one size."""

    sku: str
    per_node: int
    limited_by: Limit
    sandboxes: int
    nodes: int
    spare_slots: int
    cpu_request_share: float
    memory_request_share: float
    next_fit_hint: str | None = None

    def describe(self) -> str:
        return f"{self.per_node} per node (limited by {self.limited_by})"


def per_node(capacity: NodeCapacity, shape: SandboxShape) -> tuple[int, Limit]:
    """Sandboxes of ``shape`` that fit on one node, and which resource runs out first."""
    fits: dict[Limit, int] = {
        "cpu": capacity.free_cpu_millicores // shape.cpu_millicores,
        "memory": capacity.free_memory_bytes // shape.memory_bytes,
        "pods": capacity.free_pods,
    }
    limit = min(fits, key=lambda name: fits[name])
    return fits[limit], limit


def next_fit_hint(capacity: NodeCapacity, shape: SandboxShape, count: int) -> str | None:
    """The largest requests that would fit ``count`` sandboxes per node, if pod slots allow."""
    if count > capacity.free_pods:
        return None
    cpu = capacity.free_cpu_millicores // count
    memory = capacity.free_memory_bytes // count // MIB
    if cpu <= 0 or memory <= 0:
        return None
    return (
        f"requests of at most {cpu}m CPU and {memory}Mi memory would fit {count} per "
        f"{capacity.sku} node"
    )


def pack(sandboxes: int, shape: SandboxShape, capacity: NodeCapacity) -> Packing:
    """Nodes of ``capacity`` needed for ``sandboxes`` of ``shape`` running at once."""
    if sandboxes < 1:
        raise InvalidRequest(f"need at least one sandbox to pack, not {sandboxes}")
    count, limit = per_node(capacity, shape)
    if count == 0:
        raise InvalidRequest(
            f"a {shape.describe()} sandbox does not fit on {capacity.sku}: after AKS "
            f"reservations and DaemonSets it has {capacity.free_cpu_millicores}m CPU, "
            f"{capacity.free_memory_bytes // MIB}Mi memory and {capacity.free_pods} pod slots "
            "free",
            hint="choose a larger --vm-size, or smaller --cpu/--memory",
        )
    nodes = math.ceil(sandboxes / count)
    return Packing(
        sku=capacity.sku,
        per_node=count,
        limited_by=limit,
        sandboxes=sandboxes,
        nodes=nodes,
        spare_slots=nodes * count - sandboxes,
        cpu_request_share=sandboxes * shape.cpu_millicores / (nodes * capacity.vcpus * 1000),
        memory_request_share=sandboxes * shape.memory_bytes / (nodes * capacity.memory_bytes),
        next_fit_hint=next_fit_hint(capacity, shape, count + 1),
    )
