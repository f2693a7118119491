"""The architecture zoo benchmark (benchmarks/bench_zoo.py) on one architecture: a plan
recorded, solved and replayed, its row and table as `make bench` writes them."""

from __future__ import annotations

from benchmarks import bench_zoo


def test_one_architecture_replays_as_predicted(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_zoo, "TIME_LIMIT", 3.0)
    row = bench_zoo.one("distilbert", 0.5, tmp_path)
    assert row["feasible"], row
    assert row["measured_bytes"] == row["predicted_bytes"] <= row["budget_bytes"], row
    assert row["grads_match"], row
    low = bench_zoo.one("distilbert", 0.05, tmp_path)  # the same trace, below its floor
    assert not low["feasible"] and low["floor_bytes"] > 0.05 * low["peak_bytes"]
    table = bench_zoo.markdown({"torch": "t", "transformers": "x", "rows": [row, low], "seconds": 1.0})
    assert "| distilbert | plain | 50% |" in table and "none: floor" in table
    assert "Tally: 2 runs, 1 plans replayed: measured == predicted to the byte on 1, over budget on 0" in table
