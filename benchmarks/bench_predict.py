"""Predicted against measured extra time per plan, in CPU time, phases split (issue 8).

``python -m benchmarks.bench_predict REPS MODEL ... [--partitions]`` (models by key: llama
gpt2 bert vit resnet50): per model, the bench_replay sizes are recorded (one torch thread),
solved at the trace-peak fractions of :data:`FRACS` (with ``--partitions``, also plans that
only partition, :func:`partition_plans`), and plain and every plan are stepped REPS times,
interleaved; forward, backward and optimizer are timed in the thread's CPU time
(``time.thread_time``, so a loaded machine's waits are not counted), with minor page faults
(``getrusage``) and the runtime's rebuild seconds. Prints predicted vs measured extra per plan.
A diagnostic: the replay section of ``make bench`` (bench_replay) is the one the docs report.
"""

from __future__ import annotations

import gc
import os
import resource
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

FRACS = {"gpt2": [0.62, 0.75], "bert": [0.71, 0.86], "vit": [0.80, 0.90], "llama": [0.77, 0.90],
         "resnet50": [0.90, 0.95, 0.97]}
TIME_LIMIT = 20.0


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def phased(run) -> dict:
    """One step of a MeasuredRun, its phases timed in CPU time."""
    from taichi_plan.torch_common.step import call_model

    run.optimizer.zero_grad(set_to_none=run.loop.set_to_none)
    if run.rt is not None:
        run.rt.reset_counters()
    f0, t0 = _minflt(), time.thread_time()
    out = call_model(run.model, run.batch)
    loss = run.loss_fn(out, run.batch)
    del out
    t1, f1 = time.thread_time(), _minflt()
    loss.backward()
    del loss
    t2, f2 = time.thread_time(), _minflt()
    run.optimizer.step()
    t3 = time.thread_time()
    rec = run.rt.recompute_s if run.rt is not None else 0.0
    return dict(fw=t1 - t0, bw=t2 - t1, opt=t3 - t2, tot=t3 - t0, rec=rec, flt_fw=f1 - f0, flt_bw=f2 - f1)


def partition_plans(trace, chunks=(1, 2, 4)) -> dict:
    """Plans that only partition, to check partition costs apart from drops: the modules the
    planner may split along the batch that calibration did not time, nor their ancestors (so
    the check is not circular: ``meta.runtime_overhead.partition_probe``), disjoint, most ops
    first (on a transformer: each block's attention and MLP rather than the block), each
    split into ``chunks`` (random ones too, their chunks drawing their own numbers)."""
    import dataclasses

    from taichi_plan.problem.core import build_problem
    from taichi_plan.problem.partition.find import partitionable_spans
    from taichi_plan.problem.partition.qualify import allow_random, random_draws
    from taichi_plan.problem.partition.span import as_partition
    from taichi_plan.runtime.calls import counted_ops
    from taichi_plan.solve.result import Decisions, make_plan

    problem = allow_random(build_problem(trace), True)
    probed = set((trace.meta["runtime_overhead"].get("partition_probe") or {}).get("modules", ()))
    runs_ops = set(trace.ops["module"])  # (a container such as a ModuleList is never called: no op of its own)
    counted = counted_ops(trace)  # (replay locates a module by its first and last counted op)
    chosen: list = []
    for s in sorted((s for s in partitionable_spans(problem) if s.over == "batch" and s.split and s.module in runs_ops
                     and counted[s.fwd[0]] and counted[s.fwd[1]]
                     and not any(m == s.module or m.startswith(s.module + ".") for m in probed)),
                    key=lambda s: (s.fwd[0] - s.fwd[1], s.module)):
        if all(s.fwd[1] < c.fwd[0] or s.fwd[0] > c.fwd[1] for c in chosen):
            chosen.append(s)
    out = {}
    for k in (k for k in chunks if all(k <= s.batch for s in chosen)):
        parts = [dataclasses.replace(as_partition(s, k), random_draws=random_draws(problem, s, k)) for s in chosen]
        out[f"parts/{k}"] = make_plan(problem, None, "partitions", Decisions(partitions=parts), 0.0, 0)
    return out


