"""Managed sandbox services priced for the same workload, each by its own billing formula.

Rates are list prices from stored copies of the vendors' public pricing pages (2025-2026; the
exact capture date of each page was not recorded), as collected in Orchard's reference notes
(peer-sandbox-services.md section 4). Re-check them before quoting. Compute is billed on
allocation (requests), not on use; plan fees are listed apart.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel

HOURS_PER_MONTH = 730
SOURCE_DATE = "2025-2026 (stored copy, capture date not recorded)"


class Workload(BaseModel):
    """N sandboxes of one size, running at the same time for ``hours``."""

    sandboxes: int
    hours: float
    cpu: float
    memory_gib: float
    disk_gib: float | None = None

    @property
    def sandbox_hours(self) -> float:
        return self.sandboxes * self.hours

    @property
    def months(self) -> int:
        """Billing months a run of this length spans (plan fees are monthly)."""
        return max(1, math.ceil(self.hours / HOURS_PER_MONTH))


class ManagedQuote(BaseModel):
    service: str
    formula: str
    usd_per_sandbox_hour: float
    compute_usd: float
    disk_usd: float | None
    plan_usd: float
    total_usd: float
    source: str
    as_of: str
    session_limit: str
    restarts_per_sandbox: int | None
    notes: list[str]


def _restarts(hours: float, cap_hours: float) -> int:
    """Re-creations (or pause/resume cycles) one sandbox needs to span ``hours``."""
    return max(0, math.ceil(hours / cap_hours) - 1)


@dataclass(frozen=True)
class _Parts:
    formula: str
    per_hour: float
    disk_usd: float | None
    plan_usd: float
    session_limit: str
    restarts: int | None
    notes: list[str]


def _e2b(w: Workload) -> _Parts:
    vcpu_s, gib_s = 0.000014, 0.0000045
    plan = 150.0 * w.months
    notes = ["Pro plan $150/month needed for sessions over 1 h and more than 20 concurrent"]
    if w.sandboxes > 100:
        plan += 500.0 * w.months
        notes.append(
            "over 100 concurrent sandboxes needs a concurrency add-on (+$500/month, reported)"
        )
    return _Parts(
        formula="(vCPU x $0.000014 + GiB x $0.0000045) per second",
        per_hour=(w.cpu * vcpu_s + w.memory_gib * gib_s) * 3600,
        disk_usd=None,
        plan_usd=plan,
        session_limit="24 h per session on Pro (1 h on Hobby); pause/resume or re-create",
        restarts=_restarts(w.hours, 24),
        notes=notes,
    )


def _daytona(w: Workload) -> _Parts:
    notes = ["storage rate unconfirmed"]
    if w.sandboxes * w.cpu > 500 or w.sandboxes * w.memory_gib > 1000:
        notes.append(
            f"{w.sandboxes * w.cpu:g} vCPU / {w.sandboxes * w.memory_gib:g} GiB exceeds the Tier 4 "
            "org cap (500 vCPU / 1,000 GiB): needs custom limits"
        )
    disk = None
    if w.disk_gib is not None:
        disk = max(0.0, w.sandboxes * w.disk_gib - 5) * w.hours * 0.000108
    return _Parts(
        formula="vCPU x $0.0504 + GiB x $0.0162 per hour; disk $0.000108/GiB-h after 5 GiB",
        per_hour=w.cpu * 0.0504 + w.memory_gib * 0.0162,
        disk_usd=disk,
        plan_usd=0.0,
        session_limit="no session cap in our sources; auto-stop/archive intervals are settings",
        restarts=None,
        notes=notes,
    )


def _modal(w: Workload) -> _Parts:
    cores = w.cpu / 2
    alt = (cores * 0.00003942 + w.memory_gib * 0.00000667) * 3600 * w.sandbox_hours
    return _Parts(
        formula="(physical cores x $0.00003942 + GiB x $0.00000672) per second; 1 core = 2 vCPU",
        per_hour=(cores * 0.00003942 + w.memory_gib * 0.00000672) * 3600,
        disk_usd=None,
        plan_usd=0.0,
        session_limit="sandbox timeout at most 24 h; re-create to run longer",
        restarts=_restarts(w.hours, 24),
        notes=[
            f"at the later-listed $0.00000667/GiB-s: ${alt:,.2f}",
            "region and non-preemptible multipliers come on top",
        ],
    )


def _runloop(w: Workload) -> _Parts:
    disk = None if w.disk_gib is None else w.sandbox_hours * w.disk_gib * 0.00034236
    return _Parts(
        formula="CPU x $0.108 + GB x $0.0252 per hour; disk $0.00034236/GB-h",
        per_hour=w.cpu * 0.108 + w.memory_gib * 0.0252,
        disk_usd=disk,
        plan_usd=0.0,
        session_limit="keep_alive defaults to 1 h; on idle it suspends or shuts down (settable)",
        restarts=None,
        notes=["suspend needs the Pro plan ($250/month, not included)"],
    )


def _morph(w: Workload) -> _Parts:
    disk_mcu = 0 if w.disk_gib is None else math.ceil(w.disk_gib / 16)
    mcu = max(math.ceil(w.cpu), math.ceil(w.memory_gib / 4), disk_mcu)
    total_mcu = mcu * w.sandbox_hours
    scale = total_mcu * 0.05 - min(7500.0 * w.months, total_mcu) * 0.05 + 250.0 * w.months
    notes = [
        f"on the Scale plan ($250/month including 7,500 MCU): ${scale:,.2f}",
        "rule from a third-party transcription of Morph's pricing page; verify",
    ]
    if w.disk_gib is None:
        notes.append(f"assumes disk of at most {16 * mcu} GiB per sandbox (16 GiB per MCU)")
    total_vcpu = w.sandboxes * w.cpu
    if total_vcpu > 256:
        notes.append(f"{total_vcpu:g} vCPU at once exceeds the 256 vCPU org cap below the top tier")
    return _Parts(
        formula="$0.05 per MCU; MCU/h = max(vCPU, ceil(GiB/4), ceil(disk GiB/16))",
        per_hour=mcu * 0.05,
        disk_usd=None,
        plan_usd=0.0,
        session_limit="no session cap; optional ttl pauses or stops",
        restarts=None,
        notes=notes,
    )


_SERVICES: tuple[tuple[str, str, Callable[[Workload], _Parts]], ...] = (
    ("E2B", "e2b.dev/docs/billing; usagepricing.com/blueprint/e2b", _e2b),
    ("Daytona", "daytona.io/pricing (transcribed by api-evangelist/daytona-io)", _daytona),
    ("Modal", "modal.com/docs/guide/sandbox-resources and modal.com/pricing", _modal),
    ("Runloop", "api-evangelist/runloop-ai (finops, plans); docs.runloop.ai", _runloop),
    ("Morph", "cloud.morph.so/web/subscribe (third-party transcription)", _morph),
)


def managed_quotes(workload: Workload) -> list[ManagedQuote]:
    """Every managed service's price for ``workload``, in a fixed order."""
    quotes = []
    for name, source, formula in _SERVICES:
        parts = formula(workload)
        compute = parts.per_hour * workload.sandbox_hours
        quotes.append(
            ManagedQuote(
                service=name,
                formula=parts.formula,
                usd_per_sandbox_hour=parts.per_hour,
                compute_usd=compute,
                disk_usd=parts.disk_usd,
                plan_usd=parts.plan_usd,
                total_usd=compute + (parts.disk_usd or 0.0) + parts.plan_usd,
                source=source,
                as_of=SOURCE_DATE,
                session_limit=parts.session_limit,
                restarts_per_sandbox=parts.restarts,
                notes=parts.notes,
            )
        )
    return quotes
