"""Managed services priced for 128 x 240 h x (2 vCPU, 8 GiB), against the published figures."""

from __future__ import annotations

import pytest

from orchard_env.cost.managed import ManagedQuote, Workload, managed_quotes

REFERENCE = Workload(sandboxes=128, hours=240, cpu=2, memory_gib=8)


def quotes(workload: Workload = REFERENCE) -> dict[str, ManagedQuote]:
    return {quote.service: quote for quote in managed_quotes(workload)}


def test_reference_workload_compute_figures() -> None:
    q = quotes()
    assert [name for name in q] == ["E2B", "Daytona", "Modal", "Runloop", "Morph"]
    assert (
        round(q["E2B"].compute_usd, 2) == 7077.89
    )  # (2 x 0.000014 + 8 x 0.0000045) x 3600 x 30,720
    assert round(q["Daytona"].compute_usd, 2) == 7077.89  # (2 x 0.0504 + 8 x 0.0162) x 30,720
    assert (
        round(q["Modal"].compute_usd, 2) == 10304.96
    )  # (1 core x 0.00003942 + 8 x 0.00000672) x 3600
    assert round(q["Runloop"].compute_usd, 2) == 12828.67  # (2 x 0.108 + 8 x 0.0252) x 30,720
    assert round(q["Morph"].compute_usd, 2) == 3072.00  # max(2, 8/4) MCU x 30,720 x 0.05
    assert round(q["E2B"].compute_usd) == 7078 and round(q["Modal"].compute_usd) == 10305
    assert q["E2B"].usd_per_sandbox_hour == pytest.approx(0.2304)
    assert q["Modal"].usd_per_sandbox_hour == pytest.approx(0.335448)


def test_plan_fees_and_alternatives() -> None:
    q = quotes()
    assert q["E2B"].plan_usd == 650.0  # Pro $150 + concurrency add-on $500, one month
    assert round(q["E2B"].total_usd, 2) == 7727.89
    assert "at the later-listed $0.00000667/GiB-s: $10,260.73" in q["Modal"].notes
    assert "on the Scale plan ($250/month including 7,500 MCU): $2,947.00" in q["Morph"].notes
    assert any("Tier 4 org cap" in note for note in q["Daytona"].notes)
    small = quotes(Workload(sandboxes=10, hours=240, cpu=2, memory_gib=8))
    assert small["E2B"].plan_usd == 150.0
    assert not any("Tier 4" in note for note in small["Daytona"].notes)


def test_session_limits_that_matter_for_long_runs() -> None:
    q = quotes()
    assert q["E2B"].restarts_per_sandbox == 9  # 240 h in 24 h sessions
    assert q["Modal"].restarts_per_sandbox == 9
    assert q["Daytona"].restarts_per_sandbox is None
    short = quotes(Workload(sandboxes=1, hours=24, cpu=2, memory_gib=8))
    assert short["E2B"].restarts_per_sandbox == 0


def test_disk_is_billed_where_the_service_bills_it() -> None:
    q = quotes(REFERENCE.model_copy(update={"disk_gib": 10}))
    assert round(q["Daytona"].disk_usd or 0, 2) == 33.05  # (1,280 - 5) GiB x 240 h x 0.000108
    assert round(q["Runloop"].disk_usd or 0, 2) == 105.17  # 10 GB x 30,720 h x 0.00034236
    assert q["E2B"].disk_usd is None
    large_disk = quotes(REFERENCE.model_copy(update={"disk_gib": 80}))
    assert round(large_disk["Morph"].compute_usd, 2) == 7680.00  # ceil(80/16) = 5 MCU
    assert (
        round(quotes(REFERENCE.model_copy(update={"disk_gib": 16}))["Runloop"].disk_usd or 0, 2)
        == 168.28
    )
