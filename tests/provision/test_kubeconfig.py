"""The kubeconfig target against a fake API server over real HTTP, and the kubeconfig merge.

The fake is the deploy tests' :class:`~tests.manifests.kube_fake.FakeKube` (a stateful object
store behind the real ``kubernetes`` client), plus what these checks read and write: the
server version, and strategic merge patches of nodes (labels merged, taints replaced).
"""

from __future__ import annotations

import copy
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from orchard_env.errors import BackendUnavailable, ConfigError, OrchardError
from provision.base import Change
from provision.kubeconfig import (
    KubeconfigTarget,
    merge_kubeconfig,
    read_kubeconfig,
    remove_kubeconfig_context,
    write_kubeconfig,
)
from provision.profile import DeploymentProfile, parse_profile
from tests.manifests.kube_fake import FakeKube, Request, RunningFake, start_fake

TAINT = {"key": "workload", "value": "sandbox", "effect": "NoSchedule"}


class FakeCluster(FakeKube):
    version: str = "v1.31.2"

    def handle(self, request: Request) -> tuple[int, dict[str, Any]]:
        if request.path.rstrip("/") == "/version":
            with self.lock:
                self.requests.append(request)
            return 200, {"major": "1", "minor": "31", "gitVersion": self.version}
        if request.method == "PATCH" and request.path.startswith("/api/v1/nodes/"):
            return self._patch_node(request)
        return super().handle(request)

    def _patch_node(self, request: Request) -> tuple[int, dict[str, Any]]:
        assert request.content_type == "application/strategic-merge-patch+json"
        with self.lock:
            self.requests.append(request)
            node = self.objects[request.path]
            labels = node["metadata"].setdefault("labels", {})
            for key, value in request.body.get("metadata", {}).get("labels", {}).items():
                if value is None:
                    labels.pop(key, None)
                else:
                    labels[key] = value
            if "taints" in request.body.get("spec", {}):
                node.setdefault("spec", {})["taints"] = request.body["spec"]["taints"]
            return 200, copy.deepcopy(node)


def node(name: str, *, labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": spec,
    }


def add(fake: FakeKube, obj: dict[str, Any], path: str) -> None:
    fake.objects[path] = obj


def add_daemonset(fake: FakeKube, namespace: str, name: str) -> None:
    add(
        fake,
        {"kind": "DaemonSet", "metadata": {"name": name, "namespace": namespace}},
        f"/apis/apps/v1/namespaces/{namespace}/daemonsets/{name}",
    )


@pytest.fixture
def cluster() -> Iterator[FakeCluster]:
    fake = FakeCluster()
    running: RunningFake = start_fake(fake)
    for obj in (
        node("cp-0", labels={"node-role.kubernetes.io/control-plane": ""}),
        node("worker-a"),
        node("worker-b", taints=[{"key": "gpu", "value": "true", "effect": "NoSchedule"}]),
        node("worker-c", unschedulable=True),
    ):
        add(fake, obj, f"/api/v1/nodes/{obj['metadata']['name']}")
    try:
        yield fake
    finally:
        running.stop()


def registry(status: int, scheme: str = "https") -> httpx.MockTransport:
    def answer(request: httpx.Request) -> httpx.Response:
        assert str(request.url) == f"{scheme}://registry.example:5000/v2/"
        return httpx.Response(status)

    return httpx.MockTransport(answer)


def make(
    fake: FakeCluster,
    tmp_path: Path,
    *,
    status: int = 401,
    server: str | None = None,
    plain_http: bool = False,
) -> KubeconfigTarget:
    path = fake.kubeconfig(tmp_path / "kubeconfig")
    profile: DeploymentProfile = parse_profile(
        {
            "target": "kubeconfig",
            "kubeconfig": {"path": str(path), "context": "fake"},
            "registry": {"server": server or "registry.example:5000", "plain_http": plain_http},
        },
        source="test",
    )
    scheme = "http" if plain_http else "https"
    return KubeconfigTarget(profile, registry_transport=registry(status, scheme))


