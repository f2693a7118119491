"""``partition.ops_under``: the ops run in each module or below it, in one pass over the ops
(the partition options of a 30k-op trace were a scan of every op per module)."""

from __future__ import annotations

import numpy as np

from taichi_plan.problem.partition.span import is_under, ops_under


def test_ops_under_equals_prefix_matching_of_every_op():
    names = ["", "a", "a.b", "a.b", "ab", "a.bc", "a", "c.d", "a.b.c", "", "a..b", "a.", "c"]
    got = ops_under(names)
    fqns = {".".join(n.split(".")[:i]) for n in names if n for i in range(1, len(n.split(".")) + 1)}
    assert set(got) == fqns
    for m in fqns:
        want = np.array([i for i, x in enumerate(names) if is_under(x, m)])
        assert got[m].tolist() == want.tolist(), m
    # FQNs are matched by prefix + ".", never as substrings
    assert got["a"].tolist() == [1, 2, 3, 5, 6, 8, 10, 11]  # not "ab"
    assert got["a.b"].tolist() == [2, 3, 8]
    assert "" not in got
