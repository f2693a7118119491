"""A problem with a plan's partitions applied: the rewritten timeline, and their cost.

:func:`apply_partitions` checks each partition against the trace's spans, then rewrites the
timeline: a span split in chunks gives its own tensors' bytes to its chunked peaks
(:func:`taichi_plan.problem.partition.peaks.chunked_peaks`) and its outputs and input
gradients re-enter whole; a module checkpointed whole has its saved tensors gone from their
last forward use until its backward, its inputs held, and the peak of its re-run; a head over
tokens is :func:`taichi_plan.problem.partition.token_span.apply`'s. The candidates left for
drops are those outside every partition. :func:`partitioned_live`: only the live bytes per op.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...base.errors import PlanError
from ..core import Problem, rebuild_set
from . import token_span
from .cost import partition_cost
from .find import partitionable_spans
from .peaks import chunked_peaks, forward_lives, rerun_at, rerun_copy_end, rerun_peak
from .span import Span, is_under, occurrence_spans, span_key
from .tensors import internal_tensors, module_inputs, saved_constants, span_tensors, whole_outputs

_SYNTHETIC_ID = -(10**12)  # ids of the concatenation transients (below any -1 - tensor_id)


def candidate_rebuild_sets(problem: Problem) -> list[set[int] | tuple]:
    """Per candidate of ``problem``: the tensors its lone rebuild at its rebuild point re-makes
    (:func:`~taichi_plan.problem.core.rebuild_set`; empty when it cannot be rebuilt alone).
    They do not depend on the plan: computed once per problem (every simulation of a plan with
    partitions asks, and on a 93k-op trace they took 0.1 s each time)."""
    cached = problem.__dict__.get("_cand_rebuild_sets")
    if cached is None or cached[0] is not problem.candidates:  # (the candidates they are for, sets)
        cached = (problem.candidates, [rebuild_set(problem, int(t), int(b)) or () for t, b in
                                       zip(problem.candidates.tolist(), problem.cand_remat_before.tolist(), strict=True)])
        problem.__dict__["_cand_rebuild_sets"] = cached
    return cached[1]


def apply_partitions(problem: Problem, partitions, drops=()) -> tuple[Problem, float]:
    """A problem with the partitions applied (see the package docstring), and their cost.
    ``drops`` may not touch a partitioned module's internal tensors."""
    if not partitions:
        return problem, 0.0
    return _apply_partitions(problem, partitions, drops, live_only=False)


def partitioned_live(problem: Problem, partitions) -> np.ndarray:
    """The unplanned live bytes per op with ``partitions`` applied: :func:`apply_partitions`'s
    ``baseline_live``, without building its problem (its candidates and indexes, which the
    floor's hundreds of partition options never read: 10 s of a 30 s limit on a 93k-op trace)."""
    if not partitions:
        return problem.baseline_live
    return _apply_partitions(problem, partitions, (), live_only=True)[0]


