"""Start the agent: ``python -I -S <bundle>/agent`` in a sandbox, ``-m`` of this package on a host.

As PID 1 it forks first, with only ``os``, ``signal`` and ``sys`` imported, and leaves a tiny
reaper behind (:func:`.init.become_init_reaper`); the child imports the rest (without ssl) and
serves.
"""

import os
import sys

from .init import become_init_reaper

if os.getpid() == 1:
    become_init_reaper()

# asyncio imports ssl when it can, and with it libssl and its state (0.7 MB of an idle
# agent's PSS); the agent serves no TLS, so asyncio is told there is none.
sys.modules["ssl"] = None  # type: ignore[assignment]

from .server import main  # noqa: E402 - after the fork and the ssl block, on purpose

sys.exit(main())
