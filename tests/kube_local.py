"""The real local cluster of ``scripts/k8s/up.sh`` (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, and a node: containerd, the kubelet, kube-router
enforcing NetworkPolicy, kube-proxy and an image registry, in a network namespace of its
own), for the ``kube_real`` test tier.

:func:`local_cluster` finds the running cluster, or starts it (or what of it is not running,
e.g. the node of a control plane started without one) when its binaries are cached
(``scripts/k8s/ensure-bins.sh check``). Every pytest session using it holds a shared lock; the
last session leaving a cluster that a session started stops it (``down.sh``), so concurrent
sessions share one cluster and none is left running. A cluster started by ``make cluster`` is
left alone. Without the binaries the tier is skipped, except under ``make test``
(``ORCHARD_KUBE_REAL=require``), where it fails.

Tests isolate themselves with namespaces of their own (:func:`unique_name`).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import os
import ssl
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts" / "k8s"
STATE = Path(os.environ.get("ORCHARD_K8S_STATE", "/var/lib/orchard/k8s"))
NETNS = os.environ.get("ORCHARD_K8S_NETNS", "orchard-k8s")
INTERNET_NETNS = f"{NETNS}-internet"  # the cluster's stand-in for the internet
INTERNET = "198.51.100.10"  # its address (scripts/k8s/common.sh)
LOCKS = STATE.parent / "k8s-locks"
STARTED_BY_TESTS = "started-by-tests"


@dataclass(frozen=True)
class LocalCluster:
    kubeconfig: Path  # the admin's (system:masters)
    bin: Path

    def admin(self) -> k8s.ApiClient:
        return k8s_config.new_client_from_config(str(self.kubeconfig))

    def server_and_ca(self) -> tuple[str, str]:
        """The API server's URL and the cluster CA (base64 PEM, as in a kubeconfig)."""
        cluster = yaml.safe_load(self.kubeconfig.read_text())["clusters"][0]["cluster"]
        return cluster["server"], cluster["certificate-authority-data"]

    def token_kubeconfig(self, path: Path, token: str) -> Path:
        """A kubeconfig for this cluster that authenticates with a bearer ``token``."""
        server, ca = self.server_and_ca()
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "local", "cluster": {"server": server, "certificate-authority-data": ca}}
            ],
            "users": [{"name": "user", "user": {"token": token}}],
            "contexts": [{"name": "local", "context": {"cluster": "local", "user": "user"}}],
            "current-context": "local",
        }
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path

    def service_account_kubeconfig(self, path: Path, namespace: str, name: str) -> Path:
        """A kubeconfig with a real token of ServiceAccount ``namespace/name`` (TokenRequest),
        as a pod of that ServiceAccount would have."""
        with self.admin() as api:
            request = k8s.AuthenticationV1TokenRequest(
                spec=k8s.V1TokenRequestSpec(audiences=[], expiration_seconds=3600)
            )
            answer = k8s.CoreV1Api(api).create_namespaced_service_account_token(
                name, namespace, request
            )
        return self.token_kubeconfig(path, answer.status.token)

    def etcdctl(self, *args: str) -> str:
        """Run etcdctl against the cluster's etcd (which listens only inside its netns)."""
        done = subprocess.run(
            [
                "nsenter",
                f"--net=/run/netns/{NETNS}",
                "--",
                str(self.bin / "etcdctl"),
                "--endpoints",
                "http://127.0.0.1:2379",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return done.stdout

    def compact_etcd(self) -> int:
        """Compact etcd up to its current revision (older resourceVersions become 410 Gone);
        returns that revision."""
        status = yaml.safe_load(self.etcdctl("endpoint", "status", "-w", "json"))
        revision = int(status[0]["Status"]["header"]["revision"])
        self.etcdctl("compact", str(revision), "--physical")
        return revision


def unique_name(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


# The processes up.sh starts, each with a pid file in STATE/run named after its binary.
COMPONENTS = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "containerd",
    "kubelet",
    "kube-router",
    "kube-proxy",
    "docker-registry",
)


def _running(name: str) -> bool:
    try:
        pid = int((STATE / "run" / f"{name}.pid").read_text())
        return Path(f"/proc/{pid}/exe").readlink().name == name
    except (OSError, ValueError):
        return False


def _ready(kubeconfig: Path) -> bool:
    if not kubeconfig.exists() or not all(_running(name) for name in COMPONENTS):
        return False
    if not (Path("/run/netns") / INTERNET_NETNS).exists():
        return False
    try:
        config = yaml.safe_load(kubeconfig.read_text())
        cluster = config["clusters"][0]["cluster"]
    except (OSError, yaml.YAMLError, KeyError, IndexError, TypeError):
        return False
    pki = kubeconfig.parent / "pki"
    context = ssl.create_default_context(
        cadata=base64.b64decode(cluster["certificate-authority-data"]).decode()
    )
    context.load_cert_chain(pki / "admin.crt", pki / "admin.key")
    try:
        with urllib.request.urlopen(
            cluster["server"] + "/readyz", context=context, timeout=5
        ) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def _cached_bin() -> Path | None:
    done = subprocess.run(
        ["bash", str(SCRIPTS / "ensure-bins.sh"), "check"],
        capture_output=True,
        text=True,
        check=False,
    )
    return Path(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None


def _run(script: str) -> None:
    done = subprocess.run(
        ["bash", str(SCRIPTS / script)], capture_output=True, text=True, check=False, timeout=600
    )
    if done.returncode != 0:
        raise RuntimeError(f"scripts/k8s/{script} failed ({done.returncode}):\n{done.stderr}")


@contextlib.contextmanager
def _lock(name: str, mode: int) -> Iterator[Any]:
    LOCKS.mkdir(parents=True, exist_ok=True)
    with (LOCKS / name).open("a") as handle:
        fcntl.flock(handle, mode)
        yield handle


@contextlib.contextmanager
def local_cluster() -> Iterator[LocalCluster | str]:
    """The running local cluster (started if need be), or why there is none."""
    kubeconfig = STATE / "admin.kubeconfig"
    bin_dir = _cached_bin()
    if bin_dir is None:
        yield (
            "no local Kubernetes binaries: run `make k8s-bins` (a Go build, ~10 min cold) "
            "and `make cluster`"
        )
        return
    with _lock("users", fcntl.LOCK_SH) as users:
        with _lock("start", fcntl.LOCK_EX):
            if not _ready(kubeconfig):
                # A cluster of which something already runs (e.g. `make cluster` without the
                # node) is completed, and stays whoever's it was.
                fresh = not any(_running(name) for name in COMPONENTS)
                _run("up.sh")
                if fresh:
                    (STATE / STARTED_BY_TESTS).write_text(str(os.getpid()))
        try:
            yield LocalCluster(kubeconfig, bin_dir)
        finally:
            with _lock("start", fcntl.LOCK_EX):
                try:  # the last user of a cluster the tests started stops it
                    fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    pass
                else:
                    if (STATE / STARTED_BY_TESTS).exists():
                        _run("down.sh")
