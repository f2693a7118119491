"""Shared fixtures: a small hand-built trace and the public benchmark graphs directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from taichi_plan.trace.format import Trace, frame, op_signature

REPO_ROOT = Path(__file__).resolve().parents[1]


# make test runs files on two processes, one file at a time each, in the order below (the
# Makefile passes --no-loadscope-reorder, or pytest-xdist would start with the files that hold
# the most tests): the slowest file first, so that no slow file is left for the end while the
# other process has nothing to do. A file's cost is the sum of its tests' seconds in the last
# run that ran them (.pytest_cache, TEST_SECONDS_KEY); for a file none of whose tests ran yet,
# its seconds below (make test on 2026-12-01, under load, divided by 4), else 0.
TEST_SECONDS_KEY = "taichi_plan/test_seconds"
SLOW_FILES = {
    "test_replay.py": 85, "test_rebuild_points.py": 12, "test_loops.py": 55, "test_tokens.py": 50, "test_fsdp_replay.py": 44,
    "test_record.py": 32, "test_replay_apply.py": 30, "test_ddp.py": 29, "test_optimizer_plan.py": 28,
    "test_reshard.py": 28, "test_ilp_exhaustive.py": 24, "test_readme.py": 23, "test_gpu_check.py": 22,
    "test_maxbatch.py": 22, "test_replay_blocks.py": 21, "test_partition_exact.py": 20, "test_pyrefs.py": 19,
    "test_trainer.py": 18, "test_fsdp_record.py": 16, "test_overhead.py": 16, "test_bench_replay.py": 15,
    "test_record_cli.py": 14, "test_replay_memory.py": 12, "test_solve.py": 11, "test_checkpoint_whole.py": 10,
    "test_messages.py": 9, "test_record_step.py": 9,
}


def pytest_collection_modifyitems(config, items):
    """Files in decreasing cost, each file's tests in their own order (test_readme.py's
    depend on it)."""
    cache = getattr(config, "cache", None)
    seconds = (cache.get(TEST_SECONDS_KEY, None) if cache is not None else None) or {}
    by_file: dict[str, list] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0], []).append(item)

    def cost(f: str) -> float:
        known = [seconds[i.nodeid] for i in by_file[f] if i.nodeid in seconds]
        return sum(known) if known else SLOW_FILES.get(Path(f).name, 0)

    items[:] = [i for f in sorted(by_file, key=lambda f: -cost(f)) for i in by_file[f]]


class _TestSeconds:
    """Adds each test's seconds (setup, call, teardown) to the cache at the end of a run; on
    the process that reports (pytest-xdist's controller, or the only one)."""

    def __init__(self, config):
        self.config, self.seconds = config, {}

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self, session):
        cache = getattr(self.config, "cache", None)
        if cache is not None and self.seconds:
            cache.set(TEST_SECONDS_KEY, {**(cache.get(TEST_SECONDS_KEY, None) or {}), **self.seconds})


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # not a pytest-xdist worker
        config.pluginmanager.register(_TestSeconds(config), "taichi_plan_test_seconds")
        return
    # Each of N worker processes gets its share of the cores for torch's intra-op threads:
    # with torch's default (every core) in each, N processes spin on the same cores, and a
    # test's steps then took 1.5-3x their seconds alone.
    import torch

    workers = int(config.workerinput.get("workercount", 1))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(workers, 1)))


@pytest.fixture(autouse=True, scope="module")
def _frozen_before_each_file():
    """Recordings and measurements run ``gc.collect()`` before each step (record/recorder/__init__.py:
    a step's garbage cycles must not depend on when the collector last ran). With torch,
    transformers and the test modules imported, each full collection scans a few million
    objects (0.2 s each: a quarter of a replay test's time). So before each test file, once
    its garbage is collected, what is still alive (imports, session fixtures) is moved out of
    the collector's sight (``gc.freeze``): a collection then scans what the file's tests made.
    Nothing alive then is garbage in a step the file measures."""
    import gc

    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(autouse=True, scope="session")
def _short_calibration():
    """Real recordings calibrate the replay runtime's cost on their model (runtime/calibrate/:
    7 interleaved repetitions after an untimed warm-up run, up to 15 s). Tests count what
    calibration measures, never how fast: 1 repetition, no warm-up, 1 s, keep the suite short
    (calibration was a quarter of make test's seconds with the warm-up)."""
    from taichi_plan.runtime.calibrate.config import CalibrationConfig, using_default

    with using_default(CalibrationConfig(repeats=1, budget_s=1.0, warm_up=False)):
        yield


def cpu_slowdown(cpu_s: float = 0.3) -> float:
    """Wall seconds one CPU second of this thread takes now: 1 on an idle machine, about N/2
    when N busy processes share the 2 cores. A busy loop of ``cpu_s`` CPU seconds, for tests
    that check a wall-clock limit: they allow its fixed overshoot times this factor."""
    import time

    w0, c0 = time.perf_counter(), time.thread_time()
    while time.thread_time() - c0 < cpu_s:
        pass
    return max(1.0, (time.perf_counter() - w0) / (time.thread_time() - c0))


