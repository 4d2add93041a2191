"""``GET /resources``: what the substrate offers and what live sandboxes asked for."""

from __future__ import annotations

import os
import socket

from orchard_env.errors import NotSupported
from orchard_env.orchestrator.backends.base import Backend
from orchard_env.orchestrator.store import Store
from orchard_env.protocol import NodeResources, ResourceAmounts, ResourcesReport


def host_node() -> NodeResources:
    """This machine, where the local engine runs its containers (a local socket)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    amounts = ResourceAmounts(cpu=float(os.cpu_count() or 1), memory_bytes=memory)
    return NodeResources(name=socket.gethostname(), capacity=amounts, allocatable=amounts)


async def resources_report(store: Store, backend: Backend) -> ResourcesReport:
    if backend.name == "kubernetes":
        raise NotSupported("/resources is not implemented for the kubernetes backend yet")
    nodes = [host_node()]
    live = [record for record in await store.list_sandboxes(pooled=True) if record.live]
    totals = ResourceAmounts(
        cpu=sum(n.allocatable.cpu for n in nodes),
        memory_bytes=sum(n.allocatable.memory_bytes for n in nodes),
    )
    requests = ResourceAmounts(
        cpu=sum(r.cpu for r in live), memory_bytes=sum(r.memory_bytes for r in live)
    )
    return ResourcesReport(
        backend=backend.name,
        nodes=nodes,
        totals=totals,
        requests=requests,
        available=ResourceAmounts(
            cpu=max(totals.cpu - requests.cpu, 0.0),
            memory_bytes=max(totals.memory_bytes - requests.memory_bytes, 0),
        ),
        sandboxes=len(live),
    )
