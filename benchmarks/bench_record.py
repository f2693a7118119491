"""Recorder speed: fake GPT-2 small (b8, s1024) and GPT-2 XL (1.5B), and a real mlp.

``python -m benchmarks.bench_record`` prints one row per workload; ``run()`` returns them as
dicts {workload, mode, ops, seconds, peak_bytes}. Seconds are wall time of
``record_workload`` (warm-up step + 2 recorded steps + tables), in a process that has
already imported torch and transformers.
"""

from __future__ import annotations

import time

CASES = [
    ("gpt2-small b8 s1024", "gpt2", {"batch": 8, "seq": 1024}, True),
    ("gpt2-xl b8 s1024", "gpt2", {"batch": 8, "seq": 1024, "layers": 48, "hidden": 1600, "heads": 25}, True),
    ("mlp b64", "mlp", {"batch": 64}, False),
]


def run() -> list[dict]:
    import transformers  # noqa: F401  (import cost is not the recorder's)

    from taichi_plan.record import get_workload, record_workload
    from taichi_plan.trace.format import baseline_peak

    rows = []
    for label, model, sizes, fake in CASES:
        workload = get_workload(model=model, **sizes)
        t0 = time.perf_counter()
        trace = record_workload(workload, fake=fake)
        seconds = time.perf_counter() - t0
        rows.append(
            {
                "workload": label,
                "mode": "fake" if fake else "real",
                "ops": len(trace.ops),
                "seconds": round(seconds, 2),
                "peak_bytes": baseline_peak(trace)[0],
            }
        )
    return rows


def main() -> None:
    rows = run()
    print(f"{'workload':<22}{'mode':<6}{'ops':>8}{'seconds':>9}{'peak GB':>10}")
    for r in rows:
        print(f"{r['workload']:<22}{r['mode']:<6}{r['ops']:>8}{r['seconds']:>9.2f}{r['peak_bytes'] / 1e9:>10.2f}")


if __name__ == "__main__":
    main()
