"""Who may talk to whom under the rendered NetworkPolicies.

A small evaluator of the NetworkPolicy rules Kubernetes defines (policies add up; a pod
selected by no policy of a direction is open in that direction; a connection needs the
source's egress and the destination's ingress) runs over a model cluster: the orchestrator,
Redis, sandboxes with and without network, a pod that only pretends to be the orchestrator,
the cluster DNS and addresses outside the cluster.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

import pytest

from manifests.render import render
from orchard_env.config import SERVICE_SETTINGS
from tests.manifests.test_render import FULL

SERVICE_NS = FULL.namespace
SANDBOX_NS = FULL.sandbox_namespace
EGRESS_EXCEPT = next(s for s in SERVICE_SETTINGS if s.key == "egress_except").parse(
    next(s.default for s in SERVICE_SETTINGS if s.key == "egress_except") or ""
)


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    ip: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Outside:
    ip: str


Peer = Pod | Outside


def _selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    if selector is None:
        return True
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not ok:
            return False
    return True


def _in_block(ip: str, block: dict[str, Any]) -> bool:
    address = ipaddress.ip_address(ip)
    if address not in ipaddress.ip_network(block["cidr"]):
        return False
    return not any(address in ipaddress.ip_network(cidr) for cidr in block.get("except", []))


def _peer_matches(peer_rule: dict[str, Any], policy_ns: str, peer: Peer) -> bool:
    if "ipBlock" in peer_rule:
        return _in_block(peer.ip, peer_rule["ipBlock"])
    if isinstance(peer, Outside):
        return False
    if "namespaceSelector" in peer_rule:
        ns_labels = {"kubernetes.io/metadata.name": peer.namespace}
        if not _selects(peer_rule["namespaceSelector"], ns_labels):
            return False
    elif peer.namespace != policy_ns:
        return False
    return _selects(peer_rule.get("podSelector"), peer.labels)


def _port_matches(rule: dict[str, Any], port: int, protocol: str) -> bool:
    ports = rule.get("ports")
    if not ports:
        return True
    return any(
        p.get("port") in (None, port) and p.get("protocol", "TCP") == protocol for p in ports
    )


def _allowed(
    policies: list[dict[str, Any]], pod: Pod, direction: str, other: Peer, port: int, proto: str
) -> bool:
    """Whether ``pod``'s ``direction`` (Ingress/Egress) lets the connection with ``other``."""
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == pod.namespace
        and direction in p["spec"].get("policyTypes", ["Ingress"])
        and _selects(p["spec"]["podSelector"], pod.labels)
    ]
    if not selecting:
        return True  # isolated by no policy in this direction
    for policy in selecting:
        for rule in policy["spec"].get(key, []):
            peers = rule.get(peers_key)
            peer_ok = not peers or any(
                _peer_matches(peer, policy["metadata"]["namespace"], other) for peer in peers
            )
            if peer_ok and _port_matches(rule, port, proto):
                return True
    return False


def can_connect(
    policies: list[dict[str, Any]], src: Peer, dst: Peer, port: int, proto: str = "TCP"
) -> bool:
    if isinstance(src, Pod) and not _allowed(policies, src, "Egress", dst, port, proto):
        return False
    return not (isinstance(dst, Pod) and not _allowed(policies, dst, "Ingress", src, port, proto))


def sandbox_egress_policy(sandbox_id: str) -> dict[str, Any]:
    """The per-sandbox policy the contract gives the Kubernetes backend for a sandbox with
    network: the internet except ``egress_except`` (not rendered by the manifests)."""
    return {
        "metadata": {"name": f"orchard-egress-{sandbox_id}", "namespace": SANDBOX_NS},
        "spec": {
            "podSelector": {"matchLabels": {"orchard.sandbox-id": sandbox_id}},
            "policyTypes": ["Egress"],
            "egress": [{"to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": list(EGRESS_EXCEPT)}}]}],
        },
    }


def _sandbox(name: str, ip: str, *, network: bool) -> Pod:
    labels = {"app.kubernetes.io/managed-by": "orchard", "orchard.sandbox-id": name}
    if network:
        labels["orchard.network"] = "open"
    return Pod(name, SANDBOX_NS, ip, labels)


