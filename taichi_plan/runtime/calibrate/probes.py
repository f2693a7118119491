"""What calibration runs the model's call under besides the runtime checking every op: plans of
the model's own that split its modules along the batch (:func:`build_partition_probes`), split
its spans of other kinds (:func:`build_span_probes`; the kinds in :func:`span_terms`) and drop
tensors (:func:`build_drop_probe`), each as the call's ``CallPlan``, at the chunk counts and
shares of the peak their :class:`~.config.CalibrationConfig` says."""

from __future__ import annotations

from dataclasses import replace

from .config import CalibrationConfig, default_config


def span_terms() -> dict:
    """Per span kind (a span's ``over``) other than the batch: the function giving a span's
    (recorded seconds of the ops its chunks run again, its forward and backward ops), the two
    quantities its cost scales (:func:`taichi_plan.problem.partition.overhead.span_cost`). A new kind of span
    is calibrated by adding its own here."""
    from ...problem.partition import token_span

    return {"tokens": token_span.cost_terms}


def build_drop_probe(trace, call: dict, config: CalibrationConfig | None = None):
    """A plan of the model's own that drops tensors of the measured call and partitions
    nothing (the heuristic's drops at the first of ``config.drop_probe_fractions`` that fits,
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

    from ...problem.core import build_problem
    from ...solve import solve
    from ...solve.result import drops_from_plan
    from ..calls import call_plans

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

    for share in (config or default_config()).drop_probe_fractions:
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


def build_partition_probes(trace, call: dict, model, problem=None, config: CalibrationConfig | None = None):
    """What partitions are calibrated on: the model's own modules that the planner may split
    along the batch, inside the measured call, disjoint, most forward ops first (containers
    such as a ``ModuleList``, which are never called, left out), if they hold at least
    ``config.probe_min_share`` of the call's ops; returns
    (problem, those spans, K, {chunks: (CallPlan, partitions)} for 1 and K chunks), or None
    when the call has no such module."""
    import torch

    from ...base.errors import PlanError
    from ...plan.format import Plan
    from ...problem.core import build_problem
    from ...problem.partition.find import partitionable_spans
    from ...problem.partition.span import as_partition
    from ..calls import call_plans, counted_ops

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
    config = config or default_config()
    if sum(s.fwd[1] - s.fwd[0] + 1 for s in chosen) < config.probe_min_share * (end - start + 1):
        return None
    k_most = min(config.probe_chunks, *(s.batch for s in chosen))
    probes = {}
    for k in (1, k_most):
        parts = [as_partition(s, k) for s in chosen]
        plan = Plan(trace={}, budget_bytes=None, solver={}, predicted={}, partitions=parts)
        try:  # (grads_alive None: the repetitions' gradients are alive, which the guard would refuse)
            probes[k] = (replace(call_plans(plan, trace, problem)[0], probe=True, grads_alive=None), parts)
        except PlanError:
            return None
    return problem, chosen, k_most, probes


def build_span_probes(trace, call: dict, problem=None, config: CalibrationConfig | None = None) -> dict:
    """What spans of other kinds than the batch are calibrated on (:func:`span_terms`): per
    kind, the one span of that kind inside the measured call with the most ops; returns
    {kind: (problem, span, (k1, k2), {chunks: (CallPlan, partitions)})} for its fewest chunks
    k1 and the most up to ``config.span_probe_most`` k2 (kinds with one choice left out)."""
    from dataclasses import replace as _replace

    from ...base.errors import PlanError
    from ...plan.format import Plan
    from ...problem.core import build_problem
    from ...problem.partition.find import partitionable_spans
    from ...problem.partition.span import as_partition
    from ..calls import call_plans

    terms = span_terms()
    problem = problem if problem is not None else build_problem(trace)
    start, end = int(call["start"]), int(call["end"])
    best: dict = {}
    for s in partitionable_spans(problem):
        if s.over in terms and start <= s.fwd[0] and s.fwd[1] <= end:
            n = terms[s.over](problem, s)[1]
            if s.over not in best or n > terms[s.over](problem, best[s.over])[1]:
                best[s.over] = s
    out = {}
    most = (config or default_config()).span_probe_most
    for kind, span in best.items():
        ks = tuple(sorted(c for c in span.chunk_choices if c <= most))
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