def test_checks_find_version_policy_engine_and_nodes_to_label(
    cluster: FakeCluster, tmp_path: Path
) -> None:
    add_daemonset(cluster, "calico-system", "calico-node")
    target = make(cluster, tmp_path)
    report = target.check()
    assert report.server == cluster.url
    assert report.version == "v1.31.2"
    assert report.network_policy == ["Calico"]
    assert (report.sandbox_nodes, report.to_label, report.to_taint) == (
        [],
        ["worker-a", "worker-b"],
        ["worker-b"],  # worker-a stays untainted for the orchestrator
    )
    assert report.registry_ok and report.warnings == []
    assert target.changes(report) == [
        Change("update", "node", "worker-a", ("label workload=sandbox",)),
        Change(
            "update",
            "node",
            "worker-b",
            ("label workload=sandbox", "taint workload=sandbox:NoSchedule"),
        ),
    ]
    assert {r.method for r in cluster.requests} == {"GET"}  # checks only read


def test_labelling_needs_consent_and_then_labels_and_taints(
    cluster: FakeCluster, tmp_path: Path
) -> None:
    add_daemonset(cluster, "kube-system", "cilium")
    target = make(cluster, tmp_path)
    with pytest.raises(OrchardError) as caught:
        target.provision(lambda _m: None, consent=False)
    assert caught.value.message == (
        "no node is labelled workload=sandbox; Orchard would label worker-a, worker-b and "
        "taint worker-b"
    )
    assert caught.value.hint is not None and caught.value.hint.startswith("rerun with --yes")
    assert {r.method for r in cluster.requests} == {"GET"}

    outputs = target.provision(lambda _m: None, consent=True)
    assert outputs["labelled_nodes"] == ["worker-a", "worker-b"]
    assert outputs["network_policy"] == ["Cilium"]
    a = cluster.objects["/api/v1/nodes/worker-a"]
    b = cluster.objects["/api/v1/nodes/worker-b"]
    assert a["metadata"]["labels"] == {"workload": "sandbox"} and "taints" not in a["spec"]
    assert b["metadata"]["labels"] == {"workload": "sandbox"}
    assert b["spec"]["taints"] == [{"key": "gpu", "value": "true", "effect": "NoSchedule"}, TAINT]

    again = make(cluster, tmp_path).check()  # found now: nothing more to label
    assert (again.sandbox_nodes, again.to_label) == (["worker-a", "worker-b"], [])
    assert again.untainted_sandbox_nodes == ["worker-a"]

    target.unlabel(outputs["labelled_nodes"], lambda _m: None)
    assert cluster.objects["/api/v1/nodes/worker-a"]["metadata"]["labels"] == {}
    assert cluster.objects["/api/v1/nodes/worker-b"]["spec"]["taints"] == [
        {"key": "gpu", "value": "true", "effect": "NoSchedule"}
    ]


def test_no_policy_engine_is_warned_about_loudly(cluster: FakeCluster, tmp_path: Path) -> None:
    add_daemonset(cluster, "kube-system", "kube-proxy")
    report = make(cluster, tmp_path).check()
    assert report.network_policy == []
    assert report.warnings[0].startswith("NO NETWORKPOLICY ENGINE FOUND: ")
    assert "Unless an engine runs outside pods (kube-router" in report.warnings[0]
    assert "sandbox isolation is fake" in report.warnings[0]
    assert "`orchard smoke` (the last stage of `orchard up`) checks" in report.warnings[0]


def test_a_single_worker_is_labelled_but_not_tainted(cluster: FakeCluster, tmp_path: Path) -> None:
    for name in ("worker-b", "worker-c"):
        del cluster.objects[f"/api/v1/nodes/{name}"]
    add_daemonset(cluster, "calico-system", "calico-node")
    report = make(cluster, tmp_path).check()
    assert (report.to_label, report.to_taint) == (["worker-a"], [])
    assert any("sandboxes will share it with the orchestrator" in w for w in report.warnings)


def test_forbidden_daemonset_list_means_unknown_enforcement(
    cluster: FakeCluster, tmp_path: Path
) -> None:
    cluster.forbidden.add("/apis/apps/v1/daemonsets")
    report = make(cluster, tmp_path).check()
    assert not report.network_policy_known
    assert report.warnings[0].startswith("cannot list DaemonSets (forbidden)")


@pytest.mark.parametrize(("status", "ok"), [(200, True), (401, True), (404, False), (503, False)])
def test_the_registry_must_answer_200_or_401(
    cluster: FakeCluster, tmp_path: Path, status: int, ok: bool
) -> None:
    target = make(cluster, tmp_path, status=status)
    report = target.check()
    assert report.registry_ok is ok
    problem = target.registry_problem(report)
    if ok:
        assert problem is None
    else:
        assert problem == (
            "registry registry.example:5000 does not answer on "
            f"https://registry.example:5000/v2/ ({status})"
        )
        with pytest.raises(ConfigError, match="does not answer"):
            target.provision(lambda _m: None, consent=True)