def graphs_path() -> Path:
    """``$TAICHI_GRAPHS_DIR`` if set, else ``../shared/graphs`` beside the repository."""
    env = os.environ.get("TAICHI_GRAPHS_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "shared" / "graphs"


def graph_files() -> list[Path]:
    d = graphs_path()
    return sorted(d.glob("*.json")) if d.is_dir() else []


@pytest.fixture
def graphs_dir() -> Path:
    d = graphs_path()
    if not d.is_dir() or not any(d.glob("*.json")):
        pytest.skip(f"public benchmark graphs not found at {d} (set TAICHI_GRAPHS_DIR)")
    return d


def small_trace() -> Trace:
    """A 6-op step (3 forward, 2 backward, 1 optimizer) with a parameter, its gradient, an
    optimizer state, an input and activations. Live bytes per op (alloc..free inclusive):

    op:            0     1     2     3     4     5
    param  1000    x     x     x     x     x     x   (-1..-1: whole step)
    state   500    x     x     x     x     x     x   (-1..-1)
    input   200    x     x                           (-1..1)
    act1    300    x     x     x     x               (0..3)
    act2    400          x     x                     (1..2)
    loss      8                x     x               (2..3)
    tmp      50                      x               (3..3)
    grad   1000                            x     x   (4..-1)
    total        2000  2400  2208  1858  2500  2500

    Peak 2500 first at op 4 (parameter 1000, optimizer_state 500, gradient 1000).
    """
    ops = frame(
        "ops",
        {
            "op_id": [0, 1, 2, 3, 4, 5],
            "step": [0] * 6,
            "phase": ["forward", "forward", "forward", "backward", "backward", "optimizer"],
            "op": ["aten.mm.default", "aten.relu.default", "aten.sum.default",
                   "aten.threshold_backward.default", "aten.mm.default", "aten._foreach_add_.List"],
            "module": ["net.lin", "net.act", "", "net.act", "net.lin", ""],
            "duration_s": [0.001, 0.0005, 0.0001, 0.0005, 0.002, 0.0003],
            "flops": [1000, 0, 0, 0, 2000, 0],
            "cost_source": ["measured"] * 6,
            "recomputable": [True, True, True, True, True, False],
            "mutates": [False, False, False, False, False, True],
        },
    )
    tensors = frame(
        "tensors",
        {
            "tensor_id": [10, 11, 12, 13, 14, 15, 16, 17],
            "nbytes": [1000, 500, 200, 300, 400, 8, 50, 1000],
            "dtype": ["float32"] * 8,
            "shape": [[10, 25], [125], [2, 25], [3, 25], [4, 25], [2], [1, 12], [10, 25]],
            "kind": ["parameter", "optimizer_state", "input", "activation", "activation",
                     "activation", "temporary", "gradient"],
            "producer_op": [-1, -1, -1, 0, 1, 2, 3, 4],
            "alloc_op": [-1, -1, -1, 0, 1, 2, 3, 4],
            "free_op": [-1, -1, 1, 3, 2, 3, 3, -1],
        },
    )
    accesses = frame(
        "accesses",
        {
            "op_id": [0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 4, 5, 5, 5],
            "tensor_id": [12, 10, 13, 13, 14, 14, 15, 13, 16, 16, 12, 17, 10, 17, 11],
            "role": ["read", "read", "write", "read", "write", "read", "write", "read", "write",
                     "read", "read", "write", "write", "read", "write"],
            "arg_index": [0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 2],
        },
    )
    meta = {
        "name": "small",
        "mode": "fake",
        "workload": {"name": "mlp", "args": {"batch": 2, "hidden": 25}},
        "device_profile": "a100-40gb",
        "dtype": "float32",
        "torch_version": "2.13.0",
        "torch_build": "cpu",
        "steps_recorded": 2,
        "steps_match": True,
        "first_mismatch": None,
        "signature": op_signature(ops["op"].tolist()),
    }
    return Trace(ops, tensors, accesses, meta)


SMALL_TRACE_PEAK = (2500, 4)
SMALL_TRACE_PEAK_BY_KIND = {"parameter": 1000, "optimizer_state": 500, "gradient": 1000}


@pytest.fixture
def small() -> Trace:
    return small_trace()


@pytest.fixture(scope="session")
def replay_cases(tmp_path_factory):
    """Real recordings of tiny MLP/GPT-2/BERT, their auto plans and replays, each made once per
    test process however many replay tests read them (tests/replay_cases.py)."""
    from replay_cases import ReplayCases

    return ReplayCases(tmp_path_factory.mktemp("replay"))
