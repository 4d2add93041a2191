"""Profile files: optional keys, validated, the bad key named."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchard_env.cost.profile import load_profile
from orchard_env.errors import ConfigError

KNOWN = (
    "known keys: region, sandbox_vm_size, sandbox_vm_sizes, spot, system_vm_size, "
    "system_nodes, tier"
)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "profile.yaml"
    path.write_text(text)
    return path


def test_all_keys(tmp_path: Path) -> None:
    profile = load_profile(
        write(
            tmp_path,
            "region: westus2\nsandbox_vm_sizes: [Standard_D16as_v5, Standard_D32as_v5]\n"
            "spot: true\nsystem_vm_size: Standard_D4as_v5\nsystem_nodes: 1\ntier: Standard\n",
        )
    )
    assert profile.region == "westus2"
    assert profile.vm_sizes() == ["Standard_D16as_v5", "Standard_D32as_v5"]
    assert (profile.spot, profile.system_nodes, profile.tier) == (True, 1, "standard")


def test_single_size_and_empty_file(tmp_path: Path) -> None:
    assert load_profile(write(tmp_path, "sandbox_vm_size: Standard_D8as_v5\n")).vm_sizes() == [
        "Standard_D8as_v5"
    ]
    assert load_profile(write(tmp_path, "")).vm_sizes() is None


def test_unknown_key_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, "regoin: eastus\n")
    with pytest.raises(ConfigError) as caught:
        load_profile(path)
    assert caught.value.message == f"profile {path}: unknown key 'regoin'"
    assert caught.value.hint == KNOWN


def test_bad_value_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, "system_nodes: 0\n")
    with pytest.raises(ConfigError) as caught:
        load_profile(path)
    assert caught.value.message == (
        f"profile {path}: bad value for 'system_nodes': Input should be greater than or equal to 1"
    )
    path = write(tmp_path, "tier: gold\n")
    with pytest.raises(ConfigError, match="bad value for 'tier'"):
        load_profile(path)


def test_not_a_mapping_not_yaml_not_there(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_profile(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_profile(write(tmp_path, "region: [unclosed\n"))
    with pytest.raises(ConfigError, match="cannot read profile"):
        load_profile(tmp_path / "missing.yaml")
