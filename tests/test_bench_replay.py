"""Smoke test of benchmarks/bench_replay.py on a tiny GPT-2 (counts and shapes, never times)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from benchmarks import bench_replay as br  # noqa: E402

TINY = {"layers": 1, "hidden": 64, "heads": 2, "vocab": 256, "seq": 32, "batch": 4}


def _model(name, **sizes):
    from taichi_plan.record import get_workload

    torch.manual_seed(0)
    return get_workload(model=name, **sizes).build(False)[0]


def test_find_blocks():
    assert br.find_blocks(_model("gpt2", **{**TINY, "layers": 2})) == ["transformer.h.0", "transformer.h.1"]
    assert br.find_blocks(_model("gpt2", **TINY)) == ["transformer.h.0"]  # one layer: still a block
    mlp = br.find_blocks(_model("mlp", layers=2, hidden=16, batch=4))
    assert mlp == [str(i) for i in range(5)]  # Linear, ReLU, Linear, ReLU, Linear


def test_matmul_policy():
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    for op in (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.convolution.default,
               aten._scaled_dot_product_flash_attention_for_cpu.default):
        assert br.matmul_policy(None, op) == CheckpointPolicy.MUST_SAVE, op
    for op in (aten.gelu.default, aten.add.Tensor, aten.native_layer_norm.default):
        assert br.matmul_policy(None, op) == CheckpointPolicy.PREFER_RECOMPUTE, op


def test_run_tiny_gpt2():
    result = br.run([("tiny gpt2", "gpt2", TINY, None)], steps=1, time_limit=5)
    assert result["steps"] == 1 and len(result["models"]) == 1
    r = result["models"][0]
    assert set(r["methods"]) == {"plain", "ours-no-drops", *br.BASELINES, *(f"ours@{m}" for m in br.BASELINES)}
    for name, row in r["methods"].items():
        if name.startswith("ours@") and not row["feasible"]:
            assert row["min_budget_bytes"] > 0, name
            continue
        assert row["peak_bytes"] > 0 and row["step_s"] > 0, name
        assert row["peak_ratio"] > 0 and row["time_ratio"] > 0, name
    assert set(r["claims"]) == set(br.BASELINES)
    for method in br.BASELINES:  # the budget is the baseline's measured peak
        assert r["methods"][f"ours@{method}"]["budget_bytes"] == r["methods"][method]["peak_bytes"]
    text = br.markdown(result)
    assert "### tiny gpt2" in text and "| ours@ckpt-every-block |" in text and "claim holds" in text and "| ours-no-drops |" in text
