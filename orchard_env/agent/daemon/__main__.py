"""Start the agent: ``python -I -S <bundle>/agent`` in a sandbox, ``-m`` of this package on a host.

As PID 1 it forks first, with only ``os``, ``signal`` and ``sys`` imported, and leaves a tiny
reaper behind (:func:`.init.become_init_reaper`); the child imports the rest and serves.
"""

import os
import sys

from .init import become_init_reaper

if os.getpid() == 1:
    become_init_reaper()

from .server import main

sys.exit(main())
