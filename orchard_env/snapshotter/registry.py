"""Push a snapshot layer on top of a base image with the OCI distribution API (httpx).

:func:`push_snapshot` fetches the base image's manifest (resolving an index to this node's
platform) and config, makes the base's layers available in the target repository (a
cross-repository mount when both live in the same registry, a copy otherwise), uploads the new
layer and a config with its ``diff_id`` and a history entry appended, and puts the new manifest
under the target's tag.

Authentication follows the registry's challenge: ``Basic`` with the credentials of the
registry's entry in a docker config JSON (``{"auths": {"<host>": {"auth": base64(user:pass)}}}``
or ``username``/``password``), or ``Bearer``: a token from the challenge's realm, asked for with
those credentials (anonymous without). For Azure Container Registry the deploy writes an ACR
token (or the refresh token under the user ``00000000-0000-0000-0000-000000000000``) there.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import platform
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from orchard_env import errors
from orchard_env.snapshotter.layer import Layer

logger = logging.getLogger(__name__)

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
_ACCEPT = ", ".join([OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST])
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Reference:
    """``registry/repository`` plus a tag or a digest."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @classmethod
    def parse(cls, ref: str) -> Reference:
        name, digest = ref, None
        if "@" in name:
            name, _, digest = name.partition("@")
        tag = None
        last = name.rpartition("/")[2]
        if ":" in last:
            name, _, tag = name.rpartition(":")
        first, _, rest = name.partition("/")
        if rest and ("." in first or ":" in first or first == "localhost"):
            registry, repository = first, rest
        else:
            registry, repository = "registry-1.docker.io", name
            if "/" not in repository:
                repository = f"library/{repository}"
        if registry == "docker.io":
            registry = "registry-1.docker.io"
        if not re.fullmatch(r"[a-z0-9]+(?:[._/-][a-z0-9]+|__)*", repository) or (
            tag is None and digest is None
        ):
            raise errors.InvalidRequest(
                f"{ref!r} is not an image reference with a tag or digest",
                hint="write it as <registry>/<repository>:<tag> or ...@sha256:<hex>",
            )
        return cls(registry, repository, tag, digest)

    @property
    def reference(self) -> str:
        """What the manifests endpoint takes: the digest if there is one, else the tag."""
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        return f"{self.registry}/{self.repository}" + (
            f"@{self.digest}" if self.digest else f":{self.tag}"
        )


@dataclass(frozen=True)
class PushResult:
    ref: str  # the target, as given
    digest: str  # the manifest's digest
    size_bytes: int  # the new layer's compressed size


def load_credentials(docker_config: Path | None) -> dict[str, tuple[str, str]]:
    """Registry host -> (user, password) from a docker config JSON. None, or a file that does
    not exist (the optional Secret was not made), means no credentials: anonymous access."""
    if docker_config is None or not docker_config.exists():
        if docker_config is not None:
            logger.info("no registry credentials at %s: anonymous access", docker_config)
        return {}
    try:
        auths = json.loads(docker_config.read_text()).get("auths", {})
    except (OSError, ValueError) as exc:
        raise errors.ConfigError(
            f"cannot read the registry credentials {docker_config}: {exc}"
        ) from exc
    found: dict[str, tuple[str, str]] = {}
    for host, entry in auths.items():
        host = re.sub(r"^https?://", "", host).split("/")[0]
        if entry.get("auth"):
            user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
            found[host] = (user, password)
        elif entry.get("username"):
            found[host] = (entry["username"], entry.get("password", ""))
    if "index.docker.io" in found:
        found.setdefault("registry-1.docker.io", found["index.docker.io"])
    return found


def _challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, rest = header.partition(" ")
    return scheme.lower(), dict(re.findall(r'(\w+)="([^"]*)"', rest))


