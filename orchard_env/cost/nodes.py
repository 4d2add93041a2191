"""What a node leaves for sandboxes: AKS reservations, eviction threshold, DaemonSets, max pods.

Source: AKS "Node resource reservations" (learn.microsoft.com/azure/aks/node-resource-reservations),
for Kubernetes 1.29 and later:

- CPU: kube-reserved millicores by core count (60, 100, 140, 180, 260, 420, 740 for
  1, 2, 4, 8, 16, 32, 64 cores). Between listed counts we interpolate linearly; above 64
  cores we extend the last step (10m per core). Both are assumptions and labelled so.
- Memory: kube-reserved = min(20 MB x max pods + 50 MB, 25% of the node's memory), plus the
  kubelet eviction threshold ``memory.available<100Mi``. We read "MB" as MiB, the unit the
  kubelet flags use.

DaemonSet requests are not published per cluster: :class:`DaemonSetOverhead` is a stated
assumption (defaults below) that callers can override with what ``kubectl describe node``
shows.
"""

from __future__ import annotations

from itertools import pairwise

from pydantic import BaseModel, ConfigDict, Field

from orchard_env.cost.prices import VmSku
from orchard_env.errors import InvalidRequest
from orchard_env.quantities import parse_cpu, parse_memory

MIB = 1024**2

KUBE_RESERVED_CPU_MILLICORES: tuple[tuple[int, int], ...] = (
    (1, 60),
    (2, 100),
    (4, 140),
    (8, 180),
    (16, 260),
    (32, 420),
    (64, 740),
)
EVICTION_THRESHOLD_BYTES = 100 * MIB
RESERVED_MEMORY_PER_POD_BYTES = 20 * MIB
RESERVED_MEMORY_BASE_BYTES = 50 * MIB
DEFAULT_MAX_PODS = 30


def kube_reserved_cpu_millicores(cores: int) -> int:
    """AKS kube-reserved CPU for a node with ``cores`` cores (exact at the documented counts)."""
    if cores < 1:
        raise ValueError(f"a node has at least one core, not {cores}")
    table = KUBE_RESERVED_CPU_MILLICORES
    for (low_cores, low_m), (high_cores, high_m) in pairwise(table):
        if low_cores <= cores <= high_cores:
            step = (high_m - low_m) / (high_cores - low_cores)
            return round(low_m + step * (cores - low_cores))
    last_cores, last_m = table[-1]
    prev_cores, prev_m = table[-2]
    step = (last_m - prev_m) / (last_cores - prev_cores)
    return round(last_m + step * (cores - last_cores))


def kube_reserved_memory_bytes(memory_bytes: int, max_pods: int) -> int:
    """AKS 1.29+ kube-reserved memory: min(20 MiB x max pods + 50 MiB, 25% of memory)."""
    by_pods = RESERVED_MEMORY_PER_POD_BYTES * max_pods + RESERVED_MEMORY_BASE_BYTES
    return min(by_pods, memory_bytes // 4)


class DaemonSetOverhead(BaseModel):
    """Requests of the DaemonSet pods on every node (an assumption unless measured).

    The default is kube-proxy (100m) + calico-node (250m) + CNI/CSI/cloud-node-manager
    (about 50m), and about 750 Mi of memory as reported for kube-system pods in Azure/AKS#3525.
    """

    model_config = ConfigDict(frozen=True)

    cpu_millicores: int = Field(default=400, ge=0)
    memory_bytes: int = Field(default=750 * MIB, ge=0)
    pods: int = Field(default=10, ge=0)


def daemonset_overhead(
    cpu: str | None = None, memory: str | None = None, pods: int | None = None
) -> DaemonSetOverhead:
    """The default overhead with any part replaced (quantities as Kubernetes writes them)."""
    defaults = DaemonSetOverhead()
    try:
        return DaemonSetOverhead(
            cpu_millicores=defaults.cpu_millicores if cpu is None else round(parse_cpu(cpu) * 1000),
            memory_bytes=defaults.memory_bytes if memory is None else parse_memory(memory),
            pods=defaults.pods if pods is None else pods,
        )
    except ValueError as exc:  # pydantic's ValidationError is a ValueError too
        raise InvalidRequest(
            f"--daemonset-cpu/--daemonset-memory/--daemonset-pods: {exc}",
            hint="e.g. --daemonset-cpu 400m --daemonset-memory 750Mi --daemonset-pods 10",
        ) from exc


def check_max_pods(max_pods: int) -> int:
    if not 10 <= max_pods <= 250:
        raise InvalidRequest(f"--max-pods {max_pods} is outside AKS's range of 10 to 250")
    return max_pods


class NodeCapacity(BaseModel):
    """One node of a VM size, and what is left for sandbox pods."""

    sku: str
    vcpus: int
    memory_bytes: int
    max_pods: int
    reserved_cpu_millicores: int
    reserved_memory_bytes: int
    eviction_threshold_bytes: int
    daemonsets: DaemonSetOverhead
    allocatable_cpu_millicores: int
    allocatable_memory_bytes: int
    free_cpu_millicores: int
    free_memory_bytes: int
    free_pods: int

    def describe(self) -> str:
        return (
            f"{self.sku}: {self.vcpus} vCPU / {self.memory_bytes / 1024**3:g} GiB; AKS reserves "
            f"{self.reserved_cpu_millicores}m CPU and "
            f"{(self.reserved_memory_bytes + self.eviction_threshold_bytes) // MIB} Mi "
            f"(kube-reserved at max {self.max_pods} pods + 100 Mi eviction), DaemonSets request "
            f"{self.daemonsets.cpu_millicores}m / {self.daemonsets.memory_bytes // MIB} Mi: "
            f"{self.free_cpu_millicores / 1000:g} CPU and {self.free_memory_bytes // MIB} Mi free "
            f"for sandboxes"
        )


def node_capacity(
    sku: VmSku,
    *,
    max_pods: int = DEFAULT_MAX_PODS,
    daemonsets: DaemonSetOverhead | None = None,
) -> NodeCapacity:
    """Allocatable and free resources of one node of ``sku``."""
    overhead = daemonsets or DaemonSetOverhead()
    reserved_cpu = kube_reserved_cpu_millicores(sku.vcpus)
    reserved_memory = kube_reserved_memory_bytes(sku.memory_bytes, max_pods)
    allocatable_cpu = sku.vcpus * 1000 - reserved_cpu
    allocatable_memory = sku.memory_bytes - reserved_memory - EVICTION_THRESHOLD_BYTES
    return NodeCapacity(
        sku=sku.name,
        vcpus=sku.vcpus,
        memory_bytes=sku.memory_bytes,
        max_pods=max_pods,
        reserved_cpu_millicores=reserved_cpu,
        reserved_memory_bytes=reserved_memory,
        eviction_threshold_bytes=EVICTION_THRESHOLD_BYTES,
        daemonsets=overhead,
        allocatable_cpu_millicores=allocatable_cpu,
        allocatable_memory_bytes=allocatable_memory,
        free_cpu_millicores=max(0, allocatable_cpu - overhead.cpu_millicores),
        free_memory_bytes=max(0, allocatable_memory - overhead.memory_bytes),
        free_pods=max(0, max_pods - overhead.pods),
    )
