"""The relocatable agent bundle: a Python interpreter, its pruned stdlib, every shared library
it needs (the dynamic loader and libc included) and the agent package, in one folder.

Mounted read-only into any sandbox (``BUNDLE_MOUNT``), it runs the agent without touching the
image's own PATH, libc or Python, and without Python or bash in the image at all::

    <mount>/lib/ld-linux-x86-64.so.2 --inhibit-cache --library-path <mount>/lib \\
        <mount>/bin/python3 -I -S <mount>/agent --listen unix:/run/orchard/agent.sock

Layout: ``bin/python3``, ``lib/`` (shared libraries and the loader), ``lib/python3.X/`` (the
stdlib, ``lib-dynload`` inside), ``agent/`` (the :mod:`orchard_env.agent.daemon` package as
``agent/orchard_agent/``, bytecode only, and the entry ``agent/__main__.pyc`` that the
interpreter runs when given the directory: bytecode, because compiling at every start would
cost time and about 3 MB of the agent's resident memory), ``bin/orchard-subreaper`` (the
static first process of every command, from ``subreaper.c``: building a bundle needs a C
compiler and static glibc), ``bundle.json`` (what it was built from).

The interpreter finds its stdlib by itself: it looks for ``lib/python3.X/os.py`` next to its
own ``bin/`` (Python's landmark search), so no ``PYTHONHOME`` or ``LD_LIBRARY_PATH`` is set
and nothing of the bundle can leak into the commands the agent runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

from orchard_env import errors

BUNDLE_MOUNT = "/opt/orchard-agent"
RUN_DIR_MOUNT = "/run/orchard"
SOCKET_NAME = "agent.sock"
DEFAULT_PYTHON = Path("/usr/bin/python3.11")
MIN_PYTHON = (3, 11)
BUNDLE_FORMAT = 5  # bump when the layout or the pruning changes: ensure_bundle rebuilds
DAEMON_SOURCE = Path(__file__).with_name("daemon")  # shipped as the package orchard_agent
DAEMON_PACKAGE = "orchard_agent"
SUBREAPER_SOURCE = Path(__file__).with_name("subreaper.c")
SUBREAPER = "bin/orchard-subreaper"  # in the bundle; the agent is told where (launch_env)
SUBREAPER_ENV = "ORCHARD_AGENT_SUBREAPER"
ENTRY = f"import {DAEMON_PACKAGE}.__main__\n"  # agent/__main__.py: run the package's entry
MANIFEST = "bundle.json"

LOADERS = {"x86_64": "ld-linux-x86-64.so.2", "aarch64": "ld-linux-aarch64.so.1"}
# Stdlib directories (at any depth) the agent never needs.
PRUNE_DIRS = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "tkinter",
        "turtledemo",
        "ensurepip",
        "lib2to3",
        "pydoc_data",
        "distutils",
        "venv",
        "sqlite3",
        "dbm",
        "curses",
        "unittest",
        "site-packages",
        "dist-packages",
        "lib-dynload",  # copied separately, filtered
    }
)
# Extension modules left out: unused by the agent, and most pull in big libraries
# (_ssl/_hashlib: libssl + libcrypto; the agent serves no TLS, and without them hashlib
# uses its builtin implementations, which keeps the agent's idle RSS low).
PRUNE_EXTENSIONS = frozenset(
    {
        "_ssl",
        "_hashlib",
        "_sqlite3",
        "_tkinter",
        "_dbm",
        "_gdbm",
        "readline",
        "_curses",
        "_curses_panel",
        "_ctypes_test",
        "_decimal",
        "_lzma",
        "_bz2",
        "_uuid",
        "_crypt",
        "nis",
        "ossaudiodev",
        "audioop",
        "xxlimited",
        "xxlimited_35",
        "_xxtestfuzz",
        "_xxsubinterpreters",
    }
)
_PROBE = """
import importlib.machinery, json, os, sys, sysconfig
print(json.dumps({
    "version": list(sys.version_info[:2]),
    "full_version": sys.version,
    "stdlib": sysconfig.get_path("stdlib"),
    "dynload": next((p for p in sys.path if p.endswith("lib-dynload")), None),
    "ext_suffixes": importlib.machinery.EXTENSION_SUFFIXES,
}))
"""
# Run by the freshly built bundle as ``python -c _VERIFY <root>``: the agent module loads
# (all its imports), and everything loaded comes from the bundle.
_VERIFY = """
import os, sys
root = sys.argv[1]
sys.path.insert(0, root + "/agent")
import orchard_agent.server
outside = set()
with open("/proc/self/maps") as maps:
    for line in maps:
        path = line.split(None, 5)[-1].strip()
        if ".so" in path and not path.startswith(root + "/"):
            outside.add(path)
