"""The harness payload and the model gateway on the local cluster's real node: `orchard
deploy` with ``tools: true`` and ``model_endpoints``, a sandbox whose harnesses are on its
PATH, and one harness turn whose model calls go through the agent's loopback relay (the
connections the orchestrator parks at the agent) and the orchestrator's gateway to the
scripted fake model, recorded as the sandbox's trajectory.

The tools image is built by Podman from the machine's cached payload (the ``tools_payload``
fixture builds it once, from npm and PyPI) on busybox and pushed to the cluster's registry,
from which the node pulls it (``tools_volume_mode`` initcontainer: copied into each pod);
the deployment's own images are given the registry's names in containerd, as in
``test_cluster_snapshots.py``. The fake model listens at the cluster's stand-in for the
internet (a network namespace only the cluster's pods reach); its key reaches the
orchestrator through the Secret ``orchard-model-keys``, never the sandbox.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import docker
import httpx
import pytest
from kubernetes import client as k8s

from images.build import detect_builder
from manifests import MODEL_KEYS_DIR, MODEL_KEYS_SECRET
from orchard_env.contexts import client_settings
from tests.harnesses.test_harness_turns import COMMANDS, run_ok
from tests.images.builds import built_image
from tests.kube_local import INTERNET, INTERNET_NETNS, LocalCluster, unique_name
from tests.manifests.test_cluster import (
    CONTEXT,
    REGISTRY,
    Deployment,
    NodeImages,
    local_deployment,
    node_images,
)
from tests.orchestrator.backends.kube_node import tag_image
from tests.servers import printing_server
from tests.tools.test_tools_engine import VERSIONS_CMD, harness_versions

pytestmark = [pytest.mark.kube_real, pytest.mark.engine]
__all__ = ["node_images"]  # test_cluster's fixture
HARNESS = "codex"  # the turn's: a native binary, the quickest to start on the small node
KEY = "fake"  # the model key's name in the Secret


@dataclass(frozen=True)
class Model:
    url: str  # as the orchestrator's pod reaches it
    key: str


@pytest.fixture(scope="module")
def tools_image(
    local_cluster: LocalCluster,
    docker_client: docker.DockerClient,
    busybox_image: str,
    tools_payload: Path,
) -> Iterator[str]:
    """The tools image, under the name `orchard deploy` gives it, in the cluster's registry."""
    ref = f"{REGISTRY}/orchard/tools:test-{os.getpid()}"
    build = contextlib.contextmanager(built_image)
    with build(
        docker_client,
        detect_builder("podman"),
        "tools",
        ref,
        base_images={"FINAL_IMAGE": busybox_image},
    ) as built:
        subprocess.run(
            ["podman", "push", "--tls-verify=false", built, f"docker://{built}"],
            capture_output=True,
            check=True,
            timeout=900,
        )
        yield built  # the node's pulled copy goes with the cluster (see test_cluster)


@pytest.fixture
def model(local_cluster: LocalCluster) -> Iterator[Model]:
    """The scripted fake model at the cluster's stand-in for the internet."""
    key = "sk-fake-" + secrets.token_hex(8)
    command = [
        *("nsenter", f"--net=/run/netns/{INTERNET_NETNS}", "--", sys.executable),
        *("-m", "orchard_env.fake_model", "--host", INTERNET, "--key", key),
    ]
    with printing_server(command) as url:
        yield Model(url, key)


def _endpoints(model: Model) -> str:
    key_file = f"{MODEL_KEYS_DIR}/{KEY}"
    return (
        'default_openai = "fake"\ndefault_anthropic = "fake-anthropic"\n'
        f'[endpoints.fake]\napi = "openai"\nbase_url = "{model.url}/v1"\n'
        f'key_file = "{key_file}"\nmodel = "fake-model"\n'
        f'[endpoints.fake-anthropic]\napi = "anthropic"\nbase_url = "{model.url}"\n'
        f'key_file = "{key_file}"\n'
    )


