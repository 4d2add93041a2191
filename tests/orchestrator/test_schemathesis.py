"""The API fuzzed by Schemathesis from the OpenAPI the service serves: every phase (examples,
coverage, fuzzing, stateful), positive and negative data, and no answer may be a 5xx.

Bounded: a fixed seed, a few examples per operation and a time budget; the service runs on
the service-tier backend (real agents as host processes), with the hooks in
:mod:`tests.orchestrator.schemathesis_hooks` keeping images local and sandboxes short-lived.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from orchard_env.config import ServiceSettings
from tests.orchestrator.conftest import make_settings
from tests.servers import fake_backend, live_service

REPO = Path(__file__).resolve().parents[2]
BUDGET_SECONDS = 90


def fuzz_settings(tmp_path: Path) -> ServiceSettings:
    # Expire what the run makes while it runs: created sandboxes (TTL clamped by the hooks)
    # and snapshots are reaped every second.
    return make_settings(
        tmp_path / "state", reap_interval_seconds=1, sandbox_ttl_seconds=10, snapshot_ttl_seconds=10
    )


def test_schemathesis_finds_no_server_error(tmp_path: Path) -> None:
    st = shutil.which("st", path=str(Path(sys.executable).parent))
    assert st is not None, "schemathesis is a dev dependency: make install"
    with (
        fake_backend() as backend,
        live_service(fuzz_settings(tmp_path), key_name="fuzz", backend=backend) as (url, api_key),
    ):
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
            },
            capture_output=True,
            text=True,
            timeout=BUDGET_SECONDS + 60,
        )
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-5000:]
