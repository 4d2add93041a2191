"""Allocatable and packing math against hand-computed values (AKS node-resource-reservations)."""

from __future__ import annotations

import pytest

from orchard_env.cost.nodes import (
    MIB,
    DaemonSetOverhead,
    daemonset_overhead,
    kube_reserved_cpu_millicores,
    kube_reserved_memory_bytes,
    node_capacity,
)
from orchard_env.cost.packing import SandboxShape, pack, per_node
from orchard_env.cost.prices import load_price_table
from orchard_env.errors import InvalidRequest

GIB = 1024**3
TABLE = load_price_table()
TWO_BY_EIGHT = SandboxShape.of(2, 8 * GIB)


@pytest.mark.parametrize(
    ("cores", "millicores"),
    [(1, 60), (2, 100), (4, 140), (8, 180), (16, 260), (32, 420), (64, 740)],
)
def test_cpu_reservation_matches_the_published_table(cores: int, millicores: int) -> None:
    assert kube_reserved_cpu_millicores(cores) == millicores


def test_cpu_reservation_between_and_beyond_the_table() -> None:
    assert kube_reserved_cpu_millicores(48) == 580  # halfway between 420 (32) and 740 (64)
    assert kube_reserved_cpu_millicores(96) == 1060  # 740 + 32 x 10m
    with pytest.raises(ValueError, match="at least one core"):
        kube_reserved_cpu_millicores(0)


def test_memory_reservation_is_pods_based_or_a_quarter_of_memory() -> None:
    # The docs' examples: 8 GB / 30 pods -> 650 MB; 4 GB / 70 pods -> 25% = 1000 MB (< 1450).
    assert kube_reserved_memory_bytes(8 * GIB, 30) == 650 * MIB
    assert kube_reserved_memory_bytes(4 * GIB, 70) == GIB
    assert kube_reserved_memory_bytes(32 * GIB, 110) == 2250 * MIB


def test_d8as_v5_capacity() -> None:
    capacity = node_capacity(TABLE.sku("Standard_D8as_v5"))
    assert capacity.allocatable_cpu_millicores == 7820  # "about 7.82 allocatable CPU"
    assert capacity.allocatable_memory_bytes == 32 * GIB - 650 * MIB - 100 * MIB
    assert capacity.free_cpu_millicores == 7420
    assert capacity.free_memory_bytes == (32768 - 750 - 750) * MIB
    assert capacity.free_pods == 20


def test_four_2cpu_8gib_sandboxes_do_not_fit_on_d8as_v5_even_without_daemonsets() -> None:
    bare = node_capacity(
        TABLE.sku("Standard_D8as_v5"),
        daemonsets=DaemonSetOverhead(cpu_millicores=0, memory_bytes=0, pods=0),
    )
    assert per_node(bare, TWO_BY_EIGHT) == (3, "cpu")


@pytest.mark.parametrize(
    ("sku", "expected", "nodes"),
    [
        ("Standard_D4as_v5", 1, 128),
        ("Standard_D8as_v5", 3, 43),
        ("Standard_D16as_v5", 7, 19),
        ("Standard_D32as_v5", 15, 9),
        ("Standard_E8as_v5", 3, 43),
    ],
)
def test_packing_128_sandboxes_of_2cpu_8gib(sku: str, expected: int, nodes: int) -> None:
    packing = pack(128, TWO_BY_EIGHT, node_capacity(TABLE.sku(sku)))
    assert (packing.per_node, packing.nodes) == (expected, nodes)
    assert packing.spare_slots == nodes * expected - 128


def test_trimmed_requests_fit_four_per_d8as_v5() -> None:
    capacity = node_capacity(TABLE.sku("Standard_D8as_v5"))
    packing = pack(128, TWO_BY_EIGHT, capacity)
    assert packing.next_fit_hint == (
        "requests of at most 1855m CPU and 7817Mi memory would fit 4 per Standard_D8as_v5 node"
    )
    trimmed = pack(128, SandboxShape.of(1.8, int(7.5 * GIB)), capacity)
    assert (trimmed.per_node, trimmed.nodes, trimmed.spare_slots) == (4, 32, 0)


def test_memory_and_pod_limits() -> None:
    capacity = node_capacity(TABLE.sku("Standard_D8as_v5"))
    assert per_node(capacity, SandboxShape.of(0.5, 16 * GIB)) == (1, "memory")
    assert per_node(capacity, SandboxShape.of(0.1, 128 * MIB)) == (20, "pods")
    more_pods = node_capacity(TABLE.sku("Standard_D8as_v5"), max_pods=110)
    assert per_node(more_pods, SandboxShape.of(0.1, 128 * MIB)) == (74, "cpu")


def test_a_sandbox_that_fits_nowhere_names_the_free_resources() -> None:
    # 8192 Mi - 650 (kube-reserved) - 100 (eviction) - 750 (DaemonSets) = 6692 Mi
    capacity = node_capacity(TABLE.sku("Standard_D2as_v5"))
    with pytest.raises(InvalidRequest) as caught:
        pack(1, TWO_BY_EIGHT, capacity)
    assert caught.value.message == (
        "a 2 CPU / 8Gi sandbox does not fit on Standard_D2as_v5: after AKS reservations and "
        "DaemonSets it has 1500m CPU, 6692Mi memory and 20 pod slots free"
    )


def test_request_shares_count_requests_against_node_size() -> None:
    packing = pack(128, TWO_BY_EIGHT, node_capacity(TABLE.sku("Standard_D8as_v5")))
    assert packing.cpu_request_share == pytest.approx(256 / (43 * 8))
    assert packing.memory_request_share == pytest.approx(1024 / (43 * 32))


def test_daemonset_overrides_parse_quantities_and_name_the_flags() -> None:
    assert daemonset_overhead("250m", "1Gi", 4) == DaemonSetOverhead(
        cpu_millicores=250, memory_bytes=GIB, pods=4
    )
    assert daemonset_overhead() == DaemonSetOverhead()
    with pytest.raises(InvalidRequest, match="--daemonset-cpu"):
        daemonset_overhead("lots")
