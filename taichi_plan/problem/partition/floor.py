"""The floor: the least memory any plan needs, at each op.

:func:`floor_bytes`: everything droppable dropped, less the most that partitions (each
module's best chunk count, or the best set of modules inside it) can save there;
:func:`partition_savings`: what one partition saves per op (cached per problem: the floor and
the ILP's options ask for the same ones).
"""

from __future__ import annotations

import numpy as np

from ..core import Problem
from .apply import partitioned_live
from .find import module_spans
from .span import Span, as_partition, is_under, span_key


def partition_savings(problem: Problem, span: Span, chunks: int) -> np.ndarray:
    """Bytes the partition frees at each op (baseline minus partitioned live bytes). Cached on
    the problem per (module, over, chunks): the floor and the ILP's options ask for the same
    ones (246 options on a 93k-op trace: :func:`~taichi_plan.problem.partition.apply.partitioned_live`)."""
    cache = problem.__dict__.setdefault("_partition_savings", {})
    key = (*span_key(span), int(chunks))
    if key not in cache:
        sav = problem.baseline_live - partitioned_live(problem, [as_partition(span, chunks)])
        sav.setflags(write=False)  # shared by every caller
        cache[key] = sav
    return cache[key]


def floor_bytes(problem: Problem) -> np.ndarray:
    """Bytes that must be live during each op under any plan: everything droppable dropped,
    less, at each op, the most that modules partitioned at once can save there (each module's
    best chunk count at that op; since partitions do not nest, a module or the best set of
    modules inside it, whichever saves more). Cached on the problem."""
    spans = module_spans(problem)
    cached = getattr(problem, "_floor_bytes", None)
    if cached is not None and cached[0] is spans:  # (the options it was computed for, floor)
        return cached[1]
    from ...base.deadline import check
    from ..live import min_live_bytes

    floor = min_live_bytes(problem).astype(np.int64)
    own: dict[str, np.ndarray] = {}  # module -> the most any partition of it saves, per op
    for span in spans:
        check("finding the least memory any plan needs (the floor)")
        for k in span.chunk_choices:
            sav = np.maximum(partition_savings(problem, span, k), 0)
            own[span.module] = np.maximum(own[span.module], sav) if span.module in own else sav
    best: dict[str, np.ndarray] = {}
    for m in sorted(own, key=lambda x: -x.count(".")):  # innermost first
        inner = [c for c in best if c != m and is_under(c, m) and not any(
            d != c and d != m and is_under(c, d) and is_under(d, m) for d in own)]
        best[m] = np.maximum(own[m], sum((best[c] for c in inner), np.zeros_like(own[m])))
    for m, sav in best.items():
        if not any(d != m and is_under(m, d) for d in own):  # outermost: disjoint, so they add
            floor = floor - sav
    problem._floor_bytes = (spans, floor)
    return floor
