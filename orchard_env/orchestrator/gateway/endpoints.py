"""The model endpoints the gateway may forward to, and their real credentials.

They come from the TOML file named by the ``model_endpoints_file`` setting, never from a
sandbox or an API request (a create names an endpoint; it cannot pair a URL of its own with
someone's key)::

    default_openai = "openai"        # what a sandbox gets when it names none
    default_anthropic = "anthropic"

    [endpoints.openai]
    api = "openai"                   # OpenAI-compatible: Chat Completions and Responses
    base_url = "https://api.openai.com/v1"
    key_env = "OPENAI_API_KEY"       # or key_file = "/etc/orchard/openai.key"
    model = "gpt-5.1"                # the model the harnesses are configured for

    [endpoints.anthropic]
    api = "anthropic"                # Anthropic Messages; base_url without /v1
    base_url = "https://api.anthropic.com"
    key_file = "/etc/orchard/anthropic.key"

The key is read when a call is forwarded (a rotated file applies at once) and is never
logged, recorded or returned.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from orchard_env import errors

APIS = ("openai", "anthropic")


@dataclass(frozen=True)
class Endpoint:
    name: str
    api: str
    base_url: str  # no trailing slash
    model: str | None = None
    key_env: str | None = None
    key_file: Path | None = None

    def key(self) -> str | None:
        """The real credential, or None when the endpoint takes none (a local vLLM)."""
        if self.key_env:
            return os.environ.get(self.key_env) or None
        if self.key_file is not None:
            try:
                return self.key_file.read_text().strip() or None
            except OSError:
                return None
        return None


@dataclass(frozen=True)
class Endpoints:
    endpoints: dict[str, Endpoint]
    defaults: dict[str, str]  # api -> endpoint name

    def pick(self, api: str, name: str | None) -> Endpoint | None:
        """The endpoint named (it must speak ``api``), else the default for ``api``."""
        chosen = name if name is not None else self.defaults.get(api)
        if chosen is None:
            return None
        found = self.endpoints.get(chosen)
        if found is None or found.api != api:
            known = sorted(n for n, e in self.endpoints.items() if e.api == api) or ["none"]
            raise errors.InvalidRequest(
                f"model_gateway.{api}: no {api} endpoint named {chosen!r}",
                hint=f"name one of the service's {api} endpoints: {', '.join(known)}",
            )
        return found


NO_ENDPOINTS = Endpoints({}, {})


def load_endpoints(path: Path | None) -> Endpoints:
    if path is None:
        return NO_ENDPOINTS
    where = f"model_endpoints_file {path}"
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise errors.ConfigError(f"{where}: {exc}") from exc
    endpoints = {
        name: _endpoint(name, value, where) for name, value in (data.get("endpoints") or {}).items()
    }
    defaults: dict[str, str] = {}
    for api in APIS:
        name = data.get(f"default_{api}")
        if name is None:
            continue
        if name not in endpoints or endpoints[name].api != api:
            raise errors.ConfigError(f"{where}: default_{api} = {name!r} is no {api} endpoint")
        defaults[api] = name
    return Endpoints(endpoints, defaults)


def _endpoint(name: str, value: Any, where: str) -> Endpoint:
    if not isinstance(value, dict):
        raise errors.ConfigError(f"{where}: endpoints.{name} must be a table")
    api = value.get("api")
    if api not in APIS:
        raise errors.ConfigError(f"{where}: endpoints.{name}.api must be one of {APIS}")
    base_url = str(value.get("base_url") or "").rstrip("/")
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
        raise errors.ConfigError(
            f"{where}: endpoints.{name}.base_url {base_url!r} must be an http(s) URL"
        )
    key_file = value.get("key_file")
    return Endpoint(
        name=name,
        api=api,
        base_url=base_url,
        model=value.get("model"),
        key_env=value.get("key_env"),
        key_file=Path(key_file) if key_file else None,
    )
