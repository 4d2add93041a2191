"""Any existing cluster (target ``kubeconfig``), and the kubeconfig files both cluster targets use.

What `orchard up --target kubeconfig` checks before it deploys anything:

- the cluster answers, and its Kubernetes version is one Orchard supports;
- NetworkPolicies are enforced (a Calico, Cilium, Azure NPM, Antrea or kube-router DaemonSet
  runs). Without an enforcing plugin a NetworkPolicy is accepted and silently ignored, so
  sandboxes would not be isolated from each other or the network: that is warned about loudly.
  An engine running outside pods (kube-router or k3s's controller as a node process) is not
  visible to the API, so the warning says so; `orchard smoke` then checks enforcement itself;
- sandbox nodes exist (label ``workload=sandbox``). When none does, Orchard labels and taints
  worker nodes itself, but only with consent (``--yes``), and always leaves one node without
  the taint for the orchestrator;
- the registry answers on ``https://<server>/v2/`` (200, or 401 asking for a login);
  ``http://`` for a registry of ``registry.plain_http``.

The kubeconfig helpers (:func:`merge_kubeconfig`, :func:`write_kubeconfig`,
:func:`remove_kubeconfig_context`) are plain YAML dictionaries in, dictionaries out, so the AKS
target merges its fetched credentials with the same code.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import yaml

from manifests import SUPPORTED_KUBERNETES_VERSIONS
from orchard_env.errors import BackendUnavailable, ConfigError, OrchardError
from provision.base import Change, Progress
from provision.profile import DeploymentProfile

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

SANDBOX_LABEL = ("workload", "sandbox")
SANDBOX_TAINT = {"key": "workload", "value": "sandbox", "effect": "NoSchedule"}
MIN_KUBERNETES = tuple(int(part) for part in SUPPORTED_KUBERNETES_VERSIONS[0].split("."))
_CONTROL_PLANE_LABELS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")
# DaemonSet names of the plugins that enforce NetworkPolicies, and what to call them.
NETWORK_POLICY_DAEMONSETS = {
    "calico-node": "Calico",
    "cilium": "Cilium",
    "azure-npm": "Azure NPM",
    "antrea-agent": "Antrea",
    "kube-router": "kube-router",
}


# --- kubeconfig files ------------------------------------------------------------------------


def default_kubeconfig_path() -> Path:
    """The file kubectl writes to: the first entry of ``KUBECONFIG``, else ``~/.kube/config``."""
    env = os.environ.get("KUBECONFIG", "")
    first = next((part for part in env.split(os.pathsep) if part), None)
    return Path(first).expanduser() if first else Path.home() / ".kube" / "config"


def kubeconfig_path(profile: DeploymentProfile) -> Path:
    return (
        Path(profile.kubeconfig.path).expanduser()
        if profile.kubeconfig.path
        else (default_kubeconfig_path())
    )


def read_kubeconfig(path: Path) -> dict[str, Any]:
    """A kubeconfig as a dictionary; a missing file is an empty config."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {"apiVersion": "v1", "kind": "Config", "clusters": [], "users": [], "contexts": []}
    except OSError as exc:
        raise ConfigError(f"cannot read kubeconfig {path}: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"kubeconfig {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"kubeconfig {path} is not a mapping")
    return data


def _named(entries: Any, source: str, kind: str) -> list[dict[str, Any]]:
    if entries is None:
        return []
    if not isinstance(entries, list) or not all(
        isinstance(entry, dict) and isinstance(entry.get("name"), str) for entry in entries
    ):
        raise ConfigError(f"{source}: '{kind}' must be a list of entries with a name")
    return [dict(entry) for entry in entries]


def merge_kubeconfig(
    base: Mapping[str, Any], new: Mapping[str, Any], *, name: str, make_current: bool = True
) -> dict[str, Any]:
    """``base`` with the single context of ``new`` added as ``name``.

    The new cluster, user and context entries are all renamed ``name`` (as kind does), and
    replace entries of that name in ``base``; every other entry of ``base`` is kept as it is.
    """
    clusters = _named(new.get("clusters"), "new kubeconfig", "clusters")
    users = _named(new.get("users"), "new kubeconfig", "users")
    contexts = _named(new.get("contexts"), "new kubeconfig", "contexts")
    if len(contexts) != 1:
        raise ConfigError(f"new kubeconfig: expected one context, found {len(contexts)}")
    context = dict(contexts[0].get("context") or {})
    cluster = next((c for c in clusters if c["name"] == context.get("cluster")), None)
    user = next((u for u in users if u["name"] == context.get("user")), None)
    if cluster is None or user is None:
        raise ConfigError("new kubeconfig: its context names a cluster or user it does not hold")
    merged = dict(base)
    merged.setdefault("apiVersion", "v1")
    merged.setdefault("kind", "Config")
    for key, entry in (
        ("clusters", {**cluster, "name": name}),
        ("users", {**user, "name": name}),
        ("contexts", {"name": name, "context": {**context, "cluster": name, "user": name}}),
    ):
        kept = [e for e in _named(base.get(key), "kubeconfig", key) if e["name"] != name]
        merged[key] = [*kept, entry]
    if make_current or not merged.get("current-context"):
        merged["current-context"] = name
    return merged


def remove_kubeconfig_context(base: Mapping[str, Any], name: str) -> dict[str, Any]:
    """``base`` without the context ``name`` and the cluster and user entries of that name."""
    result = dict(base)
    for key in ("clusters", "users", "contexts"):
        result[key] = [e for e in _named(base.get(key), "kubeconfig", key) if e["name"] != name]
    if result.get("current-context") == name:
        result["current-context"] = ""
    return result


def write_kubeconfig(path: Path, data: Mapping[str, Any]) -> None:
    """Write atomically with mode 0600 (it holds credentials)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.orchard-tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        yaml.safe_dump(dict(data), handle, default_flow_style=False, sort_keys=False)
    tmp.chmod(0o600)
    tmp.replace(path)


def api_client(path: Path, context: str | None) -> ApiClient:
    """A Kubernetes API client for one context of a kubeconfig file."""
    from kubernetes import config as kube_config
    from kubernetes.config.config_exception import ConfigException

    if not path.exists():
        raise ConfigError(
            f"kubeconfig {path} does not exist",
            hint="set kubeconfig.path in the profile, or KUBECONFIG",
        )
    loader: Any = kube_config.new_client_from_config  # untyped in the kubernetes package
    try:
        client: ApiClient = loader(config_file=str(path), context=context, persist_config=False)
    except ConfigException as exc:
        raise ConfigError(
            f"kubeconfig {path}: {exc}",
            hint="`kubectl config get-contexts` lists the contexts; set kubeconfig.context",
        ) from exc
    return client


# --- cluster checks --------------------------------------------------------------------------


def _version_tuple(git_version: str) -> tuple[int, int] | None:
    match = re.match(r"^v?(\d+)\.(\d+)", git_version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _name(obj: Mapping[str, Any]) -> str:
    return str(obj.get("metadata", {}).get("name", ""))


def _labels(obj: Mapping[str, Any]) -> dict[str, str]:
    return dict(obj.get("metadata", {}).get("labels") or {})


def _taints(node: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list(node.get("spec", {}).get("taints") or [])


def _is_control_plane(node: Mapping[str, Any]) -> bool:
    return any(label in _labels(node) for label in _CONTROL_PLANE_LABELS)


def _has_sandbox_taint(node: Mapping[str, Any]) -> bool:
    return any(
        t.get("key") == SANDBOX_TAINT["key"] and t.get("effect") == SANDBOX_TAINT["effect"]
        for t in _taints(node)
    )


@dataclass
class ClusterReport:
    """What the checks found (read-only)."""

    server: str
    version: str
    network_policy: list[str]
    network_policy_known: bool
    sandbox_nodes: list[str]
    untainted_sandbox_nodes: list[str]
    to_label: list[str]
    to_taint: list[str]
    registry: str | None
    registry_status: str
    warnings: list[str] = field(default_factory=list)

    @property
    def registry_ok(self) -> bool:
        return self.registry_status in ("200", "401")


class KubeconfigTarget:
    """An existing cluster reached through a kubeconfig context."""

    target = "kubeconfig"

    def __init__(
        self,
        profile: DeploymentProfile,
        *,
        registry_transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.profile = profile
        self.path = kubeconfig_path(profile)
        self.context = profile.kubeconfig.context
        self._registry_transport = registry_transport
        self._client: ApiClient | None = None

    @property
    def client(self) -> ApiClient:
        if self._client is None:
            self._client = api_client(self.path, self.context)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            closer: Any = self._client.close  # untyped in the kubernetes package
            closer()
            self._client = None

    def _json(self, call: Callable[..., Any], *args: Any) -> dict[str, Any]:
        """One API call's JSON (wire field names, no model objects)."""
        response = call(*args, _preload_content=False, _request_timeout=30)
        data: dict[str, Any] = json.loads(response.data)
        return data

    # --- checks --------------------------------------------------------------------------

    def _version(self) -> tuple[str, str]:
        from kubernetes.client import VersionApi
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        server = str(self.client.configuration.host)
        try:
            info = self._json(VersionApi(self.client).get_code)
        except (ApiException, HTTPError, OSError) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise BackendUnavailable(
                f"the cluster at {server} does not answer: {reason}",
                hint=f"check the context ({self.context or 'current'}) in {self.path}: "
                "`kubectl --context <name> version`",
            ) from exc
        version = str(info.get("gitVersion", ""))
        parsed = _version_tuple(version)
        if parsed is not None and parsed < MIN_KUBERNETES:
            oldest = ".".join(map(str, MIN_KUBERNETES))
            raise ConfigError(
                f"the cluster runs Kubernetes {version}; Orchard needs {oldest} or newer",
                hint="upgrade the cluster, or use another context (kubeconfig.context)",
            )
        return server, version

    def _network_policy(self) -> tuple[list[str], bool]:
        from kubernetes.client import AppsV1Api
        from kubernetes.client.exceptions import ApiException

        try:
            daemonsets = self._json(AppsV1Api(self.client).list_daemon_set_for_all_namespaces)
        except ApiException as exc:
            if exc.status == 403:
                return [], False
            raise
        found = {
            NETWORK_POLICY_DAEMONSETS[_name(ds)]
            for ds in daemonsets.get("items", [])
            if _name(ds) in NETWORK_POLICY_DAEMONSETS
        }
        return sorted(found), True

    def _nodes(self) -> tuple[list[str], list[str], list[str], list[str]]:
        """(sandbox nodes, untainted sandbox nodes, nodes to label, nodes to taint)."""
        from kubernetes.client import CoreV1Api

        nodes = self._json(CoreV1Api(self.client).list_node).get("items", [])
        key, value = SANDBOX_LABEL
        labelled = [n for n in nodes if _labels(n).get(key) == value]
        if labelled:
            untainted = [_name(n) for n in labelled if not _has_sandbox_taint(n)]
            return sorted(_name(n) for n in labelled), sorted(untainted), [], []
        names = sorted(
            _name(n)
            for n in nodes
            if not _is_control_plane(n) and not n.get("spec", {}).get("unschedulable")
        )
        # The first worker stays untainted so the orchestrator has somewhere to run; with a
        # single worker, sandboxes share it (labelled, not tainted).
        return [], [], names, names[1:]

    def _registry(self) -> tuple[str | None, str]:
        server = self.profile.registry.server
        if server is None:
            return None, "not set"
        url = f"{self._registry_url(server)}/v2/"
        try:
            with httpx.Client(transport=self._registry_transport, timeout=15) as client:
                response = client.get(url)
        except httpx.HTTPError as exc:
            return server, f"unreachable ({type(exc).__name__}: {exc})"
        return server, str(response.status_code)

    def check(self) -> ClusterReport:
        """Read-only checks of the cluster and the registry."""
        server, version = self._version()
        engines, known = self._network_policy()
        sandbox, untainted, to_label, to_taint = self._nodes()
        registry, status = self._registry()
        report = ClusterReport(
            server=server,
            version=version,
            network_policy=engines,
            network_policy_known=known,
            sandbox_nodes=sandbox,
            untainted_sandbox_nodes=untainted,
            to_label=to_label,
            to_taint=to_taint,
            registry=registry,
            registry_status=status,
        )
        if not known:
            report.warnings.append(
                "cannot list DaemonSets (forbidden), so whether NetworkPolicies are enforced is "
                "unknown: sandboxes may not be isolated"
            )
        elif not engines:
            report.warnings.append(
                "NO NETWORKPOLICY ENGINE FOUND: no Calico, Cilium, Azure NPM, Antrea or "
                "kube-router DaemonSet runs in this cluster. Unless an engine runs outside pods "
                "(kube-router or k3s's embedded policy controller as a process of each node), "
                "the NetworkPolicies Orchard creates are ignored and sandbox isolation is fake "
                "(any sandbox with network can reach any pod). `orchard smoke` (the last stage "
                "of `orchard up`) checks that a sandbox's egress is refused and fails if it is "
                "not; install a policy engine (e.g. Calico) before running untrusted code."
            )
        if untainted:
            report.warnings.append(
                f"sandbox nodes without the {_taint_text()} taint: {', '.join(untainted)} "
                "(other pods may be scheduled next to sandboxes)"
            )
        if to_label and len(to_label) == 1:
            report.warnings.append(
                f"one schedulable node ({to_label[0]}): sandboxes will share it with the "
                "orchestrator (labelled, not tainted)"
            )
        if not sandbox and not to_label:
            report.warnings.append("no schedulable worker node: sandboxes cannot start")
        return report

    def changes(self, report: ClusterReport) -> list[Change]:
        """What provisioning would change in the cluster (node labels and taints only)."""
        label = "=".join(SANDBOX_LABEL)
        found = [
            Change("keep", "sandbox node", name, (f"labelled {label}",))
            for name in report.sandbox_nodes
        ]
        return found + [
            Change(
                "update",
                "node",
                name,
                (f"label {label}",)
                + ((f"taint {_taint_text()}",) if name in report.to_taint else ()),
            )
            for name in report.to_label
        ]

    def _registry_url(self, server: str) -> str:
        return f"{'http' if self.profile.registry.plain_http else 'https'}://{server}"

    def registry_problem(self, report: ClusterReport) -> str | None:
        if report.registry is None:
            return (
                "the kubeconfig target needs registry.server in the profile: a registry you can "
                "push to and the cluster can pull from"
            )
        if not report.registry_ok:
            return (
                f"registry {report.registry} does not answer on "
                f"{self._registry_url(report.registry)}/v2/ ({report.registry_status})"
            )
        return None

    # --- provisioning --------------------------------------------------------------------

    def provision(self, progress: Progress, *, consent: bool) -> dict[str, Any]:
        """Check the cluster and prepare sandbox nodes; returns the stage's outputs."""
        progress(f"checking the cluster ({self.context or 'current context'} in {self.path})")
        report = self.check()
        problem = self.registry_problem(report)
        if problem is not None:
            raise ConfigError(problem, hint="`docker login <server>` first if it needs a login")
        for warning in report.warnings:
            progress(f"WARNING: {warning}")
        if report.to_label and not consent:
            raise OrchardError(
                f"no node is labelled {'='.join(SANDBOX_LABEL)}; Orchard would label "
                f"{', '.join(report.to_label)} and taint {', '.join(report.to_taint) or 'none'}",
                hint="rerun with --yes to let it, or label nodes yourself: "
                "`kubectl label node <name> workload=sandbox` and "
                f"`kubectl taint node <name> {_taint_text()}`",
            )
        for name in report.to_label:
            progress(f"labelling node {name}")
            self._label(name, taint=name in report.to_taint)
        return {
            "kubeconfig": str(self.path),
            "context": self.context,
            "server": report.server,
            "kubernetes_version": report.version,
            "network_policy": report.network_policy,
            "sandbox_nodes": report.sandbox_nodes or report.to_label,
            "labelled_nodes": report.to_label,
            "registry": report.registry,
            "warnings": report.warnings,
        }

    def _label(self, name: str, *, taint: bool) -> None:
        from kubernetes.client import CoreV1Api

        core = CoreV1Api(self.client)
        key, value = SANDBOX_LABEL
        body: dict[str, Any] = {"metadata": {"labels": {key: value}}}
        if taint:
            node = self._json(core.read_node, name)
            kept = [t for t in _taints(node) if t.get("key") != SANDBOX_TAINT["key"]]
            body["spec"] = {"taints": [*kept, SANDBOX_TAINT]}
        self._patch(name, body)

    def _patch(self, name: str, body: dict[str, Any]) -> None:
        from kubernetes.client import CoreV1Api

        CoreV1Api(self.client).patch_node(
            name,
            body,
            _content_type="application/strategic-merge-patch+json",
            _preload_content=False,
            _request_timeout=30,
        )

    def unlabel(self, names: list[str], progress: Progress) -> None:
        """Undo :meth:`provision`'s labels and taints on ``names`` (gone nodes are skipped)."""
        from kubernetes.client import CoreV1Api
        from kubernetes.client.exceptions import ApiException

        core = CoreV1Api(self.client)
        for name in names:
            try:
                node = self._json(core.read_node, name)
            except ApiException as exc:
                if exc.status == 404:
                    continue
                raise
            progress(f"removing the sandbox label and taint from {name}")
            kept = [t for t in _taints(node) if t.get("key") != SANDBOX_TAINT["key"]]
            self._patch(
                name, {"metadata": {"labels": {SANDBOX_LABEL[0]: None}}, "spec": {"taints": kept}}
            )


def _taint_text() -> str:
    return f"{SANDBOX_TAINT['key']}={SANDBOX_TAINT['value']}:{SANDBOX_TAINT['effect']}"
