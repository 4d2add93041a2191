"""Sandbox backends behind one Protocol (:mod:`.base`) and the factory that picks one."""

from __future__ import annotations

from orchard_env.config import ServiceSettings
from orchard_env.errors import NotSupported
from orchard_env.orchestrator.backends.base import Backend


def make_backend(settings: ServiceSettings) -> Backend:
    """The backend named by ``settings.backend`` (imported lazily: its SDK is heavy)."""
    if settings.backend == "docker":
        from orchard_env.agent.bundle import ensure_bundle
        from orchard_env.orchestrator.backends.docker_engine import DockerEngineBackend

        bundle_dir = settings.agent_bundle_dir or ensure_bundle(settings.state_dir / "bundle")
        return DockerEngineBackend(settings, bundle_dir=bundle_dir)
    if settings.backend == "kubernetes":
        try:
            from orchard_env.orchestrator.backends.kubernetes import KubernetesBackend
        except ImportError as exc:
            raise NotSupported(
                f"the kubernetes backend needs the `kubernetes` package ({exc})",
                hint="pip install 'kubernetes>=30'",
            ) from exc
        return KubernetesBackend(settings)
    raise NotSupported(
        f"unknown backend {settings.backend!r}", hint="ORCHARD_BACKEND is docker or kubernetes"
    )
