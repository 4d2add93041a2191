"""The CLI's boundary: help, exit codes, messages, stdout vs stderr. No service needed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchard_cli.main import app
from orchard_env import __version__, contexts
from tests.cli.conftest import run_orchard_text

runner = CliRunner()


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    path = tmp_path / "config.toml"
    monkeypatch.setenv("ORCHARD_CONFIG", str(path))
    for name in ("ORCHARD_URL", "ORCHARD_API_KEY", "ORCHARD_CONTEXT", "SANDBOX_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    return path


def test_help_lists_every_command_group() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for group in ("up", "down", "status", "serve", "sandbox", "keys", "smoke", "bench", "cost"):
        assert group in result.output


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.stdout == f"orchard {__version__}\n"


def test_help_does_not_import_heavy_sdks() -> None:
    probe = (
        "import sys\n"
        "from orchard_cli.main import app\n"
        "heavy = [m for m in ('kubernetes', 'azure', 'docker', 'fastapi', 'uvicorn') "
        "if m in sys.modules]\n"
        "print(heavy)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_user_mistake_prints_message_and_hint_without_traceback(isolated: Path) -> None:
    env = {"ORCHARD_CONFIG": str(isolated), "PATH": "/usr/bin:/bin"}
    result = run_orchard_text("sandbox", "create", "--label", "novalue", env=env)
    assert result.returncode == 125
    assert result.stdout == ""
    assert "Error: label 'novalue' is not KEY=VALUE" in result.stderr
    assert "Hint: for example --label team=rl" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("flag", "value", "hint"),
    [
        ("--memory", "8192", "a number without a unit is bytes, did you mean 8192Mi?"),
        ("--cpu", "0.5m", "did you mean 0.5 (500m)?"),
    ],
)
def test_sizes_below_the_minimum_are_refused_with_a_hint(
    isolated: Path, flag: str, value: str, hint: str
) -> None:
    env = {"ORCHARD_CONFIG": str(isolated), "PATH": "/usr/bin:/bin", "COLUMNS": "200"}
    result = run_orchard_text(
        "sandbox", "create", "--url", "http://127.0.0.1:9", flag, value, env=env
    )
    assert result.returncode == 125
    assert "below the minimum" in result.stderr and hint in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_unreachable_service_is_one_clear_error(isolated: Path) -> None:
    env = {"ORCHARD_CONFIG": str(isolated), "PATH": "/usr/bin:/bin"}
    result = run_orchard_text("sandbox", "list", "--url", "http://127.0.0.1:9", env=env)
    assert result.returncode == 125
    assert "Error:" in result.stderr and "127.0.0.1:9" in result.stderr
    assert "orchard up" in result.stderr
    assert "Traceback" not in result.stderr


def test_usage_error_exits_125() -> None:
    result = run_orchard_text("sandbox", "create", "--no-such-flag")
    assert result.returncode == 125
    assert "No such option" in result.stderr


def test_destructive_command_without_tty_demands_yes(tmp_path: Path) -> None:
    result = runner.invoke(app, ["down", "--state-dir", str(tmp_path)], input="")
    assert result.exit_code == 125
    assert "Rerun with --yes" in result.output


def test_cp_needs_exactly_one_remote_side(tmp_path: Path) -> None:
    result = run_orchard_text("sandbox", "cp", "a.txt", "b.txt")
    assert result.returncode == 125
    assert "exactly one side of cp must be SANDBOX:PATH" in result.stderr


def test_context_commands(isolated: Path) -> None:
    contexts.write_context(
        "lab", {"url": "http://lab:8000", "api_key": "sekret", "target": "local"}
    )
    contexts.write_context("prod", {"url": "http://prod:8000"}, make_current=False)
    listed = runner.invoke(app, ["context", "list"])
    assert listed.exit_code == 0 and "lab" in listed.stdout and "prod" in listed.stdout
    shown = runner.invoke(app, ["context", "show"])
    assert '"api_key": "***"' in shown.stdout and "sekret" not in shown.stdout
    assert runner.invoke(app, ["context", "use", "prod"]).exit_code == 0
    assert contexts.load_config_file()["current_context"] == "prod"
    missing = run_orchard_text("context", "use", "nope", env={"ORCHARD_CONFIG": str(isolated)})
    assert missing.returncode == 125 and "no context named 'nope'" in missing.stderr


def test_status_of_a_service_that_never_ran(tmp_path: Path) -> None:
    result = runner.invoke(app, ["status", "--state-dir", str(tmp_path), "--json"])
    assert result.exit_code == 3
    assert '"running": false' in result.stdout


def test_unknown_target_is_refused(tmp_path: Path) -> None:
    result = run_orchard_text("up", "--target", "mars", "--state-dir", str(tmp_path))
    assert result.returncode == 125
    assert "unknown target 'mars'" in result.stderr


def test_create_echoes_the_quantities_as_the_service_reads_them() -> None:
    result = run_orchard_text(
        "sandbox", "create", "--memory", "8G", "--cpu", "500m", "--url", "http://127.0.0.1:9"
    )
    assert result.returncode == 125  # nothing listens there; the echo came first
    assert "memory 8G = 7.45 GiB" in result.stderr
    assert "cpu 500m = 0.5 cores" in result.stderr
    small = run_orchard_text("sandbox", "create", "--memory", "8192", "--url", "http://127.0.0.1:9")
    assert "memory 8192 = 8.00 KiB" in small.stderr


def _modules_after(*argv: str) -> set[str]:
    """The modules loaded by running `orchard ARGV` (the real entry point) in a fresh process."""
    probe = (
        "import sys\n"
        f"sys.argv = ['orchard', *{list(argv)!r}]\n"
        "from orchard_cli.main import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "sys.stderr.write('\\nMODULES ' + ' '.join(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    return set(done.stderr.rsplit("MODULES ", 1)[1].split())


def test_version_loads_no_parser_no_sdk() -> None:
    loaded = _modules_after("--version")
    assert not {"typer", "rich", "pydantic", "httpx", "orchard_env.sdk"} & loaded


def test_a_sandbox_command_loads_only_its_own_group() -> None:
    loaded = _modules_after("sandbox", "list", "--url", "http://127.0.0.1:9")
    assert "orchard_cli.sandbox" in loaded and "orchard_env.sdk.client" in loaded
    unneeded = {
        "orchard_cli.cost",
        "orchard_cli.bench",
        "orchard_cli.service",
        "orchard_cli.images",
        "orchard_env.cost",
        "orchard_env.bench",
        "orchard_env.sdk.aio",
        "orchard_env.sdk.pty",
        "websockets",
        "provision",
        "kubernetes",
        "docker",
    }
    assert unneeded & loaded == set()


def test_bench_startup_reports_ratios_to_a_bare_interpreter() -> None:
    from orchard_env.bench_startup import BARE, bench_startup
    from orchard_env.errors import OrchardError

    result = bench_startup({"sleep": [sys.executable, "-c", "import time; time.sleep(0.2)"]}, n=3)
    assert set(result.stats) == {BARE, "sleep"} and result.stats["sleep"].n == 3
    assert result.figures["sleep: p50 / bare p50"] > 0
    with pytest.raises(OrchardError, match=r"`fails` exited 3"):
        bench_startup({"fails": [sys.executable, "-c", "raise SystemExit(3)"]}, n=1)


def test_a_cluster_context_is_never_taken_for_the_local_service(isolated: Path) -> None:
    contexts.write_context("demo", {"url": "https://demo:443", "api_key": "k", "target": "aks"})
    env = {"ORCHARD_CONFIG": str(isolated), "PATH": "/usr/bin:/bin"}
    for command in (["status"], ["down", "--yes"]):
        done = run_orchard_text(*command, "--context", "demo", env=env)
        assert done.returncode == 125
        assert "context 'demo' is a deployment on aks and no profile says which" in done.stderr
    local = run_orchard_text("down", "--context", "demo", "--target", "local", "--yes", env=env)
    assert local.returncode == 125
    assert "context 'demo' (from --context) is a deployment on aks, not local" in local.stderr
    assert "demo" in contexts.load_config_file()["contexts"]  # nothing removed


def test_client_commands_take_the_flag_over_orchard_context(isolated: Path) -> None:
    contexts.write_context("a", {"url": "http://127.0.0.1:9"})
    contexts.write_context("b", {"url": "http://127.0.0.1:7"})
    env = {"ORCHARD_CONFIG": str(isolated), "PATH": "/usr/bin:/bin", "ORCHARD_CONTEXT": "a"}
    from_env = run_orchard_text("sandbox", "list", env=env)
    assert from_env.returncode == 125 and "127.0.0.1:9" in from_env.stderr
    from_flag = run_orchard_text("sandbox", "list", "--context", "b", env=env)
    assert from_flag.returncode == 125 and "127.0.0.1:7" in from_flag.stderr
    unknown = run_orchard_text("sandbox", "list", env={**env, "ORCHARD_CONTEXT": "zz"})
    assert "context 'zz' (from ORCHARD_CONTEXT) is not in" in unknown.stderr


def test_keys_create_local_with_a_quota(isolated: Path, tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    quota = ["--max-sandboxes", "2", "--max-cpu", "1.5", "--max-memory", "8Gi"]
    created = runner.invoke(
        app, ["keys", "create", "tenant", "--local", "--state-dir", state, *quota, "--json"]
    )
    assert created.exit_code == 0, created.output
    shown = json.loads(created.stdout)
    assert (shown["max_sandboxes"], shown["max_cpu"], shown["max_memory"]) == (2, 1.5, "8Gi")
    env = {"ORCHARD_CONFIG": str(isolated), "PATH": "/usr/bin:/bin"}
    bad = run_orchard_text(
        "keys", "create", "x", "--local", "--state-dir", state, "--max-memory", "lots", env=env
    )
    assert bad.returncode == 125 and "Traceback" not in bad.stderr
    assert "Error: max_memory: memory 'lots' is not a quantity" in bad.stderr
