"""Opt-in: `orchard deploy`, `orchard smoke` and `orchard undeploy` against a real cluster.

Runs only with ``ORCHARD_TEST_CLUSTER=1`` and ``KUBECONFIG`` naming the cluster (kind, AKS,
...). The cluster must be able to pull the images of ``ORCHARD_TEST_TAG`` (default: the
checkout's tag) from the profile's registry (``ORCHARD_TEST_PROFILE``, default: the defaults
for any cluster, local ``localhost/orchard/...`` images, which suits kind after `kind load`),
and the smoke test's image (``ORCHARD_TEST_SMOKE_IMAGE``, default: `orchard smoke`'s). It
deletes the deployment's namespaces at the end. See docs/deployment.md.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from manifests.deploy import port_forward_command
from provision.profile import load_profile

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(
        os.environ.get("ORCHARD_TEST_CLUSTER") != "1" or not os.environ.get("KUBECONFIG"),
        reason="opt-in: set ORCHARD_TEST_CLUSTER=1 and KUBECONFIG (a real cluster)",
    ),
]
CONTEXT = "cluster-test"


def _orchard(*args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from orchard_cli.main import main; main()", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


def _wait_for_port(port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    pytest.fail(f"nothing listens on 127.0.0.1:{port} (kubectl port-forward)")


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    environment = {**os.environ, "ORCHARD_CONFIG": str(tmp_path / "config.toml")}
    yield environment
    done = _orchard("undeploy", "--yes", *_profile_args(), env=environment, timeout=900)
    assert done.returncode == 0, done.stderr


def _profile_args() -> list[str]:
    args = ["--context", CONTEXT]
    if os.environ.get("ORCHARD_TEST_PROFILE"):
        args += ["--profile", os.environ["ORCHARD_TEST_PROFILE"]]
    if os.environ.get("ORCHARD_TEST_TAG"):
        args += ["--tag", os.environ["ORCHARD_TEST_TAG"]]
    return args


def test_deploy_smoke_undeploy(env: dict[str, str]) -> None:
    deployed = _orchard("deploy", *_profile_args(), env=env, timeout=900)
    assert deployed.returncode == 0, deployed.stderr
    endpoint = deployed.stdout.strip().splitlines()[-1]
    forward = None
    if endpoint == "http://127.0.0.1:8000":  # no load balancer: reach it via kubectl
        namespace = "orchard"
        if os.environ.get("ORCHARD_TEST_PROFILE"):
            namespace = load_profile(Path(os.environ["ORCHARD_TEST_PROFILE"])).service.namespace
        forward = subprocess.Popen(
            shlex.split(port_forward_command(namespace)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_for_port(8000, time.monotonic() + 60)
    try:
        image = os.environ.get("ORCHARD_TEST_SMOKE_IMAGE")
        image_args = ["--image", image] if image else []
        smoke = _orchard("smoke", "--context", CONTEXT, *image_args, env=env, timeout=900)
        assert smoke.returncode == 0, smoke.stdout + smoke.stderr
        again = _orchard("deploy", *_profile_args(), env=env, timeout=900)
        assert again.returncode == 0, again.stderr
        assert "0 changed" in again.stderr  # idempotent on a real API server
    finally:
        if forward is not None:
            forward.terminate()
            forward.wait(timeout=10)
