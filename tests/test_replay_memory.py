"""replay checks the machine's memory before building anything, says so with both numbers,
and --force (force=True) tries anyway; --json prints the report."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from taichi_plan.base.errors import NotEnoughMemoryError
from taichi_plan.base.units import format_bytes
from taichi_plan.cli import main
from taichi_plan.plan.format import save_plan
from taichi_plan.record import get_workload, record_workload
from taichi_plan.replay import measure
from taichi_plan.replay.measure import memory
from taichi_plan.solve import solve
from taichi_plan.trace.format import read_trace, write_trace


def _needed(plan, trace_dir) -> int:
    """The unplanned peak, or the planned one plus the parameters and gradients the unplanned
    run leaves behind for the comparison, whichever is larger."""
    t = read_trace(trace_dir).tensors
    kept = int(t.loc[t["kind"].isin(["parameter", "gradient"]), "nbytes"].sum())
    return max(plan.predicted["baseline_peak_bytes"], plan.predicted["planned_peak_bytes"] + kept)


def _plan(tmp_path, name, fake, method="none", **flags):
    trace = read_trace(write_trace(record_workload(get_workload(model="mlp", **flags), fake=fake), tmp_path / name))
    plan = solve(trace, 10**15, method, time_limit=5)  # a budget that does not bind: nothing dropped
    return save_plan(plan, tmp_path / f"{name}.plan.json"), plan


@pytest.fixture
def no_build(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("replay built the workload before checking memory")

    monkeypatch.setattr(measure, "run_and_measure", refuse)


def test_huge_fake_trace_is_refused_before_building(tmp_path, no_build):
    # 8 layers of 65536 x 65536 fp32 with AdamW: ~550 GB of parameters, gradients and state.
    path, plan = _plan(tmp_path, "huge", True, layers=8, hidden=65536, batch=4)
    needed = _needed(plan, tmp_path / "huge")
    available, _ = memory.available_memory_bytes("cpu")
    assert needed > available  # no machine this suite runs on has 550 GB free
    r = CliRunner().invoke(main, ["replay", str(path)])
    assert r.exit_code == NotEnoughMemoryError.exit_code, r.output
    assert "Traceback" not in r.output and r.output.startswith("Error: ")
    text = " ".join(r.output.split())
    assert f"needs about {format_bytes(needed)}" in text
    assert re.search(r"this machine has [0-9.]+ [KMGT]?B of available RAM on cpu", text), text
    assert "recorded fake" in text and "real tensors" in text and "--force" in text
    with pytest.raises(NotEnoughMemoryError) as e:
        measure.replay(path)
    assert e.value.needed_bytes == needed and 0 < e.value.available_bytes < needed


@pytest.fixture
def small_plan(tmp_path):
    return _plan(tmp_path, "small", False, method="heuristic", layers=2, hidden=64, batch=8)


def test_force_replays_anyway_and_json_prints_the_report(small_plan, tmp_path, monkeypatch):
    path, plan = small_plan
    needed = _needed(plan, tmp_path / "small")
    assert needed > plan.predicted["baseline_peak_bytes"]  # nothing dropped: the planned run needs more
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: (1000, "available RAM"))
    r = CliRunner().invoke(main, ["replay", str(path), "--steps", "1"])
    assert r.exit_code == NotEnoughMemoryError.exit_code, r.output
    assert "this machine has 1.00 KB of available RAM" in " ".join(r.output.split())
    assert "recorded fake" not in r.output
    r = CliRunner().invoke(main, ["replay", str(path), "--steps", "1", "--force", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["memory"] == {"needed_bytes": needed, "available_bytes": 1000,
                                "available_source": "available RAM", "fits": False, "forced": True}
    assert report["measured_peak_bytes"] > 0 and report["trace_mode"] == "real"
    assert "Wrote" in r.stderr
    report = measure.replay(path, steps=1, check_grads=False, force=True)
    assert report["memory"]["forced"]


def test_replay_within_memory_reports_it(small_plan):
    path, plan = small_plan
    r = CliRunner().invoke(main, ["replay", str(path), "--steps", "1"])
    assert r.exit_code == 0, r.output
    assert "memory             needs about" in r.output and "of available RAM here" in r.output


def test_available_memory_is_this_machines():
    available, what = memory.available_memory_bytes("cpu")
    total = None
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
    assert what == "available RAM" and 0 < available <= total


def test_cuda_memory_is_the_free_device_memory(monkeypatch):
    """On CUDA the check uses torch.cuda.mem_get_info's free bytes (faked here: no GPU in CI)."""
    import torch

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (5 * 10**9, 80 * 10**9))
    assert memory.available_memory_bytes("cuda") == (5 * 10**9, "free CUDA memory")
