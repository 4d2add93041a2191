"""`orchard sandbox …`: create, list, get, exec, shell, cp, ls, patch, fork, rm."""

from __future__ import annotations

import contextlib
import shlex
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from orchard_cli.console import (
    CLI_ERROR,
    ApiKeyOpt,
    ContextOpt,
    CpuOpt,
    JsonOpt,
    MemoryOpt,
    OutputOpt,
    QuietOpt,
    UrlOpt,
    YesOpt,
    complete_sandbox_ids,
    confirm,
    connect,
    err,
    out,
)
from orchard_cli.listing import MAX_CHUNK_SIZE, emit_sandboxes
from orchard_cli.output import (
    Column,
    emit_list,
    emit_one,
    encode,
    output_format,
    parse_pairs,
    print_json,
    when,
)
from orchard_env.errors import InvalidRequest, JobNotFound
from orchard_env.smoke import DEFAULT_IMAGE

if TYPE_CHECKING:
    from orchard_env.protocol import FileEntry
    from orchard_env.sdk import SandboxClient

app = typer.Typer(help="Create, drive and delete sandboxes.", no_args_is_help=True)

IdArg = Annotated[
    str,
    typer.Argument(help="Sandbox id.", show_default=False, autocompletion=complete_sandbox_ids),
]
LabelOpt = Annotated[
    list[str] | None, typer.Option("--label", "-l", help="Label KEY=VALUE (repeatable).")
]
EnvOpt = Annotated[
    list[str] | None, typer.Option("--env", "-e", help="Variable KEY=VALUE (repeatable).")
]


FILE_COLUMNS: tuple[Column[FileEntry], ...] = (
    Column("TYPE", lambda entry: entry.type),
    Column("SIZE", lambda entry: str(entry.size)),
    Column("MODIFIED", lambda entry: when(entry.modified)),
    Column("NAME", lambda entry: entry.name),
)


def _tools_choice(text: str | None) -> bool | list[str] | None:
    """--tools: all, none or a comma-separated list (the service checks the names)."""
    if text is None or text.strip().lower() == "all":
        return None
    if text.strip().lower() in ("none", "false", "off"):
        return False
    return [name.strip() for name in text.split(",") if name.strip()]


