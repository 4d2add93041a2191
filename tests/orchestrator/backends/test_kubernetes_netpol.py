"""NetworkPolicy enforced on the local cluster's real node by kube-router (firewall mode,
scripts/k8s/netpol.sh), with the policies `orchard deploy` and the backend make (kube_real
tier): the orchestrator's pods reach the agents, nothing else in the cluster does, a
sandbox reaches neither another sandbox nor the host, and only a sandbox with network
reaches the internet (the cluster's stand-in for it, a network namespace of its own).

Every "blocked" has a real listener behind it that another pod does reach, so blocked is
not "no route". Probes are busybox pods on the node, or commands the sandboxes' agents run,
connecting with ``nc`` (busybox-static's ``wget -T`` crashes); this process reaches the
agents through
:func:`~tests.orchestrator.backends.kube_node.admit_host`.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from kubernetes import client as k8s

from orchard_env.orchestrator.backends.base import BackendSandbox
from orchard_env.orchestrator.backends.kubernetes import KubernetesBackend
from tests.kube_local import INTERNET, INTERNET_NETNS, unique_name
from tests.orchestrator.backends.kube_node import (
    AGENT_PORT,
    HOST,
    RUNTIME_CLASS,
    OnNode,
    make_spec,
    run,
)
from tests.servers import printing_server

pytestmark = [pytest.mark.kube_real, pytest.mark.engine]
ORCHESTRATOR_LABELS = {"app.kubernetes.io/name": "orchard-orchestrator"}
# Restricted Pod Security (the orchestrator's namespace enforces it).
RESTRICTED = {
    "runAsNonRoot": True,
    "runAsUser": 65534,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"hello from the host\n")

    def log_message(self, format: str, *args: object) -> None:
        del format, args


@pytest.fixture(scope="module")
def host_server() -> Iterator[str]:
    """An HTTP server on this machine's end of the cluster's veth pair: outside the cluster,
    on a route every pod has."""
    server = http.server.ThreadingHTTPServer((HOST, 0), _Hello)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"{HOST} {server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


_ACCEPTOR = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
while True:
    server.accept()[0].close()
"""


@pytest.fixture(scope="module")
def internet_server() -> Iterator[str]:
    """A TCP server at the cluster's stand-in for the internet (its own network namespace,
    routed only from the cluster's)."""
    netns = f"--net=/run/netns/{INTERNET_NETNS}"
    command = ["nsenter", netns, "--", sys.executable, "-c", _ACCEPTOR, INTERNET]
    with printing_server(command) as port:
        yield f"{INTERNET} {port}"


def connect(target: str) -> str:
    """A shell command printing whether a TCP connection to ``target`` ("HOST PORT") opens."""
    return f"nc -w 3 {target} </dev/null && echo reached || echo blocked"


def probe(
    on_node: OnNode, target: str, *, labels: dict[str, str] | None = None, tries: int = 1
) -> str:
    """``reached`` or ``blocked``: what a busybox pod on the node in the orchestrator's
    namespace (with ``labels``) gets connecting to ``target``, trying up to ``tries`` times a
    second (kube-router admits a new pod's address to the policies' sets shortly after it
    starts)."""
    name = unique_name("probe")
    script = (
        f"for i in $(seq {tries}); do nc -w 3 {target} </dev/null && "
        "{ echo reached; exit 0; }; sleep 1; done; echo blocked"
    )
    pod = {
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            "runtimeClassName": RUNTIME_CLASS,
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "probe",
                    "image": on_node.images.sandbox,
                    "command": ["/bin/busybox", "sh", "-c", script],
                    "securityContext": RESTRICTED,
                }
            ],
        },
    }
    with on_node.local.admin() as api:
        core = k8s.CoreV1Api(api)
        core.create_namespaced_pod(on_node.service, pod)
        try:
            deadline = time.monotonic() + 60 + 4 * tries
            while core.read_namespaced_pod(name, on_node.service).status.phase not in (
                "Succeeded",
                "Failed",
            ):
                assert time.monotonic() < deadline, f"probe {name} did not finish"
                time.sleep(0.5)
            # (nc's own complaint, e.g. "Connection refused" from kube-router's REJECT, first)
            return str(core.read_namespaced_pod_log(name, on_node.service)).split()[-1]
        finally:
            with contextlib.suppress(k8s.ApiException):
                core.delete_namespaced_pod(name, on_node.service, grace_period_seconds=0)


async def blocked(sandbox: BackendSandbox, target: str) -> bool:
    """Whether ``sandbox`` is refused connecting to ``target`` once kube-router has set up the
    new pod's rules (asynchronously, after the pod starts: until then it may connect)."""
    deadline = time.monotonic() + 20
    while await run(sandbox, connect(target)) == "reached\n":
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.5)
    return True


def agent_at(host: str | None) -> str:
    assert host is not None
    return f"{host} {AGENT_PORT}"


async def test_only_the_orchestrators_pods_reach_an_agent(
    node_kube: KubernetesBackend, on_node: OnNode, host_server: str
) -> None:
    found = await node_kube.create(make_spec(on_node, "sb-guarded"))
    assert found.agent is not None
    agent = agent_at(found.agent.host)
    # A pod of the orchestrator's Deployment's labels, in its namespace: admitted by the
    # deploy's orchard-agent-ingress policy.
    assert probe(on_node, agent, labels=ORCHESTRATOR_LABELS, tries=20) == "reached"
    # Any other pod of that namespace is not, though it reaches the host (no policy limits
    # its egress).
    assert probe(on_node, host_server, tries=20) == "reached"
    assert probe(on_node, agent) == "blocked"


async def test_a_sandbox_reaches_neither_another_sandbox_nor_outside_the_cluster(
    node_kube: KubernetesBackend, on_node: OnNode, host_server: str
) -> None:
    opened = await node_kube.create(make_spec(on_node, "sb-open", block_network=False))
    closed = await node_kube.create(make_spec(on_node, "sb-closed"))
    assert closed.agent is not None
    # nc works in the sandbox: its own agent, on loopback.
    assert await run(closed, connect(f"127.0.0.1 {AGENT_PORT}")) == "reached\n"
    # Not another sandbox's agent, even with network (cluster ranges are never egress).
    assert await blocked(opened, agent_at(closed.agent.host))
    # Nothing outside: the host's server, which a pod without egress policies reaches, is not
    # reached from either sandbox (its address is in egress_except's private ranges).
    assert probe(on_node, host_server, tries=20) == "reached"
    assert await blocked(closed, host_server)
    assert await blocked(opened, host_server)


async def test_a_sandbox_with_network_reaches_the_internet_and_one_without_does_not(
    node_kube: KubernetesBackend, on_node: OnNode, internet_server: str
) -> None:
    opened = await node_kube.create(make_spec(on_node, "sb-online", block_network=False))
    closed = await node_kube.create(make_spec(on_node, "sb-offline"))
    # The backend's per-sandbox egress policy opens everything but egress_except.
    assert await run(opened, connect(internet_server)) == "reached\n"
    assert await blocked(closed, internet_server)
