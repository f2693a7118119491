"""Sharded planning at scale: rank 0 of Llama-style 7B on 8 ranks and 70B on 64 ranks (FSDP2,
fake, h100-80gb), recorded and solved, and the largest batch per rank on the device's memory.

``python -m benchmarks.bench_fsdp`` prints the section; ``section()`` is the ``make bench``
section (``python -m benchmarks.bench_fsdp record`` or ``maxbatch`` prints one half). Each
recording of the first table runs ``taichi-plan record --fsdp N --fake`` in its own process
(a process group is global state): ``record`` is that process's wall time, imports and the
``FSDPMemTracker`` check included, and its CPU time; ``solve`` is ``auto`` at a budget of 60%
of the per-rank peak (or the least budget it reaches, where the model state alone is above that) under a 30 s limit (which it uses: CP-SAT searches until then). Beside
it, at the same budget, FSDP with every block checkpointed (the ``full`` baseline).

The second table is ``maxbatch --fsdp N`` at the profile's memory per rank (extra compute at
most 33%): FSDP's default (every unit reshards after forward, no activation plan), FSDP with
every block checkpointed, and ours (``heuristic``: the activation plan, partitions, the LM
head and loss over tokens among them, and each unit's ``reshard_after_forward`` and prefetching,
chosen jointly). Guided (``max_batch(guide=True)``): the search runs first on steps
drawn through the recordings at batch 2 and 3, then recordings at each guess and one above
confirm it.

The fake traces hold CPU kernels: ``--fsdp`` recordings do not map GPU kernels
(``record/gpu_ops.py``), so attention is CPU flash attention (output and logsumexp saved,
no S x S matrix, like a GPU's flash kernel) and AdamW steps one parameter at a time (a GPU's
foreach step holds more temporaries at once).
"""

from __future__ import annotations

import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA = {"vocab": 32000, "seq": 2048, "batch": 1, "dtype": "bf16"}
CASES = [  # (label, ranks, sizes)
    ("Llama-style 7B", 8, {"layers": 32, "hidden": 4096, "heads": 32, **LLAMA}),
    ("Llama-style 70B", 64, {"layers": 80, "hidden": 8192, "heads": 64, **LLAMA}),
]
# The same models built as training runs them (``--no-kv-cache``: config.use_cache = False); the
# cases above keep transformers' default, whose forward holds every layer's keys and values.
NO_KV_CASES = [(f"{label}, KV cache off (--no-kv-cache)", ranks, {**sizes, "kv_cache": False})
               for label, ranks, sizes in CASES]
# The layouts most multi-node jobs run (record table only): HSDP, 8 replicas of 8-rank shard groups
# (one node each), parameters fp32 and gathered in bf16, gradients reduced in fp32.
LAYOUT_CASES = [("Llama-style 7B, HSDP 8 x 8, fp32 gathered in bf16", 64,
                 {**CASES[0][2], "dtype": "fp32", "hsdp": 8, "fsdp-param-dtype": "bf16", "fsdp-reduce-dtype": "fp32"})]
PROFILE = "h100-80gb"
BUDGET = 0.6
TIME_LIMIT_S = 30.0
MAXBATCH_METHOD = "heuristic"
MAXBATCH_COMPARED = ("none", "full")


