"""The profile's ``model_endpoints``: the endpoints file in a ConfigMap the orchestrator
mounts (its ``model_endpoints_file``), the keys from the operator's optional Secret, and what
a deployed orchestrator could not use refused with the key named."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest

from manifests import SUPPORTED_KUBERNETES_VERSIONS
from manifests.render import KubeObject, render, values_from_profile
from orchard_env.errors import ConfigError
from provision.profile import parse_profile
from tests.manifests.test_deploy import REFS

ENDPOINTS = """\
default_openai = "model"
[endpoints.model]
api = "openai"
base_url = "http://models.example:8000/v1"
key_file = "/etc/orchard/model-keys/model"
model = "m-1"
"""


def _render(tmp_path: Path, text: str) -> list[KubeObject]:
    path = tmp_path / "endpoints.toml"
    path.write_text(text)
    profile = parse_profile({"target": "kubeconfig", "model_endpoints": str(path)}, source="t")
    return render(values_from_profile(profile, REFS))


def _one(objects: list[KubeObject], kind: str, name: str) -> KubeObject:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


@pytest.mark.parametrize("version", SUPPORTED_KUBERNETES_VERSIONS)
def test_the_file_is_mounted_where_the_setting_points(tmp_path: Path, version: str) -> None:
    objects = _render(tmp_path, ENDPOINTS)
    for obj in objects:
        kubernetes_validate.validate(obj, f"{version}.0", strict=True)
    assert _one(objects, "ConfigMap", "orchard-model-endpoints")["data"] == {
        "endpoints.toml": ENDPOINTS
    }
    config = _one(objects, "ConfigMap", "orchard-config")["data"]
    assert config["ORCHARD_MODEL_ENDPOINTS_FILE"] == "/etc/orchard/model-endpoints/endpoints.toml"
    pod = _one(objects, "Deployment", "orchard-orchestrator")["spec"]["template"]["spec"]
    assert {"name": "model-endpoints", "configMap": {"name": "orchard-model-endpoints"}} in (
        pod["volumes"]
    )
    assert {
        "name": "model-keys",
        "secret": {"secretName": "orchard-model-keys", "defaultMode": 0o440, "optional": True},
    } in pod["volumes"]
    mounts = pod["containers"][0]["volumeMounts"]
    assert {
        "name": "model-endpoints",
        "mountPath": "/etc/orchard/model-endpoints",
        "readOnly": True,
    } in mounts
    assert {"name": "model-keys", "mountPath": "/etc/orchard/model-keys", "readOnly": True} in (
        mounts
    )


def test_without_it_nothing_is_rendered(tmp_path: Path) -> None:
    objects = render(values_from_profile(parse_profile({}, source="t"), REFS))
    assert not [o for o in objects if o["metadata"]["name"] == "orchard-model-endpoints"]
    config = _one(objects, "ConfigMap", "orchard-config")["data"]
    assert "ORCHARD_MODEL_ENDPOINTS_FILE" not in config


def test_a_changed_file_rolls_the_pods(tmp_path: Path) -> None:
    def checksum(objects: list[KubeObject]) -> str:
        template = _one(objects, "Deployment", "orchard-orchestrator")["spec"]["template"]
        return str(template["metadata"]["annotations"]["orchard.config/sha256"])

    first = checksum(_render(tmp_path, ENDPOINTS))
    assert checksum(_render(tmp_path, ENDPOINTS)) == first
    assert checksum(_render(tmp_path, ENDPOINTS.replace("m-1", "m-2"))) != first


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            ENDPOINTS.replace('key_file = "/etc/orchard/model-keys/model"', 'key_env = "K"'),
            "endpoints.model.key_env: a deployed orchestrator has no such environment variable",
        ),
        (
            ENDPOINTS.replace("/etc/orchard/model-keys/model", "/etc/keys/model"),
            "endpoints.model.key_file: /etc/keys/model is not in /etc/orchard/model-keys, where "
            "the Secret orchard-model-keys is mounted",
        ),
        (
            ENDPOINTS.replace('api = "openai"', 'api = "other"'),
            "endpoints.model.api must be one of ('openai', 'anthropic')",
        ),
    ],
)
def test_what_a_deployed_orchestrator_cannot_use_is_refused(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        _render(tmp_path, text)
    assert caught.value.message.endswith(message), caught.value.message
    assert str(tmp_path / "endpoints.toml") in caught.value.message


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    profile = parse_profile({"model_endpoints": str(tmp_path / "none.toml")}, source="t")
    with pytest.raises(ConfigError) as caught:
        values_from_profile(profile, REFS)
    assert caught.value.message.startswith(
        f"model_endpoints {tmp_path / 'none.toml'}: [Errno 2] No such file or directory"
    )
