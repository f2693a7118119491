"""One plan's drops run by both mechanisms issue 8 weighs: our per-tensor runtime, and PyTorch's
``torch.utils.checkpoint`` with a ``create_selective_checkpoint_contexts`` policy per block.

``python -m benchmarks.bench_mechanism REPS MODEL ... [--frac F]`` (models by key: gpt2 bert
llama vit; default F 0.75): per model, bench_replay's sizes are recorded (one torch thread) and
solved at F of the trace's peak; the plan's partitions are left out (selective checkpointing
has none), so both run the same drops:

* ``ours``: the plan applied by the runtime (``MeasuredRun``, as ``taichi-plan replay``);
* ``sac``: each repeated block (bench_replay's ``find_blocks``) run under non-reentrant
  ``checkpoint`` with a policy built from the plan: ``MUST_SAVE`` for an op of the block
  whose output the unplanned step keeps into backward, unless the plan drops it or it is
  written in place (a saved result that is mutated fails at backward); every other op
  ``PREFER_RECOMPUTE`` (so what selective checkpointing re-runs beyond the plan's rebuilds,
  the transients before the last recomputed op, is what the mechanism costs). The policy walks the block's ops as selective checkpointing sees them
  (the runtime's counted ops), matching each live op to the trace by name (an op with no
  match is recomputed and counted); drops outside the blocks are not applied (counted,
  printed). Every run, the recording included, has the model's KV cache off
  (``config.use_cache = False``, as transformers' own checkpointing runs), so both
  mechanisms run one op stream.

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
    from taichi_plan.problem.core import grad_model_calls
    from taichi_plan.runtime.calls import counted_ops

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


# How many trace ops the policy may skip to find a live op's name: the blocks run without a KV
# cache here (as transformers' own checkpointing runs them), so the cache's ops are missing.
LOOKAHEAD = 4


def plan_policy(ops: list[int], names: list[str], save: set[int], mismatches: list[str]):
    """A ``create_selective_checkpoint_contexts`` policy for one call of a block whose forward
    is ``ops`` (trace op ids): save the ops in ``save``, recompute the rest. Each live op is
    matched to the next trace op of its name within :data:`LOOKAHEAD`; one with no match is
    recomputed and counted in ``mismatches``."""
    from torch.utils.checkpoint import CheckpointPolicy

    at = {False: 0, True: 0}  # the next trace op, in the forward and in the recompute

    def policy(ctx, func, *args, **kwargs):
        j, name = at[ctx.is_recompute], str(func)
        k = next((k for k in range(j, min(j + LOOKAHEAD + 1, len(ops))) if names[ops[k]] == name), None)
        if k is None:
            if not ctx.is_recompute:
                mismatches.append(f"op {j}: {name}")
            return CheckpointPolicy.PREFER_RECOMPUTE
        at[ctx.is_recompute] = k + 1
        return CheckpointPolicy.MUST_SAVE if ops[k] in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def no_cache(workload):
    """``workload`` whose model runs without a KV cache (``config.use_cache = False``)."""
    build = workload.build

    def build_no_cache(fake: bool):
        model, batch, loss_fn, optimizer = build(fake)
        if getattr(getattr(model, "config", None), "use_cache", None):
            model.config.use_cache = False
        return model, batch, loss_fn, optimizer

    return dataclasses.replace(workload, build=build_no_cache)


def sac_workload(workload, trace, plan, mismatches: list[str]):
    """``workload`` whose ``build`` wraps each block in checkpoint with the plan's policy;
    returns it and the number of the plan's drops outside every block."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from benchmarks.bench_replay import find_blocks, without_cache

    model0, *_ = workload.build(False)
    blocks = find_blocks(model0)
    del model0
    by_block = block_ops(trace, blocks)
    # Recomputed too: in-place ops, and ops whose output a later op writes in place (a saved
    # result that is mutated fails at backward: "cached ... has been mutated").
    writes = trace.accesses[(trace.accesses["role"] == "write")
                            & trace.accesses["op_id"].isin(trace.ops.loc[trace.ops["mutates"], "op_id"])]
    producer = dict(zip(trace.tensors["tensor_id"], trace.tensors["producer_op"], strict=True))
    dropped = {int(r.op) for r in plan.recompute}
    mutated = {int(producer[t]) for t in writes["tensor_id"]} | set(writes["op_id"].astype(int))
    # What the unplanned step keeps into backward (made in forward, freed in backward or never):
    # selective checkpointing caches every output of a saved op, so only these are saved.
    phase = trace.ops["phase"].tolist()
    t = trace.tensors
    kept = t[(t["producer_op"] >= 0) & ((t["free_op"] < 0) | t["free_op"].map(lambda f: f >= 0 and phase[f] == "backward"))]
    saved = set(kept["producer_op"].astype(int))
    inside = set().union(*map(set, by_block.values())) if by_block else set()
    names = trace.ops["op"].tolist()
    build = workload.build

    def build_wrapped(fake: bool):
        model, batch, loss_fn, optimizer = build(fake)
        for b in blocks:
            module = model.get_submodule(b)
            forward = module.forward

            def checkpointed(*args, _forward=forward, _ops=by_block[b], **kwargs):
                args, kwargs = without_cache(args, kwargs)
                ctx = functools.partial(create_selective_checkpoint_contexts,
                                        plan_policy(_ops, names, saved - dropped - mutated, mismatches))
                return checkpoint(_forward, *args, use_reentrant=False, context_fn=ctx, **kwargs)

            module.forward = checkpointed
        return model, batch, loss_fn, optimizer

    return dataclasses.replace(workload, build=build_wrapped), len(dropped - inside)


def main(models: list[str], reps: int, frac: float) -> None:
    import torch
    import transformers  # noqa: F401  (import cost is nobody's)

    from benchmarks.bench_replay import MODELS
    from taichi_plan.plan.format import save_plan
    from taichi_plan.record import get_workload, record_workload
    from taichi_plan.replay.measure.run import MeasuredRun
    from taichi_plan.runtime.calls import plan_and_trace
    from taichi_plan.solve import solve
    from taichi_plan.trace.format import baseline_peak, read_trace, write_trace

    torch.set_num_threads(1)
    for key in models:
        label = next(k for k, v in MODELS.items() if v.model == key)
        wl = no_cache(get_workload(model=key, **MODELS[label].sizes))
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
