"""Schemathesis hooks for the API fuzz run (``SCHEMATHESIS_HOOKS``): keep what a generated
request asks for local and small, without making a malformed request valid.

* A valid image reference becomes the one test image, ``ORCHARD_FUZZ_IMAGE`` (nothing is
  pulled from a registry).
* A valid ``ttl_seconds`` is at most :data:`TTL_SECONDS`, so the reaper removes what the run
  creates while it runs (a pool's, which must be at least 60, is 60); a valid fork ``count``
  is at most :data:`FORKS`, a valid pool ``size`` at most :data:`POOL_SIZE`.

Invalid values (negative and out-of-range cases) are sent as generated: they must be 400s.
"""

from __future__ import annotations

import os
from typing import Any

import schemathesis

from orchard_env.protocol import IMAGE_RE, MAX_IMAGE_LENGTH, MAX_POOL_SIZE, MAX_TTL_SECONDS

LOCAL_IMAGE = os.environ.get("ORCHARD_FUZZ_IMAGE", "")
TTL_SECONDS = 10
FORKS = 2
POOL_SIZE = 2
POOL_TTL_SECONDS = 60


def _valid_int(value: Any, top: int) -> bool:
    """A whole number the service accepts (JSON's ``57.0`` included)."""
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    return whole and not isinstance(value, bool) and 1 <= value <= top


@schemathesis.hook
def before_call(ctx: Any, case: Any, **kwargs: Any) -> None:
    body = case.body
    if not isinstance(body, dict):
        return
    image = body.get("image")
    if isinstance(image, str) and len(image) <= MAX_IMAGE_LENGTH and IMAGE_RE.match(image):
        body["image"] = LOCAL_IMAGE
    pool = case.operation.path.startswith("/pools")
    if _valid_int(body.get("ttl_seconds"), MAX_TTL_SECONDS):
        ttl = POOL_TTL_SECONDS if pool else TTL_SECONDS
        body["ttl_seconds"] = min(int(body["ttl_seconds"]), ttl)
    if pool and _valid_int(body.get("size"), MAX_POOL_SIZE):
        body["size"] = min(int(body["size"]), POOL_SIZE)
    if case.operation.path.endswith("/fork") and _valid_int(body.get("count"), 64):
        body["count"] = min(int(body["count"]), FORKS)
        if isinstance(body.get("sandbox_ids"), list):
            body["sandbox_ids"] = body["sandbox_ids"][: body["count"]]
