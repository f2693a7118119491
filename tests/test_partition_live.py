"""``partition.partitioned_live`` (the floor's and the ILP's savings, without building the
partitioned problem) equals ``apply_partitions(...)``'s ``baseline_live`` for every partition
option of three small recorded transformers."""

from __future__ import annotations

import numpy as np
import pytest

from taichi_plan.problem.core import build_problem
from taichi_plan.problem.partition.apply import apply_partitions, partitioned_live
from taichi_plan.problem.partition.find import module_spans
from taichi_plan.problem.partition.span import as_partition
from taichi_plan.record import get_workload, record_workload


@pytest.mark.parametrize("model", ["gpt2", "bert", "llama"])
def test_partitioned_live_is_the_partitioned_problems_live_bytes(model):
    p = build_problem(record_workload(get_workload(model=model, layers=2, hidden=64, heads=2, seq=32, batch=4,
                                                   vocab=200), fake=True, device_profile="a100-40gb"))
    options = [(s, k) for s in module_spans(p) for k in s.chunk_choices]
    assert len(options) >= 20
    for s, k in options:
        parts = [as_partition(s, k)]
        assert np.array_equal(partitioned_live(p, parts), apply_partitions(p, parts)[0].baseline_live), (s.module, k)
