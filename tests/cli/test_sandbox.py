"""`orchard sandbox cp | exec | patch` as a user runs them (the real entry point in a
subprocess) against a live orchestrator: docker cp's rules, exit codes, Ctrl-C."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from orchard_env.sdk import SandboxClient
from tests.cli.conftest import run_orchard
from tests.servers import Live

ENTRY = (sys.executable, "-c", "from orchard_cli.main import main; main()")


@pytest.fixture
def sandbox_id(live: Live) -> str:
    with SandboxClient(base_url=live.url, api_key=live.api_key, auto_cleanup=False) as client:
        return client.create_sandbox("any").sandbox_id


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(root)): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "proj"
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "README").write_bytes(b"read me\n")
    (root / "src" / "pkg" / "mod.py").write_bytes(b"x = 1\n")
    (root / "src" / "blob.bin").write_bytes(bytes(range(256)) * 64)
    return root


def ok(done: subprocess.CompletedProcess[bytes]) -> subprocess.CompletedProcess[bytes]:
    assert done.returncode == 0, done.stderr.decode()
    return done


def test_directories_copy_recursively_both_ways(
    sandbox_id: str, project: Path, tmp_path: Path
) -> None:
    ok(
        run_orchard("sandbox", "cp", str(project), f"{sandbox_id}:copy")
    )  # does not exist: becomes it
    back = tmp_path / "back"
    done = ok(run_orchard("sandbox", "cp", f"{sandbox_id}:copy", str(back)))
    assert _tree(back) == _tree(project)
    assert b"Copied 3 file(s)" in done.stderr
    # onto an existing directory: lands inside under its own name
    ok(run_orchard("sandbox", "cp", str(project), f"{sandbox_id}:copy"))
    nested = tmp_path / "nested"
    nested.mkdir()
    ok(run_orchard("sandbox", "cp", f"{sandbox_id}:copy/proj", str(nested)))
    assert _tree(nested / "proj") == _tree(project)
    # SRC/. copies the contents
    contents = tmp_path / "contents"
    contents.mkdir()
    ok(run_orchard("sandbox", "cp", f"{sandbox_id}:copy/.", str(contents)))
    assert set(_tree(contents)) == set(_tree(project)) | {f"proj/{n}" for n in _tree(project)}
    # `.` is the working directory: its contents, into a new directory or as a tar stream
    ok(run_orchard("sandbox", "cp", f"{sandbox_id}:.", str(tmp_path / "workdir")))
    assert _tree(tmp_path / "workdir") == {f"copy/{n}": b for n, b in _tree(contents).items()}
    done = ok(run_orchard("sandbox", "cp", f"{sandbox_id}:.", "-"))
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as archive:
        names = archive.getnames()
    assert "./copy/README" in names and "./copy/proj/src/pkg/mod.py" in names


def test_files_follow_trailing_slash_and_existing_directory_rules(
    sandbox_id: str, project: Path, tmp_path: Path
) -> None:
    readme = str(project / "README")
    ok(run_orchard("sandbox", "cp", str(project / "src"), f"{sandbox_id}:dir"))
    ok(run_orchard("sandbox", "cp", readme, f"{sandbox_id}:dir/"))  # inside, own name
    ok(run_orchard("sandbox", "cp", readme, f"{sandbox_id}:dir/renamed.txt"))  # that path
    out = tmp_path / "out"
    ok(run_orchard("sandbox", "cp", f"{sandbox_id}:dir", str(out)))
    assert (out / "README").read_bytes() == (out / "renamed.txt").read_bytes() == b"read me\n"
    missing_dir = run_orchard("sandbox", "cp", readme, f"{sandbox_id}:nowhere/")
    assert missing_dir.returncode == 125
    assert b"nowhere/ does not exist in sandbox" in missing_dir.stderr


def test_a_missing_local_file_says_it_is_missing(sandbox_id: str, tmp_path: Path) -> None:
    gone = tmp_path / "gone.txt"
    done = run_orchard("sandbox", "cp", str(gone), f"{sandbox_id}:x")
    assert done.returncode == 125
    assert f"Error: {gone} does not exist".encode() in done.stderr
    assert b"Traceback" not in done.stderr


def test_dash_is_a_tar_stream_both_ways(sandbox_id: str, project: Path, tmp_path: Path) -> None:
    packed = io.BytesIO()
    with tarfile.open(fileobj=packed, mode="w") as archive:
        archive.add(project, arcname="proj")
    ok(run_orchard("sandbox", "exec", sandbox_id, "--", "mkdir in"))
    ok(run_orchard("sandbox", "cp", "-", f"{sandbox_id}:in", stdin=packed.getvalue()))
    done = ok(run_orchard("sandbox", "cp", f"{sandbox_id}:in/proj", "-"))
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as archive:
        archive.extractall(tmp_path / "untarred", filter="data")
    assert _tree(tmp_path / "untarred" / "proj") == _tree(project)
    not_tar = run_orchard("sandbox", "cp", "-", f"{sandbox_id}:in", stdin=b"plain text")
    assert not_tar.returncode == 125 and b"is not a tar archive" in not_tar.stderr


def test_a_missing_patch_file_is_one_line_not_a_traceback(sandbox_id: str, tmp_path: Path) -> None:
    done = run_orchard("sandbox", "patch", sandbox_id, str(tmp_path / "fix.diff"))
    assert done.returncode == 125
    assert (
        done.stderr.decode().splitlines()[0]
        == f"Error: patch file {tmp_path / 'fix.diff'} does not exist"
    )
    assert b"Traceback" not in done.stderr


def test_exit_codes_pass_through_and_signals_are_128_plus_n(sandbox_id: str) -> None:
    assert run_orchard("sandbox", "exec", sandbox_id, "--", "exit 7").returncode == 7
    killed = run_orchard("sandbox", "exec", sandbox_id, "--", "kill -9 $$")
    assert killed.returncode == 137
    unknown = run_orchard("sandbox", "exec", "sb-nope", "--", "true")
    assert unknown.returncode == 125 and b"Error:" in unknown.stderr


@pytest.mark.parametrize("detach", [False, True])
def test_ctrl_c_cancels_the_remote_command_unless_detached(
    live: Live, sandbox_id: str, detach: bool
) -> None:
    flags = ["--detach-on-interrupt"] if detach else []
    process = subprocess.Popen(
        [*ENTRY, "sandbox", "exec", sandbox_id, *flags, "--", "echo started; sleep 120"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ),
    )
    assert process.stdout is not None
    assert process.stdout.readline() == b"started\n"  # the command runs: interrupt it
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    with SandboxClient(base_url=live.url, api_key=live.api_key, auto_cleanup=False) as client:
        (job,) = client.get_sandbox(sandbox_id).list_jobs()
        assert job.job_id.encode() in stderr
        if detach:
            assert b"keeps running. Re-attach with:" in stderr and b"--job-id" in stderr
            assert not job.is_complete
            client.cancel_job(job.job_id)
        else:
            assert b"was cancelled in the sandbox" in stderr
            assert client.wait_job(job.job_id, timeout=30).is_complete


def test_list_output_formats_like_kubectl(sandbox_id: str) -> None:
    labels = [f"k{i}={'v' * 60}" for i in range(3)]
    long_label = ",".join(labels)  # 200 characters: wider than any terminal default
    ok(run_orchard("sandbox", "create", *(f"--label={label}" for label in labels)))
    table = ok(run_orchard("sandbox", "list")).stdout.decode().splitlines()
    headers = ["ID", "STATUS", "IMAGE", "CPU", "MEMORY", "NETWORK", "LABELS", "CREATED"]
    assert table[0].split() == headers  # every column, though stdout is a pipe
    assert any(long_label in line for line in table[1:])  # never truncated or wrapped
    assert len(table) == 3
    wide = ok(run_orchard("sandbox", "list", "-o", "wide")).stdout.decode().splitlines()
    assert wide[0].split()[: len(headers)] == headers and "EXPIRES" in wide[0]
    ids = ok(run_orchard("sandbox", "list", "-q")).stdout.decode().split()
    assert sandbox_id in ids and len(ids) == 2
    names = ok(run_orchard("sandbox", "list", "-o", "name")).stdout.decode().split()
    assert sorted(names) == sorted(f"sandbox/{i}" for i in ids)
    as_json = json.loads(ok(run_orchard("sandbox", "list", "-o", "json")).stdout)
    assert as_json == json.loads(ok(run_orchard("sandbox", "list", "--json")).stdout)
    as_yaml = yaml.safe_load(ok(run_orchard("sandbox", "list", "-o", "yaml")).stdout)
    assert as_yaml == as_json
    got = ok(run_orchard("sandbox", "get", sandbox_id, "-o", "name")).stdout
    assert got == f"sandbox/{sandbox_id}\n".encode()
    bad = run_orchard("sandbox", "list", "-o", "xml")
    assert bad.returncode == 125 and b"unknown output format 'xml'" in bad.stderr
    both = run_orchard("sandbox", "list", "--json", "-q")
    assert both.returncode == 125 and b"choose one output format" in both.stderr


COLOUR = re.compile(rb"\x1b\[(?:[0-9]+;)*(?:3[0-8]|9[0-7])[;m]")  # an SGR foreground colour


def test_no_color_is_respected(live: Live) -> None:
    env = {**os.environ, "FORCE_COLOR": "1"}
    args = [*ENTRY, "sandbox", "get", "sb-nope"]
    colored = subprocess.run(args, capture_output=True, env=env, check=False, timeout=60)
    assert COLOUR.search(colored.stderr)  # a terminal would get colours...
    plain = subprocess.run(
        args, capture_output=True, env={**env, "NO_COLOR": "1"}, check=False, timeout=60
    )
    assert plain.returncode == 125 and not COLOUR.search(plain.stderr)  # ...unless NO_COLOR


def _complete(words: str) -> list[str]:
    env = {
        **os.environ,
        "_ORCHARD_COMPLETE": "complete_bash",
        "COMP_WORDS": words,
        "COMP_CWORD": str(len(words.split(" ")) - 1),
    }
    done = subprocess.run(
        [*ENTRY], capture_output=True, env=env, check=False, timeout=60, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_tab_completes_sandbox_and_snapshot_ids(live: Live, sandbox_id: str) -> None:
    with SandboxClient(base_url=live.url, api_key=live.api_key, auto_cleanup=False) as client:
        snap = client.get_sandbox(sandbox_id).snapshot().snapshot_id
    assert _complete("orchard sandbox exec ") == [sandbox_id]
    assert _complete(f"orchard sandbox get {sandbox_id[:5]}") == [sandbox_id]
    assert _complete("orchard sandbox get nomatch") == []
    assert _complete("orchard snapshot get ") == [snap]
    assert _complete("orchard snapshot create ") == [sandbox_id]