ORCHESTRATOR = Pod(
    "orchestrator", SERVICE_NS, "10.244.0.10", {"app.kubernetes.io/name": "orchard-orchestrator"}
)
REDIS = Pod("redis", SERVICE_NS, "10.244.0.11", {"app.kubernetes.io/name": "orchard-redis"})
DEBUG = Pod("debug", SERVICE_NS, "10.244.0.12", {"app": "debug"})
IMPOSTOR = Pod(  # the orchestrator's label, in another namespace
    "impostor", "team", "10.244.3.3", {"app.kubernetes.io/name": "orchard-orchestrator"}
)
DNS = Pod("coredns", "kube-system", "10.244.0.2", {"k8s-app": "kube-dns"})
CLOSED = _sandbox("closed", "10.244.1.5", network=False)
OPEN = _sandbox("open", "10.244.1.6", network=True)
OTHER_OPEN = _sandbox("other", "10.244.2.7", network=True)
INTERNET = Outside("93.184.215.14")
METADATA = Outside("169.254.169.254")
API_SERVER = Outside("10.0.0.1")
HOME_ROUTER = Outside("192.168.1.1")


@pytest.fixture
def policies() -> list[dict[str, Any]]:
    rendered = [o for o in render(FULL) if o["kind"] == "NetworkPolicy"]
    return [*rendered, sandbox_egress_policy("open"), sandbox_egress_policy("other")]


def test_only_the_orchestrator_reaches_the_agent_port(policies: list[dict[str, Any]]) -> None:
    port = FULL.agent_port
    for sandbox in (CLOSED, OPEN):
        assert can_connect(policies, ORCHESTRATOR, sandbox, port)
        assert not can_connect(policies, ORCHESTRATOR, sandbox, 22)  # only the agent port
        assert not can_connect(policies, ORCHESTRATOR, sandbox, port, "UDP")
        for intruder in (DEBUG, IMPOSTOR, DNS, INTERNET, REDIS):
            assert not can_connect(policies, intruder, sandbox, port), intruder.ip


def test_sandboxes_cannot_reach_each_other(policies: list[dict[str, Any]]) -> None:
    """Upstream had no ingress policy: a sandbox with network could drive another's agent."""
    for src, dst in ((OPEN, CLOSED), (OPEN, OTHER_OPEN), (CLOSED, OPEN), (OTHER_OPEN, OPEN)):
        for port in (FULL.agent_port, 22, 80):
            assert not can_connect(policies, src, dst, port)


def test_a_sandbox_without_network_reaches_nothing(policies: list[dict[str, Any]]) -> None:
    for target, port, proto in (
        (DNS, 53, "UDP"),
        (INTERNET, 443, "TCP"),
        (ORCHESTRATOR, 8000, "TCP"),
        (REDIS, 6379, "TCP"),
        (METADATA, 80, "TCP"),
    ):
        assert not can_connect(policies, CLOSED, target, port, proto)


def test_a_sandbox_with_network_reaches_dns_and_the_internet_only(
    policies: list[dict[str, Any]],
) -> None:
    assert can_connect(policies, OPEN, DNS, 53, "UDP")
    assert can_connect(policies, OPEN, DNS, 53, "TCP")
    assert can_connect(policies, OPEN, INTERNET, 443)
    for target, port in (
        (METADATA, 80),  # the cloud's instance metadata (credentials)
        (API_SERVER, 443),
        (HOME_ROUTER, 80),
        (ORCHESTRATOR, 8000),
        (REDIS, 6379),
        (DNS, 8080),
    ):
        assert not can_connect(policies, OPEN, target, port), target.ip


def test_without_the_backends_policy_a_sandbox_has_dns_only(
    policies: list[dict[str, Any]],
) -> None:
    namespace_level = [p for p in policies if "orchard-egress" not in p["metadata"]["name"]]
    assert can_connect(namespace_level, OPEN, DNS, 53, "UDP")
    assert not can_connect(namespace_level, OPEN, INTERNET, 443)


def test_the_service_namespace_accepts_the_api_only(policies: list[dict[str, Any]]) -> None:
    for client in (INTERNET, DEBUG, IMPOSTOR):
        assert can_connect(policies, client, ORCHESTRATOR, 8000)
        assert not can_connect(policies, client, ORCHESTRATOR, 9000)
    assert can_connect(policies, ORCHESTRATOR, REDIS, 6379)
    for intruder in (DEBUG, IMPOSTOR, INTERNET, OPEN):
        assert not can_connect(policies, intruder, REDIS, 6379)
    assert not can_connect(policies, ORCHESTRATOR, DEBUG, 8080)  # default deny in the namespace


def test_the_model_cluster_is_not_trivially_closed(policies: list[dict[str, Any]]) -> None:
    """The evaluator itself: with no policies every connection is open."""
    assert can_connect([], OPEN, CLOSED, FULL.agent_port)
    assert can_connect([], CLOSED, METADATA, 80)
    assert can_connect([], IMPOSTOR, REDIS, 6379)
