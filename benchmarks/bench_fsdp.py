"""Sharded planning at scale: rank 0 of Llama-style 7B on 8 ranks and 70B on 64 ranks (FSDP2,
fake, h100-80gb), recorded and solved.

``python -m benchmarks.bench_fsdp`` prints the rows; ``section()`` is the ``make bench``
section. Each recording runs ``taichi-plan record --fsdp N --fake`` in its own process (a
process group is global state); ``record_s`` is that process's wall time, imports included.
Per row: the trace's peak against ``FSDPMemTracker``'s on the same step, and at a budget of
60% of the per-rank peak the plan of ``auto`` (``solve_s``: its wall time) beside FSDP's
default (no activation plan: the trace's own peak) and FSDP with every block checkpointed
(the ``full`` baseline). Fake traces hold CPU attention kernels (the O(s^2) attention matrix
a GPU's fused kernels never allocate).
"""

from __future__ import annotations

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
BUDGET = 0.6
TIME_LIMIT_S = 30.0


def record(sizes: dict, ranks: int, out: Path) -> float:
    args = [a for k, v in sizes.items() for a in (f"--{k}", str(v))]
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "taichi_plan", "record", "--model", "llama", *args, "--fake",
                        "--fsdp", str(ranks), "--device-profile", "h100-80gb", "-o", str(out)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    return time.perf_counter() - t0


def run(cases=CASES) -> list[dict]:
    from taichi_plan.record.fsdp import trace_by_tracker_category
    from taichi_plan.solve import solve
    from taichi_plan.trace import read_trace

    rows = []
    with tempfile.TemporaryDirectory() as d:
        for label, ranks, sizes in cases:
            record_s = record(sizes, ranks, Path(d) / "t")
            trace = read_trace(Path(d) / "t")
            peak, _, _ = trace_by_tracker_category(trace)
            budget = int(BUDGET * peak)
            t0 = time.perf_counter()
            auto = solve(trace, budget, "auto", time_limit=TIME_LIMIT_S)
            solve_s = time.perf_counter() - t0
            full = solve(trace, 10**15, "full")
            kept = [u["module"] for u in (auto.reshard or {}).get("units", []) if not u["reshard_after_forward"]]
            rows.append({
                "workload": label, "ranks": ranks, "ops": len(trace.ops), "record_s": round(record_s, 1),
                "units_kept_gathered": len(kept), "units": len((auto.reshard or {}).get("units", [])),
                "allgather_saved_s": (auto.reshard or {}).get("step_compute_saved") or 0.0,
                "solve_s": round(solve_s, 1), "peak_bytes": peak,
                "tracker_peak_bytes": trace.meta["fsdp"]["mem_tracker"]["peak_bytes"],
                "budget_bytes": budget, "planned_peak_bytes": auto.predicted["planned_peak_bytes"],
                "planned_extra_pct": auto.predicted.get("extra_compute_pct"), "status": auto.solver["status"],
                "full_peak_bytes": full.predicted["planned_peak_bytes"],
                "full_extra_pct": full.predicted.get("extra_compute_pct"),
            })
    return rows


def _gb(x) -> str:
    return f"{x / 1e9:.2f}"


def section() -> str:
    rows = run()
    head = ("## Sharded: rank 0 of an FSDP2 job (fake, h100-80gb)\n\n" + __doc__.split("\n\n", 1)[1].strip()
            + "\n\n| workload | ranks | ops | record s | solve s | peak GB | FSDPMemTracker GB | budget GB | auto GB "
              "(extra %) | auto: units kept gathered (all-gather ms saved) | every block checkpointed GB (extra %) |"
              "\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    table = head + "\n".join(
        f"| {r['workload']} | {r['ranks']} | {r['ops']} | {r['record_s']} | {r['solve_s']} | {_gb(r['peak_bytes'])} | "
        f"{_gb(r['tracker_peak_bytes'])} | {_gb(r['budget_bytes'])} | {_gb(r['planned_peak_bytes'])} "
        f"({r['planned_extra_pct']:.1f}, {r['status']}) | {r['units_kept_gathered']} of {r['units']} "
        f"({1e3 * r['allgather_saved_s']:.2f}) | {_gb(r['full_peak_bytes'])} ({r['full_extra_pct']:.1f}) |"
        for r in rows) + ("\n\nNot measured here: the largest batch per rank on 80 GB at these sizes. `maxbatch "
                          "--fsdp N` searches it, but each probe is a fake recording of minutes; below, at a small "
                          "size.")
    return table + "\n\n" + maxbatch_section()


# The largest batch per rank, at a small size (each probe is a fake recording): FSDP's default
# (every unit resharding, no activation plan), FSDP + every block checkpointed, and ours (the
# activation plan and each unit's reshard_after_forward).
SMALL = ("Llama-style 4 x 256", 8, {"layers": 4, "hidden": 256, "heads": 4, "vocab": 1000, "seq": 256})
SMALL_BUDGET = 64 * 10**6


def maxbatch_rows(case=SMALL, budget_bytes: int = SMALL_BUDGET, method: str = "heuristic") -> dict:
    from taichi_plan.maxbatch import fake_recorder, max_batch

    _label, ranks, sizes = case
    record = fake_recorder("llama", device_profile="h100-80gb", fsdp=ranks, **sizes)
    return max_batch(record, budget_bytes, method=method, time_limit=TIME_LIMIT_S)


def maxbatch_section(case=SMALL, budget_bytes: int = SMALL_BUDGET) -> str:
    result = maxbatch_rows(case, budget_bytes)
    label, ranks, _ = case
    names = {"none": "FSDP default (every unit reshards, no activation plan)", "full": "FSDP + every block checkpointed",
             "sqrt-n": "FSDP + sqrt(n) checkpointing", "dtr": "FSDP + DTR's greedy"}
    rows = []
    for r in result["planners"]:
        name = names.get(r["planner"], r["planner"] + " (ours: activations and reshard_after_forward)")
        peak = f"{r['peak_bytes'] / 1e6:.1f}" if r["peak_bytes"] else "-"
        extra = "-" if r["extra_pct"] is None else f"{r['extra_pct']:.1f}"
        rows.append(f"| {name} | {r['max_batch']} | {peak} | {extra} |")
    return (f"Largest batch per rank of {label} (`maxbatch --fsdp {ranks}`, fake, h100-80gb, seq "
            f"{case[2]['seq']}) at {budget_bytes / 1e6:g} MB per rank, extra compute at most "
            f"{result['max_overhead_pct']:g}%:\n\n| planner | max batch | peak MB | extra % |\n|---|---|---|---|\n"
            + "\n".join(rows))


def main() -> None:
    print(section())


if __name__ == "__main__":
    main()
