"""What the replay runtime costs per op, measured on the recorded model itself.

:func:`~taichi_plan.runtime.mode.calibrate_overhead` times the runtime on one-element
additions: the bookkeeping alone. On a real model each op of a planned call costs more than
that (on this 2-core CPU, a 4-layer Llama's forward paid 15-18 us per op under the runtime's
dispatch mode, against 5 us on one-element additions): its arguments cross into Python and
back, and between kernels that stream megabytes the interpreter runs from cold caches. So a
real recording of a workload measures the two per-op terms on the workload's own forward
(:func:`measure_on_model`): its first grad-enabled call under the runtime with every op
checked (``check_op_s``), and with a recipe kept for every op (``recipe_op_s``), ``repeats``
times each, interleaved with the other probes, each followed by its backward (so the
runtime's Python runs from the caches a training step leaves it). A term is the runtime's
own seconds in that forward, per op of the call, median over the repetitions: the seconds
spent in its dispatch handler and its saved-tensor pack hook, minus the seconds of the
kernels it called there, which a stopwatch mode beneath it times (:func:`~.clocks.kernel_stopwatch`; its
own crossing into Python stands in for the runtime's, which no clock inside the handler
sees). Before 2026-12-02 a term was the difference of two whole forwards per op,
and the forwards' noise was the size of the term: a BERT's ``check_op_s`` read 9, 18, 23
and 62 us in four recordings on this 2-core CPU; its own seconds read 21.6-29.7 us in four (15.9-25.3 in ten since
the runtime flattens its ops itself).
``rebuild_op_s``: after each recipe forward and its backward (a rebuild's inputs are gone
by then, as in a real rebuild), every recipe of
the call is re-run through the runtime's rebuild path (:func:`~.rebuilds.rebuild_all`); its seconds
minus the seconds of the ops themselves (timed inside it), per re-run op, median over the runs;
and ``rebuild_time_ratio``: per op name, the seconds one run of its ops took there over the
seconds the trace recorded for them (a rebuild's inputs, its ``no_grad`` path and the caches
differ from the recorded forward's).

The entry, :func:`measure_on_model`, is here; it runs the probes (:mod:`.probes`) in timed rounds
(:mod:`.timing`) under the clocks of :mod:`.clocks` and :mod:`.rebuilds`, and fits the rates
(:mod:`.rates`).

Times are the thread's CPU time when torch runs one thread (:func:`~taichi_plan.torch_common.ops.op_clock`).
"""

from __future__ import annotations

import contextlib
import statistics
import warnings
from dataclasses import replace

from .clocks import SpanClock, kernel_stopwatch, own_clocked_runtime
from .config import CalibrationConfig, default_config
from .probes import build_drop_probe, build_partition_probes, build_span_probes
from .rates import (
    drop_rate,
    floored,
    module_hook_rates,
    partition_rates,
    region_outside,
    span_rates,
)
from .rebuilds import rebuild_all, time_ratios
from .timing import interleaved, runs_cleanly, top_up

# The variants of the region terms, run to at least CalibrationConfig.region_min_repeats
# repetitions, in rounds of their own beyond the budget (top_up; "drops" with them: drop_s
# pairs it with "kept").
REGION_VARIANTS = ("drops", "kept", "kept_whole", "plain", "hooks_whole")


