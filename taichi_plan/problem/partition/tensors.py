"""The tensors of a span: what it makes, saves, holds and owns.

Its forward and backward transients and what it saves for its own backward
(:func:`internal_tensors`); what its checkpoint holds (:func:`module_inputs`, the module
call's other tensor arguments included); the weights' casts a module checkpointed whole lets
go of and makes again (:func:`saved_constants`); everything a partition owns
(:func:`span_tensors`); the outputs of a module checkpointed whole that a plan may still drop
(:func:`whole_outputs`); and so what no drop may touch (:func:`blocked_tensors`).
"""

from __future__ import annotations

import numpy as np

from ..core import Problem
from . import token_span
from .qualify import constant_tensor
from .span import Span, occurrence_spans, ops_under


def internal_tensors(problem: Problem, span: Span) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(forward transients, saved-internal, backward transients) tensor indices of ``span``."""
    f0, f1 = span.fwd
    b0, b1 = span.bwd
    kinds_ok = _own_kinds(problem)
    made_f = kinds_ok & (problem.start >= f0) & (problem.start <= f1)
    made_b = kinds_ok & (problem.start >= b0) & (problem.start <= b1) & (problem.end <= b1)
    for t in np.nonzero(made_f | made_b)[0].tolist():
        if constant_tensor(problem, t):
            made_f[t] = made_b[t] = False
    f_trans = np.nonzero(made_f & (problem.end <= f1))[0]
    later = np.nonzero(made_f & (problem.end > f1))[0]
    # Saved for the module's own backward: used nowhere else, and alive until its backward (a
    # tensor freed between the two, such as a key/value cache the caller drops, keeps its size).
    saved = np.asarray([t for t in later.tolist()
                        if problem.end[t] >= b0
                        and np.all(((problem.uses[t] >= f0) & (problem.uses[t] <= f1))
                                  | ((problem.uses[t] >= b0) & (problem.uses[t] <= b1)))], dtype=np.int64)
    b_trans = np.nonzero(made_b)[0]
    return f_trans, saved, b_trans


def _own_kinds(problem: Problem) -> np.ndarray:
    """Per tensor: an activation or temporary the step makes and frees (not there before it,
    not outliving it). Once per problem: every span asks (4273 on a 93k-op trace)."""
    mask = problem.__dict__.get("_internal_kinds")
    if mask is None:
        mask = np.isin(problem.kind, ("activation", "temporary")) & ~problem.initial & ~problem.persists
        problem.__dict__["_internal_kinds"] = mask
    return mask


def module_inputs(problem: Problem, span: Span) -> list[int]:
    """Tensors made before the module (not parameters) that its checkpoint holds: those its
    forward reads, and its call's other tensor arguments (trace v10 ``meta.module_args``: a
    decoder layer's position ids, passed and never read, stay held all the same)."""
    f0, f1 = span.fwd
    ins: set[int] = set()
    for i in range(f0, f1 + 1):
        for t in problem.op_reads[i].tolist():
            if (problem.start[t] < f0 or problem.initial[t]) and problem.kind[t] in ("activation", "temporary", "input"):
                ins.add(t)
    for t in _call_args(problem, span):
        if ((problem.start[t] < f0 <= problem.end[t] or problem.initial[t])
                and problem.kind[t] in ("activation", "temporary", "input")):
            ins.add(t)
    return sorted(ins)


def _call_args(problem: Problem, span: Span) -> list[int]:
    """The tensor arguments (problem indices) of the module call whose forward starts at the
    span's first op: the call of that order among the module's calls (its forward runs in the
    trace, one per call: ``taichi_plan.problem.partition.find._module_spans`` offers no other module). Empty for traces before v10."""
    calls = (problem.trace.meta.get("module_args") or {}).get(span.module)
    if not calls or span.over == "tokens":
        return []
    fwd = problem.__dict__.get("_forward_ops_under")
    if fwd is None:
        phases = np.asarray(problem.op_phase)
        fwd = problem.__dict__["_forward_ops_under"] = {m: ops[phases[ops] == "forward"]
                                                        for m, ops in ops_under(problem.op_module).items()}
    f = fwd.get(span.module)
    if f is None:
        return []
    k = int(np.sum((np.diff(f) != 1)[f[1:] <= span.fwd[0]])) if len(f) > 1 else 0  # runs before this one
    if k >= len(calls):
        return []
    index = problem._index
    return [index[int(tid)] for tid in calls[k][1] if int(tid) in index]


