"""Finding the spans of a problem that a plan may partition, and the planners' options.

:func:`partitionable_spans`: the modules called once per micro-batch (a wrapper replay can
run) that qualify along the batch or, checkpointed whole, at one chunk; those position-wise
over their positions; and the head + loss spans over tokens. :func:`module_spans`: of those,
what the planners choose from (random ones split only on the solve's opt-in; capped by whole
classes of repeated modules, the most bytes inside per second of forward first).
:func:`state_keepers` names the modules left out for the state they leave behind, and
:func:`find_span` the span a plan's partition names.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from ..core import Problem, batch_and_seq
from .position_span import sequence_spans
from .qualify import (
    MIXES_BATCH,
    casts_parameter,
    constant_tensor,
    draws_random,
    leaves_state,
    state_writes,
)
from .span import Span, ops_under, span_key
from .tensors import internal_tensors
from .token_span import token_spans


def find_span(problem: Problem, part):
    """The span a partition names (module and ``over``), or None."""
    key = span_key(part)
    return next((s for s in partitionable_spans(problem) if span_key(s) == key), None)


MAX_SPANS = 48  # options considered, split and whole apart: the most bytes inside per forward second


def module_spans(problem: Problem) -> list:
    """The planners' partition options: the modules that can be partitioned along dim 0, with
    their forward and backward spans, random ones split only where ``problem.partition_random``
    (else checkpointed whole, one chunk), and the position-wise ones that cannot, over their
    positions (:mod:`taichi_plan.problem.partition.position_span`) (of those that can be split, and apart of those that
    can only be checkpointed whole, the ``MAX_SPANS`` with the most bytes made inside them per
    second of their forward: what a partition can save, per what it runs again), then the
    head + loss spans that can be partitioned over tokens
    (:func:`taichi_plan.problem.partition.token_span.token_spans`)."""
    cached = getattr(problem, "_module_spans", None)
    if cached is not None:
        return cached
    if problem.trace.meta.get("compiled") is not None:
        return []  # a compiled step's plan runs through compile's partitioner: no partitions yet
    # A random module without the opt-in is still checkpointed whole: its one chunk re-runs
    # with the RNG state it first ran with, so it draws the same numbers (the package docstring).
    spans = [s if problem.partition_random or not s.random_ops else dataclasses.replace(s, split=False)
             for s in _batch_spans(problem)]
    # Over positions: where the batch cannot be split (a batch of one, tensors not batch-major),
    # so a trace whose batch splits keeps the options it had; a random module only with the
    # opt-in (none is checkpointed whole over positions: that is its batch span's one chunk).
    # One that casts a weight (autocast) only where the trace says when the cast is let go
    # of, as along the batch.
    by_batch = {s.module for s in _batch_spans(problem) if s.split}
    refs = "python_refs" in problem.trace.meta
    spans += [s for s in _sequence_spans(problem)
              if s.module not in by_batch and (problem.partition_random or not s.random_ops)
              and (refs or not casts_parameter(problem, *s.fwd))]
    # Capped apart: modules that can be split (along the batch or the sequence), and those that
    # can only be checkpointed whole (outer ones hold the most bytes and would crowd the split
    # ones out of one cap).
    keep: set[tuple[str, str]] = set()
    for split in (True, False):
        group = [s for s in spans if s.split == split]
        inside = {span_key(s): sum(int(problem.nbytes[a].sum()) for a in internal_tensors(problem, s)) for s in group}
        cost = {span_key(s): float(problem.op_cost[s.fwd[0]:s.fwd[1] + 1].sum()) for s in group}
        keep.update(_capped_by_class(inside, MAX_SPANS, cost))
    spans = [s for s in spans if span_key(s) in keep] + token_spans(problem)
    problem._module_spans = spans
    return spans


_BLOCK_INDEX = re.compile(r"\.\d+(?=\.|$)")


def module_class(module: str) -> str:
    """A module's name with its block indices replaced (``model.layers.3.mlp`` ->
    ``model.layers.#.mlp``): the repeats of one module in a stack of blocks share it."""
    return _BLOCK_INDEX.sub(".#", module)


