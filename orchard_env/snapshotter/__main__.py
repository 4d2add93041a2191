"""``python -m orchard_env.snapshotter``: serve the snapshotter's HTTP API."""

from orchard_env.snapshotter.server import main

if __name__ == "__main__":
    main()
