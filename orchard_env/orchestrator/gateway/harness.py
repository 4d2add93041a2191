"""What a sandbox with a gateway is given so that the five harnesses find it with no flags:
environment variables and config files, all naming ``http://127.0.0.1:4000`` and a dummy
key (the real one stays in the orchestrator).

Base URLs carry no ``/t/<traj>`` prefix: calls go to the sandbox's current trajectory, which
the API changes between episodes without rewriting anything in the sandbox; a harness
pointed at ``http://127.0.0.1:4000/t/<traj>/v1`` by hand labels its calls itself.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from orchard_env.agent.bundle import RUN_DIR_MOUNT

if TYPE_CHECKING:
    from orchard_env.orchestrator.records import GatewayRecord

LISTEN_HOST = "127.0.0.1"
LISTEN_PORT = 4000
BASE = f"http://{LISTEN_HOST}:{LISTEN_PORT}"
HARNESS_DIR = "/tmp/orchard-harness"  # noqa: S108 - the sandbox's own /tmp
SOCKET_NAME = "model.sock"
PARKED_WAIT_SECONDS = 5.0
"""How long a harness connection waits in the sandbox for a parked connection (Kubernetes)
before the agent answers it 503."""


def gateway_enrollment(
    config: GatewayRecord, env: dict[str, str], *, parked: bool
) -> tuple[dict[str, str], dict[str, Any]]:
    """The sandbox's environment (the harness variables under its own) and the ``model``
    part of the agent's enrollment: where to listen, where to relay (the gateway's socket in
    the run directory, or, ``parked``, connections the orchestrator parks at the agent), which
    files to write."""
    extra = harness_env(config.dummy_key, config.model, config.anthropic_model)
    model: dict[str, Any] = {
        "listen": f"{LISTEN_HOST}:{LISTEN_PORT}",
        "files": harness_files(config.dummy_key, config.model),
    }
    if parked:
        model["wait"] = PARKED_WAIT_SECONDS
    else:
        model["socket"] = f"{RUN_DIR_MOUNT}/{SOCKET_NAME}"
    return {**extra, **env}, model


def harness_env(dummy_key: str, model: str | None, anthropic_model: str | None) -> dict[str, str]:
    env = {
        "ORCHARD_MODEL_GATEWAY": BASE,
        "ORCHARD_MODEL_KEY": dummy_key,
        "OPENAI_BASE_URL": f"{BASE}/v1",
        "OPENAI_API_KEY": dummy_key,
        "ANTHROPIC_BASE_URL": BASE,
        "ANTHROPIC_API_KEY": dummy_key,
        "IS_SANDBOX": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "CODEX_HOME": f"{HARNESS_DIR}/codex",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "PI_CODING_AGENT_DIR": f"{HARNESS_DIR}/pi",
        "PI_OFFLINE": "1",
        "HERMES_HOME": f"{HARNESS_DIR}/hermes",
    }
    if anthropic_model:
        for name in ("MODEL", "DEFAULT_HAIKU_MODEL", "DEFAULT_SONNET_MODEL", "DEFAULT_OPUS_MODEL"):
            env[f"ANTHROPIC_{name}"] = anthropic_model
    if model:
        env["OPENCODE_CONFIG_CONTENT"] = json.dumps(_opencode(model, dummy_key))
    return env


def harness_files(dummy_key: str, model: str | None) -> dict[str, str]:
    """Config files by absolute path in the sandbox (codex, pi, hermes read one)."""
    if not model:
        return {}
    codex = (
        f"model = {json.dumps(model)}\n"
        'model_provider = "orchard"\n'
        'approval_policy = "never"\n'
        'sandbox_mode = "danger-full-access"\n'
        "[model_providers.orchard]\n"
        'name = "Orchard model gateway"\n'
        f'base_url = "{BASE}/v1"\n'
        'env_key = "ORCHARD_MODEL_KEY"\n'
        'wire_api = "responses"\n'
        "[analytics]\n"
        "enabled = false\n"
    )
    pi_models = {
        "providers": {
            "orchard": {
                "baseUrl": f"{BASE}/v1",
                "api": "openai-completions",
                "apiKey": "$ORCHARD_MODEL_KEY",
                "models": [{"id": model, "contextWindow": 128000, "maxTokens": 4096}],
            }
        }
    }
    pi_settings = {"defaultProvider": "orchard", "defaultModel": model}
    hermes = (
        "model:\n"
        "  provider: custom\n"
        f'  base_url: "{BASE}/v1"\n'
        f"  default: {json.dumps(model)}\n"
        f"  api_key: {json.dumps(dummy_key)}\n"
    )
    return {
        f"{HARNESS_DIR}/codex/config.toml": codex,
        f"{HARNESS_DIR}/pi/models.json": json.dumps(pi_models, indent=2),
        f"{HARNESS_DIR}/pi/settings.json": json.dumps(pi_settings, indent=2),
        f"{HARNESS_DIR}/hermes/config.yaml": hermes,
    }


def _opencode(model: str, dummy_key: str) -> dict[str, Any]:
    return {
        "model": f"orchard/{model}",
        "small_model": f"orchard/{model}",
        "autoupdate": False,
        "share": "disabled",
        "permission": {"edit": "allow", "bash": "allow", "webfetch": "deny"},
        "provider": {
            "orchard": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "Orchard model gateway",
                "options": {"baseURL": f"{BASE}/v1", "apiKey": dummy_key},
                "models": {
                    model: {"tool_call": True, "limit": {"context": 128000, "output": 4096}}
                },
            }
        },
    }
