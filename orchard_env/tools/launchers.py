"""The payload's ``bin/`` launchers: small POSIX sh scripts that find the payload from their
own location (following symlinks), so it can be mounted anywhere, and pick how to start
each harness in the image at hand.

* A glibc-linked harness (claude, opencode, pi) runs directly when the image has the
  loader it was linked against, and through the payload's own loader and libraries
  (``glibc/``) otherwise: an image without a libc at all (busybox) runs it too. The
  library path goes on the loader's command line, never into ``LD_LIBRARY_PATH``, so the
  commands a harness runs keep the image's libraries.
* ``SHELL`` is pointed at the payload's static bash only when the image has no
  ``/bin/bash`` (claude's Bash tool and hermes' terminal tool need a bash).
"""

from __future__ import annotations

from collections.abc import Mapping

PROLOGUE = """#!/bin/sh
# {name}, from the Orchard tools payload (generated; see VERSIONS beside bin/).
self=$0
case $self in */*) ;; *) self=$(command -v -- "$self") ;; esac
while [ -L "$self" ]; do
    link=$(readlink "$self") || break
    case $link in /*) self=$link ;; *) self=${{self%/*}}/$link ;; esac
done
TOOLS_DIR=$(cd -P -- "${{self%/*}}/.." && pwd)
[ -x /bin/bash ] || {{ SHELL=$TOOLS_DIR/bash/bash; export SHELL; }}
"""
_DIRECT = 'exec "$TOOLS_DIR/{path}" "$@"\n'
_GLIBC = """if [ -e {interp} ]; then
    exec "$TOOLS_DIR/{path}" "$@"
fi
exec "$TOOLS_DIR/glibc/{loader}" --inhibit-cache --library-path "$TOOLS_DIR/glibc" \\
    "$TOOLS_DIR/{path}" "$@"
"""
# Each harness's executable inside the payload, and whether it is linked against glibc.
ENTRIES: Mapping[str, tuple[str, bool]] = {
    "codex": ("codex/bin/codex", False),  # static (musl)
    "claude": ("claude/claude", True),
    "opencode": ("opencode/opencode", True),
    "pi": ("pi/pi", True),
    "hermes": ("hermes/bin/hermes", False),  # runs its bundled interpreter through its loader
}
# Set before the exec (pi looks for its package.json and assets beside process.execPath,
# which is the loader when it runs through one).
_EXTRA = {"pi": "PI_PACKAGE_DIR=$TOOLS_DIR/pi; export PI_PACKAGE_DIR\n"}

PROFILE_SH = """# Orchard tools payload: bin/ after the image's PATH (its toolchain wins).
case ":$PATH:" in
    *:{bin}:*) ;;
    *) PATH="${{PATH:+$PATH:}}{bin}"; export PATH ;;
esac
"""


def launcher(name: str, interp: str, loader: str) -> str:
    """The launcher script of harness ``name``. ``interp`` is the loader path glibc-linked
    binaries name (``/lib64/ld-linux-x86-64.so.2``), ``loader`` its file name in ``glibc/``."""
    path, glibc = ENTRIES[name]
    body = (_GLIBC if glibc else _DIRECT).format(path=path, interp=interp, loader=loader)
    return PROLOGUE.format(name=name) + _EXTRA.get(name, "") + body


def python_launcher(loader: str) -> str:
    """``hermes/bin/python``: the bundled interpreter through its own loader and libraries
    (``-E -s``: the image's PYTHONPATH, PYTHONHOME and user site stay out)."""
    return (
        "#!/bin/sh\n"
        "# The hermes harness's interpreter (generated).\n"
        'here=$(cd -P -- "${0%/*}/.." && pwd)\n'
        f'exec "$here/lib/{loader}" --inhibit-cache --library-path "$here/lib" \\\n'
        '    "$here/bin/python3" -E -s "$@"\n'
    )


def console_script(module: str, function: str) -> str:
    """``hermes/bin/hermes``: runs the entry point with ``sys.executable`` set to
    ``bin/python``, so the subprocesses Python code starts use the loader too."""
    code = (
        "import os, sys; "
        "sys.executable = os.path.join(os.path.dirname(sys.argv[1]), 'python'); "
        "sys.argv = ['hermes', *sys.argv[2:]]; "
        f"from {module} import {function}; "
        f"sys.exit({function}())"
    )
    return (
        "#!/bin/sh\n"
        "# The hermes harness (generated).\n"
        'bin=$(cd -P -- "${0%/*}" && pwd)\n'
        f'exec "$bin/python" -c "{code}" "$bin/hermes" "$@"\n'
    )