for module in list(sys.modules.values()):
    where = getattr(module, "__file__", None)
    if where and not os.path.realpath(where).startswith(root + "/"):
        outside.add(where)
if sys.prefix != root:
    sys.exit(f"the interpreter took {sys.prefix} as its prefix, not {root}")
if outside:
    sys.exit("loaded from outside the bundle: " + ", ".join(sorted(outside)))
"""


def loader_name(machine: str | None = None) -> str:
    """The glibc dynamic loader's file name for a machine (default: this host's)."""
    machine = machine or platform.machine()
    try:
        return LOADERS[machine]
    except KeyError:
        raise errors.NotSupported(
            f"no agent bundle for machine {machine!r} (supported: {', '.join(sorted(LOADERS))})"
        ) from None


def launch_argv(
    mount: str = BUNDLE_MOUNT,
    listen: str = f"unix:{RUN_DIR_MOUNT}/{SOCKET_NAME}",
    machine: str | None = None,
) -> list[str]:
    """The container command that starts the agent from a bundle mounted at ``mount``.

    ``--inhibit-cache`` keeps the image's ``/etc/ld.so.cache`` out of the lookup, and
    ``--library-path`` overrides any ``LD_LIBRARY_PATH`` of the image for the agent only
    (the loader does not change the environment, so commands still get the image's value).
    """
    return [
        f"{mount}/lib/{loader_name(machine)}",
        "--inhibit-cache",
        "--library-path",
        f"{mount}/lib",
        f"{mount}/bin/python3",
        "-I",
        "-S",
        f"{mount}/agent",
        "--listen",
        listen,
    ]


def launch_env(mount: str = BUNDLE_MOUNT) -> dict[str, str]:
    """Environment variables the launcher must add for the agent: where its subreaper is.

    The interpreter finds its stdlib from its own location and the loader gets the library
    path on its command line (see :func:`launch_argv`), so the container environment stays
    exactly the image's plus the sandbox's and this ``ORCHARD_AGENT_*`` setting, which the
    agent never passes on to its commands.
    """
    return {SUBREAPER_ENV: f"{mount}/{SUBREAPER}"}


def find_python(python: Path | None = None) -> Path:
    """The interpreter to bundle: ``python`` if given, else Debian's python3.11, another
    system python3.x (>= 3.11), or the running interpreter."""
    if python is not None:
        if not (python.is_file() and os.access(python, os.X_OK)):
            raise errors.InvalidRequest(f"python {python} is not an executable file")
        return python
    candidates = [DEFAULT_PYTHON]
    for folder in (Path("/usr/bin"), Path("/usr/local/bin")):
        candidates += sorted(folder.glob("python3.[1-9]*"), reverse=True)
    candidates.append(Path(sys.executable))
    for candidate in candidates:
        if candidate.name.endswith("-config") or not candidate.is_file():
            continue
        if _probe(candidate.resolve(), quiet=True) is not None:
            return candidate
    raise errors.OrchardError(
        "no Python >= 3.11 interpreter found to build the agent bundle from",
        hint="install one (apt-get install python3.11) or pass python= to build_bundle()",
    )


class _Interpreter(TypedDict):
    version: list[int]
    full_version: str
    stdlib: str
    dynload: str | None
    ext_suffixes: list[str]


def _probe(python: Path, *, quiet: bool = False) -> _Interpreter | None:
    try:
        out = subprocess.run(
            [str(python), "-I", "-S", "-c", _PROBE],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
            env={},
        ).stdout
        info: _Interpreter = json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        if quiet:
            return None
        raise errors.OrchardError(f"cannot inspect the interpreter {python}: {exc}") from None
    version = info["version"]
    if tuple(version) < MIN_PYTHON:
        if quiet:
            return None
        raise errors.InvalidRequest(
            f"{python} is Python {version}; the agent needs >= {MIN_PYTHON[0]}.{MIN_PYTHON[1]}"
        )
    return info


def _shared_libraries(files: list[Path]) -> tuple[dict[str, Path], Path]:
    """Every library ``ldd`` lists for ``files`` (name -> resolved path), and the loader."""
    ldd = shutil.which("ldd")
    if ldd is None:
        raise errors.OrchardError(
            "ldd is not installed: it is needed to build the agent bundle",
            hint="apt-get install libc-bin",
        )
    result = subprocess.run(
        [ldd, *map(str, files)], capture_output=True, text=True, check=False, timeout=120
    )
    libraries: dict[str, Path] = {}
    loader: Path | None = None
    for raw in result.stdout.splitlines():
        line = raw.strip()
        if "=>" in line:
            name, _, target = line.partition("=>")
            location = target.split(" (", 1)[0].strip()
            if location == "not found":
                raise errors.OrchardError(
                    f"ldd cannot find {name.strip()}, which the agent interpreter needs",
                    hint="install the library, or build from another interpreter (python=)",
                )
            if location.startswith("/"):
                libraries[name.strip()] = Path(location).resolve()
        elif line.startswith("/") and " (" in line:
            candidate = Path(line.split(" (", 1)[0])
            if candidate.name.startswith("ld-"):
                loader = candidate
    if loader is None:
        raise errors.OrchardError(
            f"could not find the dynamic loader in ldd's output for {files[0]}",
            hint="the bundle needs a dynamically linked glibc interpreter",
        )
    return libraries, loader


def _pruner(keep: frozenset[str]) -> Callable[[str, list[str]], set[str]]:
    """The copytree filter: pruned stdlib directories (less ``keep``) and dead links."""
    pruned = PRUNE_DIRS - keep
    return lambda folder, names: _ignore_pruned(folder, names, pruned)


def _ignore_pruned(folder: str, names: list[str], pruned: frozenset[str]) -> set[str]:
    ignored = {name for name in names if name in pruned or name.startswith("config-3")}
    ignored.update(n for n in names if n.endswith((".opt-1.pyc", ".opt-2.pyc", ".exe")))
    # A link out of the stdlib that leads nowhere (Debian's sitecustomize.py points into
    # /etc/python3.11, which the agent never reads: it runs with -I -S).
    ignored.update(n for n in names if not Path(folder, n).exists())
    return ignored


def _extension_name(filename: str, suffixes: list[str]) -> str | None:
    for suffix in suffixes:
        if filename.endswith(suffix):
            return filename[: -len(suffix)]
    return None


def _populate(root: Path, python: Path, keep: frozenset[str]) -> None:
    info = _probe(python)
    assert info is not None
    major, minor = info["version"]
    stdlib = Path(info["stdlib"])
    suffixes = info["ext_suffixes"]
    target_stdlib = root / "lib" / f"python{major}.{minor}"

    (root / "bin").mkdir(parents=True)
    shutil.copy2(python, root / "bin" / "python3")
    shutil.copytree(stdlib, target_stdlib, ignore=_pruner(keep), copy_function=shutil.copy2)

    dynload_dir = target_stdlib / "lib-dynload"
    dynload_dir.mkdir()
    extensions = []
    if info["dynload"]:
        for entry in sorted(Path(info["dynload"]).iterdir()):
            name = _extension_name(entry.name, suffixes)
            if name is None or name.startswith("_test"):
                continue
            if name in PRUNE_EXTENSIONS and name not in keep:
                continue
            shutil.copy2(entry, dynload_dir / entry.name)
            extensions.append(dynload_dir / entry.name)

    libraries, loader = _shared_libraries([root / "bin" / "python3", *extensions])
    expected_loader = loader_name()
    if loader.name != expected_loader:
        raise errors.NotSupported(
            f"{python} uses the loader {loader.name}, expected {expected_loader}",
            hint="build the bundle from a glibc interpreter of this machine",
        )
    for name, path in libraries.items():
        shutil.copy2(path, root / "lib" / name)
    shutil.copy2(loader.resolve(), root / "lib" / loader.name)

    _install_daemon(root)
    build_subreaper(root / SUBREAPER)
    (root / MANIFEST).write_text(
        json.dumps(
            {
                "format": BUNDLE_FORMAT,
                "python": str(python),
                "python_version": info["full_version"],
                "machine": platform.machine(),
                "loader": loader.name,
                "daemon_sha256": daemon_digest(),
            },
            indent=2,
        )
        + "\n"
    )
    root.chmod(0o755)  # mkdtemp made it 0700; the agent may run as any user of the image


def daemon_sources() -> list[Path]:
    """The agent package's modules, in a stable order."""
    return sorted(DAEMON_SOURCE.glob("*.py"))


def daemon_digest() -> str:
    """SHA-256 over the agent package's module names and contents, and its subreaper's."""
    digest = hashlib.sha256()
    for source in [*daemon_sources(), SUBREAPER_SOURCE]:
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    return digest.hexdigest()


def build_subreaper(dest: Path) -> Path:
    """Compile ``subreaper.c`` into a static executable at ``dest``: one that runs in any
    image of this machine's architecture, whatever its libc."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise errors.NotSupported(
            "building the agent bundle needs a C compiler for its subreaper, and none is on PATH",
            hint="apt-get install gcc libc6-dev (make host installs them)",
        )
    result = subprocess.run(
        [compiler, "-O2", "-static", "-s", "-o", str(dest), str(SUBREAPER_SOURCE)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    if result.returncode != 0:
        raise errors.OrchardError(
            f"compiling {SUBREAPER_SOURCE} with {compiler} failed: {result.stderr.strip()[-2000:]}",
            hint="install gcc and libc6-dev (static glibc), e.g. with make host",
        )
    return dest


def _install_daemon(root: Path) -> None:
    """Compile the agent package into ``agent/orchard_agent/`` (bytecode beside where each
    source would be, which the interpreter imports without the source) and the entry."""
    package = root / "agent" / DAEMON_PACKAGE
    package.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        sources = [(source, package / f"{source.stem}.pyc") for source in daemon_sources()]
        entry = Path(tmp) / "__main__.py"
        entry.write_text(ENTRY)
        sources.append((entry, root / "agent" / "__main__.pyc"))
        _run_bundled(
            root,
            "import py_compile, sys\n"
            "for src, dst in zip(sys.argv[1::2], sys.argv[2::2]):\n"
            "    name = dst.rsplit('/agent/', 1)[1][:-1]\n"
            "    py_compile.compile(src, dst, dfile=name, doraise=True)",
            *(str(path) for pair in sources for path in pair),
        )


def _run_bundled(root: Path, code: str, *args: str) -> None:
    """Run ``code`` with the bundle's own interpreter, loader and libraries (empty env)."""
    argv = launch_argv(str(root))
    python_argv = argv[: argv.index("-S") + 1]
    result = subprocess.run(
        [*python_argv, "-c", code, *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        env={},
        cwd="/",
    )
    if result.returncode != 0:
        raise errors.OrchardError(
            f"the agent bundle at {root} does not work: "
            f"{(result.stderr or result.stdout).strip()[-2000:]}",
            hint="build it from another interpreter (python=), or report this",
        )


def verify_bundle(root: Path) -> None:
    """Start the bundled interpreter with an empty environment and check that the agent's
    modules load, and load only from the bundle (its own libc and stdlib, never the host's)."""
    _run_bundled(root, _VERIFY, str(root))


def build_bundle(
    dest: Path, python: Path | None = None, *, keep: frozenset[str] = frozenset()
) -> Path:
    """Build the bundle at ``dest`` (which must not exist) from ``python`` (see
    :func:`find_python`): built and verified in a temporary folder beside ``dest``, then
    renamed into place, so ``dest`` is either absent or complete. ``keep`` names stdlib
    directories and extension modules to keep although the agent prunes them (a bundle for
    another Python program, such as the hermes harness, needs ``_ssl`` or ``sqlite3``)."""
    interpreter = find_python(python)
    dest = dest.absolute()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        _populate(tmp, interpreter, keep)
        verify_bundle(tmp)
        try:
            tmp.rename(dest)
        except OSError:
            raise errors.Conflict(
                f"the agent bundle destination {dest} already exists",
                hint="remove it first, or use ensure_bundle() to reuse a cached bundle",
            ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def bundle_key(python: Path) -> str:
    """Cache key: bundle format, the agent's sources, and the interpreter (path, version, file)."""
    real = python.resolve()
    info = real.stat()
    digest = hashlib.sha256()
    for part in (
        str(BUNDLE_FORMAT),
        daemon_digest(),
        str(real),
        f"{info.st_size}:{info.st_mtime_ns}",
        platform.machine(),
    ):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def ensure_bundle(cache_root: Path, python: Path | None = None) -> Path:
    """The bundle for the current agent sources and interpreter under ``cache_root``, built once.

    Safe when several processes race: each builds in its own temporary folder and the first
    rename wins; the others drop their copy and use the winner's.
    """
    interpreter = find_python(python)
    dest = cache_root.absolute() / f"agent-{bundle_key(interpreter)}"
    if (dest / MANIFEST).is_file():
        return dest
    try:
        return build_bundle(dest, interpreter)
    except errors.Conflict:
        if (dest / MANIFEST).is_file():
            return dest
        raise


def bundle_size(root: Path) -> int:
    """Total bytes of the files in a bundle."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())
