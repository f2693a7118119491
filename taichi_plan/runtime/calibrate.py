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
kernels it called there, which a stopwatch mode beneath it times (:func:`_stopwatch`; its
own crossing into Python stands in for the runtime's, which no clock inside the handler
sees). Before 2026-12-02 a term was the difference of two whole forwards per op,
and the forwards' noise was the size of the term: a BERT's ``check_op_s`` read 9, 18, 23
and 62 us in four recordings on this 2-core CPU; its own seconds read 21.6-29.7 us in four (15.9-25.3 in ten since
the runtime flattens its ops itself).
``rebuild_op_s``: after each recipe forward and its backward (a rebuild's inputs are gone
by then, as in a real rebuild), every recipe of
the call is re-run through the runtime's rebuild path (:func:`_rebuild_all`); its seconds
minus the seconds of the ops themselves (timed inside it), per re-run op, median over the runs;
and ``rebuild_time_ratio``: per op name, the seconds one run of its ops took there over the
seconds the trace recorded for them (a rebuild's inputs, its ``no_grad`` path and the caches
differ from the recorded forward's).

Times are the thread's CPU time when torch runs one thread (:func:`~taichi_plan.torch_common.ops.op_clock`).
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
import warnings
from dataclasses import replace

# A real recording spends at most about this long measuring (fewer repetitions on a large model:
# there the runtime's cost is a small part of the step, and an error in it matters less).
BUDGET_S = 15.0
REPEATS = 7
# Run each variant once untimed before the timed rounds (its one-time costs out of the
# measurement). The test suite turns it off: its tests count what calibration measures.
WARM_UP = True
# Partitions are calibrated checkpointed whole and split into this many chunks (fewer when the
# batch is smaller): the planner's chunk choices are 2, 4 and 8.
PROBE_CHUNKS = 4
# ... and only when those modules hold at least this share of the call's ops: a few ops (a
# ResNet's classifier, its modules with batch norm being unsplittable) time noise, not a rate.
PROBE_MIN_SHARE = 0.25
# A span partitioned over something else than the batch (a head and its loss over tokens) is
# calibrated split into its fewest chunks and into the most of its choices up to this many: its
# most chunks (32), so the costs of the counts between are interpolated, not extrapolated.
# Probed at 2 and 8, the difference of two noisy whole-step extras (a 4-layer Llama's read
# -5.0 to 48.7 ms at 2 chunks in three recordings) gave a per-chunk rate of 161-510 us per op,
# and where it came out near 0 the planner took 32 chunks as if free: measured 191-204 ms
# slower than planned, a loss against checkpointing every block (docs/benchmarks.md). At 2
# and 32: 456-500 us in three recordings.
SPAN_PROBE_MOST = 32

# The fewest repetitions region_op_s is taken from (_region_outside): a difference of whole
# forwards, which a model whose step fits twice in BUDGET_S measures as noise.
REGION_MIN_REPEATS = 5
# ... which the region variants are run to at least, in rounds of their own beyond the budget
# (_top_up; "drops" with them: drop_s pairs it with "kept"). Within the budget alone a 4-layer
# GPT-2 and Llama ran 4 on a slower afternoon of the same machine type, and their plans, then
# charged no region_op_s, measured 3-6 ms over their predictions (2026-12-05).
REGION_VARIANTS = ("drops", "kept", "kept_whole", "plain", "hooks_whole")


def _span_terms() -> dict:
    """Per span kind (a span's ``over``) other than the batch: the function giving a span's
    (recorded seconds of the ops its chunks run again, its forward and backward ops), the two
    quantities its cost scales (:func:`taichi_plan.problem.partition.overhead.span_cost`). A new kind of span
    is calibrated by adding its own here."""
    from ..problem.partition import token_span

    return {"tokens": token_span.cost_terms}


def measure_on_model(model, batch, loss_fn, trace, repeats: int | None = None,
                     budget_s: float | None = None) -> dict | None:
    """``check_op_s`` and ``recipe_op_s`` measured on ``model``'s first grad-enabled call as the
    trace recorded it (in the recorded loop's autocast), with ``ops`` (the call's ops in the
    trace: the per-op terms are per op of the call, as :mod:`taichi_plan.problem.partition.overhead` charges them)
    and ``repeats`` (repetitions run); None when the trace has no model call to measure on, or
    the model's call is not the recorded one (then the microbenchmark's terms stay).
    ``repeats``/``budget_s`` default to :data:`REPEATS`/:data:`BUDGET_S`, read at call time (the
    test suite lowers them: its tests count, they do not time)."""
    import torch

    repeats = REPEATS if repeats is None else repeats
    budget_s = BUDGET_S if budget_s is None else budget_s

    from ..problem.core import grad_model_calls
    from ..torch_common.loop import AUTOCAST_DTYPES, Loop
    from ..torch_common.ops import op_clock
    from ..torch_common.step import call_model
    from .call_plan import CallPlan
    from .calls import call_ops
    from .install import install
    from .mode import PlanRuntime
    from .partition import install_partitions

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
    from ..problem.core import build_problem

    built = build_problem(trace)  # one problem for the partition and span probes (caches shared)
    chunked = _partition_probes(trace, call, model, built)
    if chunked is not None:
        problem, spans, k_most, probes = chunked
        variants.update({f"part{k}": v for k, v in probes.items()})
    span_probes = _span_probes(trace, call, built)
    drop_probe = _drop_probe(trace, call)
    if drop_probe is not None:  # the plan's call, and the same call with its recipes kept but nothing dropped
        variants["drops"] = (drop_probe[2], [], True)
        variants["kept"] = (replace(drop_probe[2], drops={}, group_of={}, probe=True), [], True)
        if drop_probe[2].module_starts:  # the module hooks alone: no region, no op checked
            variants["hooks"] = (replace(drop_probe[2], drops={}, group_of={}, triggers={}, regions={},
                                         whole_call=False, probe=True), [], True)
            # the same regions unclocked, and the call plain: what the regions cost the forward
            # beyond the runtime's own seconds (_region_outside)
            variants["kept_whole"] = (variants["kept"][0], [])
            variants["plain"] = (None, [])
            # the module hooks alone unclocked: what a module call costs them whole (_hook_rates)
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

    # The span the span probes split: every run times its own stretch of the step (_SpanClock),
    # so that a probe's extra is the difference of two spans of tens of milliseconds, not of two
    # whole steps (one span of each kind is probed; their heads are timed apart).
    span_heads = [ps[1].module for ps, _ks, _p in span_probes.values()]
    span_index = {kind: i for i, kind in enumerate(span_probes)}  # (a kind left out below keeps its place)

    def forward(variant: tuple) -> tuple[float, ...]:
        """(forward seconds, forward and backward seconds, then per probed span its own
        seconds: :class:`_SpanClock`) of ``variant``; an own-clocked one adds the runtime's
        own seconds in the forward (kernels out), in its unpack hooks (the rebuilds they
        run in) and in its module hooks, the module calls those saw and the regions entered,
        after the first two."""
        plan, parts, *own_clocked = variant
        own_clocked = bool(own_clocked and own_clocked[0])
        rt = ((_own_clocked() if own_clocked else PlanRuntime)([plan], on_mismatch="warn")
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
        spans = [_SpanClock(model, m, clock) for m in span_heads]
        try:
            with torch.enable_grad(), autocast, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                stopwatch = _stopwatch(rt) if own_clocked else contextlib.nullcontext()
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
                    rebuilds.extend(_rebuild_all(rt, frames[0], clock, rebuilt_s))
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
        if chunked is not None and not _runs_cleanly(forward, {f"part{k}": variants[f"part{k}"] for k in probes},
                                                     runtimes, ran):
            chunked = None  # a module that cannot run in chunks here: partitions keep the launch overhead
            variants = {n: v for n, v in variants.items() if not n.startswith("part")}
        if drop_probe is not None and not _runs_cleanly(forward, {"drops": variants["drops"]}, runtimes, ran):
            drop_probe = None  # a drop cannot be rebuilt here: drops cost what the other terms say
            for name in REGION_VARIANTS:
                variants.pop(name, None)
        for kind, (_span, ks, _p) in list(span_probes.items()):
            if not _runs_cleanly(forward, {f"{kind}{k}": variants[f"{kind}{k}"] for k in ks}, runtimes, ran):
                del span_probes[kind]  # it keeps the launch overhead
                for k in ks:
                    del variants[f"{kind}{k}"]
        times = _interleaved(forward, variants, repeats, budget_s, clock, ran)
        if "kept_whole" in times:
            _top_up(forward, {n: variants[n] for n in REGION_VARIANTS}, times, REGION_MIN_REPEATS)
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
        out.update(_partition_rates(problem, spans, k_most, extra("part1", "check", 1), extra(f"part{k_most}", "part1", 1)))
    if span_probes:
        # each span's own seconds are the last of each run's times, in the order of span_heads
        out["span_costs"] = {kind: _span_rates(kind, span, ks, [extra(f"{kind}{k}", "check",
                                                                      span_index[kind] - len(span_heads)) for k in ks])
                             for kind, (span, ks, _p) in span_probes.items()}
    if rebuilds:
        out["rebuild_op_s"] = statistics.median(rebuilds)
        out["rebuild_time_ratio"] = _time_ratios(trace, call, ops, rebuilt_s)
    hook_rates = _hook_rates(times)
    own_call_s = hook_rates.pop("module_call_own_s", 0.0)
    forward_call_s = hook_rates.pop("module_call_forward_s", own_call_s)
    out.update(hook_rates)
    if drop_probe is not None:
        out.update(_region_outside(times, sum(last - first + 1 for spans in drop_probe[2].regions.values()
                                                    for first, last in spans.values()),
                                   forward_call_s - own_call_s))
    out = floored(out, trace.meta.get("runtime_overhead") or {})
    if drop_probe is not None and "rebuild_op_s" in out:
        out.update(_drop_rate(drop_probe, statistics.median(
            (a[2] + a[3]) - (b[2] + b[3]) for a, b in zip(times["drops"], times["kept"], strict=True)), out))
    return out


class _SpanClock:
    """The seconds one step spends in a head + loss span (a span over tokens): from the head's
    call to the end of the loss, and from the start of the backward to the moment the head's
    input gets its gradient (the span's backward is the first of the step's, the head and its
    loss being the last of its forward). Split or not, the span's work is in these two
    stretches, and the rest of the step is not: the span probes' extras are their differences
    (:func:`measure_on_model`). Measured as differences of whole forward and backward passes,
    two recordings of one 4-layer Llama gave its head split in 2 an extra of 10.7 and 19.7 ms
    on an idle CPU, the step's own noise; trained with that split alone the step measured
    +12.5 and +20.1 ms (docs/benchmarks.md). A span whose input carries no gradient, or
    whose head is not called, counts its forward stretch only."""

    def __init__(self, model, head: str, clock):
        self.clock, self.start, self.fwd_s, self.bw0, self.bw1 = clock, None, 0.0, None, None
        try:
            module = model.get_submodule(head)
        except AttributeError:
            module = None
        self.handles = [module.register_forward_pre_hook(self._called)] if module is not None else []

    def _called(self, _module, args):
        self.start = self.clock()
        x = next((a for a in args if hasattr(a, "requires_grad")), None)
        if x is not None and x.requires_grad:
            self.handles.append(x.register_hook(self._grad))

    def _grad(self, _grad):
        if self.bw1 is None:
            self.bw1 = self.clock()

    def forward_done(self) -> None:
        now = self.clock()
        if self.start is not None:
            self.fwd_s = now - self.start
        self.bw0 = now

    def seconds(self) -> float:
        bw = self.bw1 - self.bw0 if self.bw1 is not None and self.bw0 is not None else 0.0
        return self.fwd_s + bw

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


@functools.cache
def _own_clocked():
    """:class:`~taichi_plan.runtime.mode.PlanRuntime` with the seconds it spends in its
    dispatch handler and its pack hook summed in ``own_s`` (kernels included: a
    :func:`_stopwatch` beneath it times those), in its unpack hook in ``unpack_s`` (the
    rebuilds it runs included), and in its module hooks in ``hook_s`` (regions entered and
    left included; ``hook_n``: the module calls), for calibration only."""
    from .mode import PlanRuntime

    class OwnClocked(PlanRuntime):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.own_s, self.unpack_s, self.inside = 0.0, 0.0, False
            self.hook_s, self.hook_n = 0.0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            t0 = time.perf_counter()
            self.inside = True
            try:
                return super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self.inside = False
                self.own_s += time.perf_counter() - t0

        _pack = _clocked(PlanRuntime._pack, "own_s")
        _unpack = _clocked(PlanRuntime._unpack, "unpack_s")
        _left = _clocked(PlanRuntime._left, "hook_s")

        def _entered(self, module, args):
            self.hook_n += 1
            t0 = time.perf_counter()
            try:
                return PlanRuntime._entered(self, module, args)
            finally:
                self.hook_s += time.perf_counter() - t0

    return OwnClocked


def _clocked(method, total: str):
    """``method`` with its seconds added to the attribute ``total`` of its object."""

    def clocked(self, *args):
        t0 = time.perf_counter()
        try:
            return method(self, *args)
        finally:
            setattr(self, total, getattr(self, total) + time.perf_counter() - t0)

    return clocked


def _stopwatch(rt):
    """A dispatch mode to enter beneath the own-clocked runtime ``rt``: it sums in ``kernel_s``
    the seconds of the ops ``rt``'s handler calls (other ops pass through untimed). Its entry
    from C++ into Python is in the runtime's seconds, where it stands in for the runtime's own
    entry."""
    mode = _stopwatch_class()()
    mode.rt, mode.kernel_s = rt, 0.0
    return mode


@functools.cache
def _stopwatch_class():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Stopwatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not self.rt.inside:
                return func(*args, **(kwargs or {}))
            t0 = time.perf_counter()
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.kernel_s += time.perf_counter() - t0

    return Stopwatch


# A plan of drops is solved (heuristic) at the first of these shares of the trace's peak that
# it fits, to measure what a drop costs beyond what the other terms model (drop_s).
DROP_PROBE_FRACTIONS = (0.8, 0.9)


def _drop_probe(trace, call: dict):
    """A plan of the model's own that drops tensors of the measured call and partitions
    nothing (the heuristic's drops at the first of :data:`DROP_PROBE_FRACTIONS` that fits,
    its partitions left out): (problem, drops, its CallPlan for the call), or None when no
    such plan drops anything there. A probe that runs in planned regions is preferred: where
    the heuristic's plan drops a tensor made or read in the model's own top-level code (a
    Llama's rotary tables, its last hidden state), which runs the runtime over the whole call,
    its drops that run in regions on their own are tried together, then the next share; the
    first whole-call probe where none has regions.
    Without regions the probe cannot measure what regions cost (``region_s``, ``region_op_s``),
    and a 4-layer Llama's plans, all in regions, measured 2.6 ms over their predicted
    bookkeeping (2026-12-05). The plan is solved at the trace's recorded op costs alone
    (its ``runtime_overhead`` left out: the planners weigh those rates, ``Problem.rerun_cost``),
    so it is the same plan before and after calibration measures them."""
    from dataclasses import replace as _replace

    from ..problem.core import build_problem
    from ..solve import solve
    from ..solve.result import drops_from_plan
    from .calls import call_plans

    trace = _replace(trace, meta={k: v for k, v in trace.meta.items() if k != "runtime_overhead"})
    problem = build_problem(trace)
    start, end = int(call["start"]), int(call["end"])
    whole = None  # the first probe found that runs over the whole call

    def probe_of(plan, recompute):
        try:
            probe = _replace(plan, partitions=[], recompute=recompute)
            drops = drops_from_plan(problem, probe)
            cp = call_plans(probe, trace, problem)[0]
        except Exception:  # noqa: BLE001  (calibration only: no plan to run)
            return None
        return (problem, drops, _replace(cp, grads_alive=None)) if drops and cp.drops else None

    for share in DROP_PROBE_FRACTIONS:
        try:
            plan = solve(trace, int(share * problem.baseline_peak[0]), "heuristic", time_limit=10.0, problem=problem,
                         optimizer="as-recorded")
        except Exception:  # noqa: BLE001  (calibration only: no budget fits)
            continue
        ours = [r for r in plan.recompute if start <= r.op <= end]
        found = probe_of(plan, ours)
        if found is not None and not found[2].whole_call:
            return found
        whole = whole or found
        if found is None or len(ours) < 2:
            continue
        # the plan's drops that run in regions on their own (a drop made or read in the model's
        # own top-level code runs the runtime over the whole call)
        alone = [probe_of(plan, [r]) for r in ours]
        inner = [r for r, p in zip(ours, alone, strict=True) if p is not None and not p[2].whole_call]
        found = probe_of(plan, inner) if inner else None
        if found is not None and not found[2].whole_call:
            return found
    return whole


def _hook_rates(times: dict) -> dict:
    """``module_call_s`` and ``region_s`` (trace v18) measured on the model, from the drop
    probe's runs (own-clocked: each run's module-hook seconds, module calls and regions entered
    are its times' 5th-7th): ``module_call_s``, what the module hooks cost per module call in
    the probe's call with the hooks alone and no region: since trace v20 the run unclocked
    (``hooks_whole``) against the call plain, forward and backward seconds paired per
    repetition (the step pays both), over the module calls, never below their own seconds per
    call (the clocked run ``hooks``: the hooks' Python alone, all v18-v19 measured; returned as
    ``module_call_own_s``, and the forward's share per call as ``module_call_forward_s``, for
    :func:`_region_outside`). The own seconds miss the module calls' slow path once hooks are
    on and the crossing into the hooks and back: on a 4-layer Llama its 65 module calls cost
    1.4-2.9 ms whole in four recordings (22-44 us each, 0.8-2.2 ms of it in the forward),
    where their own seconds were 11-12 us each, and its plan at HF's peak (57 module calls, 75
    ops in 8 regions) measured its regions 1.3 ms over their v19 prediction.
    ``module_call_probe`` keeps the whole, forward and own seconds, the calls and the
    repetitions; the whole run is not used under :data:`REGION_MIN_REPEATS` repetitions (then
    the own seconds stand). ``region_s``, per region entered in the probe's call run in its
    regions with nothing dropped (``kept``), its module hooks' own seconds beyond their own per
    module call (entering a region turns the mode and saved-tensor hooks on, leaving it turns
    them off and checks the region's ops).
    Medians over the repetitions. On a 4-layer ViT the microbenchmark's 3.0 us per module call
    (modules that run no op) read 4.6 us per call on the model, and each region 16-18 us, which
    the overhead model had no term for: its plan's 24 regions, and its planned forward measured
    0.8 ms over its prediction. Nothing when the probe did not run (no drop probe) or its call
    has no module hooks."""
    hooks = [t[4] / t[5] for t in times.get("hooks", ()) if t[5]]
    if not hooks:
        return {}
    own_s = statistics.median(hooks)
    out = {"module_call_s": own_s, "module_call_own_s": own_s}
    regions = [(t[4] - own_s * t[5]) / t[6] for t in times.get("kept", ()) if t[6]]
    if regions:
        out["region_s"] = max(statistics.median(regions), 0.0)
    whole, plain = times.get("hooks_whole", ()), times.get("plain", ())
    if whole and plain:
        calls = statistics.median(t[5] for t in times["hooks"])
        step_s, forward_s = (statistics.median(w[i] - p[i] for w, p in zip(whole, plain, strict=True)) for i in (1, 0))
        out["module_call_probe"] = {"whole_s": step_s, "forward_s": forward_s, "own_s": own_s * calls,
                                    "calls": calls, "repeats": len(whole)}
        if len(whole) >= REGION_MIN_REPEATS and calls > 0:
            out["module_call_s"] = max(step_s / calls, own_s)
            out["module_call_forward_s"] = max(forward_s / calls, own_s)
    return out


def _region_outside(times: dict, ops: int, hooks_beyond_s: float = 0.0) -> dict:
    """``region_op_s`` (trace v19): per op the runtime runs in a planned region, what the
    regions cost the forward beyond the runtime's own seconds. The drop probe's call run in its
    regions with nothing dropped, unclocked (``kept_whole``), against the same call run plain
    (``plain``), forward seconds paired per repetition; minus the own seconds of the same call
    clocked (``kept``: its handler, pack hook and module hooks, kernels out) and what its
    module calls cost the forward beyond their hooks' own seconds (``hooks_beyond_s`` per call:
    trace v20, from the run with the hooks alone, which ``module_call_s`` charges per module
    call); divided by the ops of the probe's regions (``ops``: counted ops, as the overhead
    model counts them); medians over the repetitions, not below 0. The own clocks start inside
    the runtime's Python: they miss the crossing into it and back, the module calls' slow path
    once global hooks are on (v20: measured per module call instead), and what its Python
    between kernels costs the kernels. Over a call checked whole these came to 0-6.5 us per op
    (the whole forward against the own seconds: ViT 25-30 us per op either way), but a 4-layer
    ViT's plan of 6 drops in 12-16 regions ran its
    forward 3.5-3.7 ms slower than plain where its own seconds came to 1.8-2.1 ms. Per op, not
    per region: a probe whose drops make one region of most of the call (a 4-layer GPT-2's)
    put 1.1-3.8 ms on that one region. ``region_probe`` keeps what it was measured on, and
    ``region_op_s`` is left out (charged 0) under :data:`REGION_MIN_REPEATS` repetitions: the
    term is a difference of whole forwards, and a ResNet-50 whose forward and backward fit
    twice in the budget read 6.7 and 62.7 us per op in two recordings. Nothing without those
    runs or without ops in regions."""
    kept, whole, plain = times.get("kept", ()), times.get("kept_whole", ()), times.get("plain", ())
    if not (kept and whole and plain) or ops <= 0:
        return {}
    whole_s = statistics.median(w[0] - p[0] for w, p in zip(whole, plain, strict=True))
    own_s = statistics.median(t[2] + t[4] + hooks_beyond_s * t[5] for t in kept)
    probe = {"whole_s": whole_s, "own_s": own_s, "ops": ops, "regions": statistics.median(t[6] for t in kept),
             "repeats": len(kept)}
    if len(kept) < REGION_MIN_REPEATS:
        return {"region_probe": probe}
    return {"region_op_s": max((whole_s - own_s) / ops, 0.0), "region_probe": probe}


def _drop_rate(probe, measured_s: float, rates: dict) -> dict:
    """``drop_s``: per dropped tensor, the runtime's own extra seconds under the drop probe's
    plan against the same call with the same recipes kept and nothing dropped (``measured_s``:
    in the forward, its handler and pack hook with the kernels taken out; in the backward, its
    unpack hooks with the rebuilds they run; the checking and the recipes cancel out. Until
    2026-12-01 it was the difference of whole forwards and backwards, whose noise read 0-870 us
    per drop) beyond what the rebuild terms of ``rates`` predict for the drops (their
    re-run ops at their measured time ratios, ``rebuild_op_s`` each:
    :func:`taichi_plan.problem.partition.overhead.rebuild_seconds`); not below 0. ``drop_probe`` says what
    it was measured on."""
    from ..problem.partition.overhead import rebuild_seconds
    from ..simulate.core import simulate_plan

    problem, drops, _cp = probe
    sim, _parted = simulate_plan(problem, drops)
    # the re-run ops at the rates just measured (not at the trace's, which the simulator charged)
    modelled = rebuild_seconds(problem, [op for g in sim.groups.values() for op in g.ops], rates)
    return {"drop_s": max((measured_s - modelled) / len(drops), 0.0),
            "drop_probe": {"drops": len(drops), "measured_s": measured_s, "modelled_s": modelled}}


# The runtime's per-op terms and their order: each term's bookkeeping includes the one before.
PER_OP_TERMS = ("check_op_s", "recipe_op_s")


def floored(measured: dict, bookkeeping: dict) -> dict:
    """``measured`` with each per-op term (``check_op_s``, ``recipe_op_s``, ``rebuild_op_s``)
    no lower than the runtime's bookkeeping alone (``bookkeeping``: the same terms timed on
    one-element additions, :func:`~taichi_plan.runtime.mode.calibrate_overhead`), and
    ``recipe_op_s`` no lower than ``check_op_s`` (keeping a recipe is checking and more). A
    model's term is the difference of two medians of whole forwards, so on a loaded machine
    or a model of large ops (ResNet-50's forward is about 300 ms, its runtime cost a few) the
    noise of the forward can exceed the term; a real op cannot cost the runtime less than
    the bookkeeping the one-element additions time. The measured values are kept under
    ``unfloored``."""
    out = dict(measured)
    if "checkpoint_call_s" in bookkeeping:  # a checkpoint call's own cost: microbenchmarked only
        out.setdefault("checkpoint_call_s", float(bookkeeping["checkpoint_call_s"]))
    raw = {k: measured[k] for k in (*PER_OP_TERMS, "rebuild_op_s", "module_call_s") if k in measured}
    if "module_call_s" in bookkeeping:  # measured on the model (v18, _hook_rates) where it could be
        out["module_call_s"] = max(float(measured.get("module_call_s", 0.0)), float(bookkeeping["module_call_s"]))
    low = 0.0
    for k in PER_OP_TERMS:
        if k in out:
            out[k] = low = max(out[k], float(bookkeeping.get(k, 0.0)), low)
    if "rebuild_op_s" in out:
        out["rebuild_op_s"] = max(out["rebuild_op_s"], float(bookkeeping.get("rebuild_op_s", 0.0)), 0.0)
    if any(out[k] != v for k, v in raw.items()):
        out["unfloored"] = raw
    return out


def _time_ratios(trace, call: dict, ops: list, rebuilt_s: dict[int, list[float]]) -> dict[str, float]:
    """Per op name: the seconds one re-run of its ops took in the rebuilds (``rebuilt_s``,
    counted op of the call -> [seconds, times it ran]) over the seconds the trace recorded for
    them. Per run of the op, not per rebuild: a rebuild of every recipe runs an op of several
    outputs once per output (``native_batch_norm``'s three: its ratio read about 3 on
    ResNet-50), where a plan's rebuild runs it for the outputs it dropped."""
    from .calls import counted_ops

    counted = counted_ops(trace)
    op_ids = [o for o in range(int(call["start"]), int(call["end"]) + 1) if counted[o]]
    recorded = trace.ops["duration_s"].to_numpy()
    ran: dict[str, float] = {}
    rec: dict[str, float] = {}
    for i, (sec, times) in rebuilt_s.items():
        name = ops[i][0]
        ran[name] = ran.get(name, 0.0) + sec / times
        rec[name] = rec.get(name, 0.0) + float(recorded[op_ids[i]])
    return {n: ran[n] / rec[n] for n in sorted(ran) if rec[n] > 0}


def _rebuild_all(rt, frame, clock, op_seconds: dict[int, list[float]] | None = None) -> list[float]:
    """Re-run every recipe of ``frame`` (a call run with every recipe kept) through the runtime's
    rebuild path, in op order, each storage held until its last reader has re-run; returns
    [(seconds - the seconds of the ops themselves) / re-run ops]: the path's own cost per op,
    the ops timed where they run (added, per counted op of the call, to ``op_seconds``: [seconds,
    times run]).
    [] when a recipe cannot re-run here (an input overwritten in place, say): then nothing is
    measured."""
    from . import rebuilds as runtime
    from .frame import TRef

    order = sorted(frame.recipes, key=lambda sid: (frame.recipes[sid][0].op, sid))
    last_reader: dict[int, int] = {}
    for k, sid in enumerate(order):
        for step in frame.recipes[sid]:
            for x in step.leaves:
                if isinstance(x, TRef):
                    last_reader[x.sid] = k
    run_op = runtime._run
    op_s = [0.0]

    per_op: dict[int, list[float]] = {}

    def timed_op(step, args, kwargs):
        t = clock()
        try:
            return run_op(step, args, kwargs)
        finally:
            dt = clock() - t
            op_s[0] += dt
            got = per_op.setdefault(step.op, [0.0, 0])
            got[0] += dt
            got[1] += 1

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
    if n and op_seconds is not None:
        for i, (sec, times) in per_op.items():
            acc = op_seconds.setdefault(i, [0.0, 0])
            acc[0] += sec
            acc[1] += times
    return [(dt - op_s[0]) / n] if n else []
def _runs_cleanly(forward, variants: dict, runtimes: list, ran: set[str]) -> bool:
    """Whether each of ``variants`` (name -> variant) runs once, forward and backward, with no
    error and no mismatch (a trial run: its runtime is not kept among ``runtimes``). Each name
    run goes to ``ran``: that was the variant's first run, which :func:`_interleaved` then need
    not repeat untimed."""
    n = len(runtimes)
    try:
        for name, v in variants.items():
            forward(v)
            ran.add(name)
    except Exception:  # noqa: BLE001  (calibration only: a module that cannot run in chunks is not timed)
        return False
    finally:
        ok = not any(rt.mismatches for rt in runtimes[n:])
        del runtimes[n:]
    return ok


def _partition_probes(trace, call: dict, model, problem=None):
    """What partitions are calibrated on: the model's own modules that the planner may split
    along the batch, inside the measured call, disjoint, most forward ops first (containers
    such as a ``ModuleList``, which are never called, left out), if they hold at least
    ``PROBE_MIN_SHARE`` of the call's ops; returns
    (problem, those spans, K, {chunks: (CallPlan, partitions)} for 1 and K chunks), or None
    when the call has no such module."""
    import torch

    from ..base.errors import PlanError
    from ..plan.format import Plan
    from ..problem.core import build_problem
    from ..problem.partition.find import partitionable_spans
    from ..problem.partition.span import as_partition
    from .calls import call_plans, counted_ops

    problem = problem if problem is not None else build_problem(trace)
    start, end = int(call["start"]), int(call["end"])
    counted = counted_ops(trace)
    def called(name: str) -> bool:
        try:
            return type(model.get_submodule(name)).forward is not torch.nn.Module.forward
        except AttributeError:
            return False

    chosen: list = []
    for s in sorted((s for s in partitionable_spans(problem) if s.over == "batch" and s.split and s.batch >= 2
                     and start <= s.fwd[0] and s.fwd[1] <= end and counted[s.fwd[0]] and counted[s.fwd[1]]
                     and called(s.module)),
                    key=lambda s: (s.fwd[0] - s.fwd[1], s.module)):
        if all(s.fwd[1] < c.fwd[0] or s.fwd[0] > c.fwd[1] for c in chosen):
            chosen.append(s)
    if sum(s.fwd[1] - s.fwd[0] + 1 for s in chosen) < PROBE_MIN_SHARE * (end - start + 1):
        return None
    k_most = min(PROBE_CHUNKS, *(s.batch for s in chosen))
    probes = {}
    for k in (1, k_most):
        parts = [as_partition(s, k) for s in chosen]
        plan = Plan(trace={}, budget_bytes=None, solver={}, predicted={}, partitions=parts)
        try:  # (grads_alive None: the repetitions' gradients are alive, which the guard would refuse)
            probes[k] = (replace(call_plans(plan, trace, problem)[0], probe=True, grads_alive=None), parts)
        except PlanError:
            return None
    return problem, chosen, k_most, probes


def _span_probes(trace, call: dict, problem=None) -> dict:
    """What spans of other kinds than the batch are calibrated on (:func:`_span_terms`): per
    kind, the one span of that kind inside the measured call with the most ops; returns
    {kind: (problem, span, (k1, k2), {chunks: (CallPlan, partitions)})} for its fewest chunks
    k1 and the most up to :data:`SPAN_PROBE_MOST` k2 (kinds with one choice left out)."""
    from dataclasses import replace as _replace

    from ..base.errors import PlanError
    from ..plan.format import Plan
    from ..problem.core import build_problem
    from ..problem.partition.find import partitionable_spans
    from ..problem.partition.span import as_partition
    from .calls import call_plans

    terms = _span_terms()
    problem = problem if problem is not None else build_problem(trace)
    start, end = int(call["start"]), int(call["end"])
    best: dict = {}
    for s in partitionable_spans(problem):
        if s.over in terms and start <= s.fwd[0] and s.fwd[1] <= end:
            n = terms[s.over](problem, s)[1]
            if s.over not in best or n > terms[s.over](problem, best[s.over])[1]:
                best[s.over] = s
    out = {}
    for kind, span in best.items():
        ks = tuple(sorted(c for c in span.chunk_choices if c <= SPAN_PROBE_MOST))
        if len(ks) < 2:
            continue
        probes = {}
        try:
            for k in ks:
                parts = [as_partition(span, k)]
                plan = Plan(trace={}, budget_bytes=None, solver={}, predicted={}, partitions=parts)
                probes[k] = (_replace(call_plans(plan, trace, problem)[0], probe=True, grads_alive=None), parts)
        except PlanError:
            continue
        out[kind] = ((problem, span), ks, probes)
    return out


def _span_rates(kind: str, problem_span: tuple, ks: tuple[int, ...], extra_s: list[float]) -> dict:
    """What splitting a span of ``kind`` costs, from the span's own extra seconds split into
    each of ``ks`` chunks (``extra_s``, each against the call with every op checked:
    :class:`_SpanClock`). ``chunks`` and ``extra_s`` are the measured points, which
    :func:`taichi_plan.problem.partition.overhead.span_cost` takes as they are for the probed span (``module``):
    the cost is not linear in the chunks, smaller chunks running from the caches (a 4-layer
    Llama's head split in 4 measured cheaper than in 2), and may be below 0 (a head over
    tokens runs one fused pass, faster than the span unsplit on a CPU). For other spans of the
    kind, the least-squares line through them: ``chunk_op_s``, per op of the span, what each
    further chunk costs (the slope; not below 0: a further chunk launches more ops), and
    ``redo_ratio``, what the split costs beyond the chunks' share, over the recorded seconds
    of the ops whose time it changes (not below -1: it cannot save more than those ops
    take)."""
    problem, span = problem_span
    redo_s, n_ops = _span_terms()[kind](problem, span)
    x = [k * n_ops for k in ks]
    mx, my = statistics.fmean(x), statistics.fmean(extra_s)
    sxx = sum((a - mx) ** 2 for a in x)
    slope = sum((a - mx) * (b - my) for a, b in zip(x, extra_s, strict=True)) / sxx if sxx > 0 else 0.0
    chunk_op_s = max(slope, 0.0)
    fixed_s = my - mx * chunk_op_s
    return {"redo_ratio": max(fixed_s / redo_s, -1.0) if redo_s > 0 else 0.0, "chunk_op_s": chunk_op_s,
            "module": span.module, "chunks": list(ks), "extra_s": [float(e) for e in extra_s],
            **({"fused": bool(span.fused)} if kind == "tokens" else {})}


def _partition_rates(problem, spans: list, k_most: int, whole_s: float, more_s: float) -> dict:
    """The two per-op terms of a partition's cost (:func:`taichi_plan.problem.partition.cost.partition_cost`)
    from the step's extra seconds with ``spans`` checkpointed whole (``whole_s``, against the
    call with every op checked) and split into ``k_most`` chunks (``more_s``, against whole):
    ``checkpoint_op_s``, per forward op of a span, what checkpointing it whole costs beyond
    re-running its recorded forward; ``chunk_op_s``, per op that each further chunk runs again
    (the span's forward, its re-run in backward, its backward)."""
    n_fwd = sum(s.fwd[1] - s.fwd[0] + 1 for s in spans)
    n_bwd = sum(s.bwd[1] - s.bwd[0] + 1 for s in spans)
    redo_s = sum(float(problem.op_cost[s.fwd[0]:s.fwd[1] + 1].sum()) for s in spans)
    # each span is one checkpoint call, charged on its own (checkpoint_call_s, partition_cost)
    calls_s = len(spans) * float((problem.trace.meta.get("runtime_overhead") or {}).get("checkpoint_call_s", 0.0))
    return {"checkpoint_op_s": max((whole_s - redo_s - calls_s) / n_fwd, 0.0),
            "chunk_op_s": max(more_s / ((k_most - 1) * (2 * n_fwd + n_bwd)), 0.0),
            "partition_probe": {"modules": [s.module for s in spans], "chunks": k_most}}


def _top_up(forward, variants: dict, times: dict[str, list[float]], least: int) -> None:
    """More rounds of ``variants`` alone (:func:`_interleaved`, no budget, no warm-up: they ran
    already), appended to their ``times``, until each has ``least`` repetitions: the budget's
    rounds run every variant, and a model whose rounds fit fewer times than ``least`` would
    leave out what needs that many."""
    more = least - len(times[next(iter(variants))])
    if more > 0:
        for n, t in _interleaved(forward, variants, more, float("inf"), time.perf_counter, set(variants)).items():
            times[n].extend(t)


def _interleaved(forward, variants: dict, repeats: int, budget_s: float, clock,
                 ran: set[str] | None = None) -> dict[str, list[float]]:
    """Seconds of ``forward(variant)`` per variant, ``repeats`` times each (fewer when the
    rounds would take more than ``budget_s``), each round in another order, after one untimed
    run of each variant not already run once (``ran``: their names): a variant's
    first run pays one-time costs (the runtime's op table, the first checkpoint or chunked loss
    of the process) that a step in training does not. Without :data:`WARM_UP` (the test suite:
    its tests count, they do not time) only the rounds run."""
    names = list(variants)
    if WARM_UP:
        for n in names:
            if n not in (ran or ()):
                forward(variants[n])
    times: dict[str, list[float]] = {n: [] for n in names}
    t0 = clock()
    for r in range(repeats):
        if r and (clock() - t0) * (r + 1) / r > budget_s:  # the next round would pass the budget
            break
        for i in range(len(names)):
            n = names[(r + i) % len(names)]
            times[n].append(forward(variants[n]))
    return times
