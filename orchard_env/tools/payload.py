"""Build and cache the tools payload on this machine, from npm, PyPI and Debian.

Layout (upstream's ``/opt/sandbox-tools`` plus ``glibc/`` and ``bash/``)::

    bin/<harness>   sh launchers (see :mod:`.launchers`)
    codex/          @openai/codex's static musl build, its vendor directory whole
    claude/claude   opencode/opencode   (the -linux-x64 packages' native binaries)
    pi/             pi compiled with Bun into one native binary, with its sidecar files
    hermes/         a relocatable CPython (``build_bundle``) with hermes-agent installed
    glibc/          a loader and the libraries claude, opencode and pi link, for libc-less images
    bash/bash       Debian's bash-static (for images without bash)
    VERSIONS        ``<harness> <its --version>`` per line (upstream's format)
    profile.sh      appends bin/ to PATH (for /etc/profile.d, login shells)
    payload.json    what it was built from

npm 11 runs no install scripts of dependencies, so every binary is taken from the platform
package itself. Claude Code is proprietary: the payload is built here from the registry and
never redistributed by Orchard; a profile can leave it (or any harness) out.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from orchard_env import errors
from orchard_env.agent.bundle import build_bundle, find_python
from orchard_env.tools import HARNESSES, TOOLS_BIN, TOOLS_PROFILE, VERSIONS, check_harnesses
from orchard_env.tools.launchers import (
    ENTRIES,
    PROFILE_SH,
    console_script,
    launcher,
    python_launcher,
)

PAYLOAD_FORMAT = 1  # bump when the layout changes in a way the sources below do not show
MANIFEST = "payload.json"
INTERP = "/lib64/ld-linux-x86-64.so.2"  # the loader glibc x86-64 binaries name
LOADER = "ld-linux-x86-64.so.2"
NPM = {
    "codex": "@openai/codex",
    "claude": "@anthropic-ai/claude-code",
    "opencode": "opencode-ai",
    "pi": "@earendil-works/pi-coding-agent",
    "bun": "@oven/bun-linux-x64-baseline",
}
# What hermes needs of the stdlib that the agent's bundle prunes.
HERMES_KEEP = frozenset(
    {"_ssl", "_hashlib", "_sqlite3", "sqlite3", "_decimal", "_lzma", "_bz2", "_uuid"}
    | {"unittest", "_curses", "_curses_panel", "curses", "readline"}
)
_TOOL_TIMEOUT = 900  # seconds for one npm, pip or apt step

Progress = Callable[[str], None]


def default_cache_dir() -> Path:
    """``/var/cache/orchard/tools`` when writable (root), else ``$XDG_CACHE_HOME/orchard/tools``."""
    system = Path("/var/cache/orchard")
    if os.access(system, os.W_OK) or (not system.exists() and os.access(system.parent, os.W_OK)):
        return system / "tools"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "orchard" / "tools"


def _sources_digest() -> str:
    """The builder's own sources (this module and the launchers): a change to how the
    payload is made rebuilds it."""
    digest = hashlib.sha256()
    for source in (Path(__file__), Path(__file__).with_name("launchers.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    return digest.hexdigest()


def payload_key(harnesses: Sequence[str], versions: Mapping[str, str]) -> str:
    """Cache key: the harnesses, their versions, the builder's sources, the machine and the
    interpreter hermes runs on."""
    python = find_python().resolve()
    stat = python.stat()
    parts = {
        "format": PAYLOAD_FORMAT,
        "harnesses": list(harnesses),
        "versions": {name: versions[name] for name in sorted(versions)},
        "sources": _sources_digest(),
        "machine": platform.machine(),
        "python": [str(python), stat.st_size, stat.st_mtime_ns] if "hermes" in harnesses else None,
    }
    blob = json.dumps(parts, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cached_payload(
    harnesses: Sequence[str] = HARNESSES,
    versions: Mapping[str, str] = VERSIONS,
    *,
    cache_dir: Path | None = None,
) -> Path | None:
    """The payload :func:`ensure_payload` would return, if it is built already."""
    chosen = check_harnesses(harnesses)
    if not chosen:
        return None
    dest = (cache_dir or default_cache_dir()).absolute() / payload_key(chosen, versions)
    return dest if (dest / MANIFEST).is_file() else None


def ensure_payload(
    harnesses: Sequence[str] = HARNESSES,
    versions: Mapping[str, str] = VERSIONS,
    *,
    cache_dir: Path | None = None,
    progress: Progress | None = None,
) -> Path:
    """The payload for ``harnesses`` at ``versions``, built once per machine into
    ``<cache_dir>/<key>`` (built in a temporary folder and renamed into place; a lock file
    makes a concurrent caller wait for the build instead of starting its own)."""
    chosen = check_harnesses(harnesses)
    if not chosen:
        raise errors.InvalidRequest("a tools payload needs at least one harness")
    root = (cache_dir or default_cache_dir()).absolute()
    dest = root / payload_key(chosen, versions)
    if (dest / MANIFEST).is_file():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f"{dest.name}.lock"):
        if (dest / MANIFEST).is_file():
            return dest
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=root))
        try:
            started = time.monotonic()
            _build(tmp / "payload", tmp / "work", chosen, versions, progress)
            (tmp / "payload").rename(dest)
            if progress is not None:
                progress(f"tools payload built in {time.monotonic() - started:.0f} s: {dest}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _run(
    argv: Sequence[str], what: str, *, cwd: Path | None = None, env: dict[str, str] | None = None
) -> str:
    try:
        result = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            check=False,
            cwd=cwd,
            env=env,
            timeout=_TOOL_TIMEOUT,
        )
    except FileNotFoundError:
        raise errors.OrchardError(
            f"{argv[0]} is not installed; it is needed to {what}",
            hint="the build needs npm (Node.js 20 with npm 11 was used), pip and apt-get; "
            "scripts/setup-host.sh does not install npm",
        ) from None
    except subprocess.TimeoutExpired:
        raise errors.OrchardError(f"{what} took over {_TOOL_TIMEOUT} s: {' '.join(argv)}") from None
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip()[-2000:]
        raise errors.OrchardError(
            f"could not {what} (exit {result.returncode}): {tail}",
            hint="is the registry reachable, and the version published? `npm view PKG versions` "
            "or `pip index versions PKG` lists them",
        )
    return result.stdout


def _build(
    out: Path,
    work: Path,
    harnesses: Sequence[str],
    versions: Mapping[str, str],
    progress: Progress | None,
) -> None:
    if platform.machine() != "x86_64":
        raise errors.NotSupported(
            f"the tools payload is built for x86_64 only, not {platform.machine()}"
        )

    def step(message: str) -> None:
        if progress is not None:
            progress(message)

    out.mkdir(parents=True)
    work.mkdir(parents=True)
    npm_harnesses = [name for name in harnesses if name in ("codex", "claude", "opencode")]
    if npm_harnesses:
        step(f"npm install {', '.join(npm_harnesses)}")
        modules = _npm_install(work / "npm", [f"{NPM[n]}@{versions[n]}" for n in npm_harnesses])
        for name in npm_harnesses:
            _take_npm_binary(name, modules, out)
    if "pi" in harnesses:
        step("npm install pi and bun; compiling pi with bun")
        _build_pi(work / "pi", out / "pi", versions)
    linked = [out / ENTRIES[name][0] for name in harnesses if ENTRIES[name][1]]
    if linked:
        _copy_glibc(out, linked)
    if "hermes" in harnesses:
        step(f"pip install hermes-agent=={versions['hermes']} on a relocatable Python")
        _build_hermes(out / "hermes", versions["hermes"])
    step("apt-get download bash-static")
    bash_version = _fetch_bash(work / "deb", out / "bash")
    _write_launchers(out, harnesses)
    step("checking every harness's --version")
    _write_versions(out, work / "home", harnesses)
    (out / MANIFEST).write_text(
        json.dumps(
            {
                "format": PAYLOAD_FORMAT,
                "harnesses": list(harnesses),
                "versions": {n: versions[n] for n in (*harnesses, "bun") if n in versions},
                "bash_static": bash_version,
                "machine": platform.machine(),
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            },
            indent=2,
        )
        + "\n"
    )
    for path in (out, *out.rglob("*")):
        if path.is_dir() and not path.is_symlink():
            path.chmod(0o755)  # readable by any user of any image


def _npm_install(prefix: Path, specs: Sequence[str]) -> Path:
    _run(
        [
            "npm",
            "install",
            "--prefix",
            str(prefix),
            "--omit=dev",
            "--ignore-scripts",
            "--no-audit",
            "--no-fund",
            "--no-save",
            *specs,
        ],
        f"npm install {' '.join(specs)}",
    )
    return prefix / "node_modules"


def _take_npm_binary(name: str, modules: Path, out: Path) -> None:
    """Copy a harness's native build out of its linux-x64 platform package."""
    sources = {
        "codex": modules / "@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl",
        "claude": modules / "@anthropic-ai/claude-code-linux-x64/claude",
        "opencode": modules / "opencode-linux-x64/bin/opencode",
    }
    source = sources[name]
    if not source.exists():
        raise errors.OrchardError(
            f"npm installed {NPM[name]} but not its linux-x64 build ({source} is missing)",
            hint="this version may package its binaries differently; pin another version",
        )
    if source.is_dir():
        shutil.copytree(source, out / name, symlinks=True)
    else:
        (out / name).mkdir()
        shutil.copy2(source, out / name / source.name)


