"""``taichi-plan replay``: run the plan's workload unplanned and planned, and measure both.

Both runs build the workload from the same seed, run one unplanned warm-up step (so the
optimizer state exists, as in the recorded trace), then ``steps`` timed steps, then one more
step under the recorder, whose live-storage accounting is the trace's own (the same numbers
MemTracker gives): that step's peak is the measured peak. Gradients and parameters after
the last step are compared: bitwise for rematerialization alone (rebuilt ops replay their RNG
state), ``allclose`` when modules are partitioned.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from ..errors import PlanError
from ..plan import Plan


def _workload(trace):
    from ..record import get_workload

    wl = trace.meta.get("workload") or {}
    kind, name, args = wl.get("kind"), wl.get("name"), dict(wl.get("args") or {})
    if trace.meta.get("mode") == "imported" or kind not in ("builtin", "entry"):
        raise PlanError(
            f"Replay rebuilds the workload the trace was recorded from, but this trace is "
            f"{trace.meta.get('mode') or kind or 'unknown'}: only traces recorded from a built-in model or "
            "an --entry can be replayed (imported graphs and record() of live objects cannot)."
        )
    return get_workload(model=name, **args) if kind == "builtin" else get_workload(entry=name, **args)


def _run(workload, plan: Plan | None, trace, steps: int, seed: int, device: str):
    import torch

    from ..record.api import Loop, late_tensors, make_step_fn, registered_tensors, step_to_trace
    from ..record.recorder import Recorder
    from ..trace import baseline_peak
    from . import install, runtime_for
    from .partition import install_partitions

    torch.manual_seed(seed)
    model, batch, loss_fn, optimizer = workload.build(False)
    loop = Loop.from_meta(trace.meta) if trace is not None else Loop()
    step = make_step_fn(model, batch, loss_fn, optimizer, where=workload.name, loop=loop)
    optimizer.zero_grad(set_to_none=loop.set_to_none)
    step()  # warm-up, unplanned
    rt, handles, undo = None, [], (lambda: None)
    if plan is not None:
        rt = runtime_for(plan, trace)
        handles = install(model, rt, optimizer)
        undo = install_partitions(model, plan.partitions, rt)

    def one_step():
        optimizer.zero_grad(set_to_none=loop.set_to_none)
        if rt is not None:
            rt.reset_counters()
        step()

    times, recompute_s = [], []
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        one_step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if rt is not None:
            recompute_s.append(rt.recompute_s)
    recorder = Recorder(None, model)
    hooks = recorder.optimizer_hooks(optimizer)
    try:
        optimizer.zero_grad(set_to_none=loop.set_to_none)
        recorder.begin_step(registered_tensors(model, batch, loss_fn, optimizer))
        with recorder:
            one_step()
        rec = recorder.end_step(late_tensors(model, optimizer))
    finally:
        for h in hooks:
            h.remove()
        recorder.close()
        for h in handles:
            h.remove()
        undo()
    measured = step_to_trace(rec, 0, "measured", {})
    peak, peak_op = baseline_peak(measured)
    out = {
        "step_s": statistics.median(times) if times else None,
        "peak_bytes": peak,
        "peak_op": peak_op,
        "ops": measured.num_ops,
        "recompute_s": statistics.median(recompute_s) if recompute_s else 0.0,
        "recompute_ops": rt.recompute_ops if rt is not None else 0,
        "params": [p.detach().clone() for p in model.parameters()],
        "grads": [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()],
    }
    return out


def replay(plan: Plan | str | Path, steps: int = 3, check_grads: bool = True, seed: int = 0) -> dict:
    """Measure ``plan`` on its workload; returns the report (what ``taichi-plan replay`` prints)."""
    import torch

    from . import plan_and_trace

    if steps < 1:
        raise PlanError(f"--steps must be at least 1, got {steps}.")
    plan, trace = plan_and_trace(plan)
    workload = _workload(trace)
    device = "cuda" if torch.cuda.is_available() and trace.meta.get("torch_build") == "cuda" else "cpu"
    base = _run(workload, None, trace, steps, seed, device)
    planned = _run(workload, plan, trace, steps, seed, device)
    pred = plan.predicted
    report = {
        "plan": plan.trace.get("name"),
        "workload": (trace.meta.get("workload") or {}).get("name"),
        "device": device,
        "budget_bytes": plan.budget_bytes,
        "predicted_peak_bytes": pred["planned_peak_bytes"],
        "measured_peak_bytes": planned["peak_bytes"],
        "measured_peak_op": planned["peak_op"],
        "peak_ratio": planned["peak_bytes"] / pred["planned_peak_bytes"] if pred["planned_peak_bytes"] else None,
        "within_budget": plan.budget_bytes is None or planned["peak_bytes"] <= plan.budget_bytes,
        "baseline_predicted_peak_bytes": pred["baseline_peak_bytes"],
        "baseline_measured_peak_bytes": base["peak_bytes"],
        "step_s_unplanned": base["step_s"],
        "step_s_planned": planned["step_s"],
        "step_time_ratio": planned["step_s"] / base["step_s"] if base["step_s"] else None,
        "predicted_extra_s": pred["extra_compute"] if pred.get("cost_unit") == "s" else None,
        "measured_recompute_s": planned["recompute_s"],
        "recompute_ops": planned["recompute_ops"],
        "partitions": len(plan.partitions),
        "steps": steps,
        "mechanism": "per model call: saved-tensor hooks and per-tensor rebuild from recorded op recipes; "
                     "partitions: chunked non-reentrant checkpoint",
    }
    if check_grads:
        exact = not plan.partitions
        same = True
        worst = 0.0
        for key in ("grads", "params"):
            for a, b in zip(base[key], planned[key], strict=True):
                if a is None or b is None:
                    same &= a is None and b is None
                    continue
                if exact:
                    same &= bool(torch.equal(a, b))
                else:
                    same &= bool(torch.allclose(a, b, rtol=1e-4, atol=1e-6))
                worst = max(worst, float((a - b).abs().max()) if a.numel() else 0.0)
        report["grads_match"] = same
        report["grads_check"] = "bitwise (torch.equal)" if exact else "allclose(rtol=1e-4, atol=1e-6)"
        report["grads_max_abs_diff"] = worst
    return report
