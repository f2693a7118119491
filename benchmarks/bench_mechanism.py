"""One plan's drops run by both mechanisms issue 8 weighs: our per-tensor runtime, and PyTorch's
``torch.utils.checkpoint`` with a ``create_selective_checkpoint_contexts`` policy per block.

``python -m benchmarks.bench_mechanism REPS MODEL ... [--frac F]`` (models by key: gpt2 bert
llama vit; default F 0.75): per model, bench_replay's sizes are recorded (one torch thread) and
solved at F of the trace's peak; the plan's partitions are left out (selective checkpointing
has none), so both run the same drops:

* ``ours``: the plan applied by the runtime (``MeasuredRun``, as ``taichi-plan replay``);
* ``sac``: each repeated block (bench_replay's ``find_blocks``) run under non-reentrant
  ``checkpoint`` with a policy built from the plan: an op of the block whose output the plan
  drops ``PREFER_RECOMPUTE``, an in-place op ``PREFER_RECOMPUTE`` (a saved in-place result
  fails at backward), every other op ``MUST_SAVE``. The policy counts the block's ops as
  selective checkpointing sees them (the runtime's counted ops) and checks each op's name
  against the trace; drops outside the blocks are not applied (counted, printed).

Each is built from one seed, its peak measured by the recorder (every live storage), then
stepped REPS times interleaved with plain; step times are the thread's CPU time, medians.
Prints peak and step per mechanism, with the load: on a loaded machine the times are noise.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def block_ops(trace, blocks: list[str]) -> dict[str, list[int]]:
    """Per block: the op ids of its forward in the first grad-enabled model call, counted ops
    only, in order (what a selective-checkpoint policy of that block is called on)."""
    from taichi_plan.problem import grad_model_calls
    from taichi_plan.replay import counted_ops

    call = grad_model_calls(trace.meta)[0]
    counted = counted_ops(trace)
    modules, phases = trace.ops["module"].tolist(), trace.ops["phase"].tolist()
    out: dict[str, list[int]] = {b: [] for b in blocks}
    for i in range(int(call["start"]), int(call["end"]) + 1):
        if not counted[i] or phases[i] != "forward":
            continue
        for b in blocks:
            if modules[i] == b or modules[i].startswith(b + "."):
                out[b].append(i)
    return out


def plan_policy(ops: list[int], names: list[str], dropped: set[int], mismatches: list[str]):
    """A ``create_selective_checkpoint_contexts`` policy for one call of a block whose forward
    is ``ops`` (trace op ids): recompute what ``dropped`` holds and in-place ops, save the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    seen = {False: 0, True: 0}  # ops so far, in the forward and in the recompute

    def policy(ctx, func, *args, **kwargs):
        k = seen[ctx.is_recompute]
        seen[ctx.is_recompute] += 1
        name = str(func)
        if k >= len(ops) or names[ops[k]] != name:
            mismatches.append(f"op {k}: {name}")
            return CheckpointPolicy.MUST_SAVE
        if ops[k] in dropped or name.split(".")[-2].endswith("_"):
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return policy


def sac_workload(workload, trace, plan, mismatches: list[str]):
    """``workload`` whose ``build`` wraps each block in checkpoint with the plan's policy;
    returns it and the number of the plan's drops outside every block."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from benchmarks.bench_replay import _no_cache, find_blocks

    model0, *_ = workload.build(False)
    blocks = find_blocks(model0)
    del model0
    by_block = block_ops(trace, blocks)
    dropped = {int(r.op) for r in plan.recompute}
    inside = set().union(*map(set, by_block.values())) if by_block else set()
    names = trace.ops["op"].tolist()
    build = workload.build

    def build_wrapped(fake: bool):
        model, batch, loss_fn, optimizer = build(fake)
        for b in blocks:
            module = model.get_submodule(b)
            forward = module.forward

            def checkpointed(*args, _forward=forward, _ops=by_block[b], **kwargs):
                args, kwargs = _no_cache(args, kwargs)
                ctx = functools.partial(create_selective_checkpoint_contexts,
                                        plan_policy(_ops, names, dropped, mismatches))
                return checkpoint(_forward, *args, use_reentrant=False, context_fn=ctx, **kwargs)

            module.forward = checkpointed
        return model, batch, loss_fn, optimizer

    return dataclasses.replace(workload, build=build_wrapped), len(dropped - inside)


def main(models: list[str], reps: int, frac: float) -> None:
    import torch
    import transformers  # noqa: F401  (import cost is nobody's)

    from benchmarks.bench_replay import MODELS
    from taichi_plan.plan import save_plan
    from taichi_plan.record import get_workload, record_workload
    from taichi_plan.replay import plan_and_trace
    from taichi_plan.replay.measure import MeasuredRun
    from taichi_plan.solve import solve
    from taichi_plan.trace import baseline_peak, read_trace, write_trace

    torch.set_num_threads(1)
    for key in models:
        label = next(k for k, v in MODELS.items() if v.model == key)
        wl = get_workload(model=key, **MODELS[label].sizes)
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            trace = read_trace(write_trace(record_workload(wl, fake=False), tmp / "trace", force=True))
            plan = solve(trace, int(frac * baseline_peak(trace)[0]), "auto", time_limit=20.0, seed=0)
            plan = dataclasses.replace(plan, partitions=[])  # the drops alone: SAC has no partitions
            plan, ptrace = plan_and_trace(save_plan(plan, tmp / "p.plan.json", force=True))
            mismatches: list[str] = []
            sac, outside = sac_workload(wl, trace, plan, mismatches)
            runs = {"plain": MeasuredRun(wl, None, None, 0, "cpu"), "ours": MeasuredRun(wl, plan, ptrace, 0, "cpu"),
                    "sac": MeasuredRun(sac, None, None, 0, "cpu")}
            peaks = {n: int(r.measure_peak()["peak_bytes"]) for n, r in runs.items()}
            names = list(runs)
            for r in range(reps):
                for i in range(len(names)):
                    n = names[(r + i) % len(names)]
                    t0 = time.thread_time()
                    runs[n].one_step()
                    runs[n].step_s.append(time.thread_time() - t0)
            step = {n: statistics.median(r.step_s) for n, r in runs.items()}
            print(f"== {label}: {len(plan.recompute)} drops at {frac} of the trace peak "
                  f"({outside} outside the blocks, not applied by sac); sac policy mismatches: {len(mismatches)}"
                  f"{' (first: ' + mismatches[0] + ')' if mismatches else ''}; load {os.getloadavg()[0]:.1f}")
            for n in names:
                print(f"  {n:6s} peak {peaks[n] / 2**20:8.2f} MiB ({peaks[n] / peaks['plain']:.3f} of plain)  "
                      f"step {step[n] * 1e3:7.1f} ms ({step[n] / step['plain']:.3f} of plain)", flush=True)
            for run in runs.values():
                run.close()


if __name__ == "__main__":
    args = sys.argv[1:]
    frac = 0.75
    if "--frac" in args:
        i = args.index("--frac")
        frac = float(args[i + 1])
        del args[i:i + 2]
    main(args[1:], int(args[0]), frac)
