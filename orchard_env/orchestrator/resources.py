"""``GET /resources``: what the substrate offers and what live sandboxes asked for.

Upstream's shape (``status``, ``nodes``, ``total_capacity``, ``total_allocatable``,
``total_requested``, ``available``, ``sandbox_pods``) plus Orchard's fields. Capacity comes
from the backend (the engine's machine; the cluster's sandbox nodes). Requests come from the
backend where it sees every pod (Kubernetes: the whole sandbox namespace, as upstream), else
from the orchestrator's records. A non-admin key is shown only its own sandboxes: the
capacity of the nodes is the substrate's, but what other keys run is theirs (and the
sandboxes waiting in warm pools are the operator's).
"""

from __future__ import annotations

from orchard_env.config import ServiceSettings
from orchard_env.orchestrator.auth import Caller
from orchard_env.orchestrator.backends.base import Backend
from orchard_env.orchestrator.records import SandboxRecord
from orchard_env.orchestrator.store import Store
from orchard_env.protocol import (
    NodeResources,
    ResourceAmounts,
    ResourcesReport,
    SandboxPod,
    SandboxStatus,
)


def record_pod(record: SandboxRecord, settings: ServiceSettings) -> SandboxPod:
    """A live sandbox as an upstream ``sandbox_pods`` entry, from its record."""
    return SandboxPod(
        name=record.sandbox_id,
        namespace=settings.instance,
        phase="Running" if record.status == SandboxStatus.READY else "Pending",
        cpu_request=record.cpu,
        memory_request_bytes=record.memory_bytes,
        sandbox_id=record.sandbox_id,
    )


def _sum(nodes: list[NodeResources], field: str) -> ResourceAmounts:
    amounts = [getattr(node, field) for node in nodes]
    return ResourceAmounts(
        cpu=sum(a.cpu for a in amounts), memory_bytes=sum(a.memory_bytes for a in amounts)
    )


async def resources_report(
    store: Store, backend: Backend, settings: ServiceSettings, caller: Caller
) -> ResourcesReport:
    capacity = await backend.capacity()
    # An admin sees the sandboxes waiting in warm pools too (they hold their share).
    records = await store.list_sandboxes(owner=caller.owner_filter, pooled=caller.admin)
    live = [r for r in records if r.live]
    if capacity.pods is None:
        pods = [record_pod(record, settings) for record in live]
    elif caller.admin:
        pods = capacity.pods
    else:
        own = {record.sandbox_id for record in live}
        pods = [pod for pod in capacity.pods if pod.sandbox_id in own]
    allocatable = _sum(capacity.nodes, "allocatable")
    requested = ResourceAmounts(
        cpu=sum(p.cpu_request for p in pods), memory_bytes=sum(p.memory_request_bytes for p in pods)
    )
    return ResourcesReport(
        nodes=capacity.nodes,
        total_capacity=_sum(capacity.nodes, "capacity"),
        total_allocatable=allocatable,
        total_requested=requested,
        available=ResourceAmounts(
            cpu=max(allocatable.cpu - requested.cpu, 0.0),
            memory_bytes=max(allocatable.memory_bytes - requested.memory_bytes, 0),
        ),
        sandbox_pods=pods,
        scope="service" if caller.admin else "key",
        backend=backend.name,
        totals=allocatable,
        requests=requested,
        sandboxes=len(live),
    )