def _apply_partitions(problem: Problem, partitions, drops, live_only: bool):
    if len({p.module for p in partitions}) != len(partitions):
        raise PlanError("The plan partitions the same module twice (along its batch and over tokens?); keep one.")
    names = [p.module for p in partitions]
    for x in names:
        for y in names:
            if x != y and is_under(y, x):
                raise PlanError(f"The plan partitions both {x!r} and {y!r}, which is inside it; keep one.")
    spans = {span_key(s): s for s in partitionable_spans(problem)}
    nbytes = problem.nbytes.copy()
    start = problem.start.copy()
    end = problem.end.copy()
    new_t, new_id, new_nb, new_s, new_e = [], [], [], [], []
    cost = 0.0
    internal: set[int] = set()  # no drop may touch these, nor re-make one in its rebuild
    through: set[int] = set()  # insides of modules checkpointed whole: a rebuild may re-run them
    recast: set[int] = set()  # of those, casts of weights the module re-makes (saved_constants)
    whole_outs: set[int] = set()  # their outputs a plan may drop (whole_outputs)
    for part in partitions:
        span = spans.get(span_key(part))
        if span is None or part.dim != (1 if span.over == "sequence" else 0):
            what = {"tokens": "its loss over tokens", "sequence": "over its positions (the sequence)"}.get(
                span_key(part)[1], f"along dim {part.dim}")
            raise PlanError(
                f"The plan partitions module {part.module!r} {what}, but in this trace that module is not "
                "independent along it, leaves a tensor behind in the model's state that a re-run would "
                "make again (a KV cache: run the model with use_cache=False), or is not there. Partition "
                "only modules that `taichi-plan solve` proposes; the plan may be for another trace."
            )
        k = int(part.chunks)
        if k > 1 and span.random_ops and not (problem.partition_random or getattr(part, "random_draws", None)):
            raise PlanError(
                f"The plan partitions module {part.module!r}, which draws random numbers (op "
                f"{span.random_ops[0]}, {problem.op_name[span.random_ops[0]]}), but does not record that its chunks "
                "draw their own: partitioning it changes training. Solve again with --partition-random to allow it.")
        if span.over == "sequence" and k not in span.chunk_choices:
            raise PlanError(f"The plan splits {part.module!r} into {k} runs of its {span.batch} positions; use one of "
                            f"{', '.join(map(str, span.chunk_choices))} (they divide the positions and are not batch "
                            "chunks already).")
        if span.over == "tokens" and k < 2:
            raise PlanError(f"The plan computes {part.module!r}'s loss in {k} chunk(s) of its tokens; use 2 or more.")
        if k < 1 or k > span.batch or (k > 1 and not getattr(span, "split", True)):
            most = span.batch if getattr(span, "split", True) else 1
            raise PlanError(f"The plan splits {part.module!r} into {k} chunks; use 1..{most} (1: checkpointed "
                            "whole; more only where the module is independent along its batch).")
        if span.over == "tokens":
            added: list[tuple[int, int, int, int]] = []
            internal.update(token_span.apply(problem, span, k, nbytes, start, end, added))
            for like, nb, s0, s1 in added:
                new_t.append(like)
                new_id.append(_SYNTHETIC_ID - len(new_id))
                new_nb.append(nb)
                new_s.append(s0)
                new_e.append(s1)
            cost += partition_cost(problem, span, k)
            continue
        for occ in occurrence_spans(span):  # once per micro-batch
            if k == 1:
                owned = _checkpointed_whole(problem, occ, nbytes, end, new_t, new_id, new_nb, new_s, new_e)
                outs = whole_outputs(problem, occ)
                if outs:
                    through.update(t for t in owned if problem.start[t] >= occ.fwd[0] and t not in outs)
                    whole_outs.update(outs)
                    recast.update(saved_constants(problem, occ))
                internal.update(owned - outs)
                continue
            internal.update(span_tensors(problem, occ))
            for at, nb in chunked_peaks(problem, occ, k, nbytes, start, end).items():
                new_t.append(-1)
                new_id.append(_SYNTHETIC_ID - len(new_id))
                new_nb.append(nb)
                new_s.append(at)
                new_e.append(at)
        cost += partition_cost(problem, span, k)
    clash = [d.tensor for d in drops if d.tensor in internal]
    if clash:
        raise PlanError(
            f"The plan both drops tensor {int(problem.tensor_id[clash[0]])} and partitions a module that "
            "reads or makes it; a partitioned module keeps its inputs and recomputes its insides."
        )
    extra = np.asarray(new_t, dtype=np.int64)
    like = np.where(extra >= 0, extra, 0)
    kinds_new = np.where(extra >= 0, problem.kind[like], "temporary") if len(extra) else problem.kind[:0]
    if live_only:
        return _live_of(problem.num_ops, np.concatenate([start, np.asarray(new_s, dtype=np.int64)]),
                        np.concatenate([end, np.asarray(new_e, dtype=np.int64)]),
                        np.concatenate([nbytes, np.asarray(new_nb, dtype=np.int64)])), cost
    # Candidates left: outside every partition, and whose lone rebuild re-makes nothing of one.
    sets = candidate_rebuild_sets(problem)
    keep = np.fromiter((int(t) not in internal and internal.isdisjoint(r)
                        for t, r in zip(problem.candidates.tolist(), sets, strict=True)),
                       dtype=bool, count=len(problem.candidates))
    empty = np.zeros(0, dtype=np.int64)
    out = dataclasses.replace(
        problem,
        tensor_id=np.concatenate([problem.tensor_id, np.asarray(new_id, dtype=np.int64)]),
        nbytes=np.concatenate([nbytes, np.asarray(new_nb, dtype=np.int64)]),
        kind=np.concatenate([problem.kind, kinds_new]),
        producer=np.concatenate([problem.producer, np.full(len(extra), -1, dtype=np.int64)]),
        start=np.concatenate([start, np.asarray(new_s, dtype=np.int64)]),
        end=np.concatenate([end, np.asarray(new_e, dtype=np.int64)]),
        uses=problem.uses + [empty] * len(extra),
        # Replay runs a partitioned module's forward on chunks: none of the tensors it reads or
        # makes exists as the trace's op made it, so no rebuild can re-run one of those ops;
        # but a module checkpointed whole runs its forward as recorded, and a dropped output of
        # it is rebuilt through its insides (whole_outputs).
        rematerializable=np.concatenate([_set_mask(_set_mask(problem.rematerializable, internal - through, False), recast, True),
                                         np.zeros(len(extra), dtype=bool)]),
        rebuild_ops=_recast_ops(problem, recast) + [empty] * len(extra),
        remat_deadline=np.concatenate([problem.remat_deadline, np.zeros(len(extra), dtype=np.int64)]),
        initial=np.concatenate([problem.initial, np.zeros(len(extra), dtype=bool)]),
        persists=np.concatenate([problem.persists, np.zeros(len(extra), dtype=bool)]),
        candidates=problem.candidates[keep],
        cand_free_after=problem.cand_free_after[keep],
        cand_remat_before=problem.cand_remat_before[keep],
        cand_early_remat=problem.cand_early_remat[keep],
    )
    out.baseline_live = _live(out)
    if whole_outs:
        # A whole module's output has no early-rebuild point here (it was found with the
        # module's insides alive), and stays a candidate only where its rebuild through them
        # can run (whole_outputs checks the parameters; this, the whole chain).
        out.cand_early_remat = np.where(np.isin(out.candidates, list(whole_outs)), -1, out.cand_early_remat)
    lost = [k for k, (t, b) in enumerate(zip(out.candidates.tolist(), out.cand_remat_before.tolist(), strict=True))
            if t in whole_outs and rebuild_set(out, t, b) is None]
    if lost:
        ok = np.ones(len(out.candidates), dtype=bool)
        ok[lost] = False
        out.candidates, out.cand_free_after = out.candidates[ok], out.cand_free_after[ok]
        out.cand_remat_before, out.cand_early_remat = out.cand_remat_before[ok], out.cand_early_remat[ok]
    return out, cost