def span_tensors(problem: Problem, span: Span) -> set[int]:
    """Tensors a partition owns: everything its forward ops read or make (its inputs are held
    by the checkpointed chunks, its outputs are rebuilt by concatenation), plus its insides."""
    if span.over == "tokens":
        return token_span.span_tensors(problem, span)
    out: set[int] = set()
    for s in occurrence_spans(span):
        f0, f1 = s.fwd
        for i in range(f0, f1 + 1):
            out.update(problem.op_reads[i].tolist())
            out.update(problem.op_outputs[i].tolist())
        for arr in internal_tensors(problem, s):
            out.update(arr.tolist())
    return out


def whole_outputs(problem: Problem, span: Span) -> set[int]:
    """The outputs of a module checkpointed whole (one chunk) that a plan may still drop: made
    by its forward, read after it only by ops outside the module that run before its backward
    (never by its own backward, whose re-run re-makes what it reads, nor after it, when the
    checkpoint no longer holds the inputs). A drop of one is rebuilt through the module's insides,
    re-run from its inputs, which the checkpoint holds until its backward (the runtime rebuilds
    gone inputs recursively): so a norm checkpointed whole keeps its input alone, not its
    output too. Split into chunks, a module's outputs are joined pieces: never dropped."""
    if span.over == "tokens":
        return set()
    f0, f1 = span.fwd
    b0 = span.bwd[0]
    made = np.nonzero(_own_kinds(problem) & (problem.start >= f0) & (problem.start <= f1) & (problem.end > f1))[0]
    # What a re-run of the module reads from outside it: its inputs (held by the checkpoint)
    # and parameters, which must be in memory at the rebuild (under FSDP: its unit gathered).
    held_in = set(module_inputs(problem, span))
    outside = {u for i in range(f0, f1 + 1) for u in problem.op_reads[i].tolist()
               if problem.start[u] < f0 or problem.initial[u]} - held_in
    rebuild_at = problem.__dict__.get("_first_rebuild")  # per candidate tensor: its first rebuild point
    if rebuild_at is None:
        rebuild_at = {}
        for t, b in zip(problem.candidates.tolist(), problem.cand_remat_before.tolist(), strict=True):
            rebuild_at[t] = min(b, rebuild_at.get(t, b))
        problem.__dict__["_first_rebuild"] = rebuild_at
    out = set()
    for t in made.tolist():
        u = problem.uses[t]
        if ((u > f1).any() and not (u >= b0).any() and t in rebuild_at
                and all(problem.held(x, rebuild_at[t]) for x in outside)):
            out.add(t)
    return out


def blocked_tensors(problem: Problem, span, chunks: int) -> set[int]:
    """Tensors no drop may touch (nor re-make in its rebuild) when ``span`` is partitioned into
    ``chunks``: everything its forward reads or makes (:func:`span_tensors`), except, for one
    chunk, the outputs of :func:`whole_outputs`."""
    owned = span_tensors(problem, span)
    if chunks == 1 and span.over != "tokens":
        for s in occurrence_spans(span):
            owned = owned - whole_outputs(problem, s)
    return owned


def saved_constants(problem: Problem, span: Span) -> list[int]:
    """Tensors the span's forward makes from parameters or buffers alone (no batch in them:
    :func:`~taichi_plan.problem.partition.qualify.constant_tensor`, left out of :func:`internal_tensors`) that only the span's own
    forward and backward use, and that the step's code lets go of before the backward
    starts: autocast's cast of a weight (the cache holds it until its region ends). Checkpointed
    whole, the module saves none of them: each is freed then and cast again by the re-run in
    backward (on a tiny GPT-2 under bf16 autocast with ``mlp.c_fc`` checkpointed: 131,072 B
    of its weight's cast, which the model held through the gap and the run did not)."""
    if "python_refs" not in problem.trace.meta:
        return []  # when the step's code lets go is not known: kept through the gap, the safe side
    f0, f1 = span.fwd
    b0, b1 = span.bwd
    out = []
    made = np.nonzero(_own_kinds(problem) & (problem.start >= f0) & (problem.start <= f1) & (problem.end >= b0))[0]
    for t in made.tolist():
        u = problem.uses[t]
        if (constant_tensor(problem, t) and np.all(((u >= f0) & (u <= f1)) | ((u >= b0) & (u <= b1)))
                and len(u[u >= b0]) and problem.release_after(t, int(u[u <= f1][-1]) if len(u[u <= f1]) else f0) < b0):
            out.append(t)
    return out
