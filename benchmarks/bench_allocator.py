"""What the allocator model costs and predicts on large traces (docs/allocator.md).

``python -m benchmarks.bench_allocator`` records two fake GPT-2 traces (14k and 94k ops), times
the unplanned schedule, the allocator model (1 and 2 passes, expandable segments) and a
heuristic solve at 50%, and prints allocated and reserved peaks. Model predictions, not
measurements of a GPU.
"""

from __future__ import annotations

import time

TRACES = [
    ("GPT-2 XL b8 s1024", {"batch": 8, "seq": 1024, "layers": 48, "hidden": 1600, "heads": 25}),
    ("GPT-2 320 layers h256 b8 s256", {"batch": 8, "seq": 256, "layers": 320, "hidden": 256, "heads": 4}),
]
GIB = 2**30


def main() -> None:
    from taichi_plan.problem.core import build_problem
    from taichi_plan.record import get_workload, record_workload
    from taichi_plan.simulate.allocator import AllocatorConfig, replay_schedule
    from taichi_plan.simulate.core import build_schedule
    from taichi_plan.solve import solve

    for label, flags in TRACES:
        trace = record_workload(get_workload(model="gpt2", **flags), fake=True, device_profile="a100-40gb")
        problem = build_problem(trace)
        t0 = time.perf_counter()
        schedule = build_schedule(problem, [])
        t1 = time.perf_counter()
        times, results = {}, {}
        for name, cfg in (("2 passes", AllocatorConfig()), ("1 pass", AllocatorConfig(passes=1)),
                          ("expandable", AllocatorConfig(expandable_segments=True))):
            s = time.perf_counter()
            results[name] = replay_schedule(schedule, cfg)
            times[name] = time.perf_counter() - s
        s = time.perf_counter()
        plan = solve(trace, int(problem.baseline_peak[0] * 0.5), "heuristic", problem=problem)
        solve_s = time.perf_counter() - s
        r, p = results["2 passes"], plan.predicted
        print(f"{label}: {problem.num_ops} ops; unplanned schedule {t1 - t0:.2f} s; allocator model "
              + ", ".join(f"{k} {v:.2f} s" for k, v in times.items()))
        print(f"  unplanned: tensors {problem.baseline_peak[0] / GIB:.3f} GiB, blocks {r.allocated_peak_bytes / GIB:.3f} "
              f"GiB, reserved {r.reserved_peak_bytes / GIB:.3f} GiB (expandable "
              f"{results['expandable'].reserved_peak_bytes / GIB:.3f}), {r.segments} segments")
        print(f"  heuristic at 50% ({solve_s:.1f} s with make_plan): tensors {p['planned_peak_bytes'] / GIB:.3f} GiB, "
              f"reserved {p['planned_reserved_peak_bytes'] / GIB:.3f} GiB")


if __name__ == "__main__":
    main()
