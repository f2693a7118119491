"""Replay a sharded or DDP plan for real: N gloo ranks on this machine (``replay --nproc N``).

Each rank is a process (forked by multiprocessing's forkserver, :func:`spawn_ranks`) joined
over loopback TCP with the gloo backend (CPU); it builds the plan's workload from the same
seed, shards it as the trace's layout says (:func:`taichi_plan.record.fsdp.shard_model`), or wraps it in DDP with
the recorded bucket settings (:func:`taichi_plan.record.ddp.wrap_as_recorded`; DDP's buckets
are registered for the measured step, as the recording did), and runs it twice, each
from the same initial state: unplanned, then with the plan applied (``apply`` hooks the root
FSDP module's calls exactly as in one process). Each run takes one unplanned warm-up step,
``steps`` steps, and one more under the recorder, whose live-storage accounting (``resize_``
seen) gives that rank's measured peak. Each rank reports its measured peaks and whether its
gradient shards (and parameter shards after the optimizer step) are bitwise equal to the
unplanned run's. The live model's layout must be the plan's (world size, units,
``reshard_after_forward``), else the plan is refused.

The plan's trace is rank 0's step: every rank runs the same program on the same batch, so
every rank's peak is predicted by it (a job whose ranks differ, e.g. uneven shards, would
need a trace per rank).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..base.errors import PlanError, TaichiError
from ..plan.format import Plan
from ..torch_common.processes import init_gloo, spawn_ranks


def _sharded_run(workload, trace, plan: Plan | None, mesh, nproc: int, seed: int, steps: int) -> dict:
    """One run on this rank: build from ``seed``, shard as the trace's layout, warm up
    unplanned, apply ``plan`` (None: unplanned), ``steps`` steps, one measured step."""
    import torch

    from ..record import ddp as ddp_record
    from ..record.api import Loop, late_tensors, make_step_fn, registered_tensors, step_to_trace
    from ..record.fsdp import rebuild_optimizer, shard_model
    from ..record.recorder import Recorder
    from ..record.recorder.storages import local_tensor
    from ..runtime.calls import runtime_for
    from ..runtime.install import install
    from ..runtime.partition import install_partitions
    from ..torch_common.fsdp import live_layout, live_prefetch, recorded_mixed_precision
    from ..trace.format import baseline_peak
    from . import apply_sharding

    ddp = trace.meta.get("ddp")
    torch.manual_seed(seed)
    model, batch, loss_fn, optimizer = workload.build(False)
    if ddp is not None:
        runner = ddp_record.wrap_as_recorded(model, ddp)
    else:
        units = (trace.meta.get("fsdp") or {}).get("units", [])
        setting = {u["module"]: u["reshard_after_forward"] for u in units}  # as recorded, per unit
        if plan is not None and plan.reshard:  # an int the plan sets: FSDP2 takes one only in fully_shard
            setting.update({u["module"]: u["reshard_after_forward"] for u in plan.reshard["units"]
                            if not isinstance(u["reshard_after_forward"], bool)})
        shard_model(model, mesh, setting, mixed_precision=recorded_mixed_precision(trace.meta))
        optimizer = rebuild_optimizer(optimizer, model)
        runner = model
    loop = Loop.from_meta(trace.meta)
    step = make_step_fn(runner, batch, loss_fn, optimizer, where=workload.name, loop=loop)
    # warm-up, unplanned: FSDP's lazy init, optimizer state; DDP's first step and the one after
    # its bucket rebuild, which shows its buckets
    warmup = max(int(trace.meta.get("warmup_steps", 2)), 2) if ddp is not None else 1
    extra = []
    for w in range(warmup):
        optimizer.zero_grad(set_to_none=loop.set_to_none)
        if ddp is not None and w == warmup - 1:
            extra = [(ddp_record.BUCKET_KIND, ddp_record.bucket_tensors(step))]
        else:
            step()
    handles = []
    rt = None
    unshard = None
    if plan is not None:
        rt = runtime_for(plan, trace)
        unshard = apply_sharding(runner, plan, "replay")  # the plan's reshard_after_forward per unit
        handles = install(model, rt, optimizer)
        undo_parts = install_partitions(model, plan.partitions, rt)
        handles.append(_Undo(undo_parts))
    try:
        first_grads = None
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=loop.set_to_none)
            step()
            grads = [local_tensor(p.grad).clone() if p.grad is not None else None for p in model.parameters()]
            first_grads = grads if first_grads is None else first_grads
        params = None
        remeasured = -1
        while remeasured < MEASURE_TRIES - 1:
            remeasured += 1
            recorder = Recorder(None, model)
            hooks = recorder.optimizer_hooks(optimizer)
            try:
                optimizer.zero_grad(set_to_none=loop.set_to_none)
                recorder.begin_step(registered_tensors(model, batch, loss_fn, optimizer) + extra)
                with recorder:
                    step()
                rec = recorder.end_step(late_tensors(model, optimizer))
            finally:
                for h in hooks:
                    h.remove()
                recorder.close()
            if params is None:  # after the first measured step: a re-measured one trains once more
                params = [local_tensor(p.detach()).clone() for p in model.parameters()]
            peak, peak_op = baseline_peak(step_to_trace(rec, 0, "measured", {}))
            if not _raced(rec, recorder.offthread_freed, peak_op):
                break
        # as the measured step ran: the plan's reshard_after_forward (DDP has no units)
        units = live_layout(model)["units"] if ddp is None else []
        prefetch = live_prefetch(model) if ddp is None else {}
    finally:
        for h in handles:
            h.remove()
        if unshard is not None:
            unshard()
    return {"peak_bytes": peak, "peak_op": peak_op, "grads": grads, "first_grads": first_grads, "params": params,
            "remeasured": remeasured,
            "dropped": rt.dropped_storages if rt is not None else 0,
            "recompute_ops": rt.recompute_ops if rt is not None else 0,
            "mismatches": rt.mismatches if rt is not None else 0, "units": units, "prefetch": prefetch}


MEASURE_TRIES = 3  # measured steps at most per run, while a thread race may have moved the peak


def _raced(rec, offthread: list[int], peak_op: int) -> bool:
    """Did a storage that gloo's worker thread freed (``Recorder.offthread_freed``) live at
    the measured peak on any rank? Such a storage dies when the worker lets go of a finished
    collective, which races with the step's own code dropping it (seen: an FSDP2 all-gather
    buffer held 0.37 MB past the next all-gather once in about 15 runs), so that step's peak
    is not the step's own: the run measures one more. Every rank measures as many steps (the
    answer is all-reduced), so their collectives stay matched."""
    import torch
    import torch.distributed as dist

    t = rec.tensors
    hit = any(t["alloc_op"][i] <= peak_op <= t["free_op"][i] for i in offthread)
    if not dist.is_initialized():
        return hit
    flag = torch.tensor([int(hit)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


class _Undo:
    """A function to call on removal, among hook handles."""

    def __init__(self, fn):
        self.remove = fn


def replay_rank(rank: int, nproc: int, port: int, out_dir: str, plan_path: str, trace_path: str,
                 steps: int, seed: int) -> None:
    import torch.distributed as dist

    from ..runtime.calls import plan_and_trace
    from ..torch_common.fsdp import mesh_replicas
    from ..trace.format import read_trace
    from .measure.compare import autocast_rounding, compare_training
    from .measure.workload import workload_of

    out: dict = {"rank": rank}
    try:
        recorded = read_trace(trace_path)
        mesh = init_gloo(rank, nproc, port, mesh_replicas(recorded.meta))  # HSDP: the recorded 2-D mesh
        try:
            plan, trace = plan_and_trace(plan_path, recorded)
            workload = workload_of(trace)
            base = _sharded_run(workload, trace, None, mesh, nproc, seed, steps)
            planned = _sharded_run(workload, trace, plan, mesh, nproc, seed, steps)
            # a module checkpointed whole (one chunk) re-runs the same ops on the same values
            compared = compare_training(base, planned, exact=all(p.chunks == 1 for p in plan.partitions),
                                        rounding=autocast_rounding(plan, trace))
            same, check = compared["matched"], compared["grads_check"]
            out.update({
                "measured_peak_bytes": planned["peak_bytes"], "measured_peak_op": planned["peak_op"],
                "baseline_measured_peak_bytes": base["peak_bytes"],
                "grads_match": same["grads"], "params_match": same["params"], "grads_check": check,
                "dropped_storages": planned["dropped"], "recompute_ops": planned["recompute_ops"],
                "mismatches": planned["mismatches"],
                # measured steps the run added because a thread race may have moved the peak (_raced)
                "remeasured_steps": {"unplanned": base["remeasured"], "planned": planned["remeasured"]},
                "reshard_after_forward": [[m or "<root>", r] for m, r in planned["units"]],
                "fsdp_prefetch": planned["prefetch"],  # as the measured step ran (FSDP's defaults left out)
            })
        finally:
            dist.destroy_process_group()
    except TaichiError as e:
        out["error"] = f"rank {rank}: {e}"
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(out))


def replay_sharded(plan: Plan | str | Path, nproc: int, steps: int = 2, seed: int = 0, *, trace=None) -> dict:
    """Replay a plan of a sharded trace on ``nproc`` gloo ranks here; returns the report:
    per rank the measured peak against the predicted one and whether gradient and parameter
    shards equal the unplanned run's bitwise."""
    from ..runtime.calls import plan_and_trace

    plan, tr = plan_and_trace(plan, trace)
    lay = plan.trace.get("layout")
    if lay is None:
        raise PlanError("replay --nproc runs a sharded or DDP job, but this plan's trace is one process: record it "
                        "with `taichi-plan record --fsdp N` (or `--ddp N`) and solve again, or replay it without "
                        "--nproc.")
    flag = "--ddp" if lay.get("ddp") is not None else "--fsdp"
    if lay["world_size"] != nproc:
        raise PlanError(f"The plan was solved for rank 0 of {lay['world_size']} ranks; replay --nproc {nproc} would "
                        f"run another layout. Use --nproc {lay['world_size']}, or record with {flag} {nproc}.")
    if steps < 1:
        raise PlanError(f"--steps must be at least 1, got {steps}.")
    if plan.source is None:
        raise PlanError("replay_sharded needs a plan saved to a file (each rank loads it).")
    ranks = spawn_ranks(nproc, "taichi_plan.replay.distributed:replay_rank", {"plan_path": str(plan.source), "trace_path": str(tr.path),
                                                "steps": steps, "seed": seed})
    pred = plan.predicted["planned_peak_bytes"]
    measured = max(r["measured_peak_bytes"] for r in ranks)
    for r in ranks:
        r["peak_ratio"] = r["measured_peak_bytes"] / pred if pred else None
        r["within_budget"] = plan.budget_bytes is None or r["measured_peak_bytes"] <= plan.budget_bytes
    return {
        "plan": plan.trace.get("name"),
        "nproc": nproc,
        "backend": "gloo",
        "parallelism": "DDP" if flag == "--ddp" else "FSDP2",
        "budget_bytes": plan.budget_bytes,
        "predicted_peak_bytes": pred,
        "measured_peak_bytes": measured,  # the largest rank's
        "steps": steps,
        "baseline_predicted_peak_bytes": plan.predicted["baseline_peak_bytes"],
        "ranks": ranks,
        "grads_match": all(r["grads_match"] and r["params_match"] for r in ranks),
        "within_budget": all(r["within_budget"] for r in ranks),
        "grads_check": ranks[0].get("grads_check", "") + (": the plan splits modules into chunks"
                                                            if any(p.chunks > 1 for p in plan.partitions) else "")
                       + " on each rank's local gradient and parameter " + ("tensors" if flag == "--ddp" else "shards"),
    }


