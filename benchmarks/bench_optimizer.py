"""The optimizer step as part of the plan: the least budget with the recorded step against the
least with the optimizer options, and a plan between the two replayed (measured vs predicted).

``python -m benchmarks.bench_optimizer`` prints the section; ``make bench`` writes it to
docs/benchmarks.md. Real CPU steps are replayed; the fake Llama row is only solved.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from taichi_plan.base.errors import InfeasibleBudgetError
from taichi_plan.base.units import format_bytes
from taichi_plan.plan.format import save_plan
from taichi_plan.problem.core import build_problem
from taichi_plan.problem.optimizer.plan import OPTION_ORDER, choose_groups, refusal, view_problem
from taichi_plan.problem.partition.floor import floor_bytes
from taichi_plan.record import get_workload, record_workload
from taichi_plan.solve import solve
from taichi_plan.trace.format import write_trace

ENTRY = "examples.my_workload:make_step"
REAL = [  # (label, workload flags): real CPU steps, replayed
    ("mlp b64", dict(model="mlp", batch=64)),
    ("`--entry` example b32", dict(entry=ENTRY, batch=32)),
    ("`--entry` example b512", dict(entry=ENTRY, batch=512)),
]
FAKE = [  # (label, workload flags): fake a100-40gb steps, solved only
    ("Llama 16L h2048 b4 s1024, fake", dict(model="llama", layers=16, hidden=2048)),
]
TIME_LIMIT = 30.0
ABOVE_LEAST = 1.003  # the replayed plan's budget, over the least with the options: it then drops activations too


def least(trace, problem, optimizer: str, time_limit: float) -> int:
    """The lowest budget a plan is known for (the error of an unreachable budget says it)."""
    try:
        plan = solve(trace, 1, problem=problem, optimizer=optimizer, time_limit=time_limit)
    except InfeasibleBudgetError as e:
        return int(e.min_budget_bytes)
    return int(plan.predicted["planned_peak_bytes"])


def floor_with_options(problem, budget: int) -> int:
    floors = [int(floor_bytes(problem).max())]
    for mode in OPTION_ORDER:
        if refusal(problem.trace, mode) is None:
            groups = choose_groups(problem, budget) if mode == "groups" else None
            floors.append(int(floor_bytes(view_problem(problem, mode, groups)).max()))
    return min(floors)


def row(label: str, trace, replay_it: bool, time_limit: float = TIME_LIMIT) -> dict:
    problem = build_problem(trace)
    peak = problem.baseline_peak[0]
    out = {"label": label, "peak": peak, "floor_rec": int(floor_bytes(problem).max()),
           "least_rec": least(trace, problem, "as-recorded", time_limit),
           "floor_opt": floor_with_options(problem, 0), "least_opt": least(trace, problem, "auto", time_limit)}
    if out["least_opt"] >= out["least_rec"] or not replay_it:
        return out
    from taichi_plan.replay.measure import replay

    budget = int(out["least_opt"] * ABOVE_LEAST)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_trace(trace, Path(tmp) / "trace")
        from taichi_plan import read_trace

        saved = read_trace(path)
        plan = solve(saved, budget, time_limit=time_limit)
        plan_path = save_plan(plan, Path(tmp) / "plan.json")
        r = replay(plan_path, steps=2)
    out.update(budget=budget, mode=(plan.optimizer or {}).get("mode", "as-recorded"), dropped=len(plan.recompute),
               extra_pct=plan.predicted["extra_compute_pct"], predicted=plan.predicted["planned_peak_bytes"],
               measured=r["measured_peak_bytes"], params_bitwise=r["grads_match"])
    return out


def run(progress=lambda msg: None) -> list[dict]:
    rows = []
    for label, flags in REAL:
        progress(label)
        rows.append(row(label, record_workload(get_workload(**flags), fake=False), replay_it=True))
    for label, flags in FAKE:
        progress(label)
        trace = record_workload(get_workload(**flags), fake=True, device_profile="a100-40gb")
        rows.append(row(label, trace, replay_it=False, time_limit=60.0))
    return rows


def markdown(rows: list[dict]) -> str:
    def b(x: int, peak: int) -> str:
        return f"{format_bytes(x)} ({x / peak:.3f})"

    lines = ["## The optimizer step as part of the plan", "",
             "Where the peak is in the optimizer step, parameters, gradients and AdamW state set the floor. "
             "Least budget with the recorded step (`solve --optimizer as-recorded`) against the least with the "
             "optimizer options (`--optimizer auto`, which here steps the optimizer in backward: these steps are "
             "recorded per parameter, as PyTorch steps on CPU, so `groups` has nothing to split), and a plan just "
             f"above the latter ({ABOVE_LEAST:g} x) replayed on this CPU (`benchmarks/bench_optimizer.py`). Floor: "
             "what no plan of that step goes below; least: the lowest budget a plan is known for (what the error of "
             "`solve --budget 1MB` says). Fractions of the recorded step's peak.", "",
             "| workload (peak) | floor, recorded step | least, recorded step | floor, with options | "
             "least, with options | replayed plan: budget, option, drops, extra | predicted = measured peak |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["peak"]
        if "measured" in r:
            plan = (f"{format_bytes(r['budget'])}, {r['mode']}, {r['dropped']} dropped, +{r['extra_pct']:.2f}%")
            meas = (f"{format_bytes(r['predicted'])} {'=' if r['predicted'] == r['measured'] else '!='} "
                    f"{format_bytes(r['measured'])}, parameters {'bitwise' if r['params_bitwise'] else 'DIFFER'}")
        else:
            plan, meas = ("-", "-") if r["least_opt"] >= r["least_rec"] else ("solved only", "-")
        lines.append(f"| {r['label']} ({format_bytes(p)}) | {b(r['floor_rec'], p)} | {b(r['least_rec'], p)} | "
                     f"{b(r['floor_opt'], p)} | {b(r['least_opt'], p)} | {plan} | {meas} |")
    lines += ["", "By hand, for the mlp (the example the same way, recorded with `--entry " + ENTRY + "`):", "",
              "```",
              "taichi-plan record --model mlp --batch 64 -o traces/mlp",
              "taichi-plan solve traces/mlp --budget 1MB --optimizer as-recorded   # error: floor, least, the floor's parts",
              "taichi-plan solve traces/mlp --budget 1MB                           # the same with the optimizer options",
              "taichi-plan solve traces/mlp --budget 64.3MB -o plans/mlp-64.3MB.plan.json",
              "taichi-plan replay plans/mlp-64.3MB.plan.json --steps 3",
              "```", "",
              "Stepped in backward, the gradients are freed, so replay compares parameters only. Where the floor is "
              "activations the backward needs (the example at batch 512), freeing gradients early lowers the floor "
              "a little, but the optimizer's temporaries then sit in backward too, and no lower plan is found. "
              "The least budgets come from the heuristic's bisection; CP-SAT can go lower at a given budget (the "
              "fake Llama: `solve --budget 14GB --time-limit 60` finds a plan at 13.99 GB, 0.574 of its peak, "
              "stepped in backward with 198 tensors dropped, +20.9%). `tests/test_optimizer_plan.py` checks "
              "`AdamW(foreach=True)` as well: stepped in groups or in backward, the recorded peak of the planned "
              "step equals the predicted one and the parameters are bitwise those of the plain run."]
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(markdown(run(progress=lambda m: print(f"  {m}", file=sys.stderr, flush=True))))