def measure_on_model(model, batch, loss_fn, trace, config: CalibrationConfig | None = None) -> dict | None:
    """``check_op_s`` and ``recipe_op_s`` measured on ``model``'s first grad-enabled call as the
    trace recorded it (in the recorded loop's autocast), with ``ops`` (the call's ops in the
    trace: the per-op terms are per op of the call, as :mod:`taichi_plan.problem.partition.overhead` charges them)
    and ``repeats`` (repetitions run); None when the trace has no model call to measure on, or
    the model's call is not the recorded one (then the microbenchmark's terms stay).
    ``config`` (:class:`~.config.CalibrationConfig`: the repetitions, the budget, the probes'
    chunks and shares) defaults to :func:`~.config.default_config`, read at call time (the
    test suite lowers its repetitions and budget and turns the warm-up off: its tests count,
    they do not time)."""
    import torch

    config = default_config() if config is None else config

    from ...problem.core import grad_model_calls
    from ...torch_common.loop import AUTOCAST_DTYPES, Loop
    from ...torch_common.ops import op_clock
    from ...torch_common.step import call_model
    from ..calls import call_ops
    from ..install import install
    from ..mode import PlanRuntime
    from ..mode.call_plan import CallPlan
    from ..partition import install_partitions

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
    # "check" (untimed inside: the partition and span probes' base) and the two own-clocked
    # variants (the third element) whose own seconds give the per-op terms
    variants = {"check": (probe, []), "check_own": (probe, [], True),
                "recipe": (replace(probe, recipe_ops=None), [], True)}
    from ...problem.core import build_problem

    built = build_problem(trace)  # one problem for the partition and span probes (caches shared)
    chunked = build_partition_probes(trace, call, model, built, config)
    if chunked is not None:
        problem, spans, k_most, probes = chunked
        variants.update({f"part{k}": v for k, v in probes.items()})
    span_probes = build_span_probes(trace, call, built, config)
    drop_probe = build_drop_probe(trace, call, config)
    if drop_probe is not None:  # the plan's call, and the same call with its recipes kept but nothing dropped
        variants["drops"] = (drop_probe[2], [], True)
        variants["kept"] = (replace(drop_probe[2], drops={}, group_of={}, probe=True), [], True)
        if drop_probe[2].module_starts:  # the module hooks alone: no region, no op checked
            variants["hooks"] = (replace(drop_probe[2], drops={}, group_of={}, triggers={}, regions={},
                                         whole_call=False, probe=True), [], True)
            # the same regions unclocked, and the call plain: what the regions cost the forward
            # beyond the runtime's own seconds (region_outside)
            variants["kept_whole"] = (variants["kept"][0], [])
            variants["plain"] = (None, [])
            # the module hooks alone unclocked: what a module call costs them whole (module_hook_rates)
            variants["hooks_whole"] = (variants["hooks"][0], [])
    for kind, (_span, _ks, probes_k) in span_probes.items():
        variants.update({f"{kind}{k}": v for k, v in probes_k.items()})
    clock = op_clock()

    loop = Loop.from_meta(trace.meta)
    device = next((p.device.type for p in model.parameters()), "cpu")
    runtimes = []
    rebuilds: list[float] = []  # per recipe forward: the rebuild path's own seconds per re-run op
    # counted op of the call -> [seconds it ran in the rebuilds, times it ran] (all runs)
    rebuilt_s: dict[int, list[float]] = {}

    # The span the span probes split: every run times its own stretch of the step (SpanClock),
    # so that a probe's extra is the difference of two spans of tens of milliseconds, not of two
    # whole steps (one span of each kind is probed; their heads are timed apart).
    span_heads = [ps[1].module for ps, _ks, _p in span_probes.values()]
    span_index = {kind: i for i, kind in enumerate(span_probes)}  # (a kind left out below keeps its place)

    def forward(variant: tuple) -> tuple[float, ...]:
        """(forward seconds, forward and backward seconds, then per probed span its own
        seconds: :class:`~.clocks.SpanClock`) of ``variant``; an own-clocked one adds the runtime's
        own seconds in the forward (kernels out), in its unpack hooks (the rebuilds they
        run in) and in its module hooks, the module calls those saw and the regions entered,
        after the first two."""
        plan, parts, *own_clocked = variant
        own_clocked = bool(own_clocked and own_clocked[0])
        rt = ((own_clocked_runtime() if own_clocked else PlanRuntime)([plan], on_mismatch="warn")
              if plan is not None else None)
        handles = install(model, rt) if rt is not None else []
        undo_parts = install_partitions(model, parts, rt) if parts else (lambda: None)
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
        spans = [SpanClock(model, m, clock) for m in span_heads]
        try:
            with torch.enable_grad(), autocast, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                stopwatch = kernel_stopwatch(rt) if own_clocked else contextlib.nullcontext()
                t0 = clock()
                with stopwatch:  # beneath the runtime, which enters its mode in the call
                    out = call_model(model, batch)
                dt = clock() - t0
                loss = loss_fn(out, batch)
                del out
                for sc in spans:
                    sc.forward_done()
                loss.backward()
                total = clock() - t0
                if frames and frames[0].enabled:  # after the backward, as a rebuild runs: its inputs gone
                    rebuilds.extend(rebuild_all(rt, frames[0], clock, rebuilt_s))
        finally:
            undo_parts()
            for h in handles:
                h.remove()
            for sc in spans:
                sc.remove()
        own_s = ((rt.own_s - stopwatch.kernel_s, rt.unpack_s, rt.hook_s, rt.hook_n, rt.regions_run)
                 if own_clocked else ())
        return (dt, total, *own_s, *(sc.seconds() for sc in spans))

    was_training = model.training
    model.train(bool(call.get("training", True)))
    with torch.random.fork_rng(devices=[]):  # the forwards' random draws leave the generator as it was
        ran: set[str] = set()  # variants a trial run has run once: they need no warm-up run
        if chunked is not None and not runs_cleanly(forward, {f"part{k}": variants[f"part{k}"] for k in probes},
                                                    runtimes, ran):
            chunked = None  # a module that cannot run in chunks here: partitions keep the launch overhead
            variants = {n: v for n, v in variants.items() if not n.startswith("part")}
        if drop_probe is not None and not runs_cleanly(forward, {"drops": variants["drops"]}, runtimes, ran):
            drop_probe = None  # a drop cannot be rebuilt here: drops cost what the other terms say
            for name in REGION_VARIANTS:
                variants.pop(name, None)
        for kind, (_span, ks, _p) in list(span_probes.items()):
            if not runs_cleanly(forward, {f"{kind}{k}": variants[f"{kind}{k}"] for k in ks}, runtimes, ran):
                del span_probes[kind]  # it keeps the launch overhead
                for k in ks:
                    del variants[f"{kind}{k}"]
        times = interleaved(forward, variants, config.repeats, config.budget_s, clock, ran, config)
        if "kept_whole" in times:
            top_up(forward, {n: variants[n] for n in REGION_VARIANTS}, times, config.region_min_repeats)
    model.train(was_training)
    model.zero_grad(set_to_none=True)
    if any(rt.mismatches for rt in runtimes):  # the forward is not the recorded call: nothing measured
        return None

    def extra(name: str, base: str, which: int = 0) -> float:
        """Median over the repetitions of ``name``'s seconds minus ``base``'s (0: the forward,
        1: forward and backward)."""
        return statistics.median(a[which] - b[which] for a, b in zip(times[name], times[base], strict=True))

    def own(name: str) -> float:
        """Median over the repetitions of the runtime's own seconds in ``name``'s forward."""
        return statistics.median(t[2] for t in times[name])

    out = {"check_op_s": own("check_own") / n_ops, "recipe_op_s": own("recipe") / n_ops,
           "ops": n_ops, "repeats": len(times["check"])}
    if chunked is not None:
        out.update(partition_rates(problem, spans, k_most, extra("part1", "check", 1), extra(f"part{k_most}", "part1", 1)))
    if span_probes:
        # each span's own seconds are the last of each run's times, in the order of span_heads
        out["span_costs"] = {kind: span_rates(kind, span, ks, [extra(f"{kind}{k}", "check",
                                                                     span_index[kind] - len(span_heads)) for k in ks])
                             for kind, (span, ks, _p) in span_probes.items()}
    if rebuilds:
        out["rebuild_op_s"] = statistics.median(rebuilds)
        out["rebuild_time_ratio"] = time_ratios(trace, call, ops, rebuilt_s)
    hook_rates = module_hook_rates(times, config)
    own_call_s = hook_rates.pop("module_call_own_s", 0.0)
    forward_call_s = hook_rates.pop("module_call_forward_s", own_call_s)
    out.update(hook_rates)
    if drop_probe is not None:
        out.update(region_outside(times, sum(last - first + 1 for spans in drop_probe[2].regions.values()
                                                   for first, last in spans.values()),
                                  forward_call_s - own_call_s, config))
    out = floored(out, trace.meta.get("runtime_overhead") or {})
    if drop_probe is not None and "rebuild_op_s" in out:
        out.update(drop_rate(drop_probe, statistics.median(
            (a[2] + a[3]) - (b[2] + b[3]) for a, b in zip(times["drops"], times["kept"], strict=True)), out))
    return out


