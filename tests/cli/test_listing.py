"""The quick `orchard sandbox list` (orchard_cli.listing): for every option it handles it
prints exactly what the full command prints, against the same live service; everything else
it leaves to the full command, having printed nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import typer.main
from typer._click.core import Context
from typer.testing import Result

from orchard_cli.console import complete_sandbox_ids, complete_snapshot_ids
from orchard_cli.listing import ID_COMMANDS, quick_sandbox_list
from orchard_cli.main import app
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


def _entry_point(
    *args: str, argv: tuple[str, ...] = ("sandbox", "list"), **env: str
) -> subprocess.CompletedProcess[str]:
    """The real entry point, then whether it loaded the command-line framework."""
    script = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('typer' in sys.modules, file=sys.stderr))\n"
        "from orchard_cli.main import main\n"
        f"sys.argv = ['orchard', *{[*argv, *args]!r}]\n"
        "main()\n"
    )
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **env},
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


def test_the_id_commands_are_those_whose_first_argument_completes_ids() -> None:
    completers = {complete_sandbox_ids: "sandboxes", complete_snapshot_ids: "snapshots"}
    root = typer.main.get_command(app)
    context = Context(root)
    found = {}
    for group_name in root.list_commands(context):  # type: ignore[attr-defined]
        group = root.get_command(context, group_name)  # type: ignore[attr-defined]
        for name in getattr(group, "list_commands", lambda _c: [])(context):
            arguments = [
                p
                for p in group.get_command(context, name).params
                if p.param_type_name == "argument"
            ]
            wrapper = getattr(arguments[0], "_custom_shell_complete", None) if arguments else None
            cells = [  # typer wraps the function given as autocompletion= twice
                getattr(c.cell_contents, "__wrapped__", None)
                for c in getattr(wrapper, "__closure__", None) or ()
            ]
            kind = next((completers[c] for c in cells if c in completers), None)
            if kind is not None:
                found[(group_name, name)] = kind
    assert found == ID_COMMANDS


def _tab(words: str, shell: str = "bash") -> subprocess.CompletedProcess[str]:
    return _entry_point(
        argv=(),
        _ORCHARD_COMPLETE=f"complete_{shell}",
        COMP_WORDS=words,
        COMP_CWORD=str(len(words.split()) - (0 if words.endswith(" ") else 1)),
        _TYPER_COMPLETE_ARGS=words,
    )


def test_tab_completes_ids_without_the_framework(listed: Live) -> None:
    with SandboxClient(base_url=listed.url, api_key=listed.api_key, auto_cleanup=False) as client:
        sandbox = client.list_sandboxes()[0]
        snapshot = client.get_sandbox(sandbox.sandbox_id).snapshot()
        ids = sorted(sb.sandbox_id for sb in client.list_sandboxes())
    quick = _tab("orchard sandbox get ")
    assert quick.returncode == 0 and quick.stderr == "False\n"
    assert sorted(quick.stdout.split()) == ids
    prefix = _tab(f"orchard trajectory show {sandbox.sandbox_id[:6]}")
    assert prefix.stderr == "False\n"
    assert sorted(prefix.stdout.split()) == [i for i in ids if i.startswith(sandbox.sandbox_id[:6])]
    snapshots = _tab("orchard snapshot restore snap")
    assert snapshots.stderr == "False\n" and snapshots.stdout.split() == [snapshot.snapshot_id]
    for words, shell in [("orchard sandbox get ", "zsh"), ("orchard sandbox get --url ", "bash")]:
        full = _tab(words, shell)  # another shell or position: Typer's own completion
        assert full.returncode == 0 and full.stderr == "True\n", full.stderr
    assert sandbox.sandbox_id in _tab("orchard sandbox get ", "zsh").stdout
