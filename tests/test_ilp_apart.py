"""The ILP's count of re-runs (solve/ilp/structures.py ``apart_reruns``): two options whose rebuilds both
re-run an op, in groups that cannot be one, re-run it twice. The small random traces of
test_ilp_exhaustive.py have no such pair (no op with several outputs, no transient shared by
two rebuilds); recorded transformers have many (a layer norm's output and its saved mean and
rstd; a dropout's mask and the matmul before it). So the claim is checked on fake recordings
of three small transformers, on random plans that hold a pair (seeded), each simulated: the
simulator's groups must run the op at least twice. A failure names the model, the pair and
the plan."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from taichi_plan.base.errors import PlanError
from taichi_plan.problem.core import build_problem
from taichi_plan.problem.options import options
from taichi_plan.problem.partition.find import module_spans
from taichi_plan.problem.partition.span import as_partition
from taichi_plan.record import get_workload, record_workload
from taichi_plan.simulate.core import Drop, simulate_plan
from taichi_plan.solve.ilp.structures import apart_reruns, structure

SIZES = {"layers": 2, "hidden": 64, "heads": 2, "seq": 32, "batch": 2, "vocab": 200}
PLANS = 200


@pytest.mark.parametrize("model", ["bert", "gpt2", "llama"])
def test_options_rebuilt_apart_rerun_their_shared_op_twice(model):
    trace = record_workload(get_workload(model=model, **SIZES), fake=True, device_profile="a100-40gb")
    p = build_problem(trace)
    o = options(p)
    apart = apart_reruns(p, structure(p))
    pairs = [(q, i, j) for q, prs in apart.items() for i, j in prs]
    assert pairs, f"{model}: no pair of options re-runs an op twice (the claim is never checked)"
    per: dict[int, list[int]] = {}
    for k in range(len(o)):
        per.setdefault(int(o.cand[k]), []).append(k)
    spans = module_spans(p)
    rng = random.Random(0)
    checked = 0
    for _ in range(PLANS):
        q, i, j = rng.choice(pairs)
        chosen = {i, j}
        for c, ks in per.items():
            if rng.random() < 0.3 and c not in (int(o.cand[i]), int(o.cand[j])):
                chosen.add(rng.choice(ks))
        drops = [Drop(int(o.tensor[k]), int(o.free_after[k]), int(o.remat_before[k])) for k in sorted(chosen)]
        parts = []
        if spans and rng.random() < 0.5:  # a module checkpointed whole or split, where the drops allow
            s = rng.choice(spans)
            parts = [as_partition(s, rng.choice(s.chunk_choices))]
        try:
            sim, _ = simulate_plan(p, drops, parts)
        except PlanError:
            continue
        runs = Counter(x for g in sim.groups.values() for x in g.ops)
        for q2, prs in apart.items():
            for a, b in prs:
                if a in chosen and b in chosen:
                    checked += 1
                    assert runs[q2] >= 2, (f"{model}: options {a} and {b} re-run op {q2} ({p.op_name[q2]}) "
                                           f"{runs[q2]} time(s) under drops {drops}, partitions {parts}")
    assert checked >= PLANS, f"{model}: only {checked} (plan, pair) checks"
