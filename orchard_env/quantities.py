"""Kubernetes quantities (CPU cores, bytes of memory or disk) and a sandbox's lower bounds on
them; no third-party imports, so the command line can parse them before anything loads."""

from __future__ import annotations

import math
import re

_CPU_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m?)$")
_MEM_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|K|M|G|T|k)?$")
_MEM_UNITS = {
    None: 1,
    "k": 1000,
    "K": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
    "Ki": 1024,
    "Mi": 1024**2,
    "Gi": 1024**3,
    "Ti": 1024**4,
}

MIN_CPU = 0.01
"""Cores: less is below what the engine can enforce (10m, Kubernetes' smallest useful unit)."""
MIN_MEMORY = 32 * 1024**2
"""Bytes: what the sandbox's agent needs to run beside the commands."""


def parse_cpu(value: str | float | int) -> float:
    """Kubernetes CPU quantity → cores: ``2``, ``0.5``, ``"500m"``."""
    if isinstance(value, bool):
        raise ValueError(f"cpu {value!r} is not a quantity")
    if isinstance(value, int | float):
        cores = float(value)
    else:
        match = _CPU_RE.match(value.strip())
        if not match:
            raise ValueError(f"cpu {value!r} is not a quantity (examples: 2, 0.5, 500m)")
        cores = float(match.group(1)) / (1000 if match.group(2) else 1)
    if not math.isfinite(cores):
        raise ValueError(f"cpu {value!r} is not a finite number of cores")
    if cores <= 0:
        raise ValueError(f"cpu {value!r} must be greater than zero")
    return cores


def parse_memory(value: str | int, what: str = "memory") -> int:
    """Kubernetes memory quantity → bytes: ``"512Mi"``, ``"8Gi"``, ``"1G"``, ``1073741824``."""
    if isinstance(value, bool):
        raise ValueError(f"{what} {value!r} is not a quantity")
    if isinstance(value, int):
        size = value
    else:
        match = _MEM_RE.match(value.strip())
        if not match:
            raise ValueError(f"{what} {value!r} is not a quantity (examples: 512Mi, 8Gi, 1G)")
        size = int(float(match.group(1)) * _MEM_UNITS[match.group(2)])
    if size <= 0:
        raise ValueError(f"{what} {value!r} must be greater than zero")
    return size


def sandbox_cpu(value: str | float | int) -> float:
    """A sandbox's CPU: a quantity of at least :data:`MIN_CPU` cores."""
    cores = parse_cpu(value)
    if cores < MIN_CPU:
        hint = ""
        if isinstance(value, str) and value.strip().endswith("m"):
            number = value.strip().removesuffix("m")
            hint = (
                f": m is thousandths of a core; did you mean {number} ({float(number) * 1000:g}m)?"
            )
        raise ValueError(
            f"cpu {value!r} is {cores:g} cores, below the minimum of {MIN_CPU:g} (10m){hint}"
        )
    return cores


def sandbox_memory(value: str | int, what: str = "memory") -> int:
    """A sandbox's memory (or disk): a quantity of at least :data:`MIN_MEMORY` bytes. A
    quantity without a unit is bytes, as in Kubernetes (``8G`` is 8e9 bytes, ``8Gi`` 8 GiB)."""
    size = parse_memory(value, what)
    if size < MIN_MEMORY:
        unitless = isinstance(value, int) or value.strip().isdigit()
        hint = f": a number without a unit is bytes, did you mean {value}Mi?" if unitless else ""
        raise ValueError(
            f"{what} {value!r} is {size} bytes, below the minimum of "
            f"{format_memory(MIN_MEMORY)}{hint}"
        )
    return size


def format_memory(size: int) -> str:
    for unit in ("Ti", "Gi", "Mi", "Ki"):
        factor = _MEM_UNITS[unit]
        if size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)