def _checkpointed_whole(problem: Problem, span: Span, nbytes, end, new_t, new_id, new_nb, new_s, new_e) -> set[int]:
    """One chunk: the module's saved tensors are gone from their last forward use (or when the
    step's code lets go of them, later) until its backward, and so are what it makes from
    parameters alone for its backward (:func:`~taichi_plan.problem.partition.tensors.saved_constants`); its inputs
    are held until its backward is done (see the package docstring). The re-run before the backward's first
    read of them holds what it re-makes and its own transients at once: where that is more
    than the saved tensors and that op's outputs, the difference is on the timeline there
    (an XLNet layer's attention scores, made late in its forward: 8,832 B over before)."""
    _f_trans, saved, _b_trans = internal_tensors(problem, span)
    first = len(new_t)
    for t in saved.tolist() + saved_constants(problem, span):
        last_fwd = problem.uses[t][problem.uses[t] <= span.fwd[1]]
        end[t] = int(last_fwd[-1]) if len(last_fwd) else int(problem.start[t])
        # held past its last use while the step's code holds it: autocast's cached cast of a
        # weight stays in the cache until the autocast region ends
        end[t] = problem.release_after(t, int(end[t]))
        new_t.append(t)
        new_id.append(-1 - int(problem.tensor_id[t]))
        new_nb.append(int(nbytes[t]))
        new_s.append(span.bwd[0])
        new_e.append(rerun_copy_end(problem, t, span, int(problem.end[t])))
    made_f, _held, _outputs, fwd_life, needed = forward_lives(problem, span)
    r = rerun_at(problem, span, needed)
    if r is not None:
        there = sum(nb for nb, s0, s1 in zip(new_nb[first:], new_s[first:], new_e[first:], strict=True) if s0 <= r <= s1)
        there += int(problem.nbytes[problem.op_outputs[r]].sum())
        over = rerun_peak(problem, span, made_f, fwd_life, needed, lambda t: int(problem.nbytes[t])) - there
        if over > 0:
            new_t.append(-1)
            new_id.append(_SYNTHETIC_ID - len(new_id))
            new_nb.append(over)
            new_s.append(r)
            new_e.append(r)
    for t in module_inputs(problem, span):
        if not problem.persists[t]:
            end[t] = max(int(end[t]), span.bwd[1])
    return span_tensors(problem, span)


def _recast_ops(problem: Problem, recast: set[int]) -> list[np.ndarray]:
    """``problem.rebuild_ops`` with each tensor of ``recast`` re-made by its producer alone:
    a weight's cast that autocast caches (the recorder marks its op not recomputable, since
    dropping it frees nothing while the cache holds it) is gone once a module checkpointed
    whole has run its forward (:func:`~taichi_plan.problem.partition.tensors.saved_constants`), and a rebuild of that module's
    output through its insides casts the weight again, as the checkpoint's own re-run does.
    Never a drop: these tensors stay internal to the module."""
    if not recast:
        return problem.rebuild_ops
    out = list(problem.rebuild_ops)
    for t in recast:
        out[t] = np.asarray([problem.producer[t]], dtype=np.int64)
    return out


def _set_mask(mask: np.ndarray, tensors: set[int], value: bool) -> np.ndarray:
    """A copy of ``mask`` with ``tensors`` set to ``value`` (``mask`` itself when none)."""
    out = mask.copy()
    if tensors:
        out[np.fromiter(tensors, dtype=np.int64, count=len(tensors))] = value
    return out


def _live(problem: Problem) -> np.ndarray:
    return _live_of(problem.num_ops, problem.start, problem.end, problem.nbytes)


def _live_of(n: int, start: np.ndarray, end: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Bytes live during each of ``n`` ops, each tensor from ``start`` through ``end``."""
    delta = np.zeros(n + 1, dtype=np.int64)
    np.add.at(delta, start, nbytes)
    np.add.at(delta, end + 1, -nbytes)
    return np.cumsum(delta)[:n]
