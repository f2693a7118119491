"""The Hugging Face Trainer with a plan: examples/hf_trainer.py, run as CI runs it.

The example's Trainer (tiny GPT-2, gradient_accumulation_steps=2, clipping, AdamW, evaluation
every 2 steps) is recorded inside ``trainer.train()``, solved, then trained for 4 steps planned
and unplanned from the same seed. Parameters must be bitwise equal: the runtime rebuilds each
dropped tensor by re-running its ops with the RNG state they first ran with (GPT-2's dropout
included), and the plan has no partitions (which would only promise allclose). The last
planned step's peak, counted by ``tests/live_peak.py`` (independent of the recorder and the
simulator), must stay within the plan's budget.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from bitwise import assert_bitwise  # noqa: E402
from live_peak import LivePeak  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from taichi_plan.base.errors import PlanError, UsageError  # noqa: E402
from taichi_plan.integrations.hf import PlanCallback, record_trainer  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer.py"
STEPS, EVAL_EVERY = 4, 2


def load_example():
    spec = importlib.util.spec_from_file_location("hf_trainer_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = load_example()


class PeakOfLastStep(TrainerCallback):
    """Counts live storages over the last optimizer step (``on_step_begin`` .. ``on_optimizer_step``),
    starting from everything the step starts with: parameters, buffers, optimizer state and the
    step's micro-batches (seen through the Trainer's ``get_batch_samples``)."""

    def __init__(self, trainer, last_step: int):
        self.last_step, self.tracker, self.peak, self.batches = last_step, None, None, []
        fetch = trainer.get_batch_samples

        def get_batch_samples(*a):
            self.batches = fetch(*a)
            return self.batches

        trainer.get_batch_samples = get_batch_samples

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step == self.last_step:
            samples, num_items = self.batches
            start = [*model.parameters(), *model.buffers(), num_items]
            start += [p.grad for p in model.parameters() if p.grad is not None]
            start += [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
            start += [v for b in samples for v in b.values() if isinstance(v, torch.Tensor)]
            self.tracker = LivePeak(start)
            self.tracker.__enter__()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.tracker is not None:
            self.tracker.__exit__(None, None, None)
            self.peak, self.tracker = self.tracker.peak, None


def train(out: Path, plan_path=None):
    plan_cb = PlanCallback(plan_path) if plan_path is not None else None
    trainer = example.make_trainer(out, steps=STEPS, eval_every=EVAL_EVERY, callbacks=[plan_cb] if plan_cb else [])
    peak = PeakOfLastStep(trainer, STEPS - 1)
    trainer.add_callback(peak)
    trainer.train()
    params = [p.detach().clone() for p in trainer.model.parameters()]
    return trainer, params, peak.peak, plan_cb


@pytest.fixture(scope="module")
def planned_example(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    plan, path = example.record_and_solve(out, out / "trace", out / "trainer.plan.json", budget=0.75)
    return out, plan, path


def test_trainer_trains_planned_bitwise_within_budget(planned_example):
    out, plan, path = planned_example
    assert plan.recompute and not plan.partitions, "the plan must drop tensors, and promise bitwise"
    assert plan.budget_bytes < plan.predicted["baseline_peak_bytes"]
    _, base, base_peak, _ = train(out)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no mismatch may be reported
        trainer, planned, peak, cb = train(out, path)
    assert_bitwise(base, planned, lambda: train(out)[1])
    rt = cb.runtime
    assert rt.planned_calls == 2 * STEPS  # every micro-batch's forward; the evaluations none
    assert rt.dropped_storages > 0 and rt.mismatches == 0
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert len(evals) == STEPS // EVAL_EVERY
    assert getattr(trainer.model, "_taichi_plan", None) is None  # finished at on_train_end
    assert peak <= plan.budget_bytes < base_peak, (peak, plan.budget_bytes, base_peak)
    # The counter agrees with the trace on the step the Trainer runs, unplanned and planned
    # (here to the byte and to 4 bytes; 1% allows for a reference cycle collected late).
    assert base_peak == pytest.approx(plan.predicted["baseline_peak_bytes"], rel=0.01)
    assert peak == pytest.approx(plan.predicted["planned_peak_bytes"], rel=0.01)


def test_the_trace_is_the_step_the_trainer_runs(planned_example):
    from taichi_plan.plan.format import load_plan  # noqa: F401  (the plan loads)
    from taichi_plan.trace.format import read_trace

    out, plan, _ = planned_example
    trace = read_trace(out / "trace")
    meta = trace.meta
    assert meta["steps_match"] and meta["workload"]["kind"] == "hf_trainer"
    assert meta["device"] == "cpu" and "runtime_overhead" in meta
    assert meta["loop"]["micro_batches"] == 2 and meta["loop"]["clip_grad_norm"] == 1.0
    calls = [c for c in meta["model_calls"] if c["grad"]]
    assert len(calls) == 2
    # The Trainer passes num_items_in_batch: the model's loss sums and divides by it (a plain
    # model(**batch) call averages instead), so the loss ops are inside the model's calls.
    ops = trace.ops["op"].tolist()
    for c in calls:
        inside = ops[c["start"]: c["end"] + 1]
        assert "aten.nll_loss_forward.default" in inside and "aten.div.Tensor" in inside
    kinds = trace.tensors["kind"].tolist()
    # Both micro-batches (input_ids, labels) and num_items_in_batch exist before the step.
    assert kinds.count("input") >= 5
    # When the step's code lets go of each storage: the probe ran the Trainer's training_step,
    # and both micro-batches' forwards are mapped (the second starts with the Trainer's own
    # add of the first's loss to its running total).
    refs = meta["python_refs"]
    assert refs["segments"] == refs["segments_known"] == 2 and refs["release"], refs


def test_plan_for_another_accumulation_is_refused(planned_example, tmp_path):
    out, _, path = planned_example
    trainer = example.make_trainer(tmp_path, steps=1, eval_every=1, callbacks=[PlanCallback(path)])
    trainer.args.gradient_accumulation_steps = 1
    with pytest.raises(PlanError, match="gradient_accumulation_steps=1"):
        trainer.train()
    with pytest.raises(UsageError, match="PlanCallback"):
        record_trainer(trainer)


def test_blocks_checkpointed_whole_measure_as_predicted_with_the_kv_cache_on(planned_example):
    """The KV cache that the example's GPT-2 keeps on is no hazard in the Trainer:
    ``compute_loss`` lets go of the model's outputs, and with them the cache, before backward
    (so ``partition.leaves_state``, reading the probe's ``python_refs``, offers the blocks). A block and an attention checkpointed whole (one chunk each)
    measure their predicted peak over the Trainer's step, and train bitwise."""
    from taichi_plan.plan.format import save_plan
    from taichi_plan.problem.core import build_problem
    from taichi_plan.problem.partition.find import module_spans
    from taichi_plan.problem.partition.span import as_partition
    from taichi_plan.solve.result import Decisions, make_plan
    from taichi_plan.trace.format import read_trace

    out, _, _ = planned_example
    p = build_problem(read_trace(out / "trace"))
    spans = {s.module: s for s in module_spans(p)}
    parts = [as_partition(spans[m], 1) for m in ("transformer.h.0", "transformer.h.1.attn")]
    plan = make_plan(p, None, "manual", Decisions(partitions=parts), 0.0, 0)
    assert plan.predicted["planned_peak_bytes"] < plan.predicted["baseline_peak_bytes"]
    path = out / "whole.plan.json"
    save_plan(plan, path, force=True)
    _, base, _, _ = train(out)
    _, planned, peak, cb = train(out, path)
    assert cb.runtime.mismatches == 0
    # to the byte here; a cache kept past the module would add its keys and values (2 x 131,072 B per layer)
    assert abs(peak - plan.predicted["planned_peak_bytes"]) <= 1024, (peak, plan.predicted["planned_peak_bytes"])
    assert_bitwise(base, planned, lambda: train(out)[1])


def _bf16_trainer(out: Path, steps: int, seed: int, callbacks=()):
    """The example's tiny GPT-2 without dropout (its blocks split along the batch), trained
    under the Trainer's bf16 autocast on the CPU."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    s = example.SIZES
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(n_layer=s["layers"], n_embd=s["hidden"], n_head=s["heads"],
                                       vocab_size=s["vocab"], n_positions=s["seq"], resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(
        output_dir=str(out / "bf16"), max_steps=steps, per_device_train_batch_size=s["batch"],
        gradient_accumulation_steps=2, max_grad_norm=1.0, learning_rate=1e-3, eval_strategy="no",
        logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
        dataloader_drop_last=True, seed=seed, bf16=True)
    data = example.SyntheticText(2 * s["batch"] * steps, s["seq"], s["vocab"], seed=1)
    return Trainer(model=model, args=args, train_dataset=data, callbacks=list(callbacks))


def test_a_bf16_trainer_splits_under_autocast_as_predicted(tmp_path):
    """With ``python_refs`` the planner knows when autocast's cache lets go of a weight's cast,
    so a Trainer's bf16 trace is offered batch splits of its modules (before the probe, none:
    this budget had no plan). Trained with the plan, the last step's peak is the predicted one
    (to 16 bytes here; live_peak.py counts independently of the recorder and the simulator), and
    no container (``transformer.h``, a ModuleList the Trainer never calls) is partitioned."""
    from taichi_plan.plan.format import save_plan
    from taichi_plan.problem.core import build_problem
    from taichi_plan.solve import solve
    from taichi_plan.trace.format import write_trace

    trace = record_trainer(_bf16_trainer(tmp_path, 3, 1), steps=2, warmup=1)
    assert trace.meta["loop"]["autocast"] == "bf16" and "python_refs" in trace.meta
    write_trace(trace, tmp_path / "trace")
    p = build_problem(trace)
    plan = solve(trace, int(p.baseline_peak[0] * 0.65), "heuristic", problem=p, optimizer="as-recorded")
    split = [q for q in plan.partitions if q.chunks > 1]
    assert split and all(q.module != "transformer.h" for q in plan.partitions), plan.partitions
    plan.trace["path"] = str(tmp_path / "trace")
    save_plan(plan, tmp_path / "bf16.plan.json")
    cb = PlanCallback(tmp_path / "bf16.plan.json")
    trainer = _bf16_trainer(tmp_path, 3, 0, [cb])
    peak = PeakOfLastStep(trainer, 2)
    trainer.add_callback(peak)
    trainer.train()
    assert cb.runtime.mismatches == 0 and cb.runtime.planned_calls == 6
    assert abs(peak.peak - plan.predicted["planned_peak_bytes"]) <= 16, (peak.peak, plan.predicted)
