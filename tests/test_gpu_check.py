"""benchmarks/gpu_check.py in its CPU dry-run mode (--device cpu --tiny): the script a GPU
machine runs, exercised end to end on tiny models. Nothing here is a GPU measurement."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from benchmarks import gpu_check  # noqa: E402


@pytest.mark.slow
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
    text = gpu_check.section(out)
    assert "| workload | budget |" in text and "replayed on cpu" in text and "tiny models (dry run)" in text


def test_section_without_results_says_not_measured(tmp_path):
    text = gpu_check.section(tmp_path / "missing.json")
    assert "Not measured yet" in text and "No GPU number" in text


def test_entry_moves_the_builtin_workload():
    model, batch, loss_fn, optimizer = gpu_check.on_device("mlp", device="meta", batch=4, hidden=16, layers=1)
    assert {p.device.type for p in model.parameters()} == {"meta"} and batch.device.type == "meta"
