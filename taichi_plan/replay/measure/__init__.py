"""``taichi-plan replay``: run the plan's workload unplanned and planned, and measure both.

Both runs build the workload from the same seed, run one unplanned warm-up step (so the
optimizer state exists, as in the recorded trace), then ``steps`` timed steps, then one more
step under the recorder, whose live-storage accounting is the trace's own (the same numbers
MemTracker gives): that step's peak is the measured peak. Gradients and parameters after
the last step are compared: bitwise for rematerialization alone (rebuilt ops replay their RNG
state) and for modules checkpointed whole (one chunk: the same ops re-run on the same values,
the RNG state restored); when modules are split into chunks (also where a partitioned
module's dropout draws, chunk by chunk, the whole batch's masks: ``random_draws``
"as-unpartitioned"), the first planned step's gradients ``allclose`` and the parameters after
it within a relative L2 distance, the elements whose gradient is rounding noise left out
(:func:`~.compare.compare_training`: Adam and Adagrad turn that noise into steps of their learning
rate; the distance after the last step is reported beside it), and
*statistically* when a partitioned module's chunks draw their own masks ("per-chunk",
``solve --partition-random``): a third, unplanned run reseeds the generator after its warm-up
step, and the planned run may differ from the unplanned one (relative L2 distance of all
gradients, and of all parameters) by at most ``stat_factor`` (:class:`~.config.ComparisonConfig`) times what that reseeded run
differs by: no more than other dropout masks alone make it differ.

Before building anything, the larger of the two predicted peaks (the unplanned run needs the
trace's own peak) is compared with the memory this machine has for it (free CUDA memory, or
available RAM on CPU); a replay that cannot fit is refused with both numbers unless
``force``. A fake-recorded trace costs no memory to record but replays on real tensors.

On CUDA (:func:`~.workload.replay_device`: a GPU is here and the trace was recorded on one), the workload
is moved to the GPU (:func:`~.workload.move_workload`), the cache the warm-up step left is emptied
(``torch.cuda.empty_cache`` after ``zero_grad``: the step starts from the tensors that outlive
it, as the allocator model assumes), every timed step is bracketed by
``torch.cuda.synchronize``, and the last timed step runs between
``torch.cuda.reset_peak_memory_stats`` and ``torch.cuda.max_memory_allocated`` /
``max_memory_reserved``: the caching allocator's own peaks, reported beside the plan's
predicted allocated and reserved peaks (docs/allocator.md).

The entry, :func:`replay`, and its report are here; the workload is built by :mod:`.workload`,
checked against this machine's memory by :mod:`.memory`, run and measured by :mod:`.run`, and
the two runs' training compared by :mod:`.compare`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ...base.errors import PlanError
from ...plan.format import Plan
from ...problem.optimizer.plan import plan_mode
from .compare import autocast_rounding, compare_training, statistical_check
from .config import ComparisonConfig
from .memory import check_memory, out_of_memory_said
from .run import run_and_measure
from .workload import replay_device, workload_of


def cuda_report(predicted: dict, base: dict, planned: dict) -> dict:
    """The caching allocator's measured peaks beside the plan's predictions: allocated (the
    simulator's tensor bytes, and the allocator model's blocks) and reserved (the allocator
    model), for the planned and the unplanned run, with measured / predicted ratios. Plans
    older than format v3 predict no reserved peak (None)."""
    al = predicted.get("allocator") or {}

    def ratio(measured, pred):
        return measured / pred if measured is not None and pred else None

    out = {}
    for run, got, alloc_key, blocks_key, reserved_key in (
            ("planned", planned, "planned_peak_bytes", "planned_allocated_peak_bytes", "planned_reserved_peak_bytes"),
            ("unplanned", base, "baseline_peak_bytes", "baseline_allocated_peak_bytes", "baseline_reserved_peak_bytes")):
        m_alloc, m_res = got.get("cuda_max_allocated_bytes"), got.get("cuda_max_reserved_bytes")
        p_alloc, p_res = predicted.get(alloc_key), predicted.get(reserved_key)
        out[run] = {
            "measured_allocated_bytes": m_alloc, "measured_reserved_bytes": m_res,
            "start_allocated_bytes": got.get("cuda_start_allocated_bytes"),
            "predicted_allocated_bytes": p_alloc, "predicted_allocator_allocated_bytes": al.get(blocks_key),
            "predicted_reserved_bytes": p_res,
            "allocated_ratio": ratio(m_alloc, p_alloc), "reserved_ratio": ratio(m_res, p_res),
        }
    return out


def replay(plan: Plan | str | Path, steps: int = 3, check_grads: bool = True, seed: int = 0, *,
           force: bool = False, progress: Callable[[str], None] | None = None, trace=None,
           comparison: ComparisonConfig | None = None) -> dict:
    """Measure ``plan`` on its workload; returns the report (what ``taichi-plan replay`` prints).
    ``trace``: the plan's trace (a directory or Trace) when it is not where the plan says.

    Raises :class:`~taichi_plan.base.errors.NotEnoughMemoryError` before building anything when the
    larger predicted peak exceeds this machine's memory, unless ``force``. ``progress(message)``
    is called as the runs go. ``comparison``: the tolerances the two runs' training is judged
    by (:class:`~.config.ComparisonConfig`; its defaults when None)."""

    from ...runtime.calls import plan_and_trace

    if steps < 1:
        raise PlanError(f"--steps must be at least 1, got {steps}.")
    say = progress or (lambda msg: None)
    plan, trace = plan_and_trace(plan, trace)
    if plan.trace.get("layout") is not None:
        kind = "DDP" if plan.trace["layout"].get("ddp") is not None else "FSDP"
        raise PlanError(f"This plan is for rank 0 of a {plan.trace['layout']['world_size']}-rank {kind} job: replay it "
                        f"on its ranks, with --nproc {plan.trace['layout']['world_size']} (replay_sharded in Python).")
    device = replay_device(trace)
    workload = workload_of(trace)
    memory = check_memory(plan, trace, device, force)
    with out_of_memory_said(memory, device):
        base = run_and_measure(workload, None, trace, steps, seed, device, say, "unplanned run")
        planned = run_and_measure(workload, plan, trace, steps, seed, device, say, "planned run")
    pred = plan.predicted
    # Off CUDA an offload plan's copies go host to host: the "device" and the host are one
    # memory, which the measured peak counts together; the device peak is the simulator's.
    host_on_device = int(pred.get("host_peak_bytes") or 0) if getattr(plan, "offloads", None) and device != "cuda" else 0
    report = {
        "plan": plan.trace.get("name"),
        "workload": (trace.meta.get("workload") or {}).get("name"),
        "device": device,
        "budget_bytes": plan.budget_bytes,
        "predicted_peak_bytes": pred["planned_peak_bytes"],
        "measured_peak_bytes": planned["peak_bytes"],
        "measured_peak_op": planned["peak_op"],
        "peak_ratio": planned["peak_bytes"] / pred["planned_peak_bytes"] if pred["planned_peak_bytes"] else None,
        "within_budget": plan.budget_bytes is None or planned["peak_bytes"] <= plan.budget_bytes + host_on_device,
        "baseline_predicted_peak_bytes": pred["baseline_peak_bytes"],
        "baseline_measured_peak_bytes": base["peak_bytes"],
        "memtracker_peak_bytes": planned["memtracker_peak_bytes"],
        "memtracker_note": planned.get("memtracker_note") or base.get("memtracker_note"),
        "baseline_memtracker_peak_bytes": base["memtracker_peak_bytes"],
        "step_s_unplanned": base["step_s"],
        "step_s_planned": planned["step_s"],
        "step_time_ratio": planned["step_s"] / base["step_s"] if base["step_s"] else None,
        "predicted_extra_s": pred["extra_compute"] if pred.get("cost_unit") == "s" else None,
        "predicted_runtime_overhead_s": pred.get("runtime_overhead"),
        "predicted_extra_time_s": pred.get("extra_time"),
        "measured_extra_time_s": (planned["step_s"] - base["step_s"]) if base["step_s"] and planned["step_s"]
        else None,
        "measured_recompute_s": planned["recompute_s"],
        "recompute_ops": planned["recompute_ops"],
        "skipped_calls": planned.get("skipped_calls", 0),
        "skipped_sized_ops": planned.get("skipped_sized_ops", 0),
        "partitions": len(plan.partitions),
        "optimizer": plan_mode(plan),
        "steps": steps,
        "trace_mode": trace.meta.get("mode"),
        "memory": memory,
        "cuda": cuda_report(pred, base, planned) if device == "cuda" else None,
        "offload": None if not getattr(plan, "offloads", None) else {
            "tensors": len(plan.offloads), "host_peak_bytes": pred.get("host_peak_bytes"),
            "stall_s": pred.get("stall_s"),
            "note": None if device == "cuda" else (
                "on this CPU the copies are host-to-host: the measured peak counts the planned step and the host "
                "copies together (judged against the budget plus the host peak); the device peak of an offload "
                "plan is the simulator's, computed, not measured")},
        "mechanism": "per model call: saved-tensor hooks and per-tensor rebuild from recorded op recipes; "
                     "partitions: chunked non-reentrant checkpoint",
    }
    draws = {p.module: p.random_draws for p in plan.partitions if p.random_draws}
    if draws:
        report["random_draws"] = random_draws_sentence(draws, frozenset(p.module for p in plan.partitions
                                                                         if p.chunks == 1))
    if check_grads and "per-chunk" in draws.values():
        say("reseeded unplanned run: the spread other dropout masks make")
        other = run_and_measure(workload, None, trace, steps, seed, device, say, "reseeded unplanned run",
                                rng_seed=seed + 1)
        report.update(statistical_check(base, planned, other, config=comparison))
    elif check_grads:
        # One chunk (checkpointed whole) re-runs the same ops on the same values: bitwise.
        exact = all(p.chunks == 1 for p in plan.partitions)
        # Stepped in backward, the planned run frees each gradient once its parameter is
        # updated: only the parameters can be compared (they carry every gradient's effect).
        in_backward = plan_mode(plan) == "in-backward"
        out = compare_training(base, planned, exact, in_backward, autocast_rounding(plan, trace), comparison)
        out.pop("matched")
        if not out["grads_match"]:
            say("second unplanned run: does the model itself train the same twice?")
            again = run_and_measure(workload, None, trace, steps, seed, device, say, "second unplanned run")
            if not compare_training(base, again, True, config=comparison)["grads_match"]:
                # Nondeterministic by itself (it reseeds from the clock, as transformers'
                # Reformer does; nondeterministic kernels): the plan is judged against that.
                out = statistical_check(base, planned, again, ("params",) if in_backward else ("grads", "params"),
                                        "a second unplanned run from the same seed (the model is not deterministic "
                                        "by itself: the two unplanned runs differ too)", comparison)
                out["nondeterministic_model"] = True
        report.update(out)
    return report


def random_draws_sentence(draws: dict[str, str], whole: frozenset[str] = frozenset()) -> str:
    """What the partitioned modules that draw random numbers do to training, for people
    (``whole``: the modules checkpointed whole, one chunk)."""
    own = sorted(m for m, d in draws.items() if d == "per-chunk")
    same = sorted(m for m, d in draws.items() if d == "as-unpartitioned" and m not in whole)
    kept = sorted(m for m, d in draws.items() if d == "as-unpartitioned" and m in whole)
    parts = []
    if own:
        parts.append(f"partitioned chunks of {', '.join(own)} draw their own dropout masks: training changes "
                     "statistically, not bitwise")
    if same:
        parts.append(f"the chunks of {', '.join(same)} draw the whole batch's dropout masks (one dropout, CPU)")
    if kept:
        parts.append(f"{', '.join(kept)}, checkpointed whole, re-run(s) with the RNG state of its forward: the "
                     "same dropout masks")
    return "; ".join(parts)


