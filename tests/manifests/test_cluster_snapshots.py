"""Opt-in: snapshot and restore on a real cluster through the node snapshotter.

Runs only with ``ORCHARD_TEST_CLUSTER=1``, ``KUBECONFIG`` naming the cluster and
``ORCHARD_TEST_PROFILE`` naming a profile with ``snapshots: true`` whose ``registry.server``
the cluster's nodes pull from and the snapshotter can push to (an ``orchard-registry`` Secret
in the service and snapshotter namespaces, see docs/deployment.md). It deploys, snapshots a
sandbox in which a file was written and one deleted, restores it, checks both, and undeploys.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from manifests.deploy import port_forward_command
from orchard_env.sdk.client import SandboxClient
from provision.profile import load_profile
from tests.manifests.test_cluster import (
    CONTEXT,
    _orchard,
    _profile_args,
    _wait_for_port,
    env,
)

_PROFILE = os.environ.get("ORCHARD_TEST_PROFILE")
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(
        os.environ.get("ORCHARD_TEST_CLUSTER") != "1"
        or not os.environ.get("KUBECONFIG")
        or not _PROFILE
        or not load_profile(Path(_PROFILE)).snapshots,
        reason="opt-in: set ORCHARD_TEST_CLUSTER=1, KUBECONFIG and ORCHARD_TEST_PROFILE (a "
        "profile with snapshots: true)",
    ),
]
__all__ = ["env"]  # the deploy/undeploy fixture, shared with test_cluster


def test_snapshot_and_restore_on_a_cluster(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _PROFILE is not None
    profile = load_profile(Path(_PROFILE))
    deployed = _orchard("deploy", *_profile_args(), env=env, timeout=900)
    assert deployed.returncode == 0, deployed.stderr
    forward = None
    if deployed.stdout.strip().splitlines()[-1] == "http://127.0.0.1:8000":
        forward = subprocess.Popen(
            shlex.split(port_forward_command(profile.service.namespace)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_for_port(8000, time.monotonic() + 60)
    monkeypatch.setenv("ORCHARD_CONFIG", env["ORCHARD_CONFIG"])
    try:
        with SandboxClient(context=CONTEXT) as client:
            image = os.environ.get("ORCHARD_TEST_SMOKE_IMAGE", "debian:bookworm-slim")
            source = client.create_sandbox(image, timeout=600)
            made = source.exec("echo kept > /workspace/kept.txt && rm /etc/debian_version")
            assert made.exit_code == 0, made.stderr
            snapshot = source.snapshot()
            restored = client.restore(snapshot.snapshot_id, timeout=600)
            seen = restored.exec("cat /workspace/kept.txt; test -e /etc/debian_version; echo $?")
            assert seen.stdout.split() == ["kept", "1"]
            client.delete_snapshot(snapshot.snapshot_id, recursive=True)
    finally:
        if forward is not None:
            forward.terminate()
            forward.wait(timeout=10)