class RegistryClient:
    """A minimal OCI distribution client for one push or delete (sync: the snapshotter's
    server runs each request on its own thread)."""

    def __init__(
        self,
        *,
        credentials: dict[str, tuple[str, str]] | None = None,
        plain_http: frozenset[str] = frozenset(),
        timeout: float = 300.0,
    ) -> None:
        self._credentials = credentials or {}
        self._plain_http = plain_http
        self._http = httpx.Client(timeout=timeout, follow_redirects=True)
        self._tokens: dict[tuple[str, str], str] = {}  # (registry, repository) -> header

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _url(self, registry: str, path: str) -> str:
        scheme = "http" if registry in self._plain_http else "https"
        return f"{scheme}://{registry}/v2/{path}"

    def _authorize(self, registry: str, repository: str, challenge: str) -> str:
        scheme, params = _challenge(challenge)
        creds = self._credentials.get(registry)
        if scheme == "basic":
            if creds is None:
                raise errors.PermissionDenied(
                    f"registry {registry} wants a login and there are no credentials for it",
                    hint="put an entry for it in the snapshotter's registry credentials",
                )
            return "Basic " + base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode()
        if scheme != "bearer" or "realm" not in params:
            raise errors.PermissionDenied(f"registry {registry} asks for {challenge!r}")
        query = {k: v for k, v in params.items() if k in ("service", "scope")}
        response = self._http.get(params["realm"], params=query, auth=creds)
        if response.status_code != 200:
            raise errors.PermissionDenied(
                f"registry {registry} refused a token for {query.get('scope', repository)}: "
                f"HTTP {response.status_code} {response.text[:200]}",
                hint="check the registry credentials (a token allowed to pull and push)",
            )
        body = response.json()
        return "Bearer " + str(body.get("token") or body["access_token"])

    def request(
        self,
        method: str,
        registry: str,
        repository: str,
        path: str,
        *,
        content: Callable[[], bytes | Iterator[bytes]] | None = None,
        headers: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
        url: str | None = None,
    ) -> httpx.Response:
        """One request, authorised after the registry's challenge (retried once then)."""
        target = url or self._url(registry, f"{repository}/{path}")
        for attempt in range(2):
            sent = dict(headers or {})
            token = self._tokens.get((registry, repository))
            if token is not None:
                sent["Authorization"] = token
            response = self._http.request(
                method,
                target,
                content=content() if content is not None else None,
                headers=sent,
                params=params,
            )
            if response.status_code != 401 or attempt:
                return response
            challenge = response.headers.get("WWW-Authenticate", "")
            self._tokens[(registry, repository)] = self._authorize(registry, repository, challenge)
        raise AssertionError("unreachable")  # pragma: no cover

    def _check(self, response: httpx.Response, what: str, *ok: int) -> httpx.Response:
        if response.status_code not in (ok or (200,)):
            raise errors.BackendUnavailable(
                f"{what}: the registry answered HTTP {response.status_code}: {response.text[:300]}"
            )
        return response

    def get_manifest(self, ref: Reference) -> tuple[dict[str, Any], str]:
        """(manifest, media type) of ``ref``, an index resolved to this node's platform."""
        response = self.request(
            "GET",
            ref.registry,
            ref.repository,
            f"manifests/{ref.reference}",
            headers={"Accept": _ACCEPT},
        )
        if response.status_code == 404:
            raise errors.ImageNotFound(f"image {ref} not found in its registry")
        self._check(response, f"fetching the manifest of {ref}")
        manifest: dict[str, Any] = response.json()
        media_type = str(manifest.get("mediaType") or response.headers.get("Content-Type", ""))
        if media_type in (OCI_INDEX, DOCKER_LIST):
            wanted = _platform()
            for entry in manifest.get("manifests", []):
                plat = entry.get("platform", {})
                if (plat.get("os"), plat.get("architecture")) == wanted:
                    return self.get_manifest(
                        Reference(ref.registry, ref.repository, digest=entry["digest"])
                    )
            raise errors.ImageNotFound(f"image {ref} has no manifest for {'/'.join(wanted)}")
        return manifest, media_type

    def get_blob(self, ref: Reference, digest: str) -> bytes:
        response = self.request("GET", ref.registry, ref.repository, f"blobs/{digest}")
        return self._check(response, f"fetching blob {digest} of {ref}").content

    def has_blob(self, ref: Reference, digest: str) -> bool:
        response = self.request("HEAD", ref.registry, ref.repository, f"blobs/{digest}")
        return response.status_code == 200

    def upload_blob(
        self,
        ref: Reference,
        digest: str,
        content: Callable[[], bytes | Iterator[bytes]],
        size: int,
    ) -> None:
        """POST an upload session, then PUT the whole blob (``size`` bytes) into it."""
        started = self._check(
            self.request("POST", ref.registry, ref.repository, "blobs/uploads/"),
            f"starting an upload to {ref.registry}/{ref.repository}",
            202,
        )
        self._put_upload(ref, started, digest, content, size)

    def _put_upload(
        self,
        ref: Reference,
        started: httpx.Response,
        digest: str,
        content: Callable[[], bytes | Iterator[bytes]],
        size: int,
    ) -> None:
        location = str(started.url.join(started.headers["Location"]))
        joiner = "&" if "?" in location else "?"
        # A known length: a plain body, not chunked transfer encoding, which not every
        # registry takes on a PUT.
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        self._check(
            self.request(
                "PUT",
                ref.registry,
                ref.repository,
                "",
                url=f"{location}{joiner}digest={digest}",
                content=content,
                headers=headers,
            ),
            f"uploading blob {digest} to {ref.registry}/{ref.repository}",
            201,
        )

    def copy_blob(self, source: Reference, target: Reference, digest: str) -> None:
        """Make ``digest`` of ``source`` available in ``target``'s repository."""
        if self.has_blob(target, digest):
            return
        if source.registry == target.registry:
            mounted = self.request(
                "POST",
                target.registry,
                target.repository,
                "blobs/uploads/",
                params={"mount": digest, "from": source.repository},
            )
            if mounted.status_code == 201:
                return
            self._check(mounted, f"mounting blob {digest} into {target}", 202)
            data = self.get_blob(source, digest)
            self._put_upload(target, mounted, digest, lambda: data, len(data))
            return
        data = self.get_blob(source, digest)
        self.upload_blob(target, digest, lambda: data, len(data))

    def put_manifest(self, ref: Reference, manifest: bytes, media_type: str) -> str:
        self._check(
            self.request(
                "PUT",
                ref.registry,
                ref.repository,
                f"manifests/{ref.reference}",
                content=lambda: manifest,
                headers={"Content-Type": media_type},
            ),
            f"putting the manifest of {ref}",
            201,
        )
        return "sha256:" + hashlib.sha256(manifest).hexdigest()

    def delete_manifest(self, ref: Reference) -> bool:
        """Delete a manifest by digest (a tag is resolved first). True when it is gone
        (already gone included); raises with the registry's answer when it refuses."""
        if ref.digest is None:
            head = self.request(
                "HEAD",
                ref.registry,
                ref.repository,
                f"manifests/{ref.reference}",
                headers={"Accept": _ACCEPT},
            )
            if head.status_code == 404:
                return True
            self._check(head, f"resolving {ref}")
            ref = Reference(
                ref.registry, ref.repository, digest=head.headers["Docker-Content-Digest"]
            )
        response = self.request("DELETE", ref.registry, ref.repository, f"manifests/{ref.digest}")
        if response.status_code in (200, 202, 404):
            return True
        raise errors.NotSupported(
            f"registry {ref.registry} refused to delete {ref}: HTTP {response.status_code} "
            f"{response.text[:300]}",
            hint="turn on deletes in the registry (REGISTRY_STORAGE_DELETE_ENABLED=true for "
            "the distribution registry) or give the credentials the delete right",
        )


