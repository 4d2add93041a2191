"""The tools payload in a sandbox pod (``settings.tools_volume_mode``):

* ``image``: an image volume of ``settings.tools_image`` (``volumes[].image``, Kubernetes
  >= 1.33 with the ImageVolume feature, containerd >= 2.0), read-only at
  ``/opt/sandbox-tools`` through ``subPath``: pulled once per node, never copied. A sandbox
  that asked for some harnesses still sees the whole payload (the mount costs nothing).
* ``initcontainer``: the tools image's entrypoint copies the payload (or the chosen
  harnesses) into an emptyDir; the pod's ephemeral-storage request and limit grow by the
  volume's size so the kubelet does not evict it for the copy.
* ``off``: none.

Either way the payload's ``profile.sh`` is mounted at ``/etc/profile.d/sandbox-tools.sh``
(``subPath``), so a login shell a command starts finds the harnesses too.
"""

from __future__ import annotations

from typing import Any

from orchard_env.config import ServiceSettings
from orchard_env.tools import PROFILE_TARGET, TOOLS_BIN, TOOLS_ENV, TOOLS_MOUNT, TOOLS_PROFILE

TOOLS_VOLUME = "orchard-tools"
TOOLS_INIT_CONTAINER = "tools-injector"
TOOLS_SUBPATH = TOOLS_MOUNT.lstrip("/")  # where the tools image holds the payload
TOOLS_VOLUME_BYTES = 2 * 1024**3  # the emptyDir's sizeLimit: the payload is about 1.4 GB
# Where the tools injector sees the emptyDir it copies into: not TOOLS_MOUNT, where its image
# holds the payload (mounted there, the empty volume would hide what it is to copy).
TOOLS_COPY_TARGET = "/mnt/sandbox-tools"


def add_tools(
    pod_spec: dict[str, Any],
    settings: ServiceSettings,
    harnesses: tuple[str, ...] | None,
    init_template: dict[str, Any],
) -> None:
    """Give the pod's main container the tools payload, as the settings say. ``harnesses``:
    the sandbox's choice (None: all; ``()``: none). ``init_template``: the agent injector,
    whose resources and security context the tools injector copies."""
    image = settings.tools_image
    if image is None or settings.tools_volume_mode == "off" or harnesses == ():
        return
    main = pod_spec["containers"][0]
    main["env"].append({"name": TOOLS_ENV, "value": TOOLS_BIN})
    if settings.tools_volume_mode == "image":
        pod_spec["volumes"].append(
            {"name": TOOLS_VOLUME, "image": {"reference": image, "pullPolicy": "IfNotPresent"}}
        )
        main["volumeMounts"].append(
            {
                "name": TOOLS_VOLUME,
                "mountPath": TOOLS_MOUNT,
                "subPath": TOOLS_SUBPATH,
                "readOnly": True,
            }
        )
        main["volumeMounts"].append(_profile_mount(f"{TOOLS_SUBPATH}/{TOOLS_PROFILE}"))
        return
    pod_spec["volumes"].append(
        {"name": TOOLS_VOLUME, "emptyDir": {"sizeLimit": str(TOOLS_VOLUME_BYTES)}}
    )
    pod_spec["initContainers"].append(
        {
            **init_template,
            "name": TOOLS_INIT_CONTAINER,
            "image": image,
            "args": [TOOLS_COPY_TARGET, *(harnesses or ())],
            "volumeMounts": [{"name": TOOLS_VOLUME, "mountPath": TOOLS_COPY_TARGET}],
        }
    )
    main["volumeMounts"].append({"name": TOOLS_VOLUME, "mountPath": TOOLS_MOUNT, "readOnly": True})
    main["volumeMounts"].append(_profile_mount(TOOLS_PROFILE))
    for kind in ("requests", "limits"):
        amounts = main["resources"][kind]
        amounts["ephemeral-storage"] = str(int(amounts["ephemeral-storage"]) + TOOLS_VOLUME_BYTES)


def _profile_mount(sub_path: str) -> dict[str, Any]:
    """The payload's profile script where login shells source it (``sub_path`` in the volume)."""
    return {
        "name": TOOLS_VOLUME,
        "mountPath": PROFILE_TARGET,
        "subPath": sub_path,
        "readOnly": True,
    }
