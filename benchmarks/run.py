"""``make bench``: every benchmark in one run, written to ``docs/benchmarks.md``.

Timings are wall seconds on this machine, measured side by side in one process; quality is
the simulator's extra compute (as a ratio: total compute with recomputes / without) and the
solver's proven lower bound. Nothing here is part of ``make test``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from rich.progress import Progress

from benchmarks import (
    bench_bounds,
    bench_compiled,
    bench_floor,
    bench_fsdp,
    bench_graphs,
    bench_offload,
    bench_optimizer,
    bench_record,
    bench_replay,
    bench_zoo,
    gpu_check,
)
from benchmarks.common import RECORDED, machine
from taichi_plan.base.atomic import write_text_atomic

OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
REPLAY_JSON = OUT.with_name("bench_replay.json")
TIME_LIMIT = float(os.environ.get("BENCH_TIME_LIMIT", "30"))

RECORDED_TIME_LIMIT = float(os.environ.get("BENCH_RECORDED_TIME_LIMIT", "20"))
SIZES = [  # solve time against trace size: GPT-2 configs of growing depth (fake)
    ("GPT-2 2 layers", {"batch": 8, "seq": 512, "layers": 2}),
    ("GPT-2 XL 48 layers", {"batch": 8, "seq": 1024, "layers": 48, "hidden": 1600, "heads": 25}),
    ("GPT-2 320 layers h256", {"batch": 8, "seq": 256, "layers": 320, "hidden": 256, "heads": 4}),
]


def fmt(x, p=4):
    return "-" if x is None else f"{x:.{p}f}"


def solve_rows(trace, label, fractions, methods, bar=None, time_limit=None):
    from taichi_plan.base.errors import InfeasibleBudgetError
    from taichi_plan.problem.core import build_problem
    from taichi_plan.solve import solve

    problem = build_problem(trace)
    base = problem.baseline_peak[0]
    rows = []
    for frac in fractions:
        for method in methods:
            t0 = time.perf_counter()
            row = {"trace": label, "ops": problem.num_ops, "budget": frac, "method": method}
            try:
                plan = solve(trace, int(base * frac), method, time_limit=time_limit or TIME_LIMIT, problem=problem)
                s = plan.solver
                row.update(status=s["status"], ratio=1 + plan.predicted["extra_compute"] / problem.step_cost,
                           lb=None if s["lower_bound"] is None else 1 + s["lower_bound"] / problem.step_cost,
                           gap=s["gap"], parts=len(plan.partitions))
            except InfeasibleBudgetError as e:
                row.update(status="infeasible", ratio=None, lb=None, gap=None, parts=0,
                           reach=(e.min_budget_bytes or 0) / base)
            row["seconds"] = time.perf_counter() - t0
            rows.append(row)
            if bar:
                bar()
            print(f"  {label} {frac} {method}: {row['status']} {fmt(row['ratio'])} {row['seconds']:.1f}s",
                  file=sys.stderr, flush=True)
    return rows


def bounds_section(rows) -> str:
    return ("## Bounds on recorded traces (issue 11)\n\n`auto` at 30 s per solve, without and with the bound phase "
            "(docs/planner.md, `solve/bound.py`); gap = (cost - bound) / cost; wall seconds on this machine, "
            "whole solve.\n\n" + bench_bounds.markdown(rows))


MAXBATCH = [  # (label, record flags, budget, device profile): the issue's five models, two decoders again
    ("GPT-2 small s1024 on 16GB (v100-16gb)", {"model": "gpt2", "seq": 1024}, "16GB", "v100-16gb"),
    ("BERT-base s512 on 16GB (v100-16gb)", {"model": "bert", "seq": 512}, "16GB", "v100-16gb"),
    ("ResNet-50 224 on 16GB (v100-16gb)", {"model": "resnet50"}, "16GB", "v100-16gb"),
    ("ViT-base 224 on 16GB (v100-16gb)", {"model": "vit"}, "16GB", "v100-16gb"),
    ("Llama 8L h1024 s1024 on 16GB (v100-16gb)", {"model": "llama"}, "16GB", "v100-16gb"),
    # The two decoders as training runs them (record --no-kv-cache): above, transformers' default
    # keeps every layer's keys and values in a KV cache, for every planner alike.
    ("GPT-2 small s1024 on 16GB (v100-16gb), KV cache off", {"model": "gpt2", "seq": 1024, "kv_cache": False},
     "16GB", "v100-16gb"),
    ("Llama 8L h1024 s1024 on 16GB (v100-16gb), KV cache off", {"model": "llama", "kv_cache": False}, "16GB",
     "v100-16gb"),
]


def maxbatch_section(say=lambda msg: None, only: tuple[int, ...] | None = None) -> str:
    """The max-batch tables of :data:`MAXBATCH` (``only``: their indices), each with its search
    time and the batch sizes it recorded; ``say`` gets the search's progress."""
    from taichi_plan.base.units import parse_budget
    from taichi_plan.explore.maxbatch import fake_recorder, max_batch, render_max_batch
    from taichi_plan.trace.devices import get_profile

    parts = ["## Max batch under a budget (extra compute <= 33%, fake recordings)\n",
             "MegTaiChi reports 5x the batch of no planning and 2.4x that of sqrt(n). Ours here is "
             "the `heuristic` planner (20 s limit per solve), with the optimizer step as recorded; "
             "the baselines are no planning, sqrt(n) and every-block checkpointing (each region re-run "
             "once) and DTR's offline heuristic. A batch fits a planner when its plan for the budget "
             "fits and adds at most 33% compute (`taichi_plan/explore/maxbatch.py`). Fake recordings map the "
             "GPU's kernels (fused attention, no S x S matrix: docs/gpu.md).\n"]
    total = time.perf_counter()
    for i, (label, flags, budget, profile) in enumerate(MAXBATCH):
        if only is not None and i not in only:
            continue
        t0 = time.perf_counter()
        flags = dict(flags)
        model = flags.pop("model")
        record = fake_recorder(model, None, device_profile=get_profile(profile).name, progress=say, **flags)
        res = max_batch(record, parse_budget(budget), method="heuristic", max_overhead_pct=33.0, time_limit=20,
                        progress=say)
        parts.append(f"### {label}\n\n```\n{render_max_batch(res)}\n```\n\n"
                     f"Search took {time.perf_counter() - t0:.0f} s.\n")
        say(f"{label}: {time.perf_counter() - t0:.0f} s")
    parts.append(f"All searches: {time.perf_counter() - total:.0f} s.\n")
    return "\n".join(parts)