def test_a_plain_http_registry_is_checked_over_http(cluster: FakeCluster, tmp_path: Path) -> None:
    target = make(cluster, tmp_path, status=200, plain_http=True)
    assert target.check().registry_ok
    down = make(cluster, tmp_path, status=503, plain_http=True)
    assert down.registry_problem(down.check()) == (
        "registry registry.example:5000 does not answer on http://registry.example:5000/v2/ (503)"
    )


def test_an_old_cluster_is_refused(cluster: FakeCluster, tmp_path: Path) -> None:
    cluster.version = "v1.24.17"
    with pytest.raises(ConfigError) as caught:
        make(cluster, tmp_path).check()
    assert (
        caught.value.message == "the cluster runs Kubernetes v1.24.17; Orchard needs 1.29 or newer"
    )


def test_an_unreachable_cluster_names_its_server(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    fake = FakeCluster(url=f"http://127.0.0.1:{port}")
    target = make(fake, tmp_path)
    with pytest.raises(BackendUnavailable) as caught:
        target.check()
    assert caught.value.message.startswith(
        f"the cluster at http://127.0.0.1:{port} does not answer"
    )


def test_a_missing_kubeconfig_is_a_config_error(tmp_path: Path) -> None:
    profile = parse_profile(
        {"target": "kubeconfig", "kubeconfig": {"path": str(tmp_path / "nope")}}, source="t"
    )
    with pytest.raises(ConfigError, match=r"kubeconfig .*nope does not exist"):
        KubeconfigTarget(profile).check()


# --- the kubeconfig merge ----------------------------------------------------------------------


def config(name: str, server: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": {"server": server}}],
        "users": [{"name": f"{name}-user", "user": {"token": name}}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": f"{name}-user"}}],
        "current-context": name,
    }


def test_merge_adds_one_named_context_and_keeps_the_others() -> None:
    base = config("kind", "https://127.0.0.1:6443")
    merged = merge_kubeconfig(base, config("clusterUser", "https://aks:443"), name="prod")
    assert [c["name"] for c in merged["clusters"]] == ["kind", "prod"]
    assert [u["name"] for u in merged["users"]] == ["kind-user", "prod"]
    assert merged["contexts"][1] == {"name": "prod", "context": {"cluster": "prod", "user": "prod"}}
    assert merged["clusters"][1]["cluster"] == {"server": "https://aks:443"}
    assert merged["current-context"] == "prod"
    assert base["current-context"] == "kind"  # the input is not changed


def test_merge_replaces_a_context_of_the_same_name() -> None:
    first = merge_kubeconfig({}, config("x", "https://old:443"), name="prod")
    second = merge_kubeconfig(
        first, config("y", "https://new:443"), name="prod", make_current=False
    )
    assert [c["cluster"]["server"] for c in second["clusters"]] == ["https://new:443"]
    assert len(second["users"]) == len(second["contexts"]) == 1
    assert second["current-context"] == "prod"


def test_merge_refuses_a_config_without_exactly_one_context() -> None:
    broken = config("x", "https://a:443")
    broken["contexts"] = []
    with pytest.raises(ConfigError, match="expected one context, found 0"):
        merge_kubeconfig({}, broken, name="prod")
    broken = config("x", "https://a:443")
    broken["contexts"][0]["context"]["user"] = "nobody"
    with pytest.raises(ConfigError, match="names a cluster or user it does not hold"):
        merge_kubeconfig({}, broken, name="prod")


def test_remove_takes_out_only_that_context() -> None:
    merged = merge_kubeconfig(config("kind", "https://k:6443"), config("a", "https://a"), name="p")
    removed = remove_kubeconfig_context(merged, "p")
    assert removed["contexts"] == config("kind", "https://k:6443")["contexts"]
    assert [c["name"] for c in removed["clusters"]] == ["kind"]
    assert removed["current-context"] == ""


def test_write_is_0600_and_read_handles_missing_and_bad_files(tmp_path: Path) -> None:
    path = tmp_path / "dir" / "config"
    assert read_kubeconfig(path)["contexts"] == []
    write_kubeconfig(path, config("a", "https://a"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_kubeconfig(path) == config("a", "https://a")
    path.write_text("clusters: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        read_kubeconfig(path)
    path.write_text(yaml.safe_dump(["a"]))
    with pytest.raises(ConfigError, match="is not a mapping"):
        read_kubeconfig(path)
