"""The quick `orchard sandbox list` (orchard_cli.listing): for every option it handles it
prints exactly what the full command prints, against the same live service; everything else
it leaves to the full command, having printed nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest
from typer.testing import Result

from orchard_cli.listing import quick_sandbox_list
from orchard_env.sdk import SandboxClient
from tests.cli.conftest import ok
from tests.servers import Live

HANDLED = [
    [],
    ["-o", "wide"],
    ["-owide"],
    ["--output=name"],
    ["-q"],
    ["--quiet", "-l", "team=a"],
    ["--label=team=a", "--status", "ready"],
    ["-lteam=b", "--label", "team=a"],
    ["--status=deleted"],
    ["--chunk-size", "1", "-o", "wide"],
    ["--chunk-size=2", "-o", "wide", "-o", "name"],
]


@pytest.fixture
def listed(live: Live) -> Live:
    """Three sandboxes, with labels, one deleted."""
    with SandboxClient(base_url=live.url, api_key=live.api_key, auto_cleanup=False) as client:
        client.create_sandbox("any", labels={"team": "a", "run": "1"})
        client.create_sandbox("any", labels={"team": "b"})
        client.create_sandbox("any", labels={"team": "a"}).delete()
    return live


@pytest.mark.parametrize("args", HANDLED, ids=" ".join)
def test_prints_what_the_full_command_prints(
    listed: Live,
    orchard: Callable[..., Result],
    capsys: pytest.CaptureFixture[str],
    args: list[str],
) -> None:
    assert quick_sandbox_list(args)
    quick = capsys.readouterr().out
    full = ok(orchard("sandbox", "list", *args))
    assert quick == full
    assert quick.strip()  # the cases above all list something


@pytest.mark.parametrize(
    "args",
    [
        ["--json"],
        ["-o", "json"],
        ["-o", "yaml"],
        ["-o", "xml"],
        ["-q", "-o", "name"],
        ["--help"],
        ["--bogus"],
        ["extra"],
        ["-l", "no-equals"],
        ["--status"],
        ["--status", "bogus"],
        ["--chunk-size", "0"],
        ["--chunk-size", "ten"],
        ["--context", "nowhere"],
        ["--api-key", "wrong"],
        ["--url", "http://127.0.0.1:1"],
        ["--url", "unix:///run/orchard.sock"],
    ],
    ids=" ".join,
)
def test_leaves_the_rest_to_the_full_command(
    listed: Live, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    assert not quick_sandbox_list(args)
    assert capsys.readouterr() == ("", "")


def test_a_proxy_in_the_environment_is_left_to_the_sdk(
    listed: Live, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:1")
    assert not quick_sandbox_list([])
    assert capsys.readouterr() == ("", "")


def _entry_point(*args: str) -> subprocess.CompletedProcess[str]:
    """The real entry point, then whether it loaded the command-line framework."""
    script = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('typer' in sys.modules, file=sys.stderr))\n"
        "from orchard_cli.main import main\n"
        f"sys.argv = ['orchard', 'sandbox', 'list', *{list(args)!r}]\n"
        "main()\n"
    )
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=dict(os.environ),
    )


def test_the_entry_point_takes_the_quick_path_and_falls_back(listed: Live) -> None:
    quick = _entry_point("-o", "name")
    assert quick.returncode == 0 and quick.stderr == "False\n"
    assert len(quick.stdout.splitlines()) == 2
    full = _entry_point("--json")
    assert full.returncode == 0 and full.stderr == "True\n"
    unreachable = _entry_point("--url", "http://127.0.0.1:1")
    assert unreachable.returncode == 125
    assert "cannot reach the Orchard service at http://127.0.0.1:1" in unreachable.stderr