def _build_pi(work: Path, dest: Path, versions: Mapping[str, str]) -> None:
    """pi is JavaScript on npm (it needs Node >= 22.19): compile it with Bun into one
    native binary, as pi's own build:binary does, and copy its sidecar files beside it."""
    modules = _npm_install(
        work, [f"{NPM['pi']}@{versions['pi']}", f"{NPM['bun']}@{versions['bun']}"]
    )
    package = modules / NPM["pi"]
    dest.mkdir()
    _run(
        [
            str(modules / NPM["bun"] / "bin" / "bun"),
            "build",
            "--compile",
            "--no-compile-autoload-bunfig",
            "--no-compile-autoload-dotenv",
            "--compile-autoload-package-json",
            "./dist/bun/cli.js",
            "./dist/utils/image-resize-worker.js",
            "./dist/extensions/codemode/worker.js",
            "--outfile",
            str(dest / "pi"),
        ],
        "compile pi with bun",
        cwd=package,
        env={"PATH": os.environ.get("PATH", ""), "HOME": str(work)},
    )
    for name in ("package.json", "README.md"):
        shutil.copy2(package / name, dest / name)
    shutil.copy2(modules / "@silvia-odwyer/photon-node/photon_rs_bg.wasm", dest)
    interactive = package / "dist/modes/interactive"
    (dest / "theme").mkdir()
    for theme in interactive.glob("theme/*.json"):
        shutil.copy2(theme, dest / "theme")
    shutil.copytree(interactive / "assets", dest / "assets")
    html = package / "dist/core/export-html"
    (dest / "export-html").mkdir()
    for item in html.iterdir():
        if item.is_dir():
            shutil.copytree(item, dest / "export-html" / item.name)
        elif not item.name.endswith((".js", ".ts", ".map")):
            shutil.copy2(item, dest / "export-html")


