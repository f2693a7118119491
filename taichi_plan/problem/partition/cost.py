"""A partition's cost: the extra compute of running a span in chunks or checkpointed whole.

:func:`partition_cost`: on a real recording, what the runtime measured on the model's own
modules (``meta.runtime_overhead``) or head and loss (:func:`token_cost`); else the forward's
re-run plus a launch overhead per op per chunk (:func:`launch_overhead_s`, from the trace's
device profile).
"""

from __future__ import annotations

from ..core import Problem
from .overhead import span_cost
from .span import Span, occurrence_spans
from .token_span import TokenSpan, cost_terms

DEFAULT_LAUNCH_S = 1e-5


def launch_overhead_s(problem: Problem) -> float:
    name = problem.trace.meta.get("device_profile")
    if name:
        try:
            from ...trace.devices import get_profile

            return float(get_profile(name).launch_overhead_s)
        except Exception:  # noqa: BLE001 - an unknown profile name in an old trace
            pass
    return DEFAULT_LAUNCH_S


def partition_cost(problem: Problem, span: Span, chunks: int) -> float:
    if getattr(span, "more", ()):  # once per micro-batch
        return sum(partition_cost(problem, s, chunks) for s in occurrence_spans(span))
    if span.over == "tokens":
        return token_cost(problem, span, chunks, launch_overhead_s(problem))
    f0, f1 = span.fwd
    b0, b1 = span.bwd
    n_fwd, n_bwd = f1 - f0 + 1, b1 - b0 + 1
    redo = float(problem.op_cost[f0:f1 + 1].sum())
    cal = problem.trace.meta.get("runtime_overhead") or {}
    if problem.trace.cost_unit == "s" and "chunk_op_s" in cal and "checkpoint_op_s" in cal:
        # Measured on the recorded model's own modules (taichi_plan.runtime.calibrate): what
        # checkpointing costs per forward op beyond the re-run, and what each further chunk
        # costs per op it runs again (forward, re-run, backward: each op launched once more);
        # and each chunk is one torch.utils.checkpoint call, whose own cost a small module
        # (a norm of a few ops) does not amortize (checkpoint_call_s, absent in older traces).
        return (redo + n_fwd * cal["checkpoint_op_s"] + (chunks - 1) * (2 * n_fwd + n_bwd) * cal["chunk_op_s"]
                + chunks * float(cal.get("checkpoint_call_s", 0.0)))
    return redo + chunks * (n_fwd + n_bwd) * launch_overhead_s(problem)


def token_cost(problem: Problem, span: TokenSpan, chunks: int, launch_s: float) -> float:
    """What the split costs, as measured on the recorded model's own head and loss
    (``meta.runtime_overhead.span_costs.tokens``, :func:`taichi_plan.problem.partition.overhead.span_cost`; a
    fused split may cost less than none), else ``launch_s`` per op per chunk, and for a
    per-row loss the recorded time of the ops its backward runs again."""
    redo_s, n_ops = cost_terms(problem, span)
    measured = span_cost(problem, span.over, redo_s, n_ops, chunks, span.module)
    if measured is not None:
        return measured
    return (0.0 if span.fused else redo_s) + chunks * n_ops * launch_s
