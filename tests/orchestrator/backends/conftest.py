"""Fixtures of the backend tests: a fake cluster (API server + kubelet) and settings pointing
at it through a kubeconfig, as a developer's orchestrator would (Kubernetes backend);
sandbox specs on the busybox image (engine backend); and a deployment whose sandboxes run on
the local cluster's real node, with a backend for it (kube_real tier)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from uuid import uuid4

import docker
import httpx
import pytest

from orchard_env.config import ServiceSettings
from orchard_env.fake_model import FakeModel, running
from orchard_env.orchestrator.app import create_app
from orchard_env.orchestrator.backends.base import SANDBOX_CAPABILITIES, Backend, SandboxSpec
from orchard_env.orchestrator.backends.kubernetes import KubernetesBackend
from orchard_env.orchestrator.gateway import harness
from orchard_env.orchestrator.keys import create_key
from orchard_env.orchestrator.services import Orchard
from tests.kube_local import LocalCluster
from tests.orchestrator.backends.kube_fake import FakeKubeApi, FakeKubelet, fake_cluster, free_port
from tests.orchestrator.backends.kube_node import OnNode, deployed_on_node, node_images
from tests.orchestrator.conftest import make_settings

AGENT_IMAGE = "registry.example/orchard/agent-injector:0.1.0"
CAPABILITY_BITS = {
    "CHOWN": 0,
    "DAC_OVERRIDE": 1,
    "FOWNER": 3,
    "FSETID": 4,
    "KILL": 5,
    "SETGID": 6,
    "SETUID": 7,
    "NET_BIND_SERVICE": 10,
    "SETFCAP": 31,
}  # from linux/capability.h
NAMESPACE = "orchard-sandboxes"
MiB = 1024 * 1024
Start = Callable[[ServiceSettings], Awaitable[tuple[Orchard, httpx.AsyncClient]]]


def sandbox_status(status: str) -> tuple[int, str]:
    """(bounding capability set, NoNewPrivs) from a sandbox process's /proc/self/status,
    checked against the capabilities a sandbox should have."""
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    return int(fields["CapBnd"], 16), fields["NoNewPrivs"].strip()


def sandbox_capability_mask() -> int:
    return sum(1 << CAPABILITY_BITS[name] for name in SANDBOX_CAPABILITIES)


@dataclass
class Cluster:
    api: FakeKubeApi
    kubelet: FakeKubelet
    kubeconfig: Path

    def settings(self, state_dir: Path, **overrides: Any) -> ServiceSettings:
        values: dict[str, Any] = {
            "backend": "kubernetes",
            "agent_image": AGENT_IMAGE,
            "k8s_kubeconfig": str(self.kubeconfig),
            "k8s_namespace": NAMESPACE,
            "agent_port": self.kubelet.agent_port,
            **overrides,
        }
        return make_settings(state_dir, **values)

    def names(self, resource: str) -> list[str]:
        return self.api.names(resource, NAMESPACE)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with fake_cluster(tmp_path) as (api, kubelet, kubeconfig):
        yield Cluster(api, kubelet, kubeconfig)


@pytest.fixture
def kube_settings(cluster: Cluster, tmp_path: Path) -> ServiceSettings:
    return cluster.settings(tmp_path / "state")


@pytest.fixture
async def kube(kube_settings: ServiceSettings) -> AsyncIterator[KubernetesBackend]:
    backend = KubernetesBackend(kube_settings)
    yield backend
    await backend.close()


@pytest.fixture
def model() -> Iterator[FakeModel]:
    """The scripted fake model server, on loopback."""
    with running() as fake:
        yield fake


@pytest.fixture
def model_endpoints(model: FakeModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A model endpoints file whose default OpenAI endpoint is :func:`model` (its key in the
    environment, as an operator would keep it)."""
    endpoints = tmp_path / "endpoints.toml"
    endpoints.write_text(
        'default_openai = "fake"\n'
        f'[endpoints.fake]\napi = "openai"\nbase_url = "{model.url}/v1"\n'
        'key_env = "FAKE_MODEL_KEY"\nmodel = "fake-model"\n'
    )
    monkeypatch.setenv("FAKE_MODEL_KEY", model.key)
    return endpoints


@pytest.fixture
def port(monkeypatch: pytest.MonkeyPatch) -> int:
    """The harness port in a "pod": the fake kubelet's agents share the host's loopback."""
    port = free_port()
    monkeypatch.setattr(harness, "LISTEN_PORT", port)
    return port


@pytest.fixture
def spec(busybox_image: str) -> Callable[..., SandboxSpec]:
    """Make a spec for a new sandbox on the busybox image (no network, 0.5 CPU, 256 MiB),
    with ``overrides``."""

    def make(**overrides: Any) -> SandboxSpec:
        values: dict[str, Any] = {
            "sandbox_id": f"t-{uuid4().hex[:10]}",
            "image": busybox_image,
            "cpu": 0.5,
            "memory_bytes": 256 * MiB,
            "block_network": True,
            "workdir": "/workspace",
            "agent_token": secrets.token_urlsafe(24),
        }
        return SandboxSpec(**{**values, **overrides})

    return make


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    """Start orchestrators as `orchard serve` would: the app makes its own backend from the
    settings (``make_backend``) and closes it when it stops."""
    async with AsyncExitStack() as stack:

        async def start(settings: ServiceSettings) -> tuple[Orchard, httpx.AsyncClient]:
            app = create_app(settings)
            await stack.enter_async_context(app.router.lifespan_context(app))
            orchard: Orchard = app.state.orchard
            admin = await create_key(orchard.store, "admin", admin=True)
            http = await stack.enter_async_context(
                httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=app),
                    base_url="http://orchard",
                    headers={"X-API-Key": admin.api_key},
                )
            )
            return orchard, http

        yield start


# --- the local cluster's real node (kube_real tier) ----------------------------------------


@pytest.fixture(scope="session")
def on_node(
    local_cluster: LocalCluster,
    docker_client: docker.DockerClient,
    sandbox_image: str,
    busybox_image: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[OnNode]:
    with (
        node_images(docker_client, sandbox_image, busybox_image) as images,
        deployed_on_node(local_cluster, images, tmp_path_factory.mktemp("on-node")) as found,
    ):
        yield found


B = TypeVar("B", bound=Backend)


@asynccontextmanager
async def emptied(backend: B) -> AsyncIterator[B]:
    """``backend`` for a block; at its end every sandbox it lists is deleted, then it closes."""
    try:
        yield backend
    finally:
        for sandbox in await backend.list():
            await backend.delete(sandbox.sandbox_id)
        await backend.close()


@pytest.fixture
async def node_kube(on_node: OnNode, tmp_path: Path) -> AsyncIterator[KubernetesBackend]:
    async with emptied(KubernetesBackend(on_node.settings(tmp_path / "state"))) as backend:
        yield backend
