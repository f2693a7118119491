"""benchmarks/gpu_check.py in its CPU dry-run mode (--device cpu --tiny): the script a GPU
machine runs, exercised end to end on tiny models. Nothing here is a GPU measurement."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from benchmarks import gpu_check  # noqa: E402


@pytest.mark.bench
def test_dry_run_records_solves_replays_and_writes_the_json(tmp_path, monkeypatch):
    tiny = dict(list(gpu_check.TINY.items())[:1])  # GPT-2 only: the other two run the same code
    monkeypatch.setattr(gpu_check, "TINY", tiny)
    out = tmp_path / "gpu_check.json"
    gpu_check.main(["--device", "cpu", "--tiny", "--out", str(out), "--steps", "1", "--time-limit", "5"])
    result = json.loads(out.read_text())
    assert result["machine"]["device"] == "cpu" and result["tiny"] is True and result["method"] == "heuristic"
    rows = result["rows"]
    assert [(r["on"], r["budget_fraction"]) for r in rows] == list(gpu_check.RUNS)
    replayed = [r for r in rows if r["status"] == "replayed"]
    assert replayed, rows
    for r in replayed:
        assert r["device"] == "cpu" and r["grads_match"] is True
        assert r["planned"]["allocated_ratio"] == pytest.approx(1.0, rel=0.02)  # CPU: the recorder counts as the trace does
        assert r["predicted_planned_reserved_bytes"] >= r["predicted_planned_peak_bytes"]
    fake = result["fake"]
    assert fake["status"] == "replayed" and fake["trace_device"] == "cpu", fake
    mapping = result["mapping"]  # on CPU the real recording has CPU kernels: the comparison runs, and differs
    assert mapping["status"] == "compared" and mapping["same_ops"] is False and mapping["mapping"]["profile"] == \
        gpu_check.FAKE_PROFILE and mapping["mapped_peak_bytes"] < mapping["real_peak_bytes"], mapping
    assert result["sdpa_choices"]["status"].startswith("skipped")
    text = gpu_check.section(out)
    assert "| workload | budget |" in text and "replayed on cpu" in text and "tiny models (dry run)" in text
    assert "GPU mapping of a CPU fake recording" in text


def test_section_without_results_says_not_measured(tmp_path):
    text = gpu_check.section(tmp_path / "missing.json")
    assert "Not measured yet" in text and "No GPU number" in text


def test_entry_moves_the_builtin_workload():
    model, batch, loss_fn, optimizer = gpu_check.on_device("mlp", device="meta", batch=4, hidden=16, layers=1)
    assert {p.device.type for p in model.parameters()} == {"meta"} and batch.device.type == "meta"


def test_heuristic_solves_without_ortools_through_the_stand_in(tmp_path):
    """The GPU machine has no OR-Tools: with it hidden, the script's stand-in lets
    taichi_plan.solve import, the heuristic solve, and ilp fail with a clear message."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "no_ortools.py"
    script.write_text(
        "import importlib.abc, importlib.util, sys\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'ortools' or name.startswith('ortools.'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "real = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda n, *a: None if n == 'ortools' else real(n, *a)\n"
        "from benchmarks import gpu_check\n"
        "assert gpu_check._stand_in_ortools()\n"
        "sys.path.insert(0, 'tests')\n"
        "from synthetic import chain_trace\n"
        "from taichi_plan.solve import solve\n"
        "trace = chain_trace([100] * 6)\n"
        "print(solve(trace, 800, 'heuristic').solver['status'])\n"
        "try:\n"
        "    solve(trace, 800, 'ilp')\n"
        "except RuntimeError as e:\n"
        "    print('ilp refused:', e)\n")
    r = subprocess.run([sys.executable, str(script)], cwd=root, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(root)})
    assert r.returncode == 0, r.stderr
    assert "feasible" in r.stdout and "ilp refused: OR-Tools is not installed here" in r.stdout


def test_compare_ops_finds_the_first_difference():
    from taichi_plan.trace.format import Trace, frame

    def trace(names):
        n = len(names)
        ops = frame("ops", {"op_id": list(range(n)), "step": [0] * n, "phase": ["forward"] * n, "op": names,
                            "module": [""] * n, "duration_s": [0.0] * n, "flops": [0] * n,
                            "cost_source": ["estimated"] * n, "recomputable": [True] * n, "mutates": [False] * n})
        tensors = frame("tensors", {"tensor_id": [0], "nbytes": [8], "dtype": ["float32"], "shape": [[2]],
                                    "kind": ["activation"], "producer_op": [0], "alloc_op": [0], "free_op": [n - 1]})
        accesses = frame("accesses", {"op_id": [0], "tensor_id": [0], "role": ["write"], "arg_index": [0]})
        return Trace(ops, tensors, accesses, {})

    same = gpu_check.compare_ops(trace(["a", "b"]), trace(["a", "b"]))
    assert same["same_ops"] is True and same["first_difference"] is None and same["count_difference"] == {}
    diff = gpu_check.compare_ops(trace(["a", "b", "c"]), trace(["a", "x", "c"]))
    assert diff["first_difference"] == 1 and diff["real_op"].startswith("b") and diff["mapped_op"].startswith("x")
    assert diff["count_difference"] == {"b": 1, "x": -1}
    assert gpu_check.compare_ops(trace(["a"]), trace(["a", "b"]))["first_difference"] == 1