def _child_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def record(sizes: dict, ranks: int, out: Path) -> tuple[float, float]:
    """Record in a fresh process: (wall s, CPU s)."""
    args = [a for k, v in sizes.items() for a in (f"--{k}", str(v))]
    t0, c0 = time.perf_counter(), _child_cpu_s()
    r = subprocess.run([sys.executable, "-m", "taichi_plan", "record", "--model", "llama", *args, "--fake",
                        "--fsdp", str(ranks), "--device-profile", PROFILE, "-o", str(out)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    return time.perf_counter() - t0, _child_cpu_s() - c0


def _timed(fn, *args, **kwargs):
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0, time.process_time() - c0


def run(cases=CASES) -> list[dict]:
    from taichi_plan.base.errors import InfeasibleBudgetError
    from taichi_plan.record.fsdp import trace_by_tracker_category
    from taichi_plan.solve import solve
    from taichi_plan.trace.format import read_trace

    rows = []
    with tempfile.TemporaryDirectory() as d:
        for k, (label, ranks, sizes) in enumerate(cases):
            out = Path(d) / f"case{k}-rank0-of-{ranks}"  # one directory per case: record refuses to overwrite
            record_s, record_cpu_s = record(sizes, ranks, out)
            trace = read_trace(out)
            peak, _, _ = trace_by_tracker_category(trace)
            budget = int(BUDGET * peak)
            try:
                auto, solve_s, solve_cpu_s = _timed(solve, trace, budget, "auto", time_limit=TIME_LIMIT_S)
            except InfeasibleBudgetError as e:  # the model state alone above the share: its least budget
                budget = int(e.min_budget_bytes) + 1
                auto, solve_s, solve_cpu_s = _timed(solve, trace, budget, "auto", time_limit=TIME_LIMIT_S)
            try:
                full = solve(trace, budget, "full")
            except InfeasibleBudgetError:
                full = None
            settings = [u["reshard_after_forward"] for u in (auto.reshard or {}).get("units", [])]
            kept = [r for r in settings if r is False]
            smaller = [r for r in settings if not isinstance(r, bool)]  # resharded to a smaller mesh of r ranks
            rows.append({
                "workload": label, "ranks": ranks, "ops": len(trace.ops), "record_s": round(record_s, 1),
                "record_cpu_s": round(record_cpu_s, 1), "solve_s": round(solve_s, 1),
                "solve_cpu_s": round(solve_cpu_s, 1),
                "units_kept_gathered": len(kept), "units": len(settings),
                "units_smaller_mesh": len(smaller), "smaller_mesh_ranks": sorted(set(smaller)),
                "allgather_saved_s": (auto.reshard or {}).get("step_compute_saved") or 0.0,
                "peak_bytes": peak, "tracker_peak_bytes": trace.meta["fsdp"]["mem_tracker"]["peak_bytes"],
                "budget_bytes": budget, "planned_peak_bytes": auto.predicted["planned_peak_bytes"],
                "planned_extra_pct": auto.predicted.get("extra_compute_pct"), "status": auto.solver["status"],
                "full_peak_bytes": full.predicted["planned_peak_bytes"] if full is not None else None,
                "full_extra_pct": full.predicted.get("extra_compute_pct") if full is not None else None,
            })
    return rows


def _gb(x) -> str:
    return f"{x / 1e9:.2f}"


def record_section(cases=(*CASES, *LAYOUT_CASES)) -> str:
    rows = run(cases)
    head = ("| workload | ranks | ops | record s (CPU s) | solve s (CPU s) | peak GB | FSDPMemTracker GB | budget GB | "
            "auto GB (extra %, status) | auto: units kept gathered, to a smaller mesh (all-gather ms saved) | every "
            "block checkpointed GB (extra %) |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "\n".join(
        f"| {r['workload']} | {r['ranks']} | {r['ops']} | {r['record_s']} ({r['record_cpu_s']}) | {r['solve_s']} "
        f"({r['solve_cpu_s']}) | {_gb(r['peak_bytes'])} | {_gb(r['tracker_peak_bytes'])} | {_gb(r['budget_bytes'])} | "
        f"{_gb(r['planned_peak_bytes'])} ({r['planned_extra_pct']:.1f}, {r['status']}) | {r['units_kept_gathered']}, "
        f"{r['units_smaller_mesh']}"
        + (f" to {'/'.join(map(str, r['smaller_mesh_ranks']))} ranks" if r['units_smaller_mesh'] else "")
        + f" of {r['units']} ({1e3 * r['allgather_saved_s']:.2f}) | "
        + (f"{_gb(r['full_peak_bytes'])} ({r['full_extra_pct']:.1f}) |" if r["full_peak_bytes"] is not None
           else "- (no plan at this budget) |") for r in rows)


NAMES = {"none": "FSDP default (every unit reshards, no activation plan)", "full": "FSDP + every block checkpointed",
         "sqrt-n": "FSDP + sqrt(n) checkpointing", "dtr": "FSDP + DTR's greedy"}


def maxbatch_rows(case, budget_bytes: int | None = None, method: str = MAXBATCH_METHOD,
                  compared=MAXBATCH_COMPARED, guide: bool = True) -> dict:
    """``max_batch`` of one case (batch per rank) at ``budget_bytes`` (None: the profile's
    memory), with its wall and CPU seconds and the recordings it made."""
    from taichi_plan.explore.maxbatch import fake_recorder, max_batch
    from taichi_plan.trace.devices import get_profile

    _label, ranks, sizes = case
    sizes = {k: v for k, v in sizes.items() if k != "batch"}
    budget_bytes = budget_bytes or get_profile(PROFILE).memory_bytes
    record = fake_recorder("llama", device_profile=PROFILE, fsdp=ranks, **sizes)
    result, wall_s, cpu_s = _timed(max_batch, record, budget_bytes, method=method, time_limit=TIME_LIMIT_S,
                                   compared=compared, guide=guide)
    result.update(wall_s=round(wall_s, 1), cpu_s=round(cpu_s, 1))
    return result


def maxbatch_table(case, result: dict) -> str:
    from taichi_plan.explore.maxbatch import guide_notes

    label, ranks, sizes = case
    rows = []
    for r in result["planners"]:
        name = NAMES.get(r["planner"], f"ours ({r['planner']}: activations, partitions, reshard and prefetch)")
        peak = f"{r['peak_bytes'] / 1e9:.2f}" if r["peak_bytes"] else "-"
        extra = "-" if r["extra_pct"] is None else f"{r['extra_pct']:.1f}"
        guess = "-" if r["guess"] is None else r["guess"]
        rows.append(f"| {name} | {r['max_batch']} | {peak} | {extra} | {guess} |")
    notes = [r["excluded"] for r in result["planners"] if r.get("excluded")] + guide_notes(result)
    return (f"{label}, {ranks} ranks (seq {sizes['seq']}, {sizes['dtype']}, AdamW) at "
            f"{result['budget_bytes'] / 1e9:.2f} GB per rank, extra compute at most {result['max_overhead_pct']:g}%: "
            f"{len(result['batches_recorded'])} recordings (batch "
            f"{', '.join(map(str, result['batches_recorded']))}), {result['wall_s']} s ({result['cpu_s']} s CPU).\n\n"
            "| planner | max batch per rank | peak GB | extra % | guess |\n|---|---|---|---|---|\n"
            + "\n".join(rows) + "".join(f"\n\n{n}" for n in notes))


def maxbatch_section(cases=(*CASES, *NO_KV_CASES)) -> str:
    return "\n\n".join(maxbatch_table(case, maxbatch_rows(case)) for case in cases)


def section() -> str:
    return ("## Sharded: rank 0 of an FSDP2 job (fake, h100-80gb)\n\n" + __doc__.split("\n\n", 1)[1].strip()
            + "\n\n" + record_section() + "\n\n### Largest batch per rank\n\n" + maxbatch_section())


def main() -> None:
    part = sys.argv[1] if len(sys.argv) > 1 else "all"
    print({"record": record_section, "maxbatch": maxbatch_section}.get(part, section)())


if __name__ == "__main__":
    main()