def main(models: list[str], reps: int, partitions: bool = False) -> list[dict]:
    import torch
    import transformers  # noqa: F401  (import cost is nobody's)

    import taichi_plan.runtime.mode.rebuilds as rebuilds
    from benchmarks.bench_replay import MODELS
    from taichi_plan.plan.format import save_plan
    from taichi_plan.record import get_workload, record_workload
    from taichi_plan.replay.measure.run import MeasuredRun
    from taichi_plan.runtime.calls import plan_and_trace
    from taichi_plan.solve import solve
    from taichi_plan.trace.format import baseline_peak, read_trace, write_trace

    torch.set_num_threads(1)
    rebuilds.time = types.SimpleNamespace(perf_counter=time.thread_time)  # rebuild timers in CPU time too
    out = []
    tally = {True: 0, False: 0}
    for key in models:
        label = next(k for k, v in MODELS.items() if v.model == key)
        spec = MODELS[label]
        wl = get_workload(model=spec.model, **spec.sizes)
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            trace = read_trace(write_trace(record_workload(wl, fake=False), tmp / "trace", force=True))
            peak = int(baseline_peak(trace)[0])
            runs = {"plain": MeasuredRun(wl, None, None, 0, "cpu")}
            preds = {}
            plans = {f"@{f}": solve(trace, int(f * peak), "auto", time_limit=TIME_LIMIT, seed=0) for f in FRACS[key]}
            plans.update(partition_plans(trace) if partitions else {})
            for name, plan in plans.items():
                plan, ptrace = plan_and_trace(save_plan(plan, tmp / f"{name.replace('/', '_')}.plan.json", force=True))
                p = plan.predicted
                preds[name] = dict(extra=p["extra_time"], compute=p["extra_compute"], rt=p["runtime_overhead"],
                                   part=p["partition_compute"], drops=len(plan.recompute), rops=p["recompute_ops"],
                                   parts=" ".join(f"{x.module}{'~t' if x.over == 'tokens' else ''}/{x.chunks}"
                                                  for x in plan.partitions) or "-")
                runs[name] = MeasuredRun(wl, plan, ptrace, 0, "cpu")
            names = list(runs)
            res = {n: [] for n in names}
            for r in range(reps):
                for i in range(len(names)):
                    n = names[(r + i) % len(names)]
                    res[n].append(phased(runs[n]))
            med = {n: {k: statistics.median(x[k] for x in res[n]) for k in res[n][0]} for n in names}
            pl = med["plain"]
            cal = trace.meta["runtime_overhead"]
            print(f"== {label}: plain fw {pl['fw'] * 1e3:.1f} bw {pl['bw'] * 1e3:.1f} opt {pl['opt'] * 1e3:.1f} ms; "
                  f"runtime us/op: " + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in cal.items() if k.endswith("_s"))
                  + f"; partitions timed on {cal.get('partition_probe')}"
                  + "".join(f"; {kind} span: redo x{c['redo_ratio']:.2f}, chunk {c['chunk_op_s'] * 1e6:.1f} us/op"
                            for kind, c in (cal.get("span_costs") or {}).items())
                  + (f"; drop_s on {cal['drop_probe']['drops']} drops" if "drop_probe" in cal else "")
                  + f"; load {os.getloadavg()[0]:.1f}", flush=True)
            for n in names[1:]:
                m, p = med[n], preds[n]
                ex = m["tot"] - pl["tot"]
                ok = abs(p["extra"] - ex) <= max(0.2 * abs(ex), 0.005)
                tally[ok] += 1
                print(f"  {n}: drops {p['drops']} rops {p['rops']} parts {p['parts']} | predicted {p['extra'] * 1e3:.1f} "
                      f"(compute {p['compute'] * 1e3:.1f} of which partitions {p['part'] * 1e3:.1f}, "
                      f"runtime {p['rt'] * 1e3:.1f}) | measured {ex * 1e3:.1f} "
                      f"[fw {1e3 * (m['fw'] - pl['fw']):+.1f} bw {1e3 * (m['bw'] - pl['bw']):+.1f} "
                      f"opt {1e3 * (m['opt'] - pl['opt']):+.1f}] rebuild {m['rec'] * 1e3:.1f} "
                      f"faults fw {m['flt_fw'] - pl['flt_fw']:+.0f} bw {m['flt_bw'] - pl['flt_bw']:+.0f} "
                      f"| {'within' if ok else 'MISS'}", flush=True)
                out.append(dict(model=label, plan=n, predicted=p, measured=m, plain=pl))
            for run in runs.values():
                run.close()
            del runs
            gc.collect()
    print(f"within 20% or 5 ms on {tally[True]} of {tally[True] + tally[False]} plans; load {os.getloadavg()}", flush=True)
    return out


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--partitions"]
    main(args[1:], int(args[0]), partitions="--partitions" in sys.argv)
