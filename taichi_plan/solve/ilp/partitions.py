"""The partitions the CP-SAT relaxation models (a module checkpointed whole or split into
chunks): those that free bytes at some op over the budget, each with the bytes it frees per op,
its cost, and the options it rules out."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...problem.core import Problem, rebuild_set
from ...problem.partition.cost import partition_cost
from ...problem.partition.find import module_spans
from ...problem.partition.floor import partition_savings
from ...problem.partition.span import Span
from ...problem.partition.tensors import blocked_tensors, span_tensors
from .structures import Structure


@dataclass
class PartOption:
    """Partition ``span`` into ``chunks``: frees ``savings[i]`` bytes at op i, costs ``cost``."""

    span: Span
    chunks: int
    savings: np.ndarray
    cost: float
    internal: np.ndarray  # option indices whose tensor the partition makes internal


def partition_options(problem: Problem, st: Structure, budget: int) -> list[PartOption]:
    """Partitions worth modelling: those that free bytes at some op over the budget."""
    spans = module_spans(problem)
    if not spans:
        return []
    over = problem.baseline_live > budget
    opt_of: dict[int, list[int]] = {}
    for k, t in enumerate(st.tensor.tolist()):
        opt_of.setdefault(t, []).append(k)
    out = []
    # Each option's rebuild set, once (it does not depend on the span).
    rebuilds = [rebuild_set(problem, t, b) or () for t, b in zip(st.tensor.tolist(), st.b.tolist(), strict=True)]
    early = np.nonzero(st.b != problem.cand_remat_before[st.cand])[0].tolist()  # early-rebuild options
    for span in spans:
        by_set: dict[frozenset, np.ndarray] = {}
        for chunks in span.chunk_choices:
            # Options the partition rules out: its own tensors, and those whose rebuild would
            # re-make one of them (replay cannot re-run a partitioned module's ops one by one;
            # checkpointed whole, its outputs may still be dropped: partition.whole_outputs).
            inner = frozenset(blocked_tensors(problem, span, chunks))
            if inner not in by_set:
                blocked = {k for t in inner for k in opt_of.get(t, [])}
                blocked.update(k for k, rs in enumerate(rebuilds) if k not in blocked and not inner.isdisjoint(rs))
                # A whole module's dropped output is rebuilt at its use only (its early point
                # was found with the module's insides alive: partition._apply_partitions).
                outs = span_tensors(problem, span) - inner
                blocked.update(k for k in early if outs and int(st.tensor[k]) in outs)
                by_set[inner] = np.asarray(sorted(blocked), dtype=np.int64)
            internal = by_set[inner]
            sav = partition_savings(problem, span, chunks)
            if not np.any(sav[over] > 0):
                if chunks == 1:
                    continue  # checkpointing whole may free nothing where splitting does
                break
            out.append(PartOption(span, chunks, sav, partition_cost(problem, span, chunks), internal))
    return out
