"""Sandbox backends behind one Protocol (:mod:`.base`) and the factory that picks one."""

from __future__ import annotations

import logging
from pathlib import Path

from orchard_env.config import ServiceSettings
from orchard_env.errors import NotSupported
from orchard_env.orchestrator.backends.base import Backend

log = logging.getLogger(__name__)


def _tools_dir(settings: ServiceSettings) -> Path | None:
    """The tools payload the local engine mounts: the configured one, else the cached build
    of the configured harnesses (built by `orchard up` or `orchard images build-local`)."""
    if settings.tools_dir is not None or not settings.tools:
        return settings.tools_dir
    from orchard_env.tools.payload import cached_payload

    found = cached_payload(
        settings.tools, settings.tools_versions, cache_dir=settings.tools_cache_dir
    )
    if found is None:
        log.warning(
            "no tools payload is built for %s: sandboxes start without harnesses; "
            "build it with `orchard images build-local --tools` (or `orchard up`)",
            ",".join(settings.tools),
        )
    return found


def make_backend(settings: ServiceSettings) -> Backend:
    """The backend named by ``settings.backend`` (imported lazily: its SDK is heavy)."""
    if settings.backend == "docker":
        from orchard_env.agent.bundle import ensure_bundle
        from orchard_env.orchestrator.backends.docker_engine import DockerEngineBackend

        bundle_dir = settings.agent_bundle_dir or ensure_bundle(settings.state_dir / "bundle")
        return DockerEngineBackend(settings, bundle_dir=bundle_dir, tools_dir=_tools_dir(settings))
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