def _capped_by_class(inside: dict, most: int, cost: dict) -> list:
    """Of the spans ``inside`` (key -> bytes made inside), whole classes of repeats at a time
    (:func:`module_class`), at most ``most`` spans: the classes with the most bytes in one
    repeat per second of forward (``cost``: key -> recorded seconds of its forward, what
    checkpointing it re-runs) first; a class that no
    longer fits is passed over for the ones after it, but the first class is taken whole
    whatever its size (an 80-layer model's norms). Repeats tie in bytes, so a cap by bytes
    alone kept an arbitrary part of a class (24 of the 32 input norms of a 32-layer Llama): a
    plan of a class in part moves a repeated peak to the repeats left out instead of lowering
    it. By bytes alone, a 32-layer Llama's attentions (20.8 GB inside each at batch 34, 13.8 ms
    of forward) crowded out its norms (14.8 GB, 3.1 ms), which a plan frees at a quarter of
    the cost per byte."""
    def rank(k) -> float:
        return inside[k] / max(cost[k], 1e-12)

    classes: dict[tuple, list] = {}
    for key in sorted(inside, key=lambda k: -rank(k)):
        classes.setdefault((module_class(key[0]), key[1]), []).append(key)
    out: list = []
    for members in sorted(classes.values(), key=lambda c: -rank(c[0])):
        if not out or len(out) + len(members) <= most:
            out.extend(members)
    return out


def state_keepers(problem: Problem) -> list[str]:
    """The innermost modules left out of partitioning because their forward leaves a tensor
    in the model's Python state (:func:`~taichi_plan.problem.partition.qualify.leaves_state`: a Hugging Face attention's KV cache;
    the blocks and the model around them are left out too, and not named)."""
    _batch_spans(problem)
    keeps = getattr(problem, "_keeps_state", None) or []
    return [m for m in keeps if not any(o.startswith(m + ".") for o in keeps)]


def partitionable_spans(problem: Problem) -> list:
    """Every span a plan may name, random modules included: what a plan's partitions are
    looked up in (the planners choose from :func:`module_spans`)."""
    if problem.trace.meta.get("compiled") is not None:
        return []
    return _batch_spans(problem) + _sequence_spans(problem) + token_spans(problem)


def _batch_spans(problem: Problem) -> list[Span]:
    """Every module that can be partitioned along dim 0, random ones included (cached)."""
    cached = getattr(problem, "_partitionable_spans", None)
    if cached is None:
        cached = problem._partitionable_spans = _module_spans(problem)
    return cached


def _sequence_spans(problem: Problem) -> list[Span]:
    """The position-wise modules, split over their positions, random ones included (cached:
    :func:`taichi_plan.problem.partition.position_span.sequence_spans`)."""
    cached = getattr(problem, "_sequence_spans", None)
    if cached is None:
        cached = problem._sequence_spans = sequence_spans(problem, _batch_spans(problem))
    return cached


def _called_modules(problem: Problem, under: dict) -> set[str]:
    """The modules whose forward the step called (trace v8 ``meta.called_modules``): replay
    partitions a module by wrapping its forward, and a container (``ModuleList``,
    ``ModuleDict``) runs its children's ops without ever being called, so a wrapper on it
    would never run. Older traces: every module with ops under it except those that look like
    such a container, with no ops of their own and only numbered children (a ``Sequential``
    of that shape is left out too: one option fewer, never a plan that cannot run)."""
    known = problem.trace.meta.get("called_modules")
    if known is not None:
        return set(known)
    own = set(problem.op_module)
    children: dict[str, list[str]] = {}
    for m in under:
        if "." in m:
            parent, last = m.rsplit(".", 1)
            children.setdefault(parent, []).append(last)
    return {m for m in under
            if m in own or m not in children or not all(c.isdigit() for c in children[m])}


