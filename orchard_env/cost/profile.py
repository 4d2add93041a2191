"""The cost-relevant part of a deployment profile (YAML).

Until the deployment profile schema exists, ``orchard cost`` reads these optional top-level
keys and rejects any other, naming it: ``region``, ``sandbox_vm_size``, ``sandbox_vm_sizes``,
``spot``, ``system_vm_size``, ``system_nodes``, ``tier``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from orchard_env.errors import ConfigError

Tier = Literal["free", "standard", "premium"]


class CostProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    region: str | None = None
    sandbox_vm_size: str | None = None
    sandbox_vm_sizes: list[str] | None = Field(default=None, min_length=1)
    spot: bool | None = None
    system_vm_size: str | None = None
    system_nodes: int | None = Field(default=None, ge=1)
    tier: Tier | None = None

    @field_validator("tier", mode="before")
    @classmethod
    def _tier(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    def vm_sizes(self) -> list[str] | None:
        if self.sandbox_vm_sizes is not None:
            return list(self.sandbox_vm_sizes)
        return [self.sandbox_vm_size] if self.sandbox_vm_size else None


def load_profile(path: Path) -> CostProfile:
    """Read and validate a profile; any problem is a :class:`ConfigError` naming the key."""
    known = ", ".join(CostProfile.model_fields)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read profile {path}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"profile {path} is not valid YAML: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"profile {path} must be a mapping of keys to values", hint=f"known keys: {known}"
        )
    try:
        return CostProfile.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        key = ".".join(str(part) for part in error["loc"]) or "(top level)"
        if error["type"] == "extra_forbidden":
            message = f"profile {path}: unknown key {key!r}"
        else:
            message = f"profile {path}: bad value for {key!r}: {error['msg']}"
        raise ConfigError(message, hint=f"known keys: {known}") from exc
