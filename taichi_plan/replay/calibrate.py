"""What the replay runtime costs per op, measured on the recorded model itself.

:func:`~taichi_plan.replay.runtime.calibrate_overhead` times the runtime on one-element
additions: the bookkeeping alone. On a real model each op of a planned call costs more than
that (on this 2-core CPU, a 4-layer Llama's forward paid 15-18 us per op under the runtime's
dispatch mode, against 5 us on one-element additions): its arguments cross into Python and
back, and between kernels that stream megabytes the interpreter runs from cold caches. So a
real recording of a workload measures the two per-op terms on the workload's own forward
(:func:`measure_on_model`): its first grad-enabled call, run plain, under the runtime with
every op checked (``check_op_s``), and with a recipe kept for every op (``recipe_op_s``),
``repeats`` times each, interleaved, each followed by its backward (so every forward starts
from the same allocator state); a term is the median of the per-repetition differences to
the plain forward, divided by the call's ops. ``rebuild_op_s``: after each recipe forward
and its backward (a rebuild's inputs are gone by then, as in a real rebuild), every recipe of
the call is re-run through the runtime's rebuild path (:func:`_rebuild_all`); its seconds
minus the seconds of the ops themselves (timed inside it), per re-run op, median over the runs.

Times are the thread's CPU time when torch runs one thread (:func:`~taichi_plan.record.recorder.op_clock`).
"""

from __future__ import annotations

import contextlib
import statistics
import warnings
from dataclasses import replace

# A real recording spends at most about this long measuring (fewer repetitions on a large model:
# there the runtime's cost is a small part of the step, and an error in it matters less).
BUDGET_S = 15.0
REPEATS = 7


def measure_on_model(model, batch, loss_fn, trace, repeats: int = REPEATS, budget_s: float = BUDGET_S) -> dict | None:
    """``check_op_s`` and ``recipe_op_s`` measured on ``model``'s first grad-enabled call as the
    trace recorded it (in the recorded loop's autocast), with ``ops`` (the call's ops in the
    trace: the per-op terms are per op of the call, as :mod:`taichi_plan.overhead` charges them)
    and ``repeats`` (repetitions run); None when the trace has no model call to measure on, or
    the model's call is not the recorded one (then the microbenchmark's terms stay)."""
    import torch

    from ..problem import grad_model_calls
    from ..record.api import call_model
    from ..record.loop import AUTOCAST_DTYPES, Loop
    from ..record.recorder import op_clock
    from . import call_ops, install
    from .runtime import CallPlan, PlanRuntime

    grad_calls = grad_model_calls(trace.meta) or []
    if not grad_calls:
        return None
    ops = call_ops(trace)[0]
    call = grad_calls[0]
    n_ops = int(call["end"]) - int(call["start"]) + 1  # every op of the call enters the mode, as overhead.py charges
    if not ops:
        return None
    probe = CallPlan(0, ops, {}, set(), {}, call.get("inputs", []), None, bool(call.get("training", True)),
                     probe=True)
    variants = {"plain": None, "check": probe, "recipe": replace(probe, recipe_ops=None)}
    clock = op_clock()

    loop = Loop.from_meta(trace.meta)
    device = next((p.device.type for p in model.parameters()), "cpu")
    runtimes = []
    rebuilds: list[float] = []  # per recipe forward: the rebuild path's own seconds per re-run op

    def forward(plan: CallPlan | None) -> float:
        rt = PlanRuntime([plan], on_mismatch="warn") if plan is not None else None
        handles = install(model, rt) if rt is not None else []
        runtimes.extend([rt] if rt is not None else [])
        frames = []
        if plan is not None and plan.recipe_ops is None:
            end_call = rt.end_call

            def keep_frame(failed: bool) -> None:
                frames.append(rt._frame)
                end_call(failed)

            rt.end_call = keep_frame
        autocast = (torch.autocast(device, dtype=getattr(torch, AUTOCAST_DTYPES[loop.autocast]))
                    if loop.autocast is not None else contextlib.nullcontext())
        try:
            with torch.enable_grad(), autocast, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t0 = clock()
                out = call_model(model, batch)
                dt = clock() - t0
                loss = loss_fn(out, batch)
                del out
                loss.backward()
                if frames and frames[0].enabled:  # after the backward, as a rebuild runs: its inputs gone
                    rebuilds.extend(_rebuild_all(rt, frames[0], clock))
        finally:
            for h in handles:
                h.remove()
        return dt

    was_training = model.training
    model.train(bool(call.get("training", True)))
    with torch.random.fork_rng(devices=[]):  # the forwards' random draws leave the generator as it was
        times = _interleaved(forward, variants, repeats, budget_s, clock)
    model.train(was_training)
    model.zero_grad(set_to_none=True)
    if any(rt.mismatches for rt in runtimes):  # the forward is not the recorded call: nothing measured
        return None

    def per_op(name: str) -> float:
        return max(statistics.median(a - b for a, b in zip(times[name], times["plain"], strict=True)) / n_ops, 0.0)

    out = {"check_op_s": per_op("check"), "recipe_op_s": per_op("recipe"), "ops": n_ops,
           "repeats": len(times["plain"])}
    if rebuilds:
        out["rebuild_op_s"] = max(statistics.median(rebuilds), 0.0)
    return out


def _rebuild_all(rt, frame, clock) -> list[float]:
    """Re-run every recipe of ``frame`` (a call run with every recipe kept) through the runtime's
    rebuild path, in op order, each storage held until its last reader has re-run; returns
    [(seconds - the seconds of the ops themselves) / re-run ops]: the path's own cost per op,
    the ops timed where they run. [] when a recipe cannot re-run here (an input overwritten in
    place, say): then nothing is measured."""
    from . import runtime
    from .runtime import TRef

    order = sorted(frame.recipes, key=lambda sid: (frame.recipes[sid][0].op, sid))
    last_reader: dict[int, int] = {}
    for k, sid in enumerate(order):
        for step in frame.recipes[sid]:
            for x in step.leaves:
                if isinstance(x, TRef):
                    last_reader[x.sid] = k
    run_op = runtime._run
    op_s = [0.0]

    def timed_op(step, args, kwargs):
        t = clock()
        try:
            return run_op(step, args, kwargs)
        finally:
            op_s[0] += clock() - t

    n0 = rt.recompute_ops
    runtime._run = timed_op
    try:
        t0 = clock()
        for k, sid in enumerate(order):
            frame.cache[sid] = rt._run_recipe(frame, sid)
            for step in frame.recipes[sid]:
                for x in step.leaves:
                    if isinstance(x, TRef) and last_reader.get(x.sid) == k:
                        frame.cache.pop(x.sid, None)
        dt = clock() - t0
    except Exception:  # noqa: BLE001  (calibration only: the microbenchmark's term stays)
        return []
    finally:
        runtime._run = run_op
        frame.cache.clear()
    n = rt.recompute_ops - n0
    return [(dt - op_s[0]) / n] if n else []
def _interleaved(forward, variants: dict, repeats: int, budget_s: float, clock) -> dict[str, list[float]]:
    """Seconds of ``forward(variant)`` per variant, ``repeats`` times each (fewer when one round
    takes more than ``budget_s / repeats``), each round in another order."""
    t0 = clock()
    forward(None)  # a warm-up, and about how long each forward (with its backward) takes
    names = list(variants)
    reps = max(1, min(repeats, int(budget_s / max(len(names) * (clock() - t0), 1e-9))))
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        for i in range(len(names)):
            n = names[(r + i) % len(names)]
            times[n].append(forward(variants[n]))
    return times
