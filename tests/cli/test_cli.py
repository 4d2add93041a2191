"""The CLI's boundary: help, exit codes, messages, stdout vs stderr. No service needed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchard_cli.main import app
from orchard_env import __version__, config

runner = CliRunner()


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    path = tmp_path / "config.toml"
    monkeypatch.setenv("ORCHARD_CONFIG", str(path))
    for name in ("ORCHARD_URL", "ORCHARD_API_KEY", "ORCHARD_CONTEXT", "SANDBOX_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    return path


def _main(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real entry point in a subprocess (the error boundary lives in main())."""
    return subprocess.run(
        [sys.executable, "-c", "from orchard_cli.main import main; main()", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


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
    result = _main("sandbox", "create", "--label", "novalue", env=env)
    assert result.returncode == 1
    assert result.stdout == ""
    assert "Error: label 'novalue' is not KEY=VALUE" in result.stderr
    assert "Hint: for example --label team=rl" in result.stderr
    assert "Traceback" not in result.stderr


def test_unreachable_service_is_one_clear_error(isolated: Path) -> None:
    env = {"ORCHARD_CONFIG": str(isolated), "PATH": "/usr/bin:/bin"}
    result = _main("sandbox", "list", "--url", "http://127.0.0.1:9", env=env)
    assert result.returncode == 1
    assert "Error:" in result.stderr and "127.0.0.1:9" in result.stderr
    assert "orchard up" in result.stderr
    assert "Traceback" not in result.stderr


def test_usage_error_exits_2() -> None:
    result = _main("sandbox", "create", "--no-such-flag")
    assert result.returncode == 2
    assert "No such option" in result.stderr


def test_destructive_command_without_tty_demands_yes(tmp_path: Path) -> None:
    result = runner.invoke(app, ["down", "--state-dir", str(tmp_path)], input="")
    assert result.exit_code == 2
    assert "Rerun with --yes" in result.output


def test_cp_needs_exactly_one_remote_side(tmp_path: Path) -> None:
    result = _main("sandbox", "cp", "a.txt", "b.txt")
    assert result.returncode == 1
    assert "exactly one side of cp must be SANDBOX:PATH" in result.stderr


def test_context_commands(isolated: Path) -> None:
    config.write_context("lab", {"url": "http://lab:8000", "api_key": "sekret", "target": "local"})
    config.write_context("prod", {"url": "http://prod:8000"}, make_current=False)
    listed = runner.invoke(app, ["context", "list"])
    assert listed.exit_code == 0 and "lab" in listed.stdout and "prod" in listed.stdout
    shown = runner.invoke(app, ["context", "show"])
    assert '"api_key": "***"' in shown.stdout and "sekret" not in shown.stdout
    assert runner.invoke(app, ["context", "use", "prod"]).exit_code == 0
    assert config.load_config_file()["current_context"] == "prod"
    missing = _main("context", "use", "nope", env={"ORCHARD_CONFIG": str(isolated)})
    assert missing.returncode == 1 and "no context named 'nope'" in missing.stderr


def test_status_of_a_service_that_never_ran(tmp_path: Path) -> None:
    result = runner.invoke(app, ["status", "--state-dir", str(tmp_path), "--json"])
    assert result.exit_code == 3
    assert '"running": false' in result.stdout


def test_unknown_target_is_refused(tmp_path: Path) -> None:
    result = _main("up", "--target", "mars", "--state-dir", str(tmp_path))
    assert result.returncode == 1
    assert "unknown target 'mars'" in result.stderr


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
    bad = _main(
        "keys", "create", "x", "--local", "--state-dir", state, "--max-memory", "lots", env=env
    )
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert "Error: max_memory: memory 'lots' is not a quantity" in bad.stderr
