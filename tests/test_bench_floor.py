"""The least-reachable-peak benchmark (benchmarks/bench_floor.py) on a tiny fake GPT-2: each
lever's number is the peak of a plan the simulator accepted, never below the floor no plan
can pass, and the table has one column per lever."""

from __future__ import annotations

import pytest

from benchmarks import bench_floor
from taichi_plan.problem.core import build_problem
from taichi_plan.problem.live import min_live_bytes
from taichi_plan.problem.partition.floor import floor_bytes
from taichi_plan.problem.partition.qualify import allow_random
from taichi_plan.record import get_workload, record_workload
from taichi_plan.solve.heuristic import plan_heuristic


@pytest.fixture(scope="module")
def problem():
    w = get_workload(model="gpt2", layers=2, hidden=64, heads=2, vocab=64, seq=32, batch=4)
    return build_problem(record_workload(w, fake=True, device_profile="a100-40gb"))


def test_each_lever_reaches_a_peak_between_its_floor_and_the_plain_peak(problem):
    base = problem.baseline_peak[0]
    peaks = bench_floor.least_peaks(problem)
    assert list(peaks) == list(bench_floor.LEVERS)
    assert all(0 < v <= 1.0 for v in peaks.values())
    # Floors: remat alone cannot pass min_live_bytes; nothing passes the floor with every
    # module partitioned (dropout modules included for "both + dropout").
    assert peaks["remat only"] >= min_live_bytes(problem).max() / base
    assert peaks["both"] >= floor_bytes(problem).max() / base
    assert peaks["both + dropout"] >= floor_bytes(allow_random(problem, True)).max() / base
    assert peaks["both"] < 1.0 and peaks["every block"] < 1.0


def test_partition_only_drops_nothing(problem):
    bare = bench_floor.no_drops(problem)
    assert len(bare.candidates) == 0
    dec = plan_heuristic(bare, int(0.9 * problem.baseline_peak[0]))
    assert dec.drops == []


def test_markdown_has_a_column_per_lever():
    row = {"model": "m", "ops": 3, "plain_peak_bytes": 2 * 10**9, "seconds": 1.0,
           **{k: 0.5 for k in bench_floor.LEVERS}}
    text = bench_floor.markdown([row])
    assert text.startswith(bench_floor.TITLE)
    assert "| m (3) | 2.00 GB | " + " | ".join(["0.500"] * len(bench_floor.LEVERS)) + " | 1 |" in text
