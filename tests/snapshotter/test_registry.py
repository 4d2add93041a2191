"""Pushing a snapshot on top of a base image, against the fake registry over real HTTP."""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from orchard_env import errors
from orchard_env.snapshotter.layer import Layer, write_layer
from orchard_env.snapshotter.registry import (
    DOCKER_LAYER_GZIP,
    DOCKER_MANIFEST,
    OCI_CONFIG,
    OCI_INDEX,
    OCI_LAYER_GZIP,
    OCI_MANIFEST,
    Reference,
    RegistryClient,
    load_credentials,
    push_snapshot,
)
from tests.orchestrator.backends.registry_fake import FakeRegistry


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _tar_gz(files: dict[str, bytes]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, content in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return gzip.compress(raw.getvalue(), mtime=0)


def _push_base(
    client: RegistryClient, ref: Reference, *, media_type: str = OCI_MANIFEST
) -> tuple[str, str]:
    """A one-layer base image; returns (its layer's digest, its diff id)."""
    layer = _tar_gz({"base.txt": b"base\n"})
    diff_id = _sha(gzip.decompress(layer))
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": ["PATH=/usr/bin", "FOO=bar"], "Cmd": ["sh"]},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
            "history": [{"created_by": "base"}],
        }
    ).encode()
    client.upload_blob(ref, _sha(layer), lambda: layer, len(layer))
    client.upload_blob(ref, _sha(config), lambda: config, len(config))
    docker = media_type == DOCKER_MANIFEST
    manifest = {
        "schemaVersion": 2,
        "mediaType": media_type,
        "config": {
            "mediaType": "application/vnd.docker.container.image.v1+json" if docker else OCI_CONFIG,
            "size": len(config),
            "digest": _sha(config),
        },
        "layers": [
            {
                "mediaType": DOCKER_LAYER_GZIP if docker else OCI_LAYER_GZIP,
                "size": len(layer),
                "digest": _sha(layer),
            }
        ],
        "annotations": {"org.opencontainers.image.source": "base"},
    }
    client.put_manifest(ref, json.dumps(manifest).encode(), media_type)
    return _sha(layer), diff_id


def _client(registry: FakeRegistry, docker_config: Path) -> RegistryClient:
    return RegistryClient(
        credentials=load_credentials(docker_config), plain_http=frozenset({registry.host})
    )


def _snapshot_layer(tmp_path: Path) -> Layer:
    upper = tmp_path / "upper"
    upper.mkdir()
    (upper / "new.txt").write_text("new\n")
    return write_layer(upper, tmp_path / "layer.tar.gz")


@pytest.mark.parametrize("media_type", [OCI_MANIFEST, DOCKER_MANIFEST])
def test_push_snapshot_appends_the_layer_to_the_base_image(
    tmp_path: Path, registry: FakeRegistry, docker_config: Path, media_type: str
) -> None:
    layer = _snapshot_layer(tmp_path)
    with _client(registry, docker_config) as client:
        base = Reference.parse(f"{registry.host}/orchard/base:1")
        base_layer, base_diff = _push_base(client, base, media_type=media_type)
        target = f"{registry.host}/orchard/snapshots:snap-1"
        result = push_snapshot(client, base_image=str(base), target=target, layer=layer)

        assert result.ref == target
        assert result.size_bytes == layer.size_bytes
        manifest, got_type = client.get_manifest(Reference.parse(target))
        assert got_type == media_type
        assert result.digest == _sha(registry.state.manifests[("orchard/snapshots", "snap-1")][0])
        assert [entry["digest"] for entry in manifest["layers"]] == [base_layer, layer.digest]
        assert manifest["layers"][1]["mediaType"] == (
            DOCKER_LAYER_GZIP if media_type == DOCKER_MANIFEST else OCI_LAYER_GZIP
        )
        assert "annotations" not in manifest
        config = json.loads(client.get_blob(Reference.parse(target), manifest["config"]["digest"]))
    assert config["rootfs"]["diff_ids"] == [base_diff, layer.diff_id]
    assert config["config"]["Env"] == ["PATH=/usr/bin", "FOO=bar"]
    assert [h["created_by"] for h in config["history"]] == ["base", "orchard snapshot"]
    assert registry.state.mounts == 1  # the base layer was mounted, not copied


def test_push_copies_the_base_layers_when_the_registry_does_not_mount(
    tmp_path: Path, registry: FakeRegistry, docker_config: Path
) -> None:
    registry.state.allow_mount = False
    layer = _snapshot_layer(tmp_path)
    with _client(registry, docker_config) as client:
        base = Reference.parse(f"{registry.host}/orchard/base:1")
        base_layer, _ = _push_base(client, base)
        push_snapshot(client, base_image=str(base), target=f"{registry.host}/snaps:s2", layer=layer)
    assert registry.state.mounts == 0
    assert ("snaps", base_layer) in registry.state.repo_blobs


