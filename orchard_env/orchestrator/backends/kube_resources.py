"""Capacity and requests from Kubernetes objects, for ``GET /resources``.

Nodes give ``status.capacity`` and ``status.allocatable``; a pod's requests are the sum of its
containers' ``resources.requests`` (as upstream counts them; init containers run before and
are not added). Pods that finished (``Succeeded``, ``Failed``) no longer hold anything.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from orchard_env.protocol import NodeResources, ResourceAmounts, SandboxPod
from orchard_env.quantities import parse_cpu, parse_memory

log = logging.getLogger(__name__)

KubeObject = dict[str, Any]
FINISHED_PHASES = frozenset({"Succeeded", "Failed"})


def quantity(value: Any, parse: Callable[[str], float]) -> float:
    """A Kubernetes quantity, or 0 for none, zero, or one this parser does not read (logged:
    a figure left out is better than a report refused for another tenant's odd pod)."""
    if value in (None, "", "0", 0):
        return 0.0
    try:
        return float(parse(str(value)))
    except ValueError:
        log.warning("unreadable Kubernetes quantity", extra={"quantity": str(value)})
        return 0.0


def _amounts(resources: KubeObject | None) -> ResourceAmounts:
    resources = resources or {}
    return ResourceAmounts(
        cpu=quantity(resources.get("cpu"), parse_cpu),
        memory_bytes=int(quantity(resources.get("memory"), parse_memory)),
    )


def node_resources(node: KubeObject) -> NodeResources:
    status = node.get("status") or {}
    return NodeResources(
        name=node["metadata"]["name"],
        capacity=_amounts(status.get("capacity")),
        allocatable=_amounts(status.get("allocatable")),
    )


def pod_requests(pod: KubeObject, sandbox_id: str | None) -> SandboxPod | None:
    """The pod's requests, or None once it has finished."""
    phase = str((pod.get("status") or {}).get("phase") or "Pending")
    if phase in FINISHED_PHASES:
        return None
    containers = (pod.get("spec") or {}).get("containers") or []
    requests = [_amounts((c.get("resources") or {}).get("requests")) for c in containers]
    return SandboxPod(
        name=pod["metadata"]["name"],
        namespace=pod["metadata"].get("namespace") or "",
        phase=phase,
        cpu_request=sum(r.cpu for r in requests),
        memory_request_bytes=sum(r.memory_bytes for r in requests),
        sandbox_id=sandbox_id,
    )
