"""The rates fitted from calibration's timed runs: a partition's per-op terms, a span's cost
per chunk, what module hooks and regions cost, what a drop costs beyond its modelled rebuild,
and :func:`floored`, which keeps each per-op term no lower than the runtime's bookkeeping
alone."""

from __future__ import annotations

import statistics

from .config import CalibrationConfig, default_config
from .probes import span_terms


def module_hook_rates(times: dict, config: CalibrationConfig | None = None) -> dict:
    """``module_call_s`` and ``region_s`` (trace v18) measured on the model, from the drop
    probe's runs (own-clocked: each run's module-hook seconds, module calls and regions entered
    are its times' 5th-7th): ``module_call_s``, what the module hooks cost per module call in
    the probe's call with the hooks alone and no region: since trace v20 the run unclocked
    (``hooks_whole``) against the call plain, forward and backward seconds paired per
    repetition (the step pays both), over the module calls, never below their own seconds per
    call (the clocked run ``hooks``: the hooks' Python alone, all v18-v19 measured; returned as
    ``module_call_own_s``, and the forward's share per call as ``module_call_forward_s``, for
    :func:`region_outside`). The own seconds miss the module calls' slow path once hooks are
    on and the crossing into the hooks and back: on a 4-layer Llama its 65 module calls cost
    1.4-2.9 ms whole in four recordings (22-44 us each, 0.8-2.2 ms of it in the forward),
    where their own seconds were 11-12 us each, and its plan at HF's peak (57 module calls, 75
    ops in 8 regions) measured its regions 1.3 ms over their v19 prediction.
    ``module_call_probe`` keeps the whole, forward and own seconds, the calls and the
    repetitions; the whole run is not used under ``config.region_min_repeats`` repetitions (then
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
        if len(whole) >= (config or default_config()).region_min_repeats and calls > 0:
            out["module_call_s"] = max(step_s / calls, own_s)
            out["module_call_forward_s"] = max(forward_s / calls, own_s)
    return out


def region_outside(times: dict, ops: int, hooks_beyond_s: float = 0.0,
                   config: CalibrationConfig | None = None) -> dict:
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
    ``region_op_s`` is left out (charged 0) under ``config.region_min_repeats`` repetitions: the
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
    if len(kept) < (config or default_config()).region_min_repeats:
        return {"region_probe": probe}
    return {"region_op_s": max((whole_s - own_s) / ops, 0.0), "region_probe": probe}


def drop_rate(probe, measured_s: float, rates: dict) -> dict:
    """``drop_s``: per dropped tensor, the runtime's own extra seconds under the drop probe's
    plan against the same call with the same recipes kept and nothing dropped (``measured_s``:
    in the forward, its handler and pack hook with the kernels taken out; in the backward, its
    unpack hooks with the rebuilds they run; the checking and the recipes cancel out. Until
    2026-12-01 it was the difference of whole forwards and backwards, whose noise read 0-870 us
    per drop) beyond what the rebuild terms of ``rates`` predict for the drops (their
    re-run ops at their measured time ratios, ``rebuild_op_s`` each:
    :func:`taichi_plan.problem.partition.overhead.rebuild_seconds`); not below 0. ``drop_probe`` says what
    it was measured on."""
    from ...problem.partition.overhead import rebuild_seconds
    from ...simulate.core import simulate_plan

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
    if "module_call_s" in bookkeeping:  # measured on the model (v18, module_hook_rates) where it could be
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


def span_rates(kind: str, problem_span: tuple, ks: tuple[int, ...], extra_s: list[float]) -> dict:
    """What splitting a span of ``kind`` costs, from the span's own extra seconds split into
    each of ``ks`` chunks (``extra_s``, each against the call with every op checked:
    :class:`~.clocks.SpanClock`). ``chunks`` and ``extra_s`` are the measured points, which
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
    redo_s, n_ops = span_terms()[kind](problem, span)
    x = [k * n_ops for k in ks]
    mx, my = statistics.fmean(x), statistics.fmean(extra_s)
    sxx = sum((a - mx) ** 2 for a in x)
    slope = sum((a - mx) * (b - my) for a, b in zip(x, extra_s, strict=True)) / sxx if sxx > 0 else 0.0
    chunk_op_s = max(slope, 0.0)
    fixed_s = my - mx * chunk_op_s
    return {"redo_ratio": max(fixed_s / redo_s, -1.0) if redo_s > 0 else 0.0, "chunk_op_s": chunk_op_s,
            "module": span.module, "chunks": list(ks), "extra_s": [float(e) for e in extra_s],
            **({"fused": bool(span.fused)} if kind == "tokens" else {})}


def partition_rates(problem, spans: list, k_most: int, whole_s: float, more_s: float) -> dict:
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
