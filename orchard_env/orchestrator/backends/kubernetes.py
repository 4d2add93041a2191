"""The Kubernetes backend: each sandbox is a pod in one sandbox namespace.

Talks to the API server with the official ``kubernetes`` client (sync, run on a bounded thread
pool of its own) and keeps the pods of this orchestrator instance in a watch-fed cache (list,
then watch from the list's resourceVersion; relist on 410 Gone; reconnect with backoff).
Per sandbox it makes:

* a pod named after the sandbox id. An init container (``settings.agent_image``) copies the
  relocatable agent bundle into an emptyDir, mounted read-only at ``BUNDLE_MOUNT`` in the
  sandbox container; that container runs the user's image with the bundle's launcher as its
  command, so any image works (no shell or Python needed). The agent listens on TCP
  ``settings.agent_port``; the orchestrator enrolls it with the per-sandbox key and the
  sandbox's environment (neither is in the pod spec: nothing in the pod can read them);
* a Secret ``orchard-agent-<id>-<hash>`` holding that key for the orchestrator (named in the
  pod's ``orchard.agent-secret`` annotation; the pod never mounts it), created right after
  the pod and owned by it, so Kubernetes deletes it with the pod (the hash makes the name
  unique to the pod: see :func:`dependent_names`);
* for a sandbox with network only, a NetworkPolicy ``orchard-egress-<id>-<hash>`` (also owned
  by the pod) allowing egress to the internet except ``settings.egress_except``, plus DNS.
  Without it the namespace's default-deny policy (``orchard deploy``) blocks all egress.

The orchestrator's RBAC Role suffices: pods create/get/list/watch/delete, secrets
create/get/delete, networkpolicies create/delete (no patch, no list of secrets).

Isolation of the pod: requests = limits for CPU and memory (Guaranteed QoS), an
ephemeral-storage limit, ``activeDeadlineSeconds`` from the sandbox's TTL (a backstop for
when the orchestrator is down), no service-account token, no service links, no privilege
escalation, the RuntimeDefault seccomp profile, only the capabilities images need
(:data:`~orchard_env.orchestrator.backends.base.SANDBOX_CAPABILITIES`), and
the profile's ``runtimeClassName`` (gVisor, Kata) when set. Kubernetes has no per-pod PID
limit field: ``spec.pids_limit`` is enforced by the kubelet's ``podPidsLimit`` (on AKS, the
sandbox node pool's kubelet config), not by the pod.

Snapshots (when ``settings.registry`` and ``settings.snapshotter_token_file`` are set): the
snapshotter pod on the sandbox's node (``orchard_env.snapshotter``, a DaemonSet in
``settings.snapshotter_namespace``, found by listing its pods there: pods get/list in that
namespace) commits the sandbox container's writable layer and pushes it to
``<registry>:<snapshot id>``; a restore is a pod whose image is that reference.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any, ParamSpec, TypeVar

import httpx
import kubernetes.client
import kubernetes.config
import urllib3
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from orchard_env import errors
from orchard_env.config import ServiceSettings
from orchard_env.orchestrator.backends.base import (
    AgentEndpoint,
    BackendSandbox,
    Capability,
    Capacity,
    SandboxSpec,
    SandboxState,
    SnapshotImage,
    image_repository,
)
from orchard_env.orchestrator.backends.kube_objects import (
    ANNOTATION_RECORD,
    INIT_CONTAINER,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_SANDBOX_ID,
    MAIN_CONTAINER,
    MANAGED_BY,
    NODE_SELECTOR,
    TOKEN_KEY,
    Pod,
    dependent_names,
    egress_policy,
    instance_selector,
    no_agent_image,
    pod_dependents,
    pod_manifest,
    pod_name,
    token_secret,
)
from orchard_env.orchestrator.backends.kube_resources import node_resources, pod_requests
from orchard_env.orchestrator.backends.kube_status import PodView, container_statuses, view_pod
from orchard_env.orchestrator.backends.kube_watch import REQUEST_TIMEOUT, PodCache, read_body
from orchard_env.protocol import LABEL_VALUE_RE, check_sandbox_id
from orchard_env.snapshotter.registry import Reference, RegistryClient, load_credentials

log = logging.getLogger(__name__)


SNAPSHOTTER_LABEL = ("app.kubernetes.io/name", "orchard-snapshotter")
SNAPSHOT_TIMEOUT = 900.0  # seconds: the snapshotter reads, compresses and pushes the layer

_P = ParamSpec("_P")
_T = TypeVar("_T")


# --- client configuration --------------------------------------------------------------------


def load_api_client(settings: ServiceSettings, *, pool_size: int = 16) -> Any:
    """An ``ApiClient`` for the cluster: ``settings.k8s_kubeconfig`` (and ``k8s_context``) when
    set; else the pod's service account when running in a cluster; else ``KUBECONFIG`` or
    ``~/.kube/config``. Raises :class:`~orchard_env.errors.ConfigError` naming what failed."""
    configuration = kubernetes.client.Configuration()
    in_cluster = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    kubeconfig = settings.k8s_kubeconfig
    try:
        if kubeconfig is None and in_cluster and settings.k8s_context is None:
            source = "the in-cluster service account"
            kubernetes.config.load_incluster_config(  # type: ignore[no-untyped-call]
                client_configuration=configuration
            )
        else:
            kubeconfig = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
            source = f"kubeconfig {kubeconfig}" + (
                f" (context {settings.k8s_context})" if settings.k8s_context else ""
            )
            kubernetes.config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=os.path.expanduser(kubeconfig),  # noqa: PTH111 - may be a:b list
                context=settings.k8s_context,
                client_configuration=configuration,
                persist_config=False,
            )
    except (ConfigException, OSError, ValueError) as exc:
        raise errors.ConfigError(
            f"cannot load the Kubernetes credentials from {source}: {exc}",
            hint="set k8s_kubeconfig / k8s_context (ORCHARD_K8S_KUBECONFIG, "
            "ORCHARD_K8S_CONTEXT), or KUBECONFIG; in a cluster the orchestrator uses its "
            "service account",
        ) from exc
    configuration.connection_pool_maxsize = pool_size + 1  # + the watch
    return kubernetes.client.ApiClient(configuration)


def _created_at(pod: Pod) -> datetime:
    stamp = (pod.get("metadata") or {}).get("creationTimestamp")
    if not stamp:
        return datetime.now(UTC)
    return datetime.fromisoformat(str(stamp))


# --- API errors ------------------------------------------------------------------------------


def _status_message(exc: ApiException) -> str:
    try:
        body = json.loads(exc.body or "")
    except (TypeError, ValueError):
        body = None
    if isinstance(body, dict) and body.get("message"):
        return str(body["message"])
    return f"{exc.status} {exc.reason}".strip()


def _list_snapshotters(core: Any, namespace: str) -> list[Pod]:
    """The node snapshotter pods (the orchard-snapshotter DaemonSet's)."""
    response = core.list_namespaced_pod(
        namespace,
        label_selector=f"{SNAPSHOTTER_LABEL[0]}={SNAPSHOTTER_LABEL[1]}",
        _preload_content=False,
        _request_timeout=REQUEST_TIMEOUT,
    )
    items: list[Pod] = read_body(response).get("items") or []
    return items


# --- the backend ---------------------------------------------------------------------------


class KubernetesBackend:
    """Sandboxes as pods in ``settings.k8s_namespace``."""

    name = "kubernetes"
    capabilities: frozenset[Capability] = frozenset({Capability.NETWORK_ISOLATION, Capability.PTY})

    def __init__(
        self,
        settings: ServiceSettings,
        *,
        api_client: Any = None,
        start_timeout: float = 20.0,
        concurrency: int = 16,
        watch_timeout: int = 300,
    ) -> None:
        """``api_client``: a ``kubernetes.client.ApiClient`` (default: from the settings, see
        :func:`load_api_client`; one passed in is not closed by :meth:`close`).
        ``start_timeout``: how long :meth:`create` waits for the pod to run before returning it
        as still creating (pull errors and unschedulable pods return sooner).
        ``concurrency``: API calls in flight at once."""
        if not LABEL_VALUE_RE.match(settings.instance) or not settings.instance:
            raise errors.ConfigError(
                f"instance {settings.instance!r} cannot be a Kubernetes label value",
                hint="instance: up to 63 letters, digits, '-', '_', '.', starting and ending "
                "with a letter or digit",
            )
        if settings.agent_image is None:
            raise no_agent_image()
        self._settings = settings
        if settings.registry is not None and settings.snapshotter_token_file is not None:
            self.capabilities = self.capabilities | {Capability.SNAPSHOT}
        self._namespace = settings.k8s_namespace
        self._start_timeout = start_timeout
        self._owns_client = api_client is None
        self._api = api_client if api_client is not None else load_api_client(settings)
        # Typed as Any: the bodies are plain dicts (what the API server gets, and what the tests
        # validate against the Kubernetes schemas), not the client's model classes.
        self._core: Any = kubernetes.client.CoreV1Api(self._api)
        self._networking: Any = kubernetes.client.NetworkingV1Api(self._api)
        self._where = str(self._api.configuration.host)
        self._executor = ThreadPoolExecutor(concurrency, thread_name_prefix="orchard-k8s")
        self._tokens: dict[str, str] = {}
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cache = PodCache(
            self._core,
            self._namespace,
            instance_selector(settings.instance),
            self._notify_threadsafe,
            watch_timeout=watch_timeout,
        )

    # -- plumbing -------------------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._cache.start()

    def _notify_threadsafe(self, name: str | None) -> None:
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(self._wake, name)

    def _wake(self, name: str | None) -> None:
        names = list(self._waiters) if name is None else [name]
        for each in names:
            for event in self._waiters.get(each, ()):
                event.set()

    @contextlib.contextmanager
    def _waiter(self, name: str) -> Iterator[asyncio.Event]:
        event = asyncio.Event()
        self._waiters.setdefault(name, set()).add(event)
        try:
            yield event
        finally:
            waiting = self._waiters.get(name)
            if waiting is not None:
                waiting.discard(event)
                if not waiting:
                    del self._waiters[name]

    async def _call(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """Run a blocking API call on the backend's pool; an API server that does not answer
        (or answers 429/5xx) is :class:`~orchard_env.errors.BackendUnavailable`."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(
                self._executor, functools.partial(fn, *args, **kwargs)
            )
        except urllib3.exceptions.HTTPError as exc:
            raise errors.BackendUnavailable(
                f"the Kubernetes API at {self._where} did not answer: {exc}",
                hint="check the cluster and the orchestrator's network path to it",
            ) from exc
        except ApiException as exc:
            if exc.status == 429 or (exc.status or 0) >= 500:
                raise errors.BackendUnavailable(
                    f"the Kubernetes API at {self._where} is overloaded or failing: "
                    f"{_status_message(exc)}"
                ) from exc
            raise

    def _api_error(self, exc: ApiException, action: str) -> errors.OrchardError:
        """A clear error for an API refusal that the caller does not handle itself."""
        message = _status_message(exc)
        if exc.status == 401:
            return errors.OrchardError(
                f"the Kubernetes API at {self._where} rejected the orchestrator's credentials "
                f"while it tried to {action}: {message}",
                hint="refresh the kubeconfig (k8s_kubeconfig / KUBECONFIG) or the service "
                "account token",
            )
        if exc.status == 403:
            return errors.OrchardError(
                f"the orchestrator may not {action} in namespace {self._namespace}: {message}",
                hint="grant it in the orchard-orchestrator Role (`orchard deploy` installs it)",
            )
        if exc.status == 404:
            return errors.OrchardError(
                f"could not {action}: {message}",
                hint=f"does namespace {self._namespace} exist? `orchard deploy` creates it "
                "(setting k8s_namespace / ORCHARD_K8S_NAMESPACE)",
            )
        if exc.status in (400, 422):
            return errors.InvalidRequest(f"Kubernetes refused to {action}: {message}")
        return errors.OrchardError(f"could not {action}: {message}")

    # -- blocking calls (run on the pool) ---------------------------------------------------

    def _read_pod(self, name: str) -> Pod | None:
        try:
            response = self._core.read_namespaced_pod(
                name, self._namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        pod: Pod = read_body(response)
        return pod

    def _read_token(self, secret: str) -> str | None:
        try:
            response = self._core.read_namespaced_secret(
                secret, self._namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        data = read_body(response).get("data") or {}
        if TOKEN_KEY not in data:
            return None
        return base64.b64decode(data[TOKEN_KEY]).decode()

    def _create_pod(self, manifest: Pod) -> Pod:
        response = self._core.create_namespaced_pod(
            self._namespace, manifest, _preload_content=False, _request_timeout=REQUEST_TIMEOUT
        )
        pod: Pod = read_body(response)
        return pod

    def _create_dependents(self, spec: SandboxSpec, pod: Pod) -> None:
        """The pod's token Secret and (with network) its egress policy, owned by the pod."""
        read_body(
            self._core.create_namespaced_secret(
                self._namespace,
                token_secret(self._settings, spec, pod),
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT,
            )
        )
        if not spec.block_network:
            read_body(
                self._networking.create_namespaced_network_policy(
                    self._namespace,
                    egress_policy(self._settings, spec, pod),
                    _preload_content=False,
                    _request_timeout=REQUEST_TIMEOUT,
                )
            )

    def _delete_objects(self, pod: Pod) -> None:
        """Delete the pod (at once: grace period 0; only this uid) and its Secret and policy.

        A pod already gone, or replaced by another of the same name since it was looked at,
        is left alone: its Secret and policy go with their owner (garbage collection)."""
        metadata = pod["metadata"]
        try:
            response = self._core.delete_namespaced_pod(
                metadata["name"],
                self._namespace,
                grace_period_seconds=0,
                body={"preconditions": {"uid": metadata["uid"]}, "gracePeriodSeconds": 0},
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT,
            )
            read_body(response)
        except ApiException as exc:
            if exc.status in (404, 409):
                return
            raise
        names = pod_dependents(pod)
        if names is None:
            return
        dependents = (
            (self._core.delete_namespaced_secret, names[0]),
            (self._networking.delete_namespaced_network_policy, names[1]),
        )
        for delete, name in dependents:
            try:
                read_body(
                    delete(
                        name,
                        self._namespace,
                        _preload_content=False,
                        _request_timeout=REQUEST_TIMEOUT,
                    )
                )
            except ApiException as exc:
                if exc.status != 404:  # the garbage collector was first
                    raise

    def _list_pods(self) -> list[Pod]:
        response = self._core.list_namespaced_pod(
            self._namespace,
            label_selector=instance_selector(self._settings.instance),
            _preload_content=False,
            _request_timeout=REQUEST_TIMEOUT,
        )
        items: list[Pod] = read_body(response).get("items") or []
        return items

    # -- describing ---------------------------------------------------------------------------

    def _ours(self, pod: Pod) -> bool:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        return (
            labels.get(LABEL_MANAGED_BY) == MANAGED_BY
            and labels.get(LABEL_INSTANCE) == self._settings.instance
            and LABEL_SANDBOX_ID in labels
        )

    async def _token(self, pod: Pod) -> str | None:
        """The agent token of a pod, from the Secret it names (read once, then remembered)."""
        names = pod_dependents(pod)
        if names is None:
            return None
        secret = names[0]
        token = self._tokens.get(secret)
        if token is None:
            try:
                token = await self._call(self._read_token, secret)
            except ApiException as exc:
                raise self._api_error(exc, f"read the agent token Secret {secret}") from exc
            if token is not None:
                self._tokens[secret] = token
        return token

    async def _describe(self, pod: Pod, view: PodView | None = None) -> BackendSandbox:
        metadata = pod["metadata"]
        sandbox_id = metadata["labels"][LABEL_SANDBOX_ID]
        view = view or view_pod(pod)
        agent = None
        ip = (pod.get("status") or {}).get("podIP")
        if ip and view.state in (SandboxState.CREATING, SandboxState.RUNNING):
            token = await self._token(pod)
            if token is not None:
                agent = AgentEndpoint(token=token, host=ip, port=self._settings.agent_port)
        return BackendSandbox(
            sandbox_id=sandbox_id,
            state=view.state,
            agent=agent,
            created_at=_created_at(pod),
            reason=view.reason,
            exit_code=view.exit_code,
            record_annotation=(metadata.get("annotations") or {}).get(ANNOTATION_RECORD),
        )

    async def _current(self, sandbox_id: str) -> Pod | None:
        """The sandbox's pod if it is ours: from the cache, else asked of the API server (a
        pod missing from the cache is confirmed gone before anyone is told so)."""
        name = pod_name(sandbox_id)
        pod = self._cache.get(name) if self._cache.synced else None
        if pod is None:
            try:
                pod = await self._call(self._read_pod, name)
            except ApiException as exc:
                raise self._api_error(exc, f"read pod {name}") from exc
        return pod if pod is not None and self._ours(pod) else None

    # -- create -------------------------------------------------------------------------------

    def _check_id(self, sandbox_id: str) -> None:
        try:
            check_sandbox_id(sandbox_id)
        except ValueError as exc:
            raise errors.InvalidRequest(str(exc)) from exc

    async def create(self, spec: SandboxSpec) -> BackendSandbox:
        self._ensure_started()
        self._check_id(spec.sandbox_id)
        manifest = pod_manifest(self._settings, spec)
        try:
            pod = await self._call(self._create_pod, manifest)
        except ApiException as exc:
            if exc.status == 409:
                raise errors.SandboxExists(
                    f"sandbox {spec.sandbox_id!r} already exists (a pod of that name runs in "
                    f"namespace {self._namespace})",
                    hint="delete it first, or create the new one with another sandbox_id",
                ) from exc
            raise self._api_error(exc, f"create pod {spec.sandbox_id}") from exc
        self._tokens[dependent_names(spec)[0]] = spec.agent_token
        self._cache.offer(pod)
        try:
            await self._call(self._create_dependents, spec, pod)
        except BaseException as exc:
            with contextlib.suppress(Exception):  # the orchestrator deletes it again anyway
                await self._remove(spec.sandbox_id, pod)
            if isinstance(exc, ApiException):
                raise self._api_error(
                    exc, f"create the token Secret or NetworkPolicy of sandbox {spec.sandbox_id}"
                ) from exc
            raise
        return await self._wait_started(spec, pod)

    async def _wait_started(self, spec: SandboxSpec, created: Pod) -> BackendSandbox:
        """Wait until the pod runs, cannot run, or ``start_timeout`` passes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._start_timeout
        name = pod_name(spec.sandbox_id)
        pod = created
        while True:
            with self._waiter(name) as changed:
                current = await self._current(spec.sandbox_id)
                if current is None:
                    raise errors.OrchardError(
                        f"pod {name} disappeared while it was starting (deleted by someone "
                        "else, or evicted)"
                    )
                pod = current
                view = view_pod(pod)
                if view.state is SandboxState.FAILED:
                    with contextlib.suppress(Exception):  # the orchestrator retries it
                        await self._remove(spec.sandbox_id, pod)
                    if view.pull_failure is not None:
                        raise self._pull_error(spec, pod, view.pull_failure)
                    raise errors.OrchardError(
                        f"sandbox {spec.sandbox_id!r} could not start: {view.reason}"
                    )
                started = view.state is not SandboxState.CREATING
                remaining = deadline - loop.time()
                if started or remaining <= 0:
                    return await self._describe(pod, view)
                # Woken by the watch; looking again now and then covers a watch that is down.
                look_again = 2.0 if self._cache.synced else 0.25
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), min(remaining, look_again))

    def _pull_error(
        self, spec: SandboxSpec, pod: Pod, failure: tuple[str, str, str]
    ) -> errors.OrchardError:
        container, reason, message = failure
        node = (pod.get("spec") or {}).get("nodeName")
        where = f" on node {node}" if node else ""
        detail = f"{reason}: {message}" if message else reason
        if container == INIT_CONTAINER:
            return errors.ConfigError(
                f"the agent-injector image {self._settings.agent_image!r} cannot be pulled"
                f"{where}: {detail}",
                hint="check agent_image (ORCHARD_AGENT_IMAGE) and that the cluster may pull "
                "from its registry (`orchard images push`; on AKS, attach the ACR)",
            )
        return errors.ImageNotFound(
            f"image {spec.image!r} cannot be pulled{where}: {detail}",
            hint="check the name and tag; a private registry must be reachable and "
            "authorised from the cluster's nodes (on AKS, attach the ACR to the cluster)",
        )

    # -- the rest of the protocol -------------------------------------------------------------

    async def inspect(self, sandbox_id: str) -> BackendSandbox | None:
        self._ensure_started()
        self._check_id(sandbox_id)
        pod = await self._current(sandbox_id)
        return None if pod is None else await self._describe(pod)

    async def list(self) -> list[BackendSandbox]:
        """Every pod of this instance, asked of the API server (not the cache): the
        orchestrator's reconciliation adopts what it has no record of."""
        self._ensure_started()
        try:
            pods = await self._call(self._list_pods)
        except ApiException as exc:
            raise self._api_error(exc, "list the sandbox pods") from exc
        ours = [pod for pod in pods if self._ours(pod)]
        # Forget the tokens of pods that are gone (deleted by someone else).
        live = {names[0] for pod in ours if (names := pod_dependents(pod)) is not None}
        for secret in set(self._tokens) - live:
            self._tokens.pop(secret, None)
        return list(await asyncio.gather(*(self._describe(pod) for pod in ours)))

    async def delete(self, sandbox_id: str) -> None:
        self._ensure_started()
        self._check_id(sandbox_id)
        pod = await self._current(sandbox_id)
        if pod is not None:  # else never ours, or gone (its Secret and policy go with it)
            await self._remove(sandbox_id, pod)

    async def _remove(self, sandbox_id: str, pod: Pod) -> None:
        try:
            await self._call(self._delete_objects, pod)
        except ApiException as exc:
            raise self._api_error(exc, f"delete sandbox {sandbox_id}") from exc
        self._cache.forget(pod)
        names = pod_dependents(pod)
        if names is not None:
            self._tokens.pop(names[0], None)

    # -- snapshots (the node snapshotter DaemonSet) ------------------------------------------

    def is_snapshot_image(self, image: str) -> bool:
        registry = self._settings.registry
        return registry is not None and image_repository(image) == registry

    def _snapshot_settings(self) -> tuple[str, str]:
        """(target repository, snapshotter token), or NotSupported when snapshots are off."""
        registry, token_file = self._settings.registry, self._settings.snapshotter_token_file
        if registry is None or token_file is None:
            raise errors.NotSupported(
                "snapshots are off on this Kubernetes deployment",
                hint="deploy with snapshots: true in the profile (it runs the node snapshotter "
                "and sets registry and snapshotter_token_file)",
            )
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            raise errors.ConfigError(
                f"cannot read the snapshotter token {token_file}: {exc}",
                hint="snapshotter_token_file names the Secret-mounted token file",
            ) from exc
        return registry, token

    async def _snapshotter_on(self, node: str) -> str:
        """The base URL of the snapshotter pod running on ``node``."""
        namespace = self._settings.snapshotter_namespace
        try:
            pods = await self._call(_list_snapshotters, self._core, namespace)
        except ApiException as exc:
            raise self._api_error(exc, f"list the snapshotter pods in {namespace}") from exc
        for pod in pods:
            status = pod.get("status") or {}
            if (
                (pod.get("spec") or {}).get("nodeName") == node
                and status.get("phase") == "Running"
                and status.get("podIP")
            ):
                return f"http://{status['podIP']}:{self._settings.snapshotter_port}"
        raise errors.Unavailable(
            f"no running snapshotter on node {node} (namespace {namespace})",
            hint="the orchard-snapshotter DaemonSet runs on sandbox nodes; check its pods with "
            f"kubectl -n {namespace} get pods -o wide",
        )

    async def snapshot(
        self, sandbox_id: str, snapshot_id: str, *, parent: str | None = None
    ) -> SnapshotImage:
        """Ask the snapshotter on the sandbox's node to push its writable layer as
        ``<registry>:<snapshot_id>``; the ref is pinned by digest. ``parent`` is recorded by
        the orchestrator (the image's history shows the layers)."""
        self._ensure_started()
        self._check_id(sandbox_id)
        registry, token = self._snapshot_settings()
        pod = await self._current(sandbox_id)
        if pod is None:
            raise errors.SandboxNotFound(f"sandbox {sandbox_id!r} has no pod to snapshot")
        main = next(
            (
                c
                for c in container_statuses(pod.get("status") or {}, "containerStatuses")
                if c.get("name") == MAIN_CONTAINER
            ),
            {},
        )
        node = (pod.get("spec") or {}).get("nodeName")
        if not node or "running" not in (main.get("state") or {}) or not main.get("containerID"):
            raise errors.SandboxNotReady(f"sandbox {sandbox_id!r} is not running: no snapshot")
        # imageID is the pulled image pinned by digest (repo@sha256:...) where the runtime
        # reports one; else the reference the pod asked for.
        image_id = str(main.get("imageID") or "")
        base = image_id if "@sha256:" in image_id else str(main.get("image") or "")
        base = base or pod["spec"]["containers"][0]["image"]
        url = await self._snapshotter_on(node)
        body = {
            "container_id": main["containerID"],
            "base_image": base,
            "target": f"{registry}:{snapshot_id}",
        }
        try:
            async with httpx.AsyncClient(timeout=SNAPSHOT_TIMEOUT) as client:
                response = await client.post(
                    f"{url}/snapshot", json=body, headers={"Authorization": f"Bearer {token}"}
                )
        except httpx.HTTPError as exc:
            raise errors.Unavailable(
                f"the snapshotter on node {node} ({url}) did not answer: {exc!r}",
                hint="its NetworkPolicy admits the orchestrator pods only; check its log",
            ) from exc
        try:
            answer = response.json()
        except ValueError:
            answer = {}
        if response.status_code != 200:
            failure = errors.error_from_wire(response.status_code, answer)
            raise type(failure)(
                f"the snapshotter on node {node}: {failure.message}", hint=failure.hint
            )
        return SnapshotImage(
            ref=f"{answer['ref']}@{answer['digest']}", size_bytes=int(answer["size_bytes"])
        )

    def _delete_manifest(self, ref: str) -> bool:
        with RegistryClient(
            credentials=load_credentials(self._settings.registry_config),
            plain_http=frozenset(
                {Reference.parse(ref).registry} if self._settings.registry_plain_http else ()
            ),
        ) as client:
            return client.delete_manifest(Reference.parse(ref))

    async def delete_snapshot(self, ref: str) -> bool:
        """Delete the snapshot's manifest from the registry (by its digest). Its layers go
        with the registry's garbage collection."""
        registry, _ = self._snapshot_settings()
        if not ref.startswith(f"{registry}:"):
            raise errors.InvalidRequest(
                f"{ref!r} is not a snapshot image (they are {registry}:<id>)"
            )
        return await asyncio.to_thread(self._delete_manifest, ref)

    def _capacity(self) -> Capacity:
        """The nodes sandboxes can be scheduled on (``NODE_SELECTOR``), and every pod in the
        sandbox namespace with its requests (other instances' too: they use the same nodes)."""
        selector = ",".join(f"{key}={value}" for key, value in NODE_SELECTOR.items())
        try:
            nodes = read_body(
                self._core.list_node(
                    label_selector=selector,
                    _preload_content=False,
                    _request_timeout=REQUEST_TIMEOUT,
                )
            ).get("items")
        except ApiException as exc:
            if exc.status != 403:
                raise
            raise errors.OrchardError(
                f"the orchestrator may not list the cluster's nodes: {_status_message(exc)}",
                hint="`orchard deploy` grants it (ClusterRole orchard-nodes-<namespace>, "
                "nodes list only); redeploy with this version",
            ) from exc
        pods = read_body(
            self._core.list_namespaced_pod(
                self._namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT
            )
        ).get("items")
        found = []
        for pod in pods or []:
            labels = pod["metadata"].get("labels") or {}
            entry = pod_requests(pod, labels[LABEL_SANDBOX_ID] if self._ours(pod) else None)
            if entry is not None:
                found.append(entry)
        return Capacity(nodes=[node_resources(node) for node in nodes or []], pods=found)

    async def capacity(self) -> Capacity:
        try:
            return await self._call(self._capacity)
        except ApiException as exc:
            raise self._api_error(exc, "list the sandbox pods") from exc

    async def close(self) -> None:
        await asyncio.to_thread(self._cache.stop)
        await asyncio.to_thread(self._executor.shutdown, True)
        if self._owns_client:
            await asyncio.to_thread(self._api.close)
