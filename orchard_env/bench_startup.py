"""Start-up time of command lines (the CLI's), beside a bare interpreter in the same run.

Each round starts every command once, interleaved with ``python -c pass``, so a change in
the machine's load touches all of them alike; the figures are ratios of p50s, which travel
between machines better than milliseconds do.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence

from orchard_env.bench import BenchResult, Stats
from orchard_env.errors import OrchardError

BARE = "python -c pass"


def bench_startup(
    commands: Mapping[str, Sequence[str]],
    *,
    n: int,
    env: Mapping[str, str] | None = None,
    progress: Callable[[str], None] = lambda _message: None,
) -> BenchResult:
    """Wall time of each command, started ``n`` times; a command that fails is an error
    (a fast failure is not a start-up time)."""
    lines: dict[str, Sequence[str]] = {BARE: [sys.executable, "-c", "pass"], **commands}
    samples: dict[str, list[float]] = {name: [] for name in lines}
    for round_ in range(n):
        progress(f"round {round_ + 1}/{n}")
        for name, argv in lines.items():
            started = time.perf_counter()
            done = subprocess.run(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=None if env is None else dict(env),
                check=False,
            )
            samples[name].append(time.perf_counter() - started)
            if done.returncode != 0:
                first = (done.stderr.decode(errors="replace").strip().splitlines() or [""])[0]
                raise OrchardError(
                    f"`{name}` exited {done.returncode}: {first}",
                    hint="benchmark against a running service (`orchard status`)",
                )
    stats = {name: Stats.of(values) for name, values in samples.items()}
    bare = stats[BARE].p50
    figures = {f"{name}: p50 / bare p50": round(st.p50 / bare, 2) for name, st in stats.items()}
    del figures[f"{BARE}: p50 / bare p50"]
    return BenchResult("CLI start-up", {"n": n}, stats, figures)