@app.command()
def create(
    image: Annotated[str, typer.Option("--image", "-i", help="Container image.")] = DEFAULT_IMAGE,
    sandbox_id: Annotated[str | None, typer.Option("--id", help="Sandbox id (DNS label).")] = None,
    cpu: CpuOpt = None,
    memory: MemoryOpt = None,
    network: Annotated[
        bool, typer.Option("--network/--no-network", help="Allow outbound network.")
    ] = False,
    label: LabelOpt = None,
    env: EnvOpt = None,
    workdir: Annotated[str | None, typer.Option("--workdir", help="Working directory.")] = None,
    ttl: Annotated[int | None, typer.Option("--ttl", help="Lifetime cap in seconds.")] = None,
    idle_timeout: Annotated[
        int | None, typer.Option("--idle-timeout", help="Idle expiry in seconds.")
    ] = None,
    tools: Annotated[
        str | None,
        typer.Option(
            "--tools",
            help="Agent harnesses at /opt/sandbox-tools: all (default), none, or a list "
            "such as codex,pi.",
            show_default=False,
        ),
    ] = None,
    json_: JsonOpt = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """Create a sandbox, wait until it is ready and print its id.

    Quantities are Kubernetes': --memory 8G is 8x10^9 bytes (7.45 GiB), 8Gi is 8 GiB;
    --cpu 500m is half a core. The parsed values are echoed on stderr.
    """
    labels, variables = parse_pairs(label, "label"), parse_pairs(env, "env")
    for line in _quantities(cpu, memory):
        err.print(line)
    with connect(url, api_key, context) as client, err.status(f"creating a sandbox from {image}"):
        sb = client.create_sandbox(
            image,
            block_network=not network,
            sandbox_id=sandbox_id,
            cpu=cpu,
            memory=memory,
            labels=labels,
            env=variables,
            workdir=workdir,
            ttl_seconds=ttl,
            idle_timeout_seconds=idle_timeout,
            tools=_tools_choice(tools),
        )
    if json_:
        print_json(sb.info)
    else:
        out.print(sb.sandbox_id)


def _binary(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size} bytes"


def _quantities(cpu: str | None, memory: str | None) -> list[str]:
    """What the quantities mean, as the service will read them (``memory 8G = 7.45 GiB``);
    a value that does not parse is left to the service's 400, which names the field."""
    from orchard_env.quantities import parse_cpu, parse_memory

    lines = []
    with contextlib.suppress(ValueError):
        if memory is not None:
            lines.append(f"memory {memory} = {_binary(parse_memory(memory))}")
    with contextlib.suppress(ValueError):
        if cpu is not None:
            cores = parse_cpu(cpu)
            lines.append(f"cpu {cpu} = {cores:g} core{'' if cores == 1 else 's'}")
    return lines


@app.command("list")
def list_(
    label: LabelOpt = None,
    status: Annotated[str | None, typer.Option("--status", help="Only this status.")] = None,
    chunk_size: Annotated[
        int,
        typer.Option(
            "--chunk-size",
            min=1,
            max=MAX_CHUNK_SIZE,
            help="Sandboxes fetched per request (as kubectl).",
        ),
    ] = 500,
    output: OutputOpt = None,
    quiet: QuietOpt = False,
    json_: JsonOpt = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """List sandboxes, newest first, filtered by label and status."""
    fmt = output_format(output, json_=json_, quiet=quiet)
    with connect(url, api_key, context) as client:
        sandboxes = client.list_sandboxes(
            labels=parse_pairs(label, "label") or None, status=status, chunk_size=chunk_size
        )
    emit_sandboxes(encode(sandboxes), fmt)


@app.command()
def get(
    sandbox_id: IdArg,
    output: OutputOpt = None,
    json_: JsonOpt = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """Show one sandbox."""
    fmt = output_format(output, json_=json_)
    with connect(url, api_key, context) as client:
        info = client.get_sandbox(sandbox_id).info
    emit_one(info, fmt, kind="sandbox", key=info.sandbox_id)


@app.command("exec")
def exec_(
    sandbox_id: IdArg,
    command: Annotated[
        list[str],
        typer.Argument(
            help="After --: one string runs in bash -c (else sh -c); several words run as argv.",
            show_default=False,
        ),
    ],
    cwd: Annotated[str | None, typer.Option("--cwd", "-w", help="Working directory.")] = None,
    env: EnvOpt = None,
    timeout: Annotated[
        int, typer.Option("--timeout", "-t", help="Seconds before the command is killed.")
    ] = 300,
    login: Annotated[bool, typer.Option("--login", help="Run in a login shell.")] = False,
    stdin: Annotated[
        bool,
        typer.Option("--stdin", "-s", help="Send this command's standard input to the command."),
    ] = False,
    job_id: Annotated[
        str | None,
        typer.Option(
            "--job-id",
            help="Job id. Given the id of a job still known, with the same command, exec "
            "re-attaches to it and replays its output instead of starting it again.",
            show_default=False,
        ),
    ] = None,
    detach_on_interrupt: Annotated[
        bool,
        typer.Option(
            "--detach-on-interrupt",
            help="On Ctrl-C keep the command running (and say how to re-attach) instead of "
            "cancelling it.",
        ),
    ] = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """Run a command, stream its output, and exit with its exit code: 124 on timeout, 128+n
    when a signal n killed it (137 for SIGKILL), 125 for an error of orchard itself.

    Ctrl-C cancels the command in the sandbox (exit 130) and prints its job id;
    --detach-on-interrupt leaves it running instead.
    """
    argv: str | list[str] = command[0] if len(command) == 1 else command
    data = sys.stdin.buffer.read() if stdin else None
    job_id = job_id or uuid.uuid4().hex  # known before it starts: an interrupt can cancel it
    with connect(url, api_key, context) as client:
        sandbox = client.get_sandbox(sandbox_id)
        final = None
        events = sandbox.exec_stream(
            argv,
            cwd=cwd,
            env=parse_pairs(env, "env"),
            timeout=timeout,
            login_shell=login,
            stdin=data,
            shell=isinstance(argv, str),  # several words: an exact argv, as docker exec runs it
            job_id=job_id,
            cancel_on_interrupt=False,  # below: an interrupt between events counts too
        )
        try:
            for event in events:
                if event.event == "stdout" and event.data:
                    sys.stdout.write(event.data)
                    sys.stdout.flush()
                elif event.event == "stderr" and event.data:
                    sys.stderr.write(event.data)
                    sys.stderr.flush()
                elif event.event == "exit":
                    final = event.job
        except KeyboardInterrupt:
            if detach_on_interrupt:
                _detached(sandbox_id, job_id, command)
            else:
                _cancel_interrupted(client, job_id)
            raise typer.Exit(130) from None
    if final is None:
        err.print("[red]The output stream ended without an exit status.[/]")
        raise typer.Exit(CLI_ERROR)
    if final.truncated:
        err.print("[yellow]Output was truncated at the service's cap.[/]")
    if final.timed_out:
        err.print(f"[red]Timed out after {timeout} s.[/]")
        raise typer.Exit(124)
    if final.error:
        err.print(f"[red]{escape(final.error)}[/]")
    raise typer.Exit(exit_status(final.exit_code))


def exit_status(code: int | None) -> int:
    """A remote exit code as a shell reports it: -n (killed by signal n) is 128+n."""
    if code is None:
        return CLI_ERROR
    return 128 - code if code < 0 else code


def _detached(sandbox_id: str, job_id: str, command: list[str]) -> None:
    again = shlex.join(["orchard", "sandbox", "exec", sandbox_id, "--job-id", job_id, "--"])
    err.print(
        f"Detached: job {job_id} keeps running. Re-attach with:\n  {again} {shlex.join(command)}"
    )


def _cancel_interrupted(client: SandboxClient, job_id: str) -> None:
    """Cancel the interrupted command and say what became of it."""
    try:
        job = client.cancel_job(job_id)
    except JobNotFound:
        err.print("Interrupted before the command started.")
        return
    if job.cancelled:
        err.print(
            f"Interrupted: job {job_id} was cancelled in the sandbox "
            "(--detach-on-interrupt keeps a command running instead)."
        )
    elif job.is_complete:
        err.print(f"Interrupted: job {job_id} had already ended ({job.status.value}).")
    else:
        err.print(f"Interrupted: job {job_id} was told to stop, but it was still running.")


@app.command()
def shell(
    sandbox_id: IdArg,
    cmd: Annotated[
        list[str] | None, typer.Argument(help="Program to run (default: bash, else sh).")
    ] = None,
    login: Annotated[bool, typer.Option("--login/--no-login", help="Login shell.")] = True,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """Open an interactive terminal in a sandbox."""
    from orchard_cli.terminal import run_interactive

    with connect(url, api_key, context) as client:
        code = run_interactive(client.get_sandbox(sandbox_id), cmd, login_shell=login)
    raise typer.Exit(exit_status(code))


def _read_local(path: Path, what: str) -> str:
    if not path.exists():
        raise InvalidRequest(f"{what} {path} does not exist", hint="check the path")
    if path.is_dir():
        raise InvalidRequest(f"{what} {path} is a directory", hint="give a file")
    return path.read_text()


def _split_remote(spec: str) -> tuple[str | None, str]:
    sandbox_id, sep, path = spec.partition(":")
    if sep and sandbox_id and "/" not in sandbox_id:
        return sandbox_id, path
    return None, spec


@app.command()
def cp(
    source: Annotated[
        str, typer.Argument(help="LOCAL_PATH, SANDBOX:PATH, or '-' (a tar stream on stdin).")
    ],
    dest: Annotated[
        str, typer.Argument(help="LOCAL_PATH, SANDBOX:PATH, or '-' (a tar stream on stdout).")
    ],
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """Copy files or directories into or out of a sandbox, like `docker cp`.

    Directories are copied recursively. A destination that ends in / or is an existing
    directory receives the source under its own name; SRC/. copies a directory's contents,
    and ID:. the contents of the sandbox's working directory.
    '-' as the source reads a tar archive from stdin and extracts it into a sandbox
    directory; '-' as the destination writes the sandbox path to stdout as a tar archive.
    Symlinks and special files are skipped (and named).
    """
    from orchard_env.sdk import copy

    src_id, src_path = _split_remote(source)
    dst_id, dst_path = _split_remote(dest)
    if (src_id is None) == (dst_id is None):
        raise InvalidRequest(
            "exactly one side of cp must be SANDBOX:PATH",
            hint="orchard sandbox cp ./file.py sb-123:/workspace/file.py",
        )
    with connect(url, api_key, context) as client:
        if dst_id is not None:
            sandbox = client.get_sandbox(dst_id)
            if src_path == "-":
                report = copy.tar_in(sandbox, sys.stdin.buffer, dst_path)
            else:
                report = copy.copy_in(sandbox, src_path, dst_path)
            where = f"{dst_id}:{dst_path}"
        else:
            assert src_id is not None
            sandbox = client.get_sandbox(src_id)
            if dst_path == "-":
                report = copy.tar_out(sandbox, src_path, sys.stdout.buffer)
                sys.stdout.buffer.flush()
            else:
                report = copy.copy_out(sandbox, src_path, dst_path)
            where = "stdout" if dst_path == "-" else dst_path
    for path in report.skipped:
        err.print(f"[yellow]skipped[/] {escape(path)} (not a regular file or directory)")
    err.print(f"Copied {report.files} file(s), {report.bytes} bytes, to {escape(where)}.")


@app.command()
def ls(
    sandbox_id: IdArg,
    path: Annotated[str, typer.Argument(help="Directory in the sandbox.")] = "/workspace",
    output: OutputOpt = None,
    quiet: QuietOpt = False,
    json_: JsonOpt = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """List a directory in a sandbox (-q: names only)."""
    fmt = output_format(output, json_=json_, quiet=quiet)
    with connect(url, api_key, context) as client:
        entries = client.get_sandbox(sandbox_id).list_files(path)
    emit_list(entries, FILE_COLUMNS, fmt, kind="file", key=lambda entry: entry.name)


@app.command()
def patch(
    sandbox_id: IdArg,
    patch_file: Annotated[str, typer.Argument(help="Unified diff file, or '-' for stdin.")],
    cwd: Annotated[str | None, typer.Option("--cwd", help="Directory to apply in.")] = None,
    check: Annotated[bool, typer.Option("--check", help="Only check that it applies.")] = False,
    three_way: Annotated[
        bool, typer.Option("--3way", help="Fall back to a three-way merge.")
    ] = False,
    reverse: Annotated[bool, typer.Option("--reverse", "-R", help="Apply in reverse.")] = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """Apply a patch with git apply inside the sandbox."""
    text = sys.stdin.read() if patch_file == "-" else _read_local(Path(patch_file), "patch file")
    with connect(url, api_key, context) as client:
        result = client.get_sandbox(sandbox_id).apply_patch(
            text, cwd=cwd, check=check, three_way=three_way, reverse=reverse
        )
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    if not result.success:
        err.print(
            f"[red]Patch failed:[/] {result.error or 'git apply exited ' + str(result.exit_code)}"
        )
        raise typer.Exit(1)


@app.command()
def fork(
    sandbox_id: IdArg,
    count: Annotated[
        int, typer.Option("--count", "-k", help="How many copies (1-64).", min=1, max=64)
    ] = 1,
    label: LabelOpt = None,
    allow_partial: Annotated[
        bool,
        typer.Option(
            "--allow-partial", help="Keep the forks that started when others fail (exit 1)."
        ),
    ] = False,
    json_: JsonOpt = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """Start copies of a sandbox at once; print their ids when all are ready.

    One snapshot of its filesystem (not its processes), restored --count times
    concurrently: each copy has its files, resources, env and labels (plus --label).
    """
    with connect(url, api_key, context) as client, err.status(f"forking {sandbox_id}"):
        forks = client.get_sandbox(sandbox_id).fork(
            count, labels=parse_pairs(label, "label"), allow_partial=allow_partial
        )
    if json_:
        print_json([sb.info for sb in forks])
    else:
        for sb in forks:
            out.print(sb.sandbox_id)
    if len(forks) < count:
        err.print(
            f"[red]{count - len(forks)} of {count} forks failed[/] (the service log says why)"
        )
        raise typer.Exit(1)


@app.command()
def rm(
    sandbox_ids: Annotated[
        list[str] | None, typer.Argument(help="Sandbox ids.", autocompletion=complete_sandbox_ids)
    ] = None,
    all_: Annotated[
        bool, typer.Option("--all", help="Delete every sandbox matching --label.")
    ] = False,
    label: LabelOpt = None,
    yes: YesOpt = False,
    url: UrlOpt = None,
    api_key: ApiKeyOpt = None,
    context: ContextOpt = None,
) -> None:
    """Delete sandboxes (their containers and directories)."""
    with connect(url, api_key, context) as client:
        ids = list(sandbox_ids or [])
        if all_:
            ids += [
                sb.sandbox_id
                for sb in client.list_sandboxes(labels=parse_pairs(label, "label") or None)
            ]
            where = client.base_url + (f" (context {client.context})" if client.context else "")
            listed = ", ".join(ids) if ids else "none"
            confirm(f"Delete {len(ids)} sandbox(es) at {where}: {listed}?", yes=yes)
        if not ids:
            raise InvalidRequest(
                "no sandbox given", hint="orchard sandbox rm <id>… or --all [--label k=v]"
            )
        for sandbox_id in ids:
            client.delete_sandbox(sandbox_id)
            err.print(f"deleted {sandbox_id}")
