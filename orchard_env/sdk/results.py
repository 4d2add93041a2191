"""What the SDK returns: the wire models, plus what upstream's SDK callers rely on.

Upstream Orchard Env's SDK returned plain dicts for files, patches and health, and a
``JobResult`` with ``succeeded``/``failed``/``is_complete``. These classes are the protocol
models themselves (same fields, same validation) with that behaviour added, so code written
for upstream (``entry["name"]``, ``result.failed``) keeps working.
"""

from __future__ import annotations

from typing import Any

from pydantic import PrivateAttr

from orchard_env import errors, protocol

_STDERR_TAIL_LINES = 20
_STDERR_TAIL_CHARS = 2000


class _ItemAccess:
    """``model["field"]`` and ``model.get("field")``, as upstream's dict results allowed."""

    def __getitem__(self, key: str) -> Any:
        if key not in type(self).model_fields:  # type: ignore[attr-defined]
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default


class FileEntry(protocol.FileEntry, _ItemAccess):
    """One directory entry of :meth:`Sandbox.list_files`."""


class PatchResult(protocol.PatchResult, _ItemAccess):
    """The outcome of :meth:`Sandbox.apply_patch` (``success`` is git's verdict)."""


class UploadResult(protocol.FileUploadResult, _ItemAccess):
    """Where an upload landed and how many bytes it wrote."""


class Health(protocol.Health, _ItemAccess):
    """``GET /health``."""


class ExecResult(protocol.Job):
    """A command's run, like :class:`subprocess.CompletedProcess` (alias ``JobResult``).

    ``status`` is one of queued, running, succeeded, failed (upstream's four); a failed run
    says why in ``timed_out``, ``cancelled``, ``oom_killed`` and ``error``. A result from
    ``exec(wait=False)`` may still be queued or running: ``is_complete`` says.
    """

    _timeout_seconds: int | None = PrivateAttr(default=None)

    @property
    def is_complete(self) -> bool:
        """The command has finished (in any way): its output and exit code are final."""
        return self.status.done

    @property
    def failed(self) -> bool:
        """Finished without succeeding: non-zero exit, timeout, cancellation or error."""
        return self.is_complete and not self.succeeded

    @property
    def returncode(self) -> int | None:
        """``exit_code`` under :class:`subprocess.CompletedProcess`'s name."""
        return self.exit_code

    def check_returncode(self) -> None:
        """Raise :class:`~orchard_env.errors.CommandFailed` unless the command succeeded."""
        if self.succeeded:
            return
        if not self.is_complete:
            raise errors.InvalidRequest(
                f"job {self.job_id} has not finished (status {self.status.value})",
                hint="wait for it first: wait_job(job_id) or exec(..., wait=True)",
            )
        raise errors.CommandFailed(self._failure_message())

    def _failure_message(self) -> str:
        what = f"command {self.command!r} (job {self.job_id})"
        if self.timed_out:
            after = f" after {self._timeout_seconds}s" if self._timeout_seconds else ""
            message = f"{what} timed out{after}"
        elif self.cancelled:
            message = f"{what} was cancelled"
        elif self.exit_code is not None:
            message = f"{what} exited with code {self.exit_code}"
        else:
            message = f"{what} failed"
        if self.error and not (self.timed_out and self.error.startswith("Command timed out")):
            message += f": {self.error}"
        tail = _tail(self.stderr)
        if tail:
            message += f"\nstderr (last lines):\n{tail}"
        return message


def _tail(text: str) -> str:
    lines = text.rstrip("\n").splitlines()[-_STDERR_TAIL_LINES:]
    tail = "\n".join(lines)
    return tail[-_STDERR_TAIL_CHARS:]


JobResult = ExecResult
"""Upstream Orchard Env's name for :class:`ExecResult`."""
