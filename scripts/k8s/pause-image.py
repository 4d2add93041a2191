"""Write an OCI image archive (for `ctr images import`) whose only file is Debian's static
catatonit as /pause: the local cluster's pod sandbox image (registry.k8s.io is unreachable).

    python3 scripts/k8s/pause-image.py OUT.tar [NAME]   (default localhost/orchard/pause:1)
"""

import hashlib
import io
import json
import sys
import tarfile

CATATONIT = "/usr/bin/catatonit"  # Debian package catatonit: static, no libc needed


def _entry(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    archive.addfile(info, io.BytesIO(data))


def main(out: str, name: str) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as layer_tar, open(CATATONIT, "rb") as binary:
        info = layer_tar.gettarinfo(CATATONIT, arcname="pause")
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        layer_tar.addfile(info, binary)
    layer = buffer.getvalue()
    layer_digest = hashlib.sha256(layer).hexdigest()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Entrypoint": ["/pause", "-P"]},
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_digest}"]},
        }
    ).encode()
    config_digest = hashlib.sha256(config).hexdigest()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": f"sha256:{config_digest}",
                "size": len(config),
            },
            "layers": [
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": f"sha256:{layer_digest}",
                    "size": len(layer),
                }
            ],
        }
    ).encode()
    manifest_digest = hashlib.sha256(manifest).hexdigest()
    index = json.dumps(
        {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": f"sha256:{manifest_digest}",
                    "size": len(manifest),
                    "annotations": {"io.containerd.image.name": name},
                }
            ],
        }
    ).encode()
    with tarfile.open(out, "w") as archive:
        _entry(archive, "oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        _entry(archive, "index.json", index)
        for digest, data in (
            (layer_digest, layer),
            (config_digest, config),
            (manifest_digest, manifest),
        ):
            _entry(archive, f"blobs/sha256/{digest}", data)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "localhost/orchard/pause:1")
