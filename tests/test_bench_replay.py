"""Smoke test of benchmarks/bench_replay.py at tiny sizes (counts and shapes, never times)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from benchmarks import bench_replay as br  # noqa: E402

TINY = {"layers": 1, "hidden": 64, "heads": 2, "vocab": 256, "seq": 32, "batch": 4}
TINY_MLP = {"layers": 2, "hidden": 32, "batch": 8}


def _model(name, **sizes):
    from taichi_plan.record import get_workload

    torch.manual_seed(0)
    return get_workload(model=name, **sizes).build(False)[0]


def test_find_blocks():
    assert br.find_blocks(_model("gpt2", **{**TINY, "layers": 2})) == ["transformer.h.0", "transformer.h.1"]
    assert br.find_blocks(_model("gpt2", **TINY)) == ["transformer.h.0"]  # one layer: still a block
    mlp = br.find_blocks(_model("mlp", layers=2, hidden=16, batch=4))
    assert mlp == [str(i) for i in range(5)]  # Linear, ReLU, Linear, ReLU, Linear


def test_resnet_stages_and_layers():
    model = _model("resnet50", batch=1, image_size=32)
    assert br.find_blocks(model, "stages") == [f"resnet.encoder.stages.{i}" for i in range(4)]
    assert len(br.find_blocks(model, "layers")) == 3 + 4 + 6 + 3  # the bottlenecks of ResNet-50
    br.hf_checkpointing(model, "stages")
    assert all(model.get_submodule(f"resnet.encoder.stages.{i}").forward.__name__ == "checkpointed"
               for i in range(4))


def test_mlp_segments():
    model = _model("mlp", **TINY_MLP)
    assert br.sequential_segments(model) == [["0", "1"], ["2", "3"]]  # (Linear, ReLU) pairs; head apart
    x = torch.randn(TINY_MLP["batch"], TINY_MLP["hidden"])
    want = model(x)
    assert br.wrap_blocks(model, "sac-save-matmuls", "segments") == ["0-1", "2-3"]
    assert torch.equal(model(x), want)  # the same forward, checkpointed


def test_hf_checkpointing_is_transformers_own():
    model = _model("llama", **TINY)
    br.hf_checkpointing(model, "transformers")
    on = getattr(type(model), "is_activation_checkpointing", None)  # the new name; the old one warns
    assert (model.is_activation_checkpointing if on is not None else model.is_gradient_checkpointing)
    with pytest.raises(ValueError, match="unknown hf checkpointing"):
        br.hf_checkpointing(model, "everything")


def test_matmul_policy():
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    for op in (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.convolution.default,
               aten._scaled_dot_product_flash_attention_for_cpu.default):
        assert br.matmul_policy(None, op) == CheckpointPolicy.MUST_SAVE, op
    for op in (aten.gelu.default, aten.add.Tensor, aten.native_layer_norm.default):
        assert br.matmul_policy(None, op) == CheckpointPolicy.PREFER_RECOMPUTE, op


def test_interleaved_round_robin():
    names = ["a", "b", "c"]
    order = br.interleaved(names, 7)
    assert len(order) == 7 and all(sorted(rep) == names for rep in order)  # each method once per repetition
    assert [rep[0] for rep in order] == ["a", "b", "c", "a", "b", "c", "a"]  # one method later each time
    assert order[1] == ["b", "c", "a"]


def test_aa_spread():
    assert br.aa_spread([1.0] * 7, [1.0] * 7) == 0.0
    assert br.aa_spread([1.0], [2.0]) == 0.0  # one repetition: no spread to tell
    again = [0.9, 0.95, 1.0, 1.0, 1.0, 1.05, 1.1]  # ratios, plain = 1: quartiles 0.95 and 1.05
    assert br.aa_spread([1.0] * 7, again) == pytest.approx(0.05)


def test_measured_extra_is_the_median_of_paired_differences():
    """Slow repetitions that both steps share cancel out: each same-repetition difference is
    20 ms, the reported extra, with no spread, though the steps range over a second."""
    plain = [1.00, 1.00, 2.00, 2.00, 2.00]
    ours = [1.02, 1.02, 2.02, 2.02, 2.02]
    assert br.paired_extra(plain, ours) == pytest.approx([0.02] * 5)
    assert br.paired_extra([1.0, 2.0, 1.0], [2.02, 1.02, 1.02]) == pytest.approx([1.02, -0.98, 0.02])
    out = {"methods": {"plain": {"step_s": 2.0, "step_times_s": plain, "peak_bytes": 1},
                       "plain-again": {"step_s": 2.0, "step_times_s": plain, "peak_bytes": 1},
                       "ours-no-drops": {"step_s": 2.02, "step_times_s": ours, "peak_bytes": 1,
                                         "predicted_extra_s": 0.019}}}
    br.judge(out, ())
    row = out["methods"]["ours-no-drops"]
    assert row["measured_extra_s"] == pytest.approx(0.02) and row["measured_extra_spread_s"] == pytest.approx(0.0)
    assert row["extra_ok"] and "+20.0" in br._measured(row)


def test_the_extras_are_taken_against_both_plain_copies():
    """A copy of plain that strays shifts the extras by half as much: each repetition's
    reference is the mean of plain's and plain-again's steps."""
    plain, again = [1.00, 1.00, 1.00], [0.98, 0.98, 0.98]
    assert br.plain_reference(plain, again) == pytest.approx([0.99] * 3)
    assert br.plain_reference(plain, []) == plain  # no copy timed: plain alone
    out = {"methods": {"plain": {"step_s": 1.0, "step_times_s": plain, "peak_bytes": 1},
                       "plain-again": {"step_s": 0.98, "step_times_s": again, "peak_bytes": 1},
                       "ours-no-drops": {"step_s": 0.99, "step_times_s": [0.99] * 3, "peak_bytes": 1,
                                         "predicted_extra_s": 0.0}}}
    br.judge(out, ())
    assert out["methods"]["ours-no-drops"]["measured_extra_s"] == pytest.approx(0.0)


def test_extra_within():
    assert br.extra_within(0.100, 0.119) and not br.extra_within(0.100, 0.130)  # 20% of measured
    assert br.extra_within(0.0, 0.004) and not br.extra_within(0.0, 0.006)  # or 5 ms
    assert br.extra_within(None, 0.1) is None


@pytest.mark.bench
def test_run_tiny(monkeypatch):
    from taichi_plan.replay.measure.run import MeasuredRun

    steps, timed, peak = {}, {}, {}  # per method: steps run once built, steps timed, steps measuring its peak
    one_step, timed_step, measure_peak = MeasuredRun.one_step, MeasuredRun.timed_step, MeasuredRun.measure_peak

    def counting_measure_peak(self, *args, **kwargs):
        before = steps.get(self.what, 0)
        try:
            return measure_peak(self, *args, **kwargs)
        finally:
            peak[self.what] = peak.get(self.what, 0) + steps.get(self.what, 0) - before

    def counting_one_step(self):
        steps[self.what] = steps.get(self.what, 0) + 1
        return one_step(self)

    def counting_timed_step(self, *args, **kwargs):
        timed[self.what] = timed.get(self.what, 0) + 1
        return timed_step(self, *args, **kwargs)

    monkeypatch.setattr(MeasuredRun, "one_step", counting_one_step)
    monkeypatch.setattr(MeasuredRun, "timed_step", counting_timed_step)
    monkeypatch.setattr(MeasuredRun, "measure_peak", counting_measure_peak)
    result = br.run([("tiny gpt2", br.BenchModel("gpt2", TINY, None, "transformers")),
                     ("tiny mlp", br.BenchModel("mlp", TINY_MLP, "segments", None))], reps=2, time_limit=5)
    # every method: its warm-up rounds untimed, then its timed repetitions (the peak steps before)
    models = {what: timed[what] // 2 for what in timed}  # two repetitions in each model that has it
    assert models["plain"] == 2 and models["hf-checkpointing"] == 1 and set(models.values()) == {1, 2}
    untimed = {(steps[what] - timed[what] - peak[what]) / models[what] for what in timed}  # per model it runs in
    assert untimed == {br.WARMUP_ROUNDS} and br.WARMUP_ROUNDS > 0
    assert result["reps"] == 2 and result["threads"] == 1 and len(result["models"]) == 2
    gpt2, mlp = result["models"]
    for r, baselines in ((gpt2, br.BASELINES), (mlp, br.BLOCK_BASELINES)):
        expected = {"plain", "plain-again", "ours-no-drops", *baselines, *(f"ours@{m}" for m in baselines)}
        assert set(r["methods"]) == expected, r["label"]
        for name, row in r["methods"].items():
            assert "error" not in row, (name, row.get("error"))
            if name.startswith("ours@") and not row["feasible"]:
                assert row["min_budget_bytes"] > 0, name
                continue
            assert row["peak_bytes"] > 0 and row["peak_ratio"] > 0, name
            assert len(row["step_times_s"]) == 2 and row["step_s"] > 0 and row["time_ratio"] > 0, name
        for method in baselines:  # the budget is the baseline's measured peak
            assert r["methods"][f"ours@{method}"]["budget_bytes"] == r["methods"][method]["peak_bytes"]
        assert set(r["claims"]) == set(baselines)
        assert all(c["verdict"] in ("win", "tie", "loss") for c in r["claims"].values())
        assert r["aa_margin"] == max(abs(r["aa_ratio"] - 1), r["aa_spread"])
        assert r["methods"]["ours-no-drops"]["drops"] == 0  # 100% of the plain peak: nothing to drop
        assert r["no_drops"]["tolerance"] >= br.NO_DROP_TOLERANCE
    assert gpt2["methods"]["hf-checkpointing"]["peak_bytes"] < gpt2["methods"]["plain"]["peak_bytes"]
    text = br.markdown(result)
    assert "| tiny gpt2 | hf-checkpointing |" in text and "| tiny mlp | sac-save-matmuls |" in text
    assert "A/A margin" in text and "2 repetitions, interleaved" in text and "1 torch thread;" in text
    assert f"{br.WARMUP_ROUNDS} such rounds run untimed first" in text
    assert all(m["warmup_rounds"] == br.WARMUP_ROUNDS for m in result["models"])
    raw = json.loads(br.to_json(result))
    assert raw["models"][0]["methods"]["plain"]["step_times_s"] == gpt2["methods"]["plain"]["step_times_s"]


@pytest.mark.bench
def test_run_isolated_tiny():
    """``isolate=True`` runs each model in a fresh process (with glibc's malloc steady) and brings
    back the same per-model numbers as a run in this process."""
    result = br.run([("tiny mlp", br.BenchModel("mlp", TINY_MLP, "segments", None))], reps=2, time_limit=5,
                    isolate=True)
    assert result["isolated"] and result["malloc"] == "steady"
    (mlp,) = result["models"]
    assert mlp["label"] == "tiny mlp" and mlp["reps"] == 2
    assert {"plain", "plain-again", "ours-no-drops"} <= set(mlp["methods"])
    assert all(len(row["step_times_s"]) == 2 for row in mlp["methods"].values() if "step_times_s" in row)
    assert "each model in a fresh process of its own" in br.markdown(result)


def test_command_line_help_and_an_unknown_model(capsys, monkeypatch):
    """``--help`` prints the usage; a model the benchmark does not have is said in a sentence
    naming the ones it has (no KeyError traceback), before anything runs."""
    monkeypatch.setattr(br, "malloc_settings", lambda: "steady")  # no re-exec with steady malloc
    monkeypatch.setattr(br.sys, "argv", ["bench_replay", "--help"])
    br.main()
    assert "usage: python -m benchmarks.bench_replay" in capsys.readouterr().out
    monkeypatch.setattr(br.sys, "argv", ["bench_replay", "gpt2", "no-such-model"])
    monkeypatch.setattr(br, "run", lambda *a, **k: pytest.fail("ran with an unknown model"))
    with pytest.raises(SystemExit) as e:
        br.main()
    assert "no benchmark model 'no-such-model'" in str(e.value) and "resnet50" in str(e.value)
