"""The provider contract: what `orchard up` / `orchard down` / `orchard status` drive.

A provider stands an Orchard service up in stages (provision → images → deploy → smoke),
each idempotent: running a stage that is already done does nothing and says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from orchard_env.errors import ConfigError

Progress = Callable[[str], None]
STAGES = ("provision", "images", "deploy", "smoke")


@dataclass
class StageResult:
    stage: str
    summary: str
    skipped: bool = False


ChangeAction = Literal["create", "update", "keep", "drift", "delete"]


@dataclass(frozen=True)
class Change:
    """One resource in a plan: what would happen to it, and why.

    ``keep``: exists as wanted. ``drift``: exists but differs in a way Orchard does not change
    in place (it never recreates what exists); the details say what differs and what to do.
    """

    action: ChangeAction
    kind: str
    name: str
    details: tuple[str, ...] = ()


@dataclass
class UpResult:
    url: str
    context: str
    stages: list[StageResult] = field(default_factory=list)


@dataclass
class ServiceStatus:
    target: str
    running: bool
    url: str | None
    detail: dict[str, str] = field(default_factory=dict)


class Provider(Protocol):
    """One deployment target. ``down`` of something already gone returns quietly."""

    target: str

    def up(self, progress: Progress) -> UpResult: ...

    def down(self, progress: Progress) -> None: ...

    def status(self) -> ServiceStatus: ...


TARGETS = ("local", "aks", "kubeconfig")


def check_target(target: str) -> str:
    if target not in TARGETS:
        raise ConfigError(
            f"unknown target {target!r}",
            hint=f"choose one of: {', '.join(TARGETS)}",
        )
    return target