def _module_spans(problem: Problem) -> list[Span]:
    if not problem.trace.meta.get("workload"):
        return []  # no model to run the module of (hand-built traces): nothing to replay
    phases = np.asarray(problem.op_phase)
    under = ops_under(problem.op_module)
    batch = _batch_size(problem) or 1
    shapes = problem.trace.tensors["shape"].tolist()
    writes_state = state_writes(problem)
    called = _called_modules(problem, under)
    calls = problem.trace.meta.get("module_args") or {}  # trace v10: one entry per forward call
    keeps = problem._keeps_state = []
    out = []
    for m in sorted(under):
        if m not in called:
            continue  # a ModuleList or ModuleDict: never called, so nothing can run it on chunks
        ops = under[m]
        f = ops[phases[ops] == "forward"]
        b = ops[phases[ops] == "backward"]
        if len(f) < 2 or len(b) < 1:
            continue
        occ = _occurrences(f, b)
        if occ is None or len(calls.get(m, occ)) != len(occ):
            continue  # called more than once per forward (back to back, ALBERT), or interleaved: not modelled
        if any(any(k in problem.op_name[i] for k in MIXES_BATCH) for i in (*f.tolist(), *b.tolist())):
            continue
        if any(writes_state[f0:f1 + 1].any() for (f0, f1), _ in occ):
            continue  # a re-run forward would update a buffer (a running statistic) twice
        (f0, f1), bwd = occ[0]
        random_ops = tuple(i for i in range(f0, f1 + 1) if draws_random(problem, i))
        made = np.nonzero(np.logical_or.reduce([(problem.start >= a) & (problem.start <= z) for (a, z), _ in occ])
                          & ~problem.initial)[0]
        if any(leaves_state(problem, made, a, z) for (a, z), _ in occ):
            keeps.append(m)
            continue  # a re-run forward would add to that state again (leaves_state)
        ok = batch > 1
        for t in made.tolist() if ok else ():
            if t >= len(shapes):  # a partition's own bookkeeping tensor
                continue
            if problem.kind[t] not in ("activation", "temporary") or constant_tensor(problem, t):
                continue
            shp = shapes[t]
            if len(shp) == 0 or shp[0] < batch or shp[0] % batch:
                ok = False
                break
        if ok and "python_refs" not in problem.trace.meta and casts_parameter(problem, f0, f1):
            ok = False  # when autocast's cache lets go of a weight's cast is not known: not split
        out.append(Span(m, (f0, f1), bwd, batch, random_ops, split=ok, more=tuple(occ[1:])))
    return out


def _occurrences(f: np.ndarray, b: np.ndarray) -> list[tuple[tuple[int, int], tuple[int, int]]] | None:
    """The module's (forward, backward) op spans, one per micro-batch: its forward ops in
    contiguous runs, as many backward runs, each backward after its forward and before the
    next forward (a module called twice in one forward has its backwards after both: None)."""
    def runs(x: np.ndarray) -> list[tuple[int, int]]:
        cut = np.nonzero(np.diff(x) != 1)[0]
        starts, ends = np.r_[x[0], x[cut + 1]], np.r_[x[cut], x[-1]]
        return [(int(a), int(z)) for a, z in zip(starts.tolist(), ends.tolist(), strict=True)]

    fr, br = runs(f), runs(b)
    if len(fr) != len(br):
        return None
    for i, ((_f0, f1), (b0, b1)) in enumerate(zip(fr, br, strict=True)):
        if not f1 < b0 or (i + 1 < len(fr) and not b1 < fr[i + 1][0]):
            return None
    if len({z - a for a, z in fr}) != 1:
        return None  # each micro-batch runs the same ops
    return list(zip(fr, br, strict=True))


def _batch_size(problem: Problem) -> int | None:
    """The recorded step's batch size when above 1 (:func:`taichi_plan.problem.core.batch_and_seq`)."""
    b, _s = batch_and_seq(problem.trace.meta)
    return b if b is not None and b > 1 else None
