"""Structured logging for the orchestrator: one JSON object per line, with the request id.

Modules log with ``logger.info("sandbox created", extra={"sandbox_id": ...})``; the extra
fields become keys of the JSON line. API keys and agent tokens are never passed to a logger.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime

request_id_var: ContextVar[str | None] = ContextVar("orchard_request_id", default=None)

_STANDARD_ATTRS = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys()
    | {"message", "asctime", "color_message"}
)
# A key can reach a log line through a URL (the PTY route accepts ?api_key=, and uvicorn logs
# WebSocket paths with their query): mask anything shaped like one.
_SECRETS = re.compile(r"(api_key[=.:]\s*|ork_[0-9a-f]{10}_)[^\s&\"',;]+")


@contextmanager
def isolated(logger: logging.Logger, action: str, **ids: str) -> Iterator[None]:
    """Run one item of a loop over many (the reaper's passes): an error is logged with its
    traceback and the loop carries on with the next item, so one bad record never stops the
    others from being reconciled or expired."""
    try:
        yield
    except Exception:
        logger.exception(f"{action} failed; carrying on with the rest", extra=ids)


def redact(text: str) -> str:
    return _SECRETS.sub(r"\1***", text)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": redact(record.getMessage()),
        }
        request_id = request_id_var.get()
        if request_id is not None:
            line["request_id"] = request_id
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                line[key] = redact(value) if isinstance(value, str) else value
        if record.exc_info:
            line["exc"] = redact(self.formatException(record.exc_info))
        return json.dumps(line, default=str)


def configure_logging(level: str = "INFO") -> None:
    """Send every log line (uvicorn's included) to stderr as JSON."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