def _ldd(files: Sequence[Path]) -> dict[str, Path]:
    """Library name -> resolved host path, for what ``files`` link (their own RPATH
    libraries included: the caller skips what is already in the payload)."""
    found: dict[str, Path] = {}
    for chunk in range(0, len(files), 200):
        result = subprocess.run(
            ["ldd", *map(str, files[chunk : chunk + 200])],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        for line in result.stdout.splitlines():
            name, arrow, target = line.strip().partition("=>")
            location = target.split(" (", 1)[0].strip()
            if arrow and location.startswith("/"):
                found[name.strip()] = Path(location).resolve()
    return found


def _copy_glibc(out: Path, binaries: Sequence[Path]) -> None:
    """``glibc/``: the loader and every library the glibc-linked harnesses need."""
    folder = out / "glibc"
    folder.mkdir()
    for name, path in _ldd(binaries).items():
        shutil.copy2(path, folder / name)
    shutil.copy2(Path(INTERP).resolve(), folder / LOADER)


def _build_hermes(dest: Path, version: str) -> None:
    """A relocatable interpreter (the agent bundle's builder, keeping what hermes needs)
    with hermes-agent and its dependencies in its site-packages."""
    python = find_python()
    build_bundle(dest, python, keep=HERMES_KEEP)
    (dest / "bin" / "python").write_text(python_launcher(LOADER))
    (dest / "bin" / "python").chmod(0o755)
    site = _run(
        [str(dest / "bin" / "python"), "-c", "import site; print(site.getsitepackages()[0])"],
        "ask the bundled Python for its site-packages",
        env={},
    ).strip()
    _run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-warn-script-location",
            "--disable-pip-version-check",
            "--no-cache-dir",
            "--target",
            site,
            f"hermes-agent=={version}",
        ],
        f"pip install hermes-agent=={version}",
    )
    site_dir = Path(site)
    shutil.rmtree(site_dir / "bin", ignore_errors=True)  # scripts naming the host's python
    for leftover in ("pip", "setuptools", "_distutils_hack"):
        shutil.rmtree(site_dir / leftover, ignore_errors=True)
    lib = dest / "lib"
    extensions = [p for p in site_dir.rglob("*.so*") if p.is_file()]
    for name, path in _ldd(extensions).items():
        if not path.is_relative_to(dest) and not (lib / name).exists():
            shutil.copy2(path, lib / name)
    module, function = _entry_point(site_dir, "hermes")
    (dest / "bin" / "hermes").write_text(console_script(module, function))
    (dest / "bin" / "hermes").chmod(0o755)


