"""Configuration precedence: flag > ORCHARD_* > upstream SANDBOX_* > context > default."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from orchard_env import config, contexts
from orchard_env.errors import ConfigError


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in (
        "ORCHARD_URL",
        "ORCHARD_API_KEY",
        "ORCHARD_CONTEXT",
        "SANDBOX_BASE_URL",
        "SANDBOX_API_KEY",
        "ORCHARD_PORT",
        "ORCHARD_MAX_CPU",
        "ORCHARD_STATE_DIR",
    ):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "config.toml"
    monkeypatch.setenv("ORCHARD_CONFIG", str(path))
    return path


def test_client_defaults_without_any_configuration() -> None:
    settings = contexts.client_settings()
    assert settings == contexts.ClientSettings("http://127.0.0.1:8000", None, None)


def test_client_precedence_flag_env_upstream_context(monkeypatch: pytest.MonkeyPatch) -> None:
    contexts.write_context("lab", {"url": "http://context:1", "api_key": "ctx-key"})
    assert contexts.client_settings().url == "http://context:1"
    monkeypatch.setenv("SANDBOX_BASE_URL", "http://upstream:2/")
    assert contexts.client_settings().url == "http://upstream:2"
    monkeypatch.setenv("ORCHARD_URL", "http://orchard:3")
    assert contexts.client_settings().url == "http://orchard:3"
    assert contexts.client_settings(url="http://flag:4").url == "http://flag:4"
    assert contexts.client_settings().api_key == "ctx-key"
    assert contexts.client_settings().context == "lab"


def test_named_context_that_does_not_exist_lists_known_ones() -> None:
    contexts.write_context("lab", {"url": "http://x:1"})
    with pytest.raises(ConfigError, match=r"context 'prod' is not in .*\(known: lab\)"):
        contexts.client_settings(context="prod")


def test_config_file_is_private_and_contexts_can_be_removed(isolated: Path) -> None:
    contexts.write_context("a", {"url": "http://a:1", "api_key": "secret"})
    assert stat.S_IMODE(isolated.stat().st_mode) == 0o600
    assert contexts.remove_context("a")
    assert not contexts.remove_context("a")
    assert contexts.load_config_file() == {"contexts": {}}


def test_service_bad_env_value_names_key_and_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCHARD_MAX_CPU", "lots")
    with pytest.raises(ConfigError) as info:
        config.service_settings()
    assert info.value.message.startswith("bad value 'lots' for max_cpu (from ORCHARD_MAX_CPU)")
    assert info.value.hint == "max_cpu: largest CPU a sandbox may ask for"


def test_a_pull_policy_kubernetes_does_not_know_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCHARD_IMAGE_PULL_POLICY", "ifnotpresent")
    with pytest.raises(ConfigError) as info:
        config.service_settings()
    assert info.value.message == (
        "bad value 'ifnotpresent' for image_pull_policy (from ORCHARD_IMAGE_PULL_POLICY): "
        "must be IfNotPresent, Always or Never"
    )


def test_service_flags_are_parsed_like_env_values(tmp_path: Path) -> None:
    settings = config.service_settings(port="9001", state_dir=str(tmp_path), max_cpu="500m")
    assert settings.port == 9001
    assert settings.state_dir == tmp_path
    assert settings.max_cpu == 0.5
    assert settings.db_path == tmp_path / "orchard.db"


def test_service_section_of_config_file(isolated: Path) -> None:
    isolated.write_text('[service]\nport = 8123\ndefault_memory = "1Gi"\n')
    settings = config.service_settings()
    assert settings.port == 8123
    assert settings.default_memory == 1024**3


def test_invalid_toml_is_a_config_error(isolated: Path) -> None:
    isolated.write_text("this is = = not toml")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        contexts.client_settings()


def test_unknown_backend_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCHARD_BACKEND", "nomad")
    with pytest.raises(ConfigError, match="unknown backend 'nomad'"):
        config.service_settings()


def test_each_state_dir_gets_an_instance_of_its_own_unless_one_is_set(tmp_path: Path) -> None:
    first = config.service_settings(state_dir=tmp_path / "a")
    second = config.service_settings(state_dir=tmp_path / "b")
    assert first.instance.startswith("default-") and second.instance.startswith("default-")
    assert first.instance != second.instance
    assert config.service_settings(state_dir=tmp_path / "a").instance == first.instance
    assert (tmp_path / "a" / "instance").read_text() == first.instance + "\n"
    assert config.service_settings(state_dir=tmp_path / "a", instance="x").instance == "x"
    # A state dir from before (a database, no instance file) keeps the name its containers have.
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "orchard.db").touch()
    assert config.service_settings(state_dir=tmp_path / "old").instance == "default"
    kube = config.service_settings(state_dir=tmp_path / "k", backend="kubernetes")
    assert kube.instance == "default" and not (tmp_path / "k" / "instance").exists()
    assert config.state_id(tmp_path / "a") == config.state_id(tmp_path / "a")
    assert config.state_id(tmp_path / "a") != config.state_id(tmp_path / "b")
