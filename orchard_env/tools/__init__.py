"""The tools payload: the agent harnesses (codex, claude, opencode, pi, hermes) every sandbox
finds on its PATH, built on this machine from npm, PyPI and Debian and mounted read-only at
``/opt/sandbox-tools`` (upstream's path and layout: ``bin/<harness>`` launchers and a
``VERSIONS`` file).

This module holds what the orchestrator needs to know about the payload (its harnesses, the
pinned versions, how a sandbox asks for a subset); :mod:`.payload` builds and caches it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from orchard_env import errors

TOOLS_MOUNT = "/opt/sandbox-tools"
TOOLS_BIN = f"{TOOLS_MOUNT}/bin"
# The payload's profile.sh (bin/ appended to PATH), mounted where login shells source it, so a
# ``bash -l`` a command starts finds the harnesses too (upstream links it there).
TOOLS_PROFILE = "profile.sh"
PROFILE_TARGET = "/etc/profile.d/sandbox-tools.sh"
# The environment variable the agent reads to append the payload's bin/ to PATH.
TOOLS_ENV = "ORCHARD_AGENT_TOOLS_BIN"
HARNESSES = ("codex", "claude", "opencode", "pi", "hermes")

# The one place versions are pinned (override per build: the ``tools_versions`` setting,
# ``ORCHARD_TOOLS_VERSIONS`` or ``orchard images build --tools-version NAME=VERSION``).
# ``bun`` is not a harness: it compiles pi (JavaScript on npm) into a native binary.
VERSIONS: Mapping[str, str] = {
    "codex": "0.171.0",
    "claude": "2.1.332",
    "opencode": "1.18.33",
    "pi": "1.6.0",
    "bun": "1.4.5",
    "hermes": "0.19.0",
}
# Where each one comes from.
PACKAGES: Mapping[str, str] = {
    "codex": "npm @openai/codex",
    "claude": "npm @anthropic-ai/claude-code",
    "opencode": "npm opencode-ai",
    "pi": "npm @earendil-works/pi-coding-agent",
    "bun": "npm @oven/bun-linux-x64-baseline",
    "hermes": "PyPI hermes-agent",
}
_VERSION_RE = re.compile(r"^[0-9A-Za-z][0-9A-Za-z.+-]{0,63}$")


def parse_versions(text: str, base: Mapping[str, str] = VERSIONS) -> dict[str, str]:
    """``codex=0.172.0,hermes=0.19.1`` -> ``base`` (the pins) with those replaced."""
    versions = dict(base)
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, sep, version = item.partition("=")
        name, version = name.strip(), version.strip()
        if not sep or name not in VERSIONS:
            raise ValueError(f"{item!r} is not NAME=VERSION with NAME one of {', '.join(VERSIONS)}")
        if not _VERSION_RE.match(version):
            raise ValueError(f"{version!r} is not a package version (e.g. 0.171.0)")
        versions[name] = version
    return versions


def parse_harnesses(text: str) -> tuple[str, ...]:
    """A profile: harness names separated by commas, ``all`` or ``none``."""
    value = text.strip().lower()
    if value == "all":
        return HARNESSES
    if value in ("", "none", "off", "false"):
        return ()
    return check_harnesses(part.strip() for part in value.split(",") if part.strip())


def check_harnesses(names: Iterable[str], *, field: str = "tools") -> tuple[str, ...]:
    """The names in payload order, each known, no duplicates; otherwise a 400 naming them."""
    chosen = list(names)
    unknown = sorted({name for name in chosen if name not in HARNESSES})
    if unknown:
        raise errors.InvalidRequest(
            f"{field}: unknown harness {', '.join(map(repr, unknown))} "
            f"(known: {', '.join(HARNESSES)})",
            hint=f"pass false for none, true for all, or a list of {', '.join(HARNESSES)}",
        )
    return tuple(name for name in HARNESSES if name in chosen)
