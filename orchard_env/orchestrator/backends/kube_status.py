"""What a sandbox pod's status means: its state, and why, in words a user can act on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orchard_env.orchestrator.backends.base import SandboxState
from orchard_env.orchestrator.backends.kube_objects import MAIN_CONTAINER, Pod

# Waiting reasons of a container whose image cannot be pulled: the pod would wait forever.
PULL_FAILURES = frozenset(
    {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
)
# Waiting reason of a container that cannot be made as specified (a missing Secret or key).
# (CreateContainerError is not in it: the runtime's hiccups, which the kubelet retries.)
CREATE_FAILURES = frozenset({"CreateContainerConfigError"})
MAX_REASON = 600  # characters of a kubelet message kept in a reason


@dataclass(frozen=True)
class PodView:
    """A pod's status read as a sandbox state."""

    state: SandboxState
    reason: str | None = None
    exit_code: int | None = None
    # (container name, waiting reason, kubelet message) when an image cannot be pulled.
    pull_failure: tuple[str, str, str] | None = None


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."


def container_statuses(status: dict[str, Any], key: str) -> list[dict[str, Any]]:
    return list(status.get(key) or [])


def _terminated_reason(terminated: dict[str, Any], *, with_code: bool = False) -> str:
    """``OOMKilled``, ``Error: <the container's last output>`` (FallbackToLogsOnError)."""
    reason = terminated.get("reason") or "Error"
    if with_code:
        reason += f" (exit code {terminated.get('exitCode')})"
    message = terminated.get("message")
    return _clip(f"{reason}: {message}") if message else reason


def view_pod(pod: Pod) -> PodView:
    """Map a pod to a :class:`~.base.SandboxState`, reasons included."""
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    phase = status.get("phase") or "Pending"
    # Set when the kubelet ended the pod itself: DeadlineExceeded, Evicted (with the message).
    pod_why = _clip(": ".join(str(p) for p in (status.get("reason"), status.get("message")) if p))
    containers = container_statuses(status, "containerStatuses")
    main = next((c for c in containers if c.get("name") == MAIN_CONTAINER), {})
    terminated = (main.get("state") or {}).get("terminated")
    if terminated is not None:
        reason = _terminated_reason(terminated)
        return PodView(
            SandboxState.EXITED,
            f"{pod_why}; {reason}" if pod_why else reason,
            int(terminated.get("exitCode", 0)),
        )
    if metadata.get("deletionTimestamp"):
        return PodView(SandboxState.EXITED, "its pod is being deleted")
    for init in container_statuses(status, "initContainerStatuses"):
        init_terminated = (init.get("state") or {}).get("terminated")
        if init_terminated is not None and init_terminated.get("exitCode", 0) != 0:
            why = _terminated_reason(init_terminated, with_code=True)
            return PodView(SandboxState.FAILED, f"the agent injector failed: {why}")
    if phase in ("Failed", "Succeeded"):
        return PodView(SandboxState.FAILED, pod_why or f"its pod's phase is {phase}")
    for container in (*container_statuses(status, "initContainerStatuses"), main):
        waiting = (container.get("state") or {}).get("waiting") or {}
        waiting_reason, message = waiting.get("reason"), _clip(waiting.get("message") or "")
        detail = f"{waiting_reason}: {message}" if message else str(waiting_reason)
        if waiting_reason in PULL_FAILURES:
            name = container.get("name", "?")
            return PodView(
                SandboxState.FAILED,
                f"container {name}: {detail}",
                pull_failure=(name, waiting_reason, message),
            )
        if waiting_reason in CREATE_FAILURES:
            return PodView(SandboxState.FAILED, detail)
    if phase == "Running" and (main.get("state") or {}).get("running") is not None:
        return PodView(SandboxState.RUNNING)
    for condition in status.get("conditions") or []:
        if (
            condition.get("type") == "PodScheduled"
            and condition.get("status") == "False"
            and condition.get("reason") == "Unschedulable"
        ):
            message = condition.get("message") or "no node can run it"
            return PodView(SandboxState.UNSCHEDULABLE, _clip(message))
    if phase == "Unknown":
        # The node stopped reporting: the pod may still run (and its agent answer).
        return PodView(SandboxState.RUNNING, "its pod's node does not report the pod's state")
    return PodView(SandboxState.CREATING)