def _platform() -> tuple[str, str]:
    machine = platform.machine().lower()
    return "linux", {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def _file_chunks(path: Path) -> Callable[[], Iterator[bytes]]:
    def chunks() -> Iterator[bytes]:
        with path.open("rb") as f:
            while block := f.read(_CHUNK):
                yield block

    return chunks


def push_snapshot(
    client: RegistryClient,
    *,
    base_image: str,
    target: str,
    layer: Layer,
    comment: str = "orchard snapshot",
) -> PushResult:
    """Push ``base_image`` + ``layer`` as ``target`` (a tagged reference)."""
    base = Reference.parse(base_image)
    dest = Reference.parse(target)
    if dest.tag is None or dest.digest is not None:
        raise errors.InvalidRequest(f"snapshot target {target!r} must be a tag, not a digest")
    manifest, media_type = client.get_manifest(base)
    config = json.loads(client.get_blob(base, manifest["config"]["digest"]))
    for entry in manifest["layers"]:
        client.copy_blob(base, dest, entry["digest"])
    if not client.has_blob(dest, layer.digest):
        client.upload_blob(dest, layer.digest, _file_chunks(layer.path), layer.size_bytes)

    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    config.setdefault("rootfs", {"type": "layers", "diff_ids": []})["diff_ids"].append(
        layer.diff_id
    )
    config.setdefault("history", []).append({"created": now, "created_by": comment})
    config["created"] = now
    config_bytes = json.dumps(config, separators=(",", ":")).encode()
    config_digest = "sha256:" + hashlib.sha256(config_bytes).hexdigest()
    if not client.has_blob(dest, config_digest):
        client.upload_blob(dest, config_digest, lambda: config_bytes, len(config_bytes))

    docker_flavour = media_type == DOCKER_MANIFEST
    new_manifest = dict(manifest)
    new_manifest.pop("annotations", None)  # the base's (e.g. its source) no longer describe it
    new_manifest["config"] = {
        "mediaType": manifest["config"].get("mediaType", OCI_CONFIG),
        "size": len(config_bytes),
        "digest": config_digest,
    }
    new_manifest["layers"] = [
        *manifest["layers"],
        {
            "mediaType": DOCKER_LAYER_GZIP if docker_flavour else OCI_LAYER_GZIP,
            "size": layer.size_bytes,
            "digest": layer.digest,
        },
    ]
    new_manifest.setdefault("mediaType", media_type)
    body = json.dumps(new_manifest, separators=(",", ":")).encode()
    digest = client.put_manifest(dest, body, media_type)
    logger.info("pushed %s (%s) on top of %s", target, digest, base_image)
    return PushResult(ref=target, digest=digest, size_bytes=layer.size_bytes)
