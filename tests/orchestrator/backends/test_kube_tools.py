"""The tools payload in sandbox pods: an image volume or an init container copying into an
emptyDir (settings.tools_volume_mode), validated against the official schemas."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import kubernetes_validate
import pytest

import manifests
from orchard_env.config import ServiceSettings
from orchard_env.orchestrator.backends.kube_objects import pod_manifest
from orchard_env.orchestrator.backends.kube_tools import TOOLS_VOLUME_BYTES
from tests.orchestrator.backends.test_kubernetes import make_spec

TOOLS_IMAGE = "registry.example/orchard/tools:1.2.3"
SUPPORTED = manifests.SUPPORTED_KUBERNETES_VERSIONS
# volumes[].image is in the API from 1.31 (alpha); Orchard documents 1.33+ for it.
IMAGE_VOLUME_VERSIONS = tuple(v for v in SUPPORTED if tuple(map(int, v.split("."))) >= (1, 33))


def _pod(settings: ServiceSettings, mode: str, **spec: Any) -> dict[str, Any]:
    tools = replace(settings, tools_image=TOOLS_IMAGE, tools_volume_mode=mode)
    return pod_manifest(tools, make_spec(**spec))


def _main(pod: dict[str, Any]) -> dict[str, Any]:
    main: dict[str, Any] = pod["spec"]["containers"][0]
    return main


@pytest.mark.parametrize("version", SUPPORTED)
def test_init_container_mode_is_valid_and_raises_ephemeral_storage(
    version: str, kube_settings: ServiceSettings
) -> None:
    plain = pod_manifest(kube_settings, make_spec())
    pod = _pod(kube_settings, "initcontainer")
    kubernetes_validate.validate(pod, version, strict=True)
    injector = pod["spec"]["initContainers"][1]
    assert injector["name"] == "tools-injector" and injector["image"] == TOOLS_IMAGE
    assert injector["args"] == ["/mnt/sandbox-tools"]  # everything
    assert injector["securityContext"]["runAsNonRoot"] is True
    # Not over /opt/sandbox-tools, where the injector's image holds what it copies.
    assert injector["volumeMounts"] == [
        {"name": "orchard-tools", "mountPath": "/mnt/sandbox-tools"}
    ]
    assert {"name": "orchard-tools", "emptyDir": {"sizeLimit": str(TOOLS_VOLUME_BYTES)}} in (
        pod["spec"]["volumes"]
    )
    main = _main(pod)
    assert {"name": "orchard-tools", "mountPath": "/opt/sandbox-tools", "readOnly": True} in (
        main["volumeMounts"]
    )
    assert {
        "name": "orchard-tools",
        "mountPath": "/etc/profile.d/sandbox-tools.sh",
        "subPath": "profile.sh",
        "readOnly": True,
    } in main["volumeMounts"]
    assert {"name": "ORCHARD_AGENT_TOOLS_BIN", "value": "/opt/sandbox-tools/bin"} in main["env"]
    for kind in ("requests", "limits"):
        before = int(_main(plain)["resources"][kind]["ephemeral-storage"])
        after = int(main["resources"][kind]["ephemeral-storage"])
        assert after == before + TOOLS_VOLUME_BYTES


@pytest.mark.parametrize("version", IMAGE_VOLUME_VERSIONS)
def test_image_volume_mode_is_valid_and_copies_nothing(
    version: str, kube_settings: ServiceSettings
) -> None:
    pod = _pod(kube_settings, "image")
    kubernetes_validate.validate(pod, version, strict=True)
    assert [c["name"] for c in pod["spec"]["initContainers"]] == ["agent-injector"]
    assert {
        "name": "orchard-tools",
        "image": {"reference": TOOLS_IMAGE, "pullPolicy": "IfNotPresent"},
    } in pod["spec"]["volumes"]
    assert {
        "name": "orchard-tools",
        "mountPath": "/opt/sandbox-tools",
        "subPath": "opt/sandbox-tools",
        "readOnly": True,
    } in _main(pod)["volumeMounts"]
    assert {
        "name": "orchard-tools",
        "mountPath": "/etc/profile.d/sandbox-tools.sh",
        "subPath": "opt/sandbox-tools/profile.sh",
        "readOnly": True,
    } in _main(pod)["volumeMounts"]


def test_a_subset_is_copied_alone(kube_settings: ServiceSettings) -> None:
    pod = _pod(kube_settings, "initcontainer", tools=("codex", "pi"))
    assert pod["spec"]["initContainers"][1]["args"] == ["/mnt/sandbox-tools", "codex", "pi"]


@pytest.mark.parametrize(
    ("mode", "tools", "image"),
    [("off", None, TOOLS_IMAGE), ("initcontainer", (), TOOLS_IMAGE), ("image", None, None)],
)
def test_no_tools(
    kube_settings: ServiceSettings, mode: str, tools: tuple[str, ...] | None, image: str | None
) -> None:
    settings = replace(kube_settings, tools_image=image, tools_volume_mode=mode)
    pod = pod_manifest(settings, make_spec(tools=tools))
    assert pod == pod_manifest(kube_settings, make_spec())
    assert all(v["name"] != "orchard-tools" for v in pod["spec"]["volumes"])
