"""`orchard bench scale` at a tiny size: the real orchestrator on fleet agents, every figure
produced, and its bad inputs refused."""

from __future__ import annotations

import pytest

from orchard_env import bench_scale as bench_scale_module
from orchard_env.bench_scale import bench_scale
from orchard_env.errors import OrchardError


def test_a_small_run_measures_every_level_and_the_running_jobs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bench_scale_module, "AGENTS_PER_FLEET", 3)  # three fleet processes
    result = bench_scale((3, 7), running_jobs=2)
    for level in (3, 7):
        for what in (
            "list, first page of 100",
            "job lookup",
            "exec of true",
            "list, every page of 100",
            "list, all in one answer",
            "reaper pass",
        ):
            assert result.stats[f"{what} @ {level}"].n >= 3
        assert result.figures[f"orchestrator RSS at {level} sandboxes, MB"] > 0
    assert "RSS per live sandbox (3 to 7), KB" in result.figures
    assert result.figures["Python heap per running job (2 running), KB"] > 0
    assert result.stats["reaper pass @ 7, 2 jobs running"].n == 3


@pytest.mark.parametrize(
    ("levels", "jobs", "message"),
    [
        ((10, 5), 0, r"levels \[10, 5\]: give rising counts"),
        ((0, 5), 0, r"levels \[0, 5\]: give rising counts"),
        ((5,), 6, "--running-jobs 6 is more than the 5 sandboxes"),
    ],
)
def test_bad_levels_are_named(levels: tuple[int, ...], jobs: int, message: str) -> None:
    with pytest.raises(OrchardError, match=message):
        bench_scale(levels, running_jobs=jobs)
