"""The reaper's agent probes: bounded per pass, rotating, and a gone agent still found."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchard_env.orchestrator import health
from orchard_env.orchestrator.records import SandboxRecord
from tests.orchestrator.conftest import Service
from tests.orchestrator.fakes import AgentProcessBackend


async def test_probes_per_pass_are_bounded_and_rotate_until_a_gone_agent_is_found(
    service: Service, backend: AgentProcessBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = [(await service.create(sandbox_id=f"probed-{i}"))["sandbox_id"] for i in range(5)]
    monkeypatch.setattr(health, "PROBES_PER_PASS", 2)
    probes: list[list[str]] = []
    check = service.orchard.health.check

    async def counted(record: SandboxRecord) -> bool:
        probes[-1].append(record.sandbox_id)
        return await check(record)

    monkeypatch.setattr(service.orchard.health, "check", counted)
    for _ in range(3):
        probes.append([])
        await service.orchard.reaper.run_pass()
    assert [len(p) for p in probes] == [2, 2, 2]
    assert set(probes[0] + probes[1] + probes[2]) == set(ids)  # each within 3 passes

    gone = ids[-1]
    uds = backend.sandboxes[gone].endpoint.uds
    assert uds is not None
    Path(uds).unlink()  # noqa: ASYNC240 - one unlink, in the test
    for _ in range(3):
        probes.append([])
        await service.orchard.reaper.run_pass()
    info = (await service.http.get(f"/sandboxes/{gone}")).json()
    assert info["status"] == "failed", info
    assert info["status_message"].startswith("its agent is gone ("), info
