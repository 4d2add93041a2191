"""Flows of the model gateway's records (see :mod:`orchard_env.sdk._flows`): a sandbox's
recorded model calls, its trajectories, and the trajectory its next calls go to."""

from __future__ import annotations

from typing import Any

from orchard_env import protocol
from orchard_env.sdk._base import ClientCore, Flow, Send, call, seg

PAGE = 1000


def model_calls(
    core: ClientCore, sandbox_id: str, trajectory_id: str | None, after: int = 0
) -> Flow[list[dict[str, Any]]]:
    """Every recorded call (``orchard.model_call/v1`` dicts) after the cursor, oldest first."""
    found: list[dict[str, Any]] = []
    while True:
        params = [("after", str(after)), ("limit", str(PAGE))]
        if trajectory_id is not None:
            params.append(("trajectory_id", trajectory_id))
        path = f"/sandboxes/{seg(sandbox_id)}/model-calls"
        data = yield from call(core, Send("GET", path, params=params))
        page = protocol.ModelCallList.model_validate(data).calls
        found += page
        if len(page) < PAGE:
            return found
        after = int(page[-1]["cursor"])


def trajectories(core: ClientCore, sandbox_id: str) -> Flow[list[protocol.TrajectorySummary]]:
    data = yield from call(core, Send("GET", f"/sandboxes/{seg(sandbox_id)}/trajectories"))
    return protocol.TrajectoryList.model_validate(data).trajectories


def set_trajectory(
    core: ClientCore, sandbox_id: str, trajectory_id: str
) -> Flow[protocol.SandboxInfo]:
    body = {"trajectory_id": trajectory_id}
    path = f"/sandboxes/{seg(sandbox_id)}/trajectory"
    data = yield from call(core, Send("PUT", path, json=body))
    return protocol.SandboxInfo.model_validate(data)
