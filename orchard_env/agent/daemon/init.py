"""PID 1 of a sandbox: a tiny init that reaps orphans and forwards TERM/INT to the agent."""

from __future__ import annotations

import os
import signal


def become_init_reaper() -> None:
    """As PID 1, fork before anything heavy is imported and stay behind as a tiny init.

    The parent reaps every zombie (orphans of the commands are re-parented to it) and
    forwards TERM/INT to the child, then exits with the child's status. Forking here, with
    only ``os``, ``signal`` and ``sys`` loaded, keeps the parent's private memory to the bare
    interpreter's; the child goes on to import the rest and serve.
    """
    pid = os.fork()
    if pid == 0:
        return

    def forward(signum: int, _frame: object) -> None:
        try:  # noqa: SIM105 - contextlib is not imported yet, on purpose
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    while True:
        try:
            reaped, status = os.wait()
        except ChildProcessError:
            os._exit(1)
        if reaped == pid:
            code = os.waitstatus_to_exitcode(status)
            os._exit(code if code >= 0 else 128 - code)