def test_an_index_resolves_to_this_platform(
    tmp_path: Path, registry: FakeRegistry, docker_config: Path
) -> None:
    layer = _snapshot_layer(tmp_path)
    with _client(registry, docker_config) as client:
        single = Reference.parse(f"{registry.host}/orchard/base:single")
        _push_base(client, single)
        body, _ = registry.state.manifests[("orchard/base", "single")]
        index = {
            "schemaVersion": 2,
            "mediaType": OCI_INDEX,
            "manifests": [
                {
                    "mediaType": OCI_MANIFEST,
                    "digest": _sha(body),
                    "size": len(body),
                    "platform": {"os": "linux", "architecture": arch},
                }
                for arch in ("amd64", "arm64")
            ],
        }
        base = Reference.parse(f"{registry.host}/orchard/base:multi")
        client.put_manifest(base, json.dumps(index).encode(), OCI_INDEX)
        result = push_snapshot(
            client, base_image=str(base), target=f"{registry.host}/snaps:s3", layer=layer
        )
        manifest, media_type = client.get_manifest(Reference.parse(result.ref))
    assert media_type == OCI_MANIFEST
    assert manifest["layers"][-1]["digest"] == layer.digest


def test_delete_manifest(tmp_path: Path, registry: FakeRegistry, docker_config: Path) -> None:
    layer = _snapshot_layer(tmp_path)
    with _client(registry, docker_config) as client:
        base = Reference.parse(f"{registry.host}/orchard/base:1")
        _push_base(client, base)
        target = f"{registry.host}/snaps:s4"
        result = push_snapshot(client, base_image=str(base), target=target, layer=layer)
        by_digest = Reference.parse(f"{registry.host}/snaps@{result.digest}")
        assert client.delete_manifest(by_digest) is True
        with pytest.raises(errors.ImageNotFound):
            client.get_manifest(Reference.parse(target))
        assert client.delete_manifest(by_digest) is True  # already gone
        assert client.delete_manifest(Reference.parse(target)) is True  # tag gone too

        again = push_snapshot(client, base_image=str(base), target=target, layer=layer)
        registry.state.allow_delete = False
        with pytest.raises(errors.NotSupported, match=r"refused to delete .*HTTP 405"):
            client.delete_manifest(Reference.parse(target))
        assert client.get_manifest(Reference.parse(f"{registry.host}/snaps@{again.digest}"))


def test_wrong_or_missing_credentials_are_refused(tmp_path: Path, registry: FakeRegistry) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps({"auths": {f"http://{registry.host}": {"username": "snap", "password": "x"}}})
    )
    assert load_credentials(bad) == {registry.host: ("snap", "x")}
    ref = Reference.parse(f"{registry.host}/orchard/base:1")
    for creds in (load_credentials(bad), {}):
        with (
            RegistryClient(credentials=creds, plain_http=frozenset({registry.host})) as client,
            pytest.raises(errors.PermissionDenied, match=r"refused a token.*HTTP 401"),
        ):
            client.get_manifest(ref)


def test_load_credentials_reports_an_unreadable_file(tmp_path: Path) -> None:
    broken = tmp_path / "config.json"
    broken.write_text("{not json")
    with pytest.raises(errors.ConfigError, match="cannot read the registry credentials"):
        load_credentials(broken)
    assert load_credentials(None) == {}
    assert load_credentials(tmp_path / "absent.json") == {}  # the optional Secret not made
    encoded = tmp_path / "hub.json"
    auth = base64.b64encode(b"me:pw").decode()
    encoded.write_text(json.dumps({"auths": {"https://index.docker.io/v1/": {"auth": auth}}}))
    assert load_credentials(encoded)["registry-1.docker.io"] == ("me", "pw")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("python:3.12", ("registry-1.docker.io", "library/python", "3.12", None)),
        ("docker.io/org/img:1", ("registry-1.docker.io", "org/img", "1", None)),
        ("127.0.0.1:5000/a/b:t", ("127.0.0.1:5000", "a/b", "t", None)),
        ("r.io/a@sha256:" + "0" * 64, ("r.io", "a", None, "sha256:" + "0" * 64)),
    ],
)
def test_reference_parse(text: str, expected: tuple[str, str, str | None, str | None]) -> None:
    ref = Reference.parse(text)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == expected


@pytest.mark.parametrize("text", ["r.io/Upper:1", "r.io/a/b"])
def test_reference_parse_refuses(text: str) -> None:
    with pytest.raises(errors.InvalidRequest, match="not an image reference"):
        Reference.parse(text)