def _entry_point(site: Path, script: str) -> tuple[str, str]:
    for entry_points in site.glob("hermes_agent-*.dist-info/entry_points.txt"):
        for line in entry_points.read_text().splitlines():
            name, _, target = line.partition("=")
            if name.strip() == script and ":" in target:
                module, _, function = target.strip().partition(":")
                return module, function
    raise errors.OrchardError(
        f"hermes-agent declares no {script!r} console script in {site}",
        hint="pin a hermes-agent version that provides the hermes command",
    )


def _fetch_bash(work: Path, dest: Path) -> str:
    """Debian's bash-static as ``bash/bash``; returns its package version."""
    work.mkdir()
    _run(["apt-get", "download", "bash-static"], "apt-get download bash-static", cwd=work)
    deb = next(work.glob("bash-static_*.deb"))
    _run(["dpkg-deb", "-x", str(deb), str(work / "x")], "unpack bash-static")
    dest.mkdir()
    shutil.copy2(work / "x" / "bin" / "bash-static", dest / "bash")
    return _run(["dpkg-deb", "-f", str(deb), "Version"], "read bash-static's version").strip()


def _write_launchers(out: Path, harnesses: Sequence[str]) -> None:
    (out / "bin").mkdir()
    for name in harnesses:
        path = out / "bin" / name
        path.write_text(launcher(name, INTERP, LOADER))
        path.chmod(0o755)
    (out / TOOLS_PROFILE).write_text(PROFILE_SH.format(bin=TOOLS_BIN))


def _write_versions(out: Path, home: Path, harnesses: Sequence[str]) -> None:
    """Run each launcher's ``--version`` (a check that the harness starts at all) and keep
    the answers in ``VERSIONS``."""
    home.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "PI_OFFLINE": "1"}
    lines = []
    for name in harnesses:
        answer = _run([str(out / "bin" / name), "--version"], f"run {name} --version", env=env)
        first = next((line.strip() for line in answer.splitlines() if line.strip()), "")
        lines.append(f"{name:<9}{first}")
    (out / "VERSIONS").write_text("\n".join(lines) + "\n")


def payload_size(root: Path) -> int:
    """Total bytes of the files in a payload."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())
