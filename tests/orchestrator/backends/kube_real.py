"""The node side of the ``kube_real`` tier: a Node object on the real control plane and the
pods bound to it, for :class:`~tests.orchestrator.backends.kube_fake.FakeKubelet`.

The real scheduler binds pods to :data:`NODE` (a Node registered through the API, without a
kubelet behind it); :class:`NodePods` watches the pods bound to it in the namespaces it serves,
as a kubelet does, and is the pod API the FakeKubelet runs real agents for (it PATCHes
``pods/status``). Pods in ``ready_namespaces`` (the orchestrator's, for ``orchard deploy``) are
only reported running and ready. A pod the API server marks for deletion is removed with a
grace period of 0 once its agent is stopped, which is the kubelet's part of a graceful delete
(the namespace controller and the garbage collector wait for it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from kubernetes import client as k8s
from kubernetes import watch

from manifests.render import snapshotter_namespace
from tests.kube_local import STATE, LocalCluster

Obj = dict[str, Any]
NODE = "orchard-test-node"
NODE_CPU = "8"


def ensure_node(cluster: LocalCluster) -> None:
    """Register :data:`NODE` (8 CPUs, 32 GiB, Ready, a sandbox node) unless it exists."""
    body = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": NODE},
    }
    # What a kubelet sets, and the label `orchard up --target kubeconfig` gives sandbox nodes.
    labels = {
        "kubernetes.io/hostname": NODE,
        "kubernetes.io/arch": "amd64",
        "kubernetes.io/os": "linux",
        "workload": "sandbox",
    }
    capacity = {"cpu": NODE_CPU, "memory": "32Gi", "pods": "110", "ephemeral-storage": "100Gi"}
    status = {
        "capacity": capacity,
        "allocatable": capacity,
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "stand-in"}
        ],
        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
    }
    with cluster.admin() as api:
        core = k8s.CoreV1Api(api)
        try:
            core.create_node(body)
        except k8s.ApiException as exc:
            if exc.status != 409:
                raise
        core.patch_node_status(NODE, {"status": status})
        # The TaintNodesByCondition admission plugin taints a new node not-ready; the node
        # lifecycle controller (off here: no kubelet heartbeats) would lift it once Ready.
        core.patch_node(NODE, {"metadata": {"labels": labels}, "spec": {"taints": []}})


@contextlib.contextmanager
def deployment_node(
    cluster: LocalCluster, namespace: str, sandbox_namespace: str, *, run_agents: bool
) -> Iterator[NodePods]:
    """The node side of a deployment with these namespaces: :data:`NODE`, the
    :func:`state_volume` of its orchestrator, and the :class:`NodePods` of the namespaces
    (sandbox pods left to a FakeKubelet if ``run_agents``, else reported ready)."""
    ensure_node(cluster)
    ready = [namespace, snapshotter_namespace(namespace)]
    with state_volume(cluster, namespace):
        pods = NodePods(
            cluster,
            namespaces=[sandbox_namespace] if run_agents else [],
            ready_namespaces=ready if run_agents else [*ready, sandbox_namespace],
        )
        try:
            yield pods
        finally:
            pods.close()


@contextlib.contextmanager
def state_volume(
    cluster: LocalCluster, namespace: str, *, owner: int | None = None
) -> Iterator[None]:
    """A PersistentVolume pre-bound to the state claim of the orchestrator in ``namespace``
    (the local cluster has no StorageClass; a real cluster's default class provisions one).
    It is a host directory; for a pod on the real node it is made here, owned by uid
    ``owner`` (the kubelet does not give a hostPath volume to the pod's fsGroup)."""
    volume = f"state-{namespace}"
    path = STATE / "volumes" / volume
    if owner is not None:
        path.mkdir(parents=True, mode=0o700)
        os.chown(path, owner, owner)
    with cluster.admin() as api:
        k8s.CoreV1Api(api).create_persistent_volume(
            {
                "metadata": {"name": volume},
                "spec": {
                    "capacity": {"storage": "5Gi"},
                    "accessModes": ["ReadWriteOnce"],
                    "persistentVolumeReclaimPolicy": "Retain",
                    "hostPath": {"path": str(path)},
                    "claimRef": {"namespace": namespace, "name": "orchard-state"},
                },
            }
        )
    try:
        yield
    finally:
        with cluster.admin() as api, contextlib.suppress(k8s.ApiException):
            k8s.CoreV1Api(api).delete_persistent_volume(volume)
        shutil.rmtree(path, ignore_errors=True)


def _plain(api: k8s.ApiClient, obj: Any) -> Obj:
    result: Obj = api.sanitize_for_serialization(obj)
    return result


class NodePods:
    """The pods bound to :data:`NODE` in ``namespaces``, with the FakeKubeApi calls the
    FakeKubelet makes (``listeners``, ``get``, ``names``, ``set_pod_status``)."""

    def __init__(
        self, cluster: LocalCluster, namespaces: Iterable[str], ready_namespaces: Iterable[str] = ()
    ) -> None:
        self.listeners: list[Callable[[str, str, Obj], None]] = []
        self._api = cluster.admin()
        self._core = k8s.CoreV1Api(self._api)
        self._namespaces = set(namespaces)
        self._ready_namespaces = set(ready_namespaces)
        self._started: set[tuple[str, str]] = set()
        self._stop = threading.Event()
        self._watch = watch.Watch()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="node-pods")
        self._thread.start()

    # --- what the FakeKubelet calls ------------------------------------------------------------

    def get(self, resource: str, namespace: str, name: str) -> Obj | None:
        assert resource == "pods"
        try:
            return _plain(self._api, self._core.read_namespaced_pod(name, namespace))
        except k8s.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def names(self, resource: str, namespace: str) -> list[str]:
        assert resource == "pods"
        pods = self._core.list_namespaced_pod(namespace).items
        return sorted(pod.metadata.name for pod in pods)

    def set_pod_status(
        self, namespace: str, name: str, status: Obj, *, node: str | None = None
    ) -> Obj | None:
        """PATCH the pod's status, as a kubelet does (the scheduler bound it already)."""
        del node
        try:
            pod = self._core.patch_namespaced_pod_status(name, namespace, {"status": status})
        except k8s.ApiException as exc:
            if exc.status == 404:  # deleted meanwhile
                return None
            raise
        return _plain(self._api, pod)

    def close(self) -> None:
        self._stop.set()
        self._watch.stop()
        self._thread.join(timeout=10)
        self._api.close()

    # --- the watch -----------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # a cut or expired watch: start again
                for event in self._watch.stream(
                    self._core.list_pod_for_all_namespaces,
                    field_selector=f"spec.nodeName={NODE}",
                    timeout_seconds=30,
                ):
                    self._on_event(event["type"], _plain(self._api, event["object"]))
            self._watch = watch.Watch()

    def _on_event(self, kind: str, pod: Obj) -> None:
        metadata = pod["metadata"]
        key = (metadata["namespace"], metadata["name"])
        if key[0] in self._ready_namespaces and kind != "DELETED":
            self._ready(pod)
        if key[0] not in self._namespaces | self._ready_namespaces:
            return
        if kind == "DELETED" or metadata.get("deletionTimestamp"):
            if key in self._started:
                self._started.discard(key)
                for listener in self.listeners:
                    listener("delete", "pods", pod)
            if kind != "DELETED":
                with contextlib.suppress(k8s.ApiException):
                    self._core.delete_namespaced_pod(
                        key[1], key[0], grace_period_seconds=0, propagation_policy="Background"
                    )
            return
        if key not in self._started and key[0] in self._namespaces:
            self._started.add(key)
            for listener in self.listeners:
                listener("create", "pods", pod)

    def _ready(self, pod: Obj) -> None:
        status = pod.get("status") or {}
        if status.get("phase") == "Running" or pod["metadata"].get("deletionTimestamp"):
            return
        containers = pod["spec"]["containers"]
        ready = [
            {"type": kind, "status": "True"}
            for kind in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
        ]
        self.set_pod_status(
            pod["metadata"]["namespace"],
            pod["metadata"]["name"],
            {
                "phase": "Running",
                "conditions": ready,
                "hostIP": "127.0.0.1",
                "podIP": "127.0.0.1",
                "containerStatuses": [
                    {
                        "name": container["name"],
                        "image": container["image"],
                        "imageID": "",
                        "ready": True,
                        "started": True,
                        "restartCount": 0,
                        "state": {"running": {"startedAt": pod["metadata"]["creationTimestamp"]}},
                    }
                    for container in containers
                ],
            },
        )
