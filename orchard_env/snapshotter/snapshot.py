"""One snapshot: find the container, read its writable layer (frozen), push it."""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

from orchard_env import errors
from orchard_env.agent.bundle import BUNDLE_MOUNT
from orchard_env.snapshotter.layer import (
    CAP_SYS_ADMIN,
    find_container_pid,
    freeze,
    has_capability,
    root_upperdir,
    write_layer,
)
from orchard_env.snapshotter.registry import RegistryClient, push_snapshot

logger = logging.getLogger(__name__)

# Never part of a snapshot: the agent's bundle and its per-sandbox secrets directory.
ALWAYS_EXCLUDED = frozenset({BUNDLE_MOUNT.strip("/"), "run/orchard"})


@dataclass(frozen=True)
class SnapshotResult:
    ref: str
    digest: str
    size_bytes: int
    frozen: bool  # False: the container ran while its layer was read (reason logged)

    def to_json(self) -> dict[str, object]:
        return {
            "ref": self.ref,
            "digest": self.digest,
            "size_bytes": self.size_bytes,
            "frozen": self.frozen,
        }


def take_snapshot(
    client: RegistryClient,
    *,
    container_id: str,
    base_image: str,
    target: str,
    pid: int | None = None,
    proc: Path = Path("/proc"),
    cgroup_root: Path = Path("/sys/fs/cgroup"),
) -> SnapshotResult:
    """Commit the writable layer of ``container_id`` on top of ``base_image`` as ``target``.

    ``pid``: a process of the container, when the caller knows it (otherwise it is found by
    the container id in ``/proc/*/cgroup``).
    """
    if not has_capability(CAP_SYS_ADMIN):
        # Without it the kernel hides trusted.* xattrs: opaque directories would go unseen
        # and a deleted directory's old contents would come back in the snapshot.
        raise errors.NotSupported(
            "the snapshotter lacks CAP_SYS_ADMIN, which reading overlayfs' "
            "trusted.overlay.opaque attributes needs",
            hint="the orchard-snapshotter DaemonSet adds it; run it as rendered",
        )
    if pid is None:
        pid = find_container_pid(container_id, proc=proc)
    root = root_upperdir(pid, proc=proc)
    with tempfile.TemporaryDirectory(prefix="orchard-snapshot-") as scratch:
        layer_path = Path(scratch) / "layer.tar.gz"
        with freeze(pid, container_id, proc=proc, cgroup_root=cgroup_root) as not_frozen:
            if not_frozen is not None:
                logger.warning("snapshot of %s is not frozen: %s", container_id, not_frozen)
            layer = write_layer(
                root.upperdir, layer_path, exclude=root.mount_points | ALWAYS_EXCLUDED
            )
        pushed = push_snapshot(client, base_image=base_image, target=target, layer=layer)
    return SnapshotResult(
        ref=pushed.ref,
        digest=pushed.digest,
        size_bytes=pushed.size_bytes,
        frozen=not_frozen is None,
    )
