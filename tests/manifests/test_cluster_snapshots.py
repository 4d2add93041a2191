"""Opt-in: snapshot and restore on a real cluster through the node snapshotter.

Runs only with ``ORCHARD_TEST_CLUSTER=1``, ``KUBECONFIG`` naming the cluster and
``ORCHARD_TEST_PROFILE`` naming a profile with ``snapshots: true`` whose ``registry.server``
the cluster's nodes pull from and the snapshotter can push to (an ``orchard-registry`` Secret
in the service and snapshotter namespaces, see docs/deployment.md). It deploys, snapshots a
sandbox in which a file was written and one deleted, restores it, checks both, and undeploys.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orchard_env.sdk.client import SandboxClient
from provision.profile import load_profile
from tests.manifests.test_cluster import CONTEXT, USER_CLUSTER, Deployment, deployment

_PROFILE = os.environ.get("ORCHARD_TEST_PROFILE")
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(
        not USER_CLUSTER or not _PROFILE or not load_profile(Path(_PROFILE)).snapshots,
        reason="opt-in: set ORCHARD_TEST_CLUSTER=1, KUBECONFIG and ORCHARD_TEST_PROFILE (a "
        "profile with snapshots: true)",
    ),
]
__all__ = ["deployment"]  # the deploy/undeploy fixture, shared with test_cluster


def test_snapshot_and_restore_on_a_cluster(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    deployed = deployment.orchard("deploy", *deployment.args, *deployment.tag)
    assert deployed.returncode == 0, deployed.stderr
    monkeypatch.setenv("ORCHARD_CONFIG", deployment.env["ORCHARD_CONFIG"])  # the deploy's context
    with (
        deployment.reachable(deployed.stdout.strip().splitlines()[-1]) as url,
        SandboxClient(base_url=url, context=CONTEXT) as client,
    ):
        image = deployment.smoke_image or "debian:bookworm-slim"
        source = client.create_sandbox(image, timeout=600)
        made = source.exec("echo kept > /workspace/kept.txt && rm /etc/debian_version")
        assert made.exit_code == 0, made.stderr
        snapshot = source.snapshot()
        restored = client.restore(snapshot.snapshot_id, timeout=600)
        seen = restored.exec("cat /workspace/kept.txt; test -e /etc/debian_version; echo $?")
        assert seen.stdout.split() == ["kept", "1"]
        client.delete_snapshot(snapshot.snapshot_id, recursive=True)
