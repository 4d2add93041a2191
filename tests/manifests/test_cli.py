"""`orchard deploy` and `orchard undeploy` at the command line: what goes to stdout and stderr,
the context they write, and that the admin key is never printed."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from manifests import BOOTSTRAP_SECRET, MASKED
from orchard_cli.main import app
from orchard_env import contexts
from tests.manifests.kube_fake import FakeKube

runner = CliRunner()
TAG = "0.1.0-test"


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    path = tmp_path / "config.toml"
    monkeypatch.setenv("ORCHARD_CONFIG", str(path))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    monkeypatch.chdir(tmp_path)  # no ./orchard.yaml
    for name in ("ORCHARD_URL", "ORCHARD_API_KEY", "ORCHARD_CONTEXT"):
        monkeypatch.delenv(name, raising=False)
    return path


def test_render_prints_kubectl_yaml_with_masked_secrets() -> None:
    result = runner.invoke(app, ["deploy", "--render", "--tag", TAG])
    assert result.exit_code == 0, result.output
    objects = list(yaml.safe_load_all(result.stdout))
    assert objects[0]["kind"] == "Namespace"
    assert all({"apiVersion", "kind", "metadata"} <= obj.keys() for obj in objects)
    secret = next(obj for obj in objects if obj["kind"] == "Secret")
    assert secret["metadata"]["name"] == BOOTSTRAP_SECRET
    assert secret["stringData"] == {"api-key": MASKED}
    assert "ork_" not in result.stdout
    deployment = next(obj for obj in objects if obj["kind"] == "Deployment")
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == f"localhost/orchard/orchestrator:{TAG}"
    assert "nodeSelector" not in deployment["spec"]["template"]["spec"]  # generic cluster
    # The tools image is opt-in: unless the profile says `tools: true` it is not built, so
    # sandboxes must not be given it (a pod with an image no registry holds never starts).
    config_map = next(obj for obj in objects if obj["kind"] == "ConfigMap")
    assert "ORCHARD_TOOLS_IMAGE" not in config_map["data"]
    assert result.stderr == ""


def test_render_reads_the_profile(tmp_path: Path) -> None:
    profile = tmp_path / "aks.yaml"
    profile.write_text(
        yaml.safe_dump(
            {"name": "prod", "target": "aks", "registry": {"server": "prodacr.azurecr.io"}}
        )
    )
    result = runner.invoke(app, ["deploy", "--render", "--profile", str(profile), "--tag", TAG])
    assert result.exit_code == 0, result.output
    deployment = next(o for o in yaml.safe_load_all(result.stdout) if o["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"kubernetes.azure.com/mode": "system"}
    assert pod["containers"][0]["image"] == f"prodacr.azurecr.io/orchard/orchestrator:{TAG}"
    assert deployment["metadata"]["labels"]["app.kubernetes.io/instance"] == "prod"


def test_a_profile_with_tools_gives_the_sandboxes_the_tools_image(tmp_path: Path) -> None:
    profile = tmp_path / "tools.yaml"
    profile.write_text(yaml.safe_dump({"target": "kubeconfig", "tools": True}))
    result = runner.invoke(app, ["deploy", "--render", "--profile", str(profile), "--tag", TAG])
    assert result.exit_code == 0, result.output
    config_map = next(o for o in yaml.safe_load_all(result.stdout) if o["kind"] == "ConfigMap")
    assert config_map["data"]["ORCHARD_TOOLS_IMAGE"] == f"localhost/orchard/tools:{TAG}"


def test_dry_run_without_a_cluster_still_renders(tmp_path: Path) -> None:
    result = runner.invoke(app, ["deploy", "--dry-run", "--tag", TAG])
    assert result.exit_code == 0, result.output
    assert next(yaml.safe_load_all(result.stdout))["kind"] == "Namespace"
    assert " ".join(result.stderr.split()) == (
        f"No server-side dry run: no cluster to ask: cannot use kubeconfig "
        f"{tmp_path / 'no-kubeconfig'}: Invalid kube-config file. No configuration found."
    )


def test_dry_run_against_a_cluster_stores_nothing(kube: FakeKube, kubeconfig: Path) -> None:
    result = runner.invoke(
        app, ["deploy", "--dry-run", "--tag", TAG, "--kubeconfig", str(kubeconfig)]
    )
    assert result.exit_code == 0, result.output
    assert "namespace/orchard created" in result.stderr
    assert "the cluster accepts every object (nothing was stored)" in result.stderr
    assert kube.objects == {}


def test_deploy_writes_a_context_and_never_prints_the_key(kube: FakeKube, kubeconfig: Path) -> None:
    kube.rollout_polls = 1
    args = ["deploy", "--tag", TAG, "--kubeconfig", str(kubeconfig), "--context", "k8s"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.stdout == "http://127.0.0.1:8000\n"
    secret = kube.get(f"/api/v1/namespaces/orchard/secrets/{BOOTSTRAP_SECRET}")
    assert secret is not None
    key = base64.b64decode(secret["data"]["api-key"]).decode()
    assert key not in result.stdout and key not in result.stderr
    assert "context 'k8s' written with a new admin key" in result.stderr
    assert "kubectl -n orchard port-forward svc/orchard 8000:80 --kubeconfig" in result.stderr
    name, context = contexts.active_context(contexts.load_config_file())
    assert (name, context) == ("k8s", {"url": "http://127.0.0.1:8000", "api_key": key})

    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    assert "0 changed" in again.stderr
    assert "context 'k8s' written with the deployment's admin key" in again.stderr


def test_undeploy_asks_first_then_deletes_and_removes_the_context(
    kube: FakeKube, kubeconfig: Path
) -> None:
    kube.rollout_polls = 1
    kube.delete_polls = 0
    deployed = runner.invoke(app, ["deploy", "--tag", TAG, "--kubeconfig", str(kubeconfig)])
    assert deployed.exit_code == 0, deployed.output
    refused = runner.invoke(app, ["undeploy", "--kubeconfig", str(kubeconfig)])
    assert refused.exit_code == 125
    assert "Rerun with --yes" in refused.stderr
    assert kube.objects != {}

    result = runner.invoke(app, ["undeploy", "--kubeconfig", str(kubeconfig), "--yes"])
    assert result.exit_code == 0, result.output
    assert "deleted namespaces orchard-sandboxes, orchard" in result.stderr
    assert "context 'orchard' removed" in result.stderr
    assert kube.objects == {}
    assert contexts.load_config_file().get("contexts") == {}
