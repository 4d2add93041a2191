"""`orchard init`, `orchard up --plan` and `orchard down` for the cluster targets (CliRunner).

Azure is the fake Resource Manager at the HTTP layer. What the commands construct is the real
AKS target with two test settings: a fake credential (``DefaultAzureCredential`` would look for
`az login` on this machine) and no waiting between polls of long-running operations.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner, Result

import provision.stages
from orchard_cli.main import app
from orchard_env.errors import ConfigError, EngineNotFound, InvalidRequest
from provision.aks import AksTarget
from provision.kubeconfig import KubeconfigTarget
from provision.profile import DeploymentProfile, load_profile
from tests.manifests.kube_fake import start_fake
from tests.provision.arm_fake import CLIENT_OPTIONS, SUBSCRIPTION, FakeArm, FakeCredential
from tests.provision.test_kubeconfig import FakeCluster, add_daemonset, node, registry

SAMPLE = f"""\
name: demo
target: aks
azure:
  subscription_id: {SUBSCRIPTION}
system_pool: {{vm_size: Standard_D4as_v5, min_nodes: 1, max_nodes: 2}}
sandbox_pool: {{vm_size: Standard_D8as_v5, min_nodes: 0, max_nodes: 4, spot: true}}
image_tag: 1.0.0-test
"""


class QuickAks(AksTarget):
    def __init__(self, profile: DeploymentProfile) -> None:
        super().__init__(profile, credential=FakeCredential(), client_options=CLIENT_OPTIONS)


@pytest.fixture(autouse=True)
def _test_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(provision.stages, "AksTarget", QuickAks)


@pytest.fixture
def sample(tmp_path: Path) -> Path:
    path = tmp_path / "sample.yaml"
    path.write_text(SAMPLE)
    return path


def invoke(*args: str) -> Result:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


def test_up_plan_prints_every_resource_and_the_hourly_cost(
    arm: FakeArm, sample: Path, tmp_path: Path
) -> None:
    result = invoke("up", "--plan", "--profile", str(sample), "--state-dir", str(tmp_path / "s"))
    assert result.exit_code == 0, result.output
    lines = [line.rstrip() for line in result.stdout.splitlines()]
    assert lines[0] == "Plan for 'demo' on aks (nothing has been changed)"
    kube = tmp_path / "kube" / "config"
    infrastructure = lines[
        lines.index("Infrastructure") + 1 : lines.index("Images (built here and pushed)") - 1
    ]
    assert infrastructure == [
        "+ create  resource group      demo-rg             in eastus",
        "+ create  container registry  demoacr             Basic, demoacr.azurecr.io",
        "+ create  AKS cluster         demo-aks            Kubernetes AKS default, Free tier, "
        "eastus; Azure CNI overlay, Calico network policy; pool system: System "
        "Standard_D4as_v5 x 1..2 (regular, Managed OS disk)",
        "+ create  node pool           sandbox             User Standard_D8as_v5 x 0..4 (spot, "
        "Managed OS disk); labels workload=sandbox, taint workload=sandbox:NoSchedule",
        "+ create  role assignment     AcrPull on demoacr  for the cluster's kubelet identity",
        f"~ update  kubeconfig context  demo-aks            {kube}",
    ]
    assert "  orchestrator: demoacr.azurecr.io/orchard/orchestrator:1.0.0-test" in lines
    assert "  sandbox: demoacr.azurecr.io/orchard/sandbox:1.0.0-test" in lines
    assert "Kubernetes objects (server-side apply, 19)" in lines
    assert "  ClusterRole orchard-nodes-orchard" in lines
    assert "  Deployment orchard/orchard-orchestrator" in lines
    assert "Stages provision: pending, images: pending, deploy: pending, smoke: pending" in lines
    # D4as_v5 $0.172/h and D8as_v5 spot $0.072618/h, each with a managed P10 ($19.71/730 h);
    # fixed: load balancer $0.025 + IP $0.005 + ACR Basic $0.167/24 per hour.
    assert "Estimated cost $0.24/h to $0.83/h (shipped prices, eastus)" in lines
    assert "  system pool 1..2 x Standard_D4as_v5 (on-demand) at $0.1990/h each" in lines
    assert (
        "  sandbox pool 0..4 x Standard_D8as_v5 (spot) at $0.0996/h each, 7 default-size "
        "sandboxes per node" in lines
    )
    assert arm.writes() == []  # a plan changes nothing
    assert not (tmp_path / "s").exists()


def test_up_plan_json(arm: FakeArm, sample: Path, tmp_path: Path) -> None:
    result = invoke("up", "--plan", "--json", "--profile", str(sample))
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["target"] == "aks"
    assert plan["changes"][0] == {
        "action": "create",
        "kind": "resource group",
        "name": "demo-rg",
        "details": ["in eastus"],
    }
    assert plan["cost"]["pricing"] == "spot"
    assert plan["cost"]["sandbox_nodes"] == [0, 4]


def test_up_plan_of_what_exists(arm: FakeArm, sample: Path) -> None:
    aks = AksTarget(
        load_profile(sample), credential=FakeCredential(), client_options=CLIENT_OPTIONS
    )
    aks.provision(lambda _m: None)
    result = invoke("up", "--plan", "--profile", str(sample))
    assert result.exit_code == 0, result.output
    assert "= exists  AKS cluster         demo-aks" in result.stdout
    assert "+ create" not in result.stdout


def test_down_deletes_what_up_created(arm: FakeArm, sample: Path) -> None:
    aks = AksTarget(
        load_profile(sample), credential=FakeCredential(), client_options=CLIENT_OPTIONS
    )
    aks.provision(lambda _m: None)
    arm.requests.clear()
    refused = invoke("down", "--profile", str(sample))
    assert refused.exit_code == 125 and "Rerun with --yes" in refused.output
    assert arm.writes() == []
    result = invoke("down", "--profile", str(sample), "--yes")
    assert result.exit_code == 0, result.output
    assert "- delete  resource group  demo-rg  and everything in it" in result.stderr
    assert arm.writes() == [f"DELETE /subscriptions/{SUBSCRIPTION}/resourcegroups/demo-rg"]


def test_target_and_profile_must_agree(sample: Path) -> None:
    result = invoke("up", "--target", "kubeconfig", "--profile", str(sample), "--plan")
    assert isinstance(result.exception, ConfigError)
    assert result.exception.message == (
        f"--target kubeconfig disagrees with profile {sample} (target: aks)"
    )


def test_plan_is_not_for_the_local_target(tmp_path: Path) -> None:
    result = invoke("up", "--plan", "--state-dir", str(tmp_path))
    assert isinstance(result.exception, InvalidRequest)
    assert result.exception.message == "--plan and --from are for the aks and kubeconfig targets"


def test_init_writes_a_profile_that_loads(tmp_path: Path) -> None:
    path = tmp_path / "orchard.yaml"
    result = invoke("init", "--target", "kubeconfig", "--name", "lab", "--output", str(path))
    assert result.exit_code == 0, result.output
    assert f"orchard up --profile {path} --plan" in result.stderr
    profile = load_profile(path)
    assert (profile.name, profile.target) == ("lab", "kubeconfig")
    assert path.read_text().startswith("# Orchard deployment profile.")
    again = invoke("init", "--output", str(path))
    assert isinstance(again.exception, ConfigError)
    assert again.exception.message == f"{path} exists"
    assert invoke("init", "--output", str(path), "--force").exit_code == 0
    assert load_profile(path).target == "aks"


def test_init_print_and_a_bad_name(tmp_path: Path) -> None:
    printed = invoke("init", "--print", "--name", "demo")
    assert printed.exit_code == 0
    assert yaml.safe_load(printed.stdout)["name"] == "demo"
    bad = invoke("init", "--print", "--name", "Not_A_Label")
    assert isinstance(bad.exception, ConfigError)
    assert bad.exception.message == (
        "--name: name: 'Not_A_Label' must be a DNS label of at most 40 characters"
    )


def test_a_cluster_target_without_profile_uses_orchard_yaml_here(
    arm: FakeArm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "orchard.yaml").write_text(SAMPLE)
    result = invoke("up", "--target", "aks", "--plan")
    assert result.exit_code == 0, result.output
    assert "Using the profile orchard.yaml." in result.stderr
    assert result.stdout.startswith("Plan for 'demo' on aks")
    mismatch = invoke("up", "--target", "kubeconfig", "--plan")
    assert isinstance(mismatch.exception, ConfigError)
    assert mismatch.exception.message == (
        "--target kubeconfig disagrees with profile orchard.yaml (target: aks)"
    )


class QuickKubeconfig(KubeconfigTarget):
    def __init__(self, profile: DeploymentProfile) -> None:
        super().__init__(profile, registry_transport=registry(401))


def test_up_on_a_cluster_shows_each_stage_and_names_the_one_that_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeCluster(rollout_polls=0)
    running = start_fake(fake)
    try:
        for obj in (node("worker-a"), node("worker-b")):
            fake.objects[f"/api/v1/nodes/{obj['metadata']['name']}"] = obj
        add_daemonset(fake, "calico-system", "calico-node")
        profile = tmp_path / "lab.yaml"
        profile.write_text(
            yaml.safe_dump(
                {
                    "name": "lab",
                    "target": "kubeconfig",
                    "kubeconfig": {
                        "path": str(fake.kubeconfig(tmp_path / "kc")),
                        "context": "fake",
                    },
                    "registry": {"server": "registry.example:5000"},
                    "image_tag": "1.0.0-test",
                }
            )
        )
        monkeypatch.setattr(provision.stages, "KubeconfigTarget", QuickKubeconfig)
        monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # no image builder
        state = tmp_path / "state"
        result = invoke("up", "--profile", str(profile), "--yes", "--state-dir", str(state))
    finally:
        running.stop()
    assert isinstance(result.exception, EngineNotFound)
    assert "✓ provision: Kubernetes v1.31.2 at http://127.0.0.1:" in result.stderr
    assert "network policy: Calico; sandbox nodes: worker-a, worker-b" in result.stderr
    assert "✗ images: no image builder works here" in result.stderr
    assert result.exception.hint is not None
    assert (
        f"`orchard up --profile {profile} --state-dir {state}` resumes at the images stage"
        in result.exception.hint
    )
