"""The API fuzzed by Schemathesis from the OpenAPI the service serves: every phase (examples,
coverage, fuzzing, stateful), positive and negative data, and no answer may be a 5xx.

Bounded: a fixed seed, a few examples per operation and a time budget; the hooks in
:mod:`tests.orchestrator.schemathesis_hooks` keep images local and sandboxes short-lived.

The service runs on the real engine backend, never on the service-tier fake: a fuzzer sends
whatever the schema allows (``DELETE .../files?path=/etc&recursive=true``, any command), and
only a container keeps that inside a sandbox. The fake's agents are host processes as root.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from orchard_env.config import ServiceSettings
from tests.orchestrator.conftest import make_settings
from tests.servers import live_service

REPO = Path(__file__).resolve().parents[2]
BUDGET_SECONDS = 90


def fuzz_settings(state_dir: Path, instance: str, bundle: Path) -> ServiceSettings:
    # Expire what the run makes while it runs: created sandboxes (TTL clamped by the hooks)
    # and snapshots are reaped every second.
    return make_settings(
        state_dir,
        backend="docker",
        instance=instance,
        agent_bundle_dir=bundle,
        reap_interval_seconds=1,
        sandbox_ttl_seconds=10,
        snapshot_ttl_seconds=10,
    )


def test_schemathesis_finds_no_server_error(
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    engine_instance: str,
    agent_bundle: Path,
    busybox_image: str,
) -> None:
    st = shutil.which("st", path=str(Path(sys.executable).parent))
    assert st is not None, "schemathesis is a dev dependency: make install"
    # A short state dir: the agent's socket path must fit a unix socket address.
    settings = fuzz_settings(
        tmp_path_factory.mktemp("fuzz"), f"{engine_instance}-fuzz", agent_bundle
    )
    with live_service(settings, key_name="fuzz") as (url, api_key):
        run = subprocess.run(
            [
                st,
                "run",
                f"{url}/openapi.json",
                "--phases=examples,coverage,fuzzing,stateful",
                "--checks=not_a_server_error",
                "--mode=all",
                "--max-examples=8",
                f"--max-time={BUDGET_SECONDS}",
                "--seed=9",
                "--workers=1",
                "--request-timeout=30",
                "--no-color",
                "--header",
                f"X-API-Key: {api_key}",
                "--report=junit",
                f"--report-dir={tmp_path / 'report'}",
            ],
            cwd=tmp_path,  # its cache (.schemathesis/) goes there, not into the tree
            env={
                **os.environ,
                "PYTHONPATH": str(REPO),
                "SCHEMATHESIS_HOOKS": "tests.orchestrator.schemathesis_hooks",
                "ORCHARD_FUZZ_IMAGE": busybox_image,
            },
            capture_output=True,
            text=True,
            timeout=BUDGET_SECONDS + 60,
        )
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-5000:]
