"""What a partition's span is: a module's forward and backward op spans, and how they are named.

:class:`Span` is a module partitioned along its batch or over its positions, or checkpointed
whole (one chunk); :func:`span_key` names a span (or a partition) in a plan, and
:func:`as_partition` makes the plan's :class:`~taichi_plan.plan.format.Partition` of one;
:func:`occurrence_spans` gives a span once per micro-batch; :func:`is_under` and
:func:`ops_under` say which ops ran in a module, by its dotted name. Token spans (a head and its
loss) are :class:`taichi_plan.problem.partition.token_span.TokenSpan`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

CHUNK_CHOICES = (2, 4, 8)


@dataclass(frozen=True)
class Span:
    """A module partitioned along dim 0 (its batch), or checkpointed whole (one chunk). Token
    spans (a head and its loss, partitioned over tokens) are
    :class:`taichi_plan.problem.partition.token_span.TokenSpan`; both have ``module``, ``over``, ``fwd``/``bwd``
    and ``chunk_choices``."""

    module: str
    fwd: tuple[int, int]
    bwd: tuple[int, int]
    batch: int
    random_ops: tuple[int, ...] = ()  # forward ops of the module that draw random numbers
    over: str = "batch"
    # May it be split into chunks of its batch (independent along dim 0, and, when it draws
    # random numbers, the solve opted in)? Otherwise one chunk only: checkpointed whole.
    split: bool = True
    # over="sequence" (taichi_plan/problem/partition/position_span.py): the workload's (batch, seq), whose product
    # ``batch`` then is, and the chunk counts offered (they divide it).
    positions: tuple[int, int] | None = None
    choices: tuple[int, ...] = ()
    # The (fwd, bwd) spans of the module in the step's later micro-batches (gradient
    # accumulation: the module runs once per micro-batch, partitioned in each).
    more: tuple = ()

    @property
    def chunk_choices(self) -> tuple[int, ...]:
        if self.over == "sequence":
            return self.choices
        # Chunks of equal size only (k divides the batch): each tensor's piece is exactly 1/k.
        return (1, *(c for c in CHUNK_CHOICES if c <= self.batch and self.batch % c == 0)) if self.split else (1,)


def span_key(x) -> tuple[str, str]:
    """(module, over) of a span or a partition: what names it in a plan."""
    return x.module, getattr(x, "over", "batch")


def as_partition(span, chunks: int):
    """The plan's :class:`~taichi_plan.plan.format.Partition` of ``span`` into ``chunks``."""
    from ...plan.format import Partition

    return Partition(span.module, 1 if span.over == "sequence" else 0, int(chunks), over=span.over)


def is_under(name: str, module: str) -> bool:
    """Is module ``name`` ``module`` itself or nested in it (by its dotted name)?"""
    return name == module or name.startswith(module + ".")


def ops_under(op_module: list[str]) -> dict[str, np.ndarray]:
    """Each module that ran ops, and each module above one -> the ids, ascending, of the ops
    run in it or in a module below it (``is_under``). One pass over the ops and one over the
    distinct names: a trace's modules repeat (one name per op), so this costs the ops times
    the nesting depth, not the ops times the modules."""
    by_name: dict[str, list[int]] = {}
    for i, x in enumerate(op_module):
        by_name.setdefault(x, []).append(i)
    parts_of: dict[str, list] = {}
    for x, ids in by_name.items():
        parts = x.split(".") if x else []
        for i in range(1, len(parts) + 1):
            parts_of.setdefault(".".join(parts[:i]), []).append(ids)
    return {m: np.sort(np.concatenate([np.asarray(ids, dtype=np.int64) for ids in lists]))
            for m, lists in parts_of.items()}


def occurrence_spans(span) -> list:
    """``span`` once per micro-batch of the step: the first, then one per later (forward,
    backward) pair (a token span, or a module run once, is its own only occurrence)."""
    more = getattr(span, "more", ())
    if not more:
        return [span]
    return [dataclasses.replace(span, fwd=fw, bwd=bw, more=()) for fw, bw in ((span.fwd, span.bwd), *more)]
