"""The watch-fed cache of one orchestrator instance's pods (list, then watch from the list's
resourceVersion; relist on 410 Gone; reconnect with backoff), run on a thread of its own."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from kubernetes.client.exceptions import ApiException

from orchard_env.orchestrator.backends.kube_objects import Pod

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = (10, 60)  # seconds to connect, and to wait for an answer (not for watches)


def _slim(pod: Pod) -> Pod:
    """A pod as the cache keeps it: without its managedFields (kilobytes each, never read)."""
    (pod.get("metadata") or {}).pop("managedFields", None)
    return pod


def read_body(response: Any) -> Any:
    """The JSON body of a raw (``_preload_content=False``) response, read to the end and its
    connection given back to the pool (unread, it would poison the next request on it)."""
    try:
        return json.loads(response.data)
    finally:
        response.release_conn()


class _Expired(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


class PodCache:
    """The pods matching one label selector, kept current by a list + watch thread.

    ``notify(name)`` is called from the thread after each change (``None``: everything may have
    changed, after a relist). :meth:`get` is authoritative only while :attr:`synced`.
    """

    def __init__(
        self,
        core: Any,
        namespace: str,
        selector: str,
        notify: Callable[[str | None], None],
        *,
        watch_timeout: int = 300,
        max_backoff: float = 10.0,
    ) -> None:
        self._core = core
        self._namespace = namespace
        self._selector = selector
        self._notify = notify
        self._watch_timeout = watch_timeout
        self._max_backoff = max_backoff
        self._pods: dict[str, Pod] = {}
        self._deleted: set[str] = set()  # uids we deleted whose DELETED event may still come
        self._lock = threading.Lock()
        self._synced = threading.Event()
        self._stopping = threading.Event()
        self._response: Any = None
        self._resource_version: str | None = None  # where the next watch continues from
        self._thread = threading.Thread(target=self._run, name="orchard-k8s-watch", daemon=True)

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread; an open watch is cut at once (its socket is shut down)."""
        self._stopping.set()
        with self._lock:
            response = self._response
        if response is not None:
            with contextlib.suppress(Exception):
                response.shutdown()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def get(self, name: str) -> Pod | None:
        with self._lock:
            return self._pods.get(name)

    def offer(self, pod: Pod) -> None:
        """A pod this process just created: known before its ADDED event arrives."""
        name = pod["metadata"]["name"]
        with self._lock:
            self._pods.setdefault(name, _slim(pod))
        self._notify(name)

    def forget(self, pod: Pod) -> None:
        """A pod this process just deleted: gone before its DELETED event arrives."""
        name, uid = pod["metadata"]["name"], pod["metadata"].get("uid")
        with self._lock:
            current = self._pods.get(name)
            # Until its DELETED event comes, late events of this pod must not bring it back.
            if current is not None and current["metadata"].get("uid") == uid:
                del self._pods[name]
                self._deleted.add(uid)
        self._notify(name)

    # -- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.5
        while not self._stopping.is_set():
            try:
                if self._resource_version is None:
                    self._relist()
                self._watch()
                backoff = 0.5
            except _Expired:
                log.info("pod watch expired (410 Gone); listing again")
                self._resource_version = None
            except Exception as exc:
                if self._stopping.is_set():
                    break
                self._synced.clear()
                log.warning(
                    "pod watch failed; retrying",
                    extra={"error": f"{type(exc).__name__}: {exc}", "retry_in": backoff},
                )
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, self._max_backoff)

    def _relist(self) -> None:
        response = self._core.list_namespaced_pod(
            self._namespace,
            label_selector=self._selector,
            _preload_content=False,
            _request_timeout=REQUEST_TIMEOUT,
        )
        listing = read_body(response)
        pods = {item["metadata"]["name"]: _slim(item) for item in listing.get("items") or []}
        with self._lock:
            self._pods = pods
            self._deleted.clear()
        self._resource_version = str(listing["metadata"]["resourceVersion"])
        self._synced.set()
        self._notify(None)

    def _watch(self) -> None:
        """Follow changes from the last resourceVersion seen until the server ends the watch
        (its timeout) or the connection drops."""
        from kubernetes.watch.watch import iter_resp_lines

        try:
            response = self._core.list_namespaced_pod(
                self._namespace,
                label_selector=self._selector,
                watch=True,
                resource_version=self._resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=self._watch_timeout,
                _preload_content=False,
                _request_timeout=(10, self._watch_timeout + 30),
            )
        except ApiException as exc:
            if exc.status == 410:
                raise _Expired from exc
            raise
        with self._lock:
            self._response = response
        try:
            if self._stopping.is_set():
                return
            self._synced.set()
            for line in iter_resp_lines(response):  # type: ignore[no-untyped-call]
                if line:
                    self._apply(json.loads(line))
        finally:
            with self._lock:
                self._response = None
            response.close()
            response.release_conn()

    def _apply(self, event: dict[str, Any]) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Expired
            raise ApiException(status=obj.get("code"), reason=obj.get("message"))
        metadata = obj.get("metadata") or {}
        if kind != "BOOKMARK":
            name, uid = metadata["name"], metadata.get("uid")
            with self._lock:
                if kind == "DELETED":
                    current = self._pods.get(name)
                    if current is not None and current["metadata"].get("uid") == uid:
                        del self._pods[name]
                    self._deleted.discard(uid)
                elif uid not in self._deleted:
                    self._pods[name] = _slim(obj)
            self._notify(name)
        if metadata.get("resourceVersion"):
            self._resource_version = str(metadata["resourceVersion"])
