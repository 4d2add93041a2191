"""``python -m orchard_env.orchestrator``: serve with settings from ORCHARD_* and config."""

from __future__ import annotations

from orchard_env.orchestrator.server import main

if __name__ == "__main__":
    main()