@pytest.mark.timeout(1800)
def test_harnesses_and_a_turn_through_the_gateway_on_a_cluster(
    local_cluster: LocalCluster,
    node_images: NodeImages,
    tools_image: str,
    model: Model,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for ref in node_images.built:  # the deploy names them by the registry
        tag_image(ref, f"{REGISTRY}/{ref.split('/', 1)[1]}")
    namespace = unique_name("orchard")
    endpoints = tmp_path / "endpoints.toml"
    endpoints.write_text(_endpoints(model))
    settings = {
        "tools": True,
        "registry": {"server": REGISTRY, "plain_http": True},
        "model_endpoints": str(endpoints),
    }
    with local_deployment(
        local_cluster, node_images, tmp_path, namespace, **settings
    ) as deployment:
        deployed = deployment.orchard("deploy", *deployment.args, *deployment.tag)
        assert deployed.returncode == 0, deployed.stderr
        # The key, in the Secret the operator makes once the deploy made the namespace.
        with local_cluster.admin() as api:
            secret = {"metadata": {"name": MODEL_KEYS_SECRET}, "stringData": {KEY: model.key}}
            k8s.CoreV1Api(api).create_namespaced_secret(namespace, secret)
        _wait_for_the_key(deployment, namespace)
        monkeypatch.setenv("ORCHARD_CONFIG", deployment.env["ORCHARD_CONFIG"])  # the deploy's
        with deployment.reachable(deployed.stdout.strip().splitlines()[-1]) as url:
            key = client_settings(url, None, CONTEXT).api_key
            headers = {"X-API-Key": key or ""}
            with httpx.Client(base_url=url, headers=headers, timeout=900) as http:
                _check(http, node_images.smoke, model)


def _wait_for_the_key(deployment: Deployment, namespace: str) -> None:
    """Until the kubelet has put the Secret, made after the pod started, into its optional
    mount (at its next sync of the pod: a minute or so)."""
    command = [
        *("kubectl", "--kubeconfig", str(deployment.kubeconfig), "-n", namespace, "exec"),
        *("deploy/orchard-orchestrator", "--", "test", "-s", f"{MODEL_KEYS_DIR}/{KEY}"),
    ]
    deadline = time.monotonic() + 300
    while True:
        found = subprocess.run(
            command, env=deployment.env, capture_output=True, text=True, timeout=60, check=False
        )
        if found.returncode == 0:
            return
        assert time.monotonic() < deadline, f"the model key never appeared: {found.stderr}"
        time.sleep(2)


def _check(http: httpx.Client, image: str, model: Model) -> None:
    created = http.post("/sandboxes", json={"image": image, "model_gateway": {}})
    assert created.status_code == 201, created.text
    sandbox = created.json()["sandbox_id"]
    ready = http.get(f"/sandboxes/{sandbox}/wait", params={"timeout": 600})
    assert ready.json()["status"] == "ready", ready.text

    # Every harness of the payload on PATH, as its --version says.
    found = harness_versions(str(run_ok(http, sandbox, VERSIONS_CMD)["stdout"]))
    assert found["codex"].startswith("codex-cli ")
    assert run_ok(http, sandbox, "command -v codex")["stdout"] == "/opt/sandbox-tools/bin/codex\n"

    # One turn: the harness asks the model, runs the command it is given, answers.
    trajectory = "cluster-turn"
    put = http.put(f"/sandboxes/{sandbox}/trajectory", json={"trajectory_id": trajectory})
    assert put.status_code == 200, put.text
    turn = f"mkdir -p /tmp/turn && cd /tmp/turn && {COMMANDS[HARNESS]} && cat out.txt"
    assert str(run_ok(http, sandbox, turn)["stdout"]).endswith("hi\n")

    listed = http.get(f"/sandboxes/{sandbox}/model-calls", params={"trajectory_id": trajectory})
    calls = listed.json()["calls"]
    answered = [c for c in calls if c.get("status") == 200 and c.get("kind") == "main"]
    assert len(answered) >= 2, calls  # the tool call, then the answer (the real key was taken)
    assert [c["seq"] for c in calls] == list(range(1, len(calls) + 1))
    assert all(model.key not in str(c["request"]) for c in calls)
    trajectories = http.get(f"/sandboxes/{sandbox}/trajectories").json()["trajectories"]
    assert trajectory in [t["trajectory_id"] for t in trajectories], trajectories
    # The sandbox holds a dummy key, never the real one.
    environment = str(run_ok(http, sandbox, "env")["stdout"])
    assert model.key not in environment
    assert http.delete(f"/sandboxes/{sandbox}").status_code in (200, 204)
