"""Output like kubectl's: a table by default, ``-o json|yaml|wide|name``, ``-q`` for ids.

Tables are plain text, columns padded and separated by three spaces, never truncated,
wrapped or dropped (a pipe gets every column of every row, whatever its width).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar

from orchard_env.errors import InvalidRequest

T = TypeVar("T")

FORMATS = ("json", "yaml", "wide", "name")


@dataclass(frozen=True)
class Column(Generic[T]):
    header: str
    value: Callable[[T], str]
    wide: bool = False  # only with -o wide


def encode(value: Any) -> Any:
    """Plain data from pydantic models (and lists and dicts of them), JSON's types only."""
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if isinstance(value, list | tuple):
        return [encode(item) for item in value]
    if isinstance(value, dict):
        return {key: encode(item) for key, item in value.items()}
    return value


def print_json(data: Any) -> None:
    """Write JSON to stdout (pydantic models and lists of them included)."""
    sys.stdout.write(json.dumps(encode(data), indent=2, default=str) + "\n")


def output_format(output: str | None, *, json_: bool = False, quiet: bool = False) -> str:
    """The format the options ask for: table, wide, json, yaml, name or quiet. Checked before
    any request is made, so a typo costs nothing."""
    if output is not None and output not in FORMATS:
        raise InvalidRequest(
            f"unknown output format {output!r}", hint=f"-o takes one of: {', '.join(FORMATS)}"
        )
    chosen = [name for name, on in (("json", json_), ("quiet", quiet)) if on]
    if output is not None:
        chosen.append(output)
    if len(set(chosen)) > 1:
        raise InvalidRequest(
            f"choose one output format (got {' and '.join(chosen)})",
            hint="--json is -o json; -q prints ids only",
        )
    return chosen[0] if chosen else "table"


def parse_pairs(items: list[str] | None, what: str) -> dict[str, str]:
    """``KEY=VALUE`` items (``--label``, ``--env``) as a dict, the last of a key winning."""
    pairs: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidRequest(
                f"{what} {item!r} is not KEY=VALUE", hint=f"for example --{what} team=rl"
            )
        pairs[key] = value
    return pairs


def when(value: datetime | float | None) -> str:
    """An instant to the second, UTC; a float is Unix epoch seconds (the wire's form)."""
    if isinstance(value, float | int):
        value = datetime.fromtimestamp(value, UTC)
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else ""


def pairs(values: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in values.items())


def table_text(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Padded columns, three spaces apart, trailing blanks stripped; newlines in a cell are
    shown as ``\\n`` so every row stays one line."""
    cells = [[str(c).replace("\n", "\\n") for c in row] for row in [headers, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["   ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "".join(line.rstrip() + "\n" for line in lines)


def _yaml(data: Any) -> None:
    import yaml

    sys.stdout.write(yaml.safe_dump(encode(data), sort_keys=False, allow_unicode=True))


def emit_list(
    items: Sequence[T],
    columns: Sequence[Column[T]],
    fmt: str,
    *,
    kind: str,
    key: Callable[[T], str],
) -> None:
    """Print a list in the chosen format (see :func:`output_format`)."""
    if fmt == "json":
        print_json(list(items))
    elif fmt == "yaml":
        _yaml(list(items))
    elif fmt in ("name", "quiet"):
        prefix = f"{kind}/" if fmt == "name" else ""
        sys.stdout.write("".join(f"{prefix}{key(item)}\n" for item in items))
    else:
        shown = [c for c in columns if fmt == "wide" or not c.wide]
        rows = [[c.value(item) for c in shown] for item in items]
        sys.stdout.write(table_text([c.header for c in shown], rows))


def emit_one(item: Any, fmt: str, *, kind: str, key: str) -> None:
    """Print one object: fields one per line by default, or the chosen format."""
    if fmt == "json":
        print_json(item)
    elif fmt == "yaml":
        _yaml(item)
    elif fmt in ("name", "quiet"):
        sys.stdout.write(f"{kind}/{key}\n" if fmt == "name" else f"{key}\n")
    else:
        fields = encode(item)
        rows = [[name, "" if value is None else str(value)] for name, value in fields.items()]
        text = table_text(["", ""], rows)
        sys.stdout.write(text.split("\n", 1)[1])