def table(rows, with_parts=False):
    head = "| trace (ops) | budget | method | status | compute ratio | lower bound | gap | partitions | solve s |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gap = "-" if r["gap"] is None else f"{100 * r['gap']:.2f}%"
        status = r["status"] + (f" (least reached {r['reach']:.3f})" if r.get("reach") else "")
        lines.append(f"| {r['trace']} ({r['ops']}) | {r['budget']} | {r['method']} | {status} | {fmt(r['ratio'])} "
                     f"| {fmt(r['lb'])} | {gap} | {r.get('parts', 0)} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def replay_section() -> str:
    """Issue 8's benchmark (``bench_replay``): its markdown, and its raw numbers written to
    ``docs/bench_replay.json``."""
    # each model in a fresh process, glibc's malloc steady there (bench_replay.STEADY_MALLOC)
    result = bench_replay.run(progress=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True), isolate=True)
    write_text_atomic(REPLAY_JSON, bench_replay.to_json(result))
    return bench_replay.markdown(result)


ZOO_INTRO = (
    "## Architectures no issue names\n\n`benchmarks/bench_zoo.py`: tiny `transformers` models of 30 architectures "
    "(decoders, encoders, encoder-decoders, vision, speech, a mixture of experts, a state-space model), each recorded "
    "for real on this CPU (one thread), solved at 50% and 30% of its peak (`auto`, 20 s) and replayed one step; "
    "six of them also recorded with 2 micro-batches under bf16 autocast. Measured - predicted: the replayed peak "
    "against the plan's prediction, in bytes. Gradients: `bitwise` where the plan only rematerializes or "
    "checkpoints modules whole, `allclose` where it splits a module into chunks or steps the optimizer in backward "
    "(replay's own checks). No plan: the budget is below the step's floor (parameters, gradients and AdamW state "
    "of these small models are much of it).\n\n")


def _guarded(title: str, make) -> str:
    """A section, or what went wrong making it (the rest of the run still lands)."""
    try:
        return make()
    except Exception as e:  # noqa: BLE001 - a benchmark section must not lose the others
        return f"## {title}\n\nFailed in this run: {type(e).__name__}: {e}"


