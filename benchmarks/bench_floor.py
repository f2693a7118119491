"""The least reachable peak per model and lever (issue 9): how low each way of planning gets.

For each model (fake recordings, a100-40gb profile, the sizes of the recorded-trace section),
the lowest peak each planner is known to reach, as a fraction of the plain
(unplanned) peak, found the way ``solve``'s infeasible path finds it: the heuristic's budget
bisected between the floor no plan can pass and the plain peak
(:func:`taichi_plan.solve.reach.least_reached`, 7 steps; the simulator judges every plan):

* remat only: the heuristic without partitions;
* partition only: the heuristic on the problem with no droppable tensor;
* both: the heuristic, partitions and drops together (what ``solve`` does);
* both + dropout: the same with modules that draw random numbers partitionable too
  (``--partition-random``: their chunks draw their own dropout masks);
* both + optimizer: the same on the step as each optimizer option the trace allows runs it
  (``--optimizer groups`` with the groups of lowest floor, ``in-backward``), the lowest;
* every block: PyTorch-style checkpointing of every repeated block (the ``full`` baseline,
  one plan whatever the budget, each block re-run once in backward);
* DTR: DTR's greedy eviction run offline, bisected like ours.

``python -m benchmarks.bench_floor`` prints the
markdown and writes it into ``docs/benchmarks.md`` (its own section, replaced in place).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

MODELS = [  # (label, model, flags): fake, a100-40gb
    ("GPT-2 small b8 s1024", "gpt2", {"batch": 8, "seq": 1024}),
    ("BERT-base b8 s512", "bert", {"batch": 8, "seq": 512}),
    ("ViT-base b32 224", "vit", {"batch": 32}),
    ("ResNet-50 b32 224", "resnet50", {"batch": 32}),
    ("Llama 8L h1024 b4 s1024", "llama", {}),
    # The two decoders as training runs them (record --no-kv-cache); above, transformers' default
    # keeps every layer's keys and values in a KV cache, so no attention or block is partitioned.
    ("GPT-2 small b8 s1024, KV cache off", "gpt2", {"batch": 8, "seq": 1024, "kv_cache": False}),
    ("Llama 8L h1024 b4 s1024, KV cache off", "llama", {"kv_cache": False}),
]
LEVERS = ("remat only", "partition only", "both", "both + dropout", "both + optimizer", "every block", "DTR")
TITLE = "## Least reachable peak per lever (fraction of the plain peak)"


def no_drops(problem):
    """``problem`` with nothing droppable: partitions are the only lever left."""
    empty = np.zeros(0, dtype=np.int64)
    return dataclasses.replace(problem, candidates=empty, cand_free_after=empty, cand_remat_before=empty,
                               cand_early_remat=empty)


def optimizer_views(problem) -> list:
    """The step as recorded and as each optimizer option the trace allows runs it (groups:
    the grouping of lowest floor)."""
    from taichi_plan.problem.optimizer.plan import (
        OPTION_ORDER,
        choose_groups,
        refusal,
        view_problem,
    )

    return [problem] + [view_problem(problem, mode, choose_groups(problem, 0) if mode == "groups" else None)
                        for mode in OPTION_ORDER if refusal(problem.trace, mode) is None]


def least_peaks(problem) -> dict[str, float]:
    """Each lever's least reachable peak, as a fraction of ``problem``'s plain peak."""
    from taichi_plan.problem.partition.qualify import allow_random
    from taichi_plan.simulate.core import simulate_plan
    from taichi_plan.solve.baselines import plan_dtr, plan_full
    from taichi_plan.solve.config import HeuristicConfig, TimeConfig
    from taichi_plan.solve.heuristic import plan_heuristic as heuristic
    from taichi_plan.solve.reach import least_reached

    bisecting = HeuristicConfig(local_max_s=TimeConfig().bisect_local_max_s)

    def plan_heuristic(p, budget, partitions=True):  # as solve's infeasible path runs it
        return heuristic(p, budget, partitions=partitions, config=bisecting)

    base = problem.baseline_peak[0]
    out = {
        "remat only": least_reached(problem, lambda p, b: plan_heuristic(p, b, partitions=False))[0],
        "partition only": least_reached(no_drops(problem), plan_heuristic)[0],
        "both": least_reached(problem, plan_heuristic)[0],
        "both + dropout": least_reached(allow_random(problem, True), plan_heuristic)[0],
        "both + optimizer": min(least_reached(view, plan_heuristic)[0] for view in optimizer_views(problem)),
        "DTR": least_reached(problem, plan_dtr)[0],
    }
    full = plan_full(problem, None)
    out["every block"] = simulate_plan(problem, full.drops, full.partitions)[0].peak_bytes
    return {k: out[k] / base for k in LEVERS}


def run(progress=lambda msg: None) -> list[dict]:
    from taichi_plan.problem.core import build_problem
    from taichi_plan.record import get_workload, record_workload

    rows = []
    for label, model, flags in MODELS:
        t0 = time.perf_counter()
        progress(f"{label}: recording")
        problem = build_problem(record_workload(get_workload(model=model, **flags), fake=True,
                                                device_profile="a100-40gb"))
        progress(f"{label}: {problem.num_ops} ops, bisecting each lever")
        rows.append({"model": label, "ops": problem.num_ops, "plain_peak_bytes": problem.baseline_peak[0],
                     **least_peaks(problem), "seconds": time.perf_counter() - t0})
    return rows


DESCRIPTION = """\
For each model (fake recordings on the a100-40gb profile), the lowest peak each way of
planning is known to reach, as a fraction of the plain (unplanned) peak: the budget of each
planner bisected between the floor no plan can pass and the plain peak, as `solve`'s
infeasible path does for the heuristic (`taichi_plan.solve.reach.least_reached`, 7 steps; the
simulator judges every plan, and a lower budget is asked only after one that fit). Our
levers use the heuristic (`auto`'s CP-SAT may reach a little lower), whose sweep also starts
from checkpointing's drops (every block, sqrt(n)) and adds per-tensor drops where still over:

* remat only: the heuristic without partitions;
* partition only: the heuristic on the problem with nothing droppable;
* both: partitions and drops together (what `solve` does);
* both + dropout: the same with modules that draw random numbers partitionable too
  (`--partition-random`: their chunks draw their own dropout masks);
* both + optimizer: the same on the step as each optimizer option the trace allows runs it
  (`--optimizer groups`, with the groups of lowest floor, and `in-backward`), the lowest;
* every block: checkpointing every repeated block (the `full` baseline: one plan whatever
  the budget, each block re-run once in backward);
* DTR: DTR's greedy eviction run offline, bisected the same way."""


def markdown(rows: list[dict], command: str = "python -m benchmarks.bench_floor") -> str:
    lines = [TITLE, "", f"Regenerated by `{command}` (also part of `make bench`). " + DESCRIPTION, "",
             "| model (ops) | plain peak | " + " | ".join(LEVERS) + " | seconds |",
             "|---|---|" + "---|" * len(LEVERS) + "---|"]
    for r in rows:
        lines.append(f"| {r['model']} ({r['ops']}) | {r['plain_peak_bytes'] / 1e9:.2f} GB | "
                     + " | ".join(f"{r[k]:.3f}" for k in LEVERS) + f" | {r['seconds']:.0f} |")
    below = [r["model"] for r in rows if r["every block"] < r["both"]]
    if below:
        lines += ["", f"`every block` reaches below the heuristic's `both` on {len(below)} of {len(rows)} models "
                  f"({', '.join(below)}): the heuristic, which plans tensor by tensor, stops "
                  "above it (why is not analysed yet). `solve` (`auto`) judges "
                  "the baselines' plans beside the heuristic's and never ends above them."]
    return "\n".join(lines) + "\n"


def write_section(path: Path, text: str) -> None:
    """Replace this benchmark's section of ``path`` (up to the next ``## ``), or append it."""
    from taichi_plan.base.atomic import write_text_atomic

    doc = path.read_text() if path.exists() else "# Benchmarks\n"
    start = doc.find(TITLE)
    if start < 0:
        doc = doc.rstrip("\n") + "\n\n" + text
    else:
        end = doc.find("\n## ", start + len(TITLE))
        doc = doc[:start] + text + ("\n" + doc[end + 1:] if end >= 0 else "")
    write_text_atomic(path, doc)


def main() -> None:
    t0 = time.perf_counter()
    rows = run(lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))
    text = markdown(rows) + f"\nWhole table: {time.perf_counter() - t0:.0f} s.\n"
    print(text)
    out = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
    write_section(out, text)
    print(f"Wrote {out}")


if __name__ == "__main__":
    main()
