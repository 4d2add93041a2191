"""The config file, its contexts, and where a client talks to: what every command needs
before anything else, so it imports nothing beyond the standard library.

Precedence, everywhere: explicit argument (CLI flag) > ``ORCHARD_*`` environment variable >
the active context in ``~/.config/orchard/config.toml`` > the default in the settings'
table. The SDK also honours upstream's ``SANDBOX_BASE_URL`` / ``SANDBOX_API_KEY`` (after
the ``ORCHARD_*`` names). A bad value raises :class:`~orchard_env.errors.ConfigError` naming
its key and where it came from. The service's own table is :mod:`orchard_env.config`.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from orchard_env.errors import ConfigError


def config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "orchard"


def config_path() -> Path:
    override = os.environ.get("ORCHARD_CONFIG")
    return Path(override) if override else config_dir() / "config.toml"


@dataclass(frozen=True)
class Setting:
    key: str  # the name in config.toml; the env var is ORCHARD_<KEY upper>
    default: str | None
    parse: Callable[[str], Any]
    help: str

    @property
    def env(self) -> str:
        return "ORCHARD_" + self.key.upper()


CLIENT_SETTINGS: tuple[Setting, ...] = (
    Setting("url", "http://127.0.0.1:8000", str, "the orchestrator's base URL"),
    Setting("api_key", None, str, "the API key sent as X-API-Key"),
)

_UPSTREAM_ENV = {"url": "SANDBOX_BASE_URL", "api_key": "SANDBOX_API_KEY"}


# --- config file and contexts ----------------------------------------------------------------


def load_config_file(path: Path | None = None) -> dict[str, Any]:
    path = path or config_path()
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        return {}
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}", hint=f"fix or remove {path}") from exc


def save_config_file(data: Mapping[str, Any], path: Path | None = None) -> Path:
    path = path or config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        tomli_w.dump(dict(data), handle)
    tmp.replace(path)
    return path


@dataclass(frozen=True)
class ContextChoice:
    """The context a command acts on, and why: ``source`` is ``--context``,
    ``ORCHARD_CONTEXT``, ``current context`` or ``default``."""

    name: str | None
    values: dict[str, Any]
    source: str

    @property
    def exists(self) -> bool:
        return bool(self.values)


def choose_context(
    data: Mapping[str, Any],
    name: str | None = None,
    *,
    default: str | None = None,
    must_exist: bool = True,
) -> ContextChoice:
    """The one precedence for a command's target: the named context (``--context``), else
    ``ORCHARD_CONTEXT``, else ``current_context``, else ``default``. A context named by the
    user that is not in the file is an error unless ``must_exist`` is false (``orchard up``
    creating it); ``default`` need not exist."""
    contexts = data.get("contexts", {})
    env = os.environ.get("ORCHARD_CONTEXT")
    current = data.get("current_context")
    chosen: str | None
    if name:
        chosen, source = name, "--context"
    elif env:
        chosen, source = env, "ORCHARD_CONTEXT"
    elif current:
        chosen, source = str(current), "current context"
    else:
        chosen, source = default, "default"
    if chosen is None:
        return ContextChoice(None, {}, source)
    if chosen not in contexts:
        if must_exist and source != "default":
            known = ", ".join(sorted(contexts)) or "none"
            where = "" if source == "--context" else f" (from {source})"
            raise ConfigError(
                f"context {chosen!r}{where} is not in {config_path()} (known: {known})",
                hint="`orchard context list` shows them; `orchard up` creates one",
            )
        return ContextChoice(chosen, {}, source)
    return ContextChoice(chosen, dict(contexts[chosen]), source)


def active_context(
    data: Mapping[str, Any], name: str | None = None
) -> tuple[str | None, dict[str, Any]]:
    """The context to use (see :func:`choose_context`), as ``(name, values)``."""
    choice = choose_context(data, name)
    return choice.name, choice.values


def write_context(name: str, values: Mapping[str, Any], *, make_current: bool = False) -> bool:
    """Write (or replace) a context. It becomes the current one when ``make_current`` is true
    or when there is no current context yet (the first one); otherwise the current context
    stays, as with ``kubectl config set-context``. Returns whether ``name`` is now current."""
    data = load_config_file()
    data.setdefault("contexts", {})[name] = dict(values)
    if make_current or not data.get("current_context"):
        data["current_context"] = name
    save_config_file(data)
    return bool(data["current_context"] == name)


def remove_context(name: str) -> bool:
    data = load_config_file()
    if name not in data.get("contexts", {}):
        return False
    del data["contexts"][name]
    if data.get("current_context") == name:
        data.pop("current_context")
    save_config_file(data)
    return True


# --- resolution ----------------------------------------------------------------------------


def resolve(
    table: tuple[Setting, ...],
    overrides: Mapping[str, Any],
    file_values: Mapping[str, Any],
    file_label: str,
    extra_env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    resolved: dict[str, Any] = {}
    for setting in table:
        source, raw = None, None
        if overrides.get(setting.key) is not None:
            source, raw = "command line", str(overrides[setting.key])
        elif setting.env in os.environ:
            source, raw = setting.env, os.environ[setting.env]
        elif extra_env and extra_env.get(setting.key, "") in os.environ:
            name = extra_env[setting.key]
            source, raw = name, os.environ[name]
        elif setting.key in file_values:
            source, raw = f"{file_label} key {setting.key!r}", str(file_values[setting.key])
        elif setting.default is not None:
            source, raw = "default", setting.default
        if raw is None:
            resolved[setting.key] = None
            continue
        try:
            resolved[setting.key] = setting.parse(raw)
        except ValueError as exc:
            raise ConfigError(
                f"bad value {raw!r} for {setting.key} (from {source}): {exc}",
                hint=f"{setting.key}: {setting.help}",
            ) from exc
    return resolved


@dataclass(frozen=True)
class ClientSettings:
    url: str
    api_key: str | None
    context: str | None


def client_settings(
    url: str | None = None, api_key: str | None = None, context: str | None = None
) -> ClientSettings:
    """Resolve where the SDK/CLI talks to, honouring upstream's SANDBOX_* variables."""
    name, values = active_context(load_config_file(), context)
    label = f"{config_path()} context {name!r}"
    resolved = resolve(
        CLIENT_SETTINGS, {"url": url, "api_key": api_key}, values, label, _UPSTREAM_ENV
    )
    return ClientSettings(
        url=resolved["url"].rstrip("/"), api_key=resolved["api_key"], context=name
    )