def main() -> None:
    from taichi_plan.record import get_workload, record_workload
    from taichi_plan.trace.import_graph import import_graph

    started = time.perf_counter()
    sections = [f"# Benchmarks\n\nRegenerated by `make bench` ({machine()}). Solver time limit "
                f"{TIME_LIMIT:g} s per solve ({RECORDED_TIME_LIMIT:g} s for recorded traces). Compute ratio = (step compute + extra) / step compute, "
                "from the simulator; lower bound = the same ratio at CP-SAT's proven bound on extra "
                "compute (a bound within taichi-plan's plan space for that kind of graph, see "
                "docs/planner.md); gap = (cost - bound) / cost.\n"]

    with Progress(transient=True) as progress:
        task = progress.add_task("bench", total=None)

        def tick():
            progress.advance(task)

        # 1. Recorder speed.
        progress.update(task, description="record times")
        rec = bench_record.run()
        sections.append("## Record times\n\n| workload | mode | ops | seconds | peak GB |\n|---|---|---|---|---|\n" +
                        "\n".join(f"| {r['workload']} | {r['mode']} | {r['ops']} | {r['seconds']:.2f} | "
                                  f"{r['peak_bytes'] / 1e9:.2f} |" for r in rec))

        # 2. Public graphs.
        progress.update(task, description="public graphs")
        rows = []
        for name in bench_graphs.GRAPHS:
            f = bench_graphs.graphs_dir() / f"{name}.json"
            if f.exists():
                rows += solve_rows(import_graph(f), name.replace("_train_nx", "")[:34], (0.9, 0.8, 0.6, 0.4),
                                   ("auto", "dtr", "sqrt-n", "selective-mm"), tick)
        sections.append("## Public remat graphs (`../shared/graphs`)\n\n" + (table(rows) if rows else
                        "The graphs directory was not found; nothing measured."))

        # 3. Recorded traces.
        progress.update(task, description="recorded traces")
        rows = []
        for label, model, flags in RECORDED:
            trace = record_workload(get_workload(model=model, **flags), fake=True, device_profile="a100-40gb")
            rows += solve_rows(trace, label, (0.7, 0.5, 0.35), ("auto", "heuristic", "dtr", "sqrt-n", "full"), tick,
                               time_limit=RECORDED_TIME_LIMIT)
        sections.append("## Recorded traces (fake mode, a100-40gb profile)\n\n`heuristic` may partition "
                        "modules too; `partitions` counts them.\n\n" + table(rows))

        # 3a. Bounds on the recorded traces, with and without the bound phase (issue 11).
        progress.update(task, description="bounds on recorded traces")
        sections.append(_guarded("Bounds on recorded traces", lambda: bounds_section(bench_bounds.run(
            say=lambda line: print(f"  {line}", file=sys.stderr, flush=True)))))

        # 3b. The least reachable peak per lever (remat, partition, both, baselines).
        progress.update(task, description="least reachable peaks")
        sections.append(_guarded("Least reachable peak", lambda: bench_floor.markdown(
            bench_floor.run(lambda msg: print(f"  {msg}", file=sys.stderr, flush=True)), "make bench")))

        # 4. Solve time against trace size.
        progress.update(task, description="trace size")
        rows = []
        for label, flags in SIZES:
            t0 = time.perf_counter()
            trace = record_workload(get_workload(model="gpt2", **flags), fake=True, device_profile="a100-40gb")
            rec_s = time.perf_counter() - t0
            for r in solve_rows(trace, label, (0.5,), ("heuristic", "auto"), tick):
                r["trace"] = f"{label}, recorded in {rec_s:.1f} s"
                rows.append(r)
        sections.append("## Solve time against trace size (budget 50%)\n\n" + table(rows))

        # 5. Replay: measured against predicted, and against PyTorch's own checkpointing.
        progress.update(task, description="replay")
        sections.append(_guarded("Replay", replay_section))

        # 5b. The optimizer step as part of the plan.
        progress.update(task, description="optimizer options")
        sections.append(_guarded("The optimizer step as part of the plan",
                                 lambda: bench_optimizer.markdown(bench_optimizer.run())))

        # 5c. Architectures no issue names, recorded, solved and replayed.
        progress.update(task, description="architecture zoo")
        sections.append(_guarded("Architectures no issue names", lambda: ZOO_INTRO + bench_zoo.markdown(bench_zoo.run(
            progress=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True)))))

        # 6. Max batch under a budget.
        progress.update(task, description="maxbatch")
        sections.append(_guarded("Max batch", lambda: maxbatch_section(
            lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))))

        # 6a. Max batch with offload to host memory allowed.
        progress.update(task, description="maxbatch with offload")
        sections.append(_guarded("Max batch with offload", lambda: bench_offload.section(
            lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))))

        # 6b. Compiled training against PyTorch's activation_memory_budget.
        progress.update(task, description="compiled")
        sections.append(_guarded("Compiled training", bench_compiled.section))

        # 7. Sharded: rank 0 of FSDP2 jobs (7B at 8 ranks, 70B at 64).
        progress.update(task, description="sharded")
        sections.append(_guarded("Sharded (FSDP2)", bench_fsdp.section))

    # 8. The GPU check's results, where a GPU machine has written them (never run here).
    sections.append(_guarded("GPU check", lambda: gpu_check.section(gpu_check.DEFAULT_OUT)))

    sections.append(f"Whole run: {time.perf_counter() - started:.0f} s.")
    write_text_atomic(OUT, "\n\n".join(sections) + "\n")
    print(f"Wrote {OUT}")


if __name__ == "__main__":
    main()
