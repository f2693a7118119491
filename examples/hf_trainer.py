"""Train with a taichi-plan plan in the Hugging Face Trainer.

    python examples/hf_trainer.py --steps 6 --eval-every 2 --budget 0.75

A tiny GPT-2 (built from a config, no download) learns a small synthetic dataset with
``gradient_accumulation_steps=2`` and an evaluation every ``--eval-every`` steps. Three parts:

1. record: ``record_trainer(trainer)`` runs a few steps of ``trainer.train()`` and records one
   optimizer step exactly as the Trainer runs it (its ``training_step`` passing
   ``num_items_in_batch`` to the model, its accumulation and clipping, the optimizer it makes);
2. solve: a plan under ``--budget`` (a fraction of the recorded step's peak); the trace and the
   plan are written to ``--trace`` (``traces/hf-trainer``) and ``--plan``
   (``plans/hf-trainer.plan.json``);
3. train: a fresh Trainer with ``callbacks=[PlanCallback(plan)]`` trains planned; evaluation
   runs unplanned. Needs ``pip install taichi-plan[hf]`` (transformers and accelerate).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import taichi_plan
from taichi_plan.base.errors import InfeasibleBudgetError
from taichi_plan.base.units import format_bytes
from taichi_plan.integrations.hf import PlanCallback, record_trainer
from taichi_plan.plan.format import save_plan
from taichi_plan.problem.core import build_problem
from taichi_plan.solve import solve

SIZES = dict(layers=2, hidden=64, heads=2, vocab=256, seq=64, batch=8)


class SyntheticText(torch.utils.data.Dataset):
    """``n`` random token sequences; each is its own language-modelling target."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_trainer(out_dir: Path, *, steps: int, eval_every: int, seed: int = 0, callbacks=()) -> Trainer:
    """A Trainer of a fresh tiny GPT-2 (weights from ``seed``): ``steps`` optimizer steps of
    ``gradient_accumulation_steps=2`` micro-batches, clipping at 1.0, AdamW, an evaluation
    every ``eval_every`` steps, nothing saved or reported."""
    s = SIZES
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(n_layer=s["layers"], n_embd=s["hidden"], n_head=s["heads"],
                                       vocab_size=s["vocab"], n_positions=s["seq"], bos_token_id=0,
                                       eos_token_id=0))
    args = TrainingArguments(
        output_dir=str(out_dir / "trainer"), max_steps=steps, per_device_train_batch_size=s["batch"],
        per_device_eval_batch_size=s["batch"], gradient_accumulation_steps=2, max_grad_norm=1.0,
        learning_rate=1e-3, eval_strategy="steps", eval_steps=eval_every, logging_strategy="no",
        save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True, dataloader_drop_last=True,
        seed=seed)
    n = s["batch"] * 2 * steps  # one epoch covers the run: every step has its two full micro-batches
    return Trainer(model=model, args=args, train_dataset=SyntheticText(n, s["seq"], s["vocab"], seed=1),
                   eval_dataset=SyntheticText(2 * s["batch"], s["seq"], s["vocab"], seed=2),
                   callbacks=list(callbacks))


def record_and_solve(work_dir: Path, trace_dir: Path, plan_path: Path, budget: float,
                     time_limit_s: float = 5.0):
    """Record the Trainer's step, solve a plan at ``budget`` x its peak (the smallest reachable
    budget if that is lower than the planner can go, said so), write the trace to
    ``trace_dir`` and the plan to ``plan_path`` (replacing them); ``work_dir``: the recording
    Trainer's ``output_dir`` (nothing is saved there)."""
    trace = record_trainer(make_trainer(work_dir, steps=3, eval_every=3, seed=1), steps=2, warmup=1)
    taichi_plan.write_trace(trace, trace_dir, force=True)
    problem = build_problem(trace)
    peak = int(problem.baseline_peak[0])
    budget_bytes = int(peak * budget)
    try:
        plan = solve(trace, budget_bytes, "heuristic", time_limit=time_limit_s, problem=problem)
    except InfeasibleBudgetError as e:
        print(f"{format_bytes(budget_bytes)} is out of reach; the smallest budget the planner reaches is "
              f"{format_bytes(e.min_budget_bytes)}: solving for that.")
        plan = solve(trace, int(e.min_budget_bytes), "heuristic", time_limit=time_limit_s, problem=problem)
    plan.trace["path"] = str(Path(trace_dir).resolve())
    save_plan(plan, plan_path, force=True)
    print(f"Recorded the Trainer's step: peak {format_bytes(peak)}; plan for {format_bytes(plan.budget_bytes)} "
          f"drops {len(plan.recompute)} tensors, predicted peak "
          f"{format_bytes(plan.predicted['planned_peak_bytes'])}.\nWrote {trace_dir}\nWrote {plan_path}")
    return plan, plan_path


def main(argv: list[str] | None = None) -> Trainer:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--budget", type=float, default=0.75, help="fraction of the recorded step's peak")
    ap.add_argument("--trace", type=Path, default=Path("traces/hf-trainer"))
    ap.add_argument("--plan", type=Path, default=Path("plans/hf-trainer.plan.json"))
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="hf-trainer-") as work:  # the Trainers' output_dir
        _plan, path = record_and_solve(Path(work), args.trace, args.plan, args.budget)
        plan_callback = PlanCallback(path)  # <- the only addition to a Trainer
        trainer = make_trainer(Path(work), steps=args.steps, eval_every=args.eval_every,
                               callbacks=[plan_callback])
        trainer.train()
    rt = plan_callback.runtime
    print(f"Trained {args.steps} steps with the plan: {rt.planned_calls} planned model calls, "
          f"{rt.dropped_storages} activations dropped and rebuilt, {rt.mismatches} mismatches.")
    return trainer


if __name__ == "__main__":
    main()
