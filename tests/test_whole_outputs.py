"""A module checkpointed whole (one chunk) keeps its inputs; its outputs may still be dropped,
rebuilt in backward through its insides from those inputs (``partition.whole_outputs``). On
Llama's RMSNorm that is what makes checkpointing it pay: the norm's float32 copy of its input
is gone, and so is its output, which the next projections save; without the drop the output
stays and checkpointing saves about nothing (docs/planner.md)."""

from __future__ import annotations

import pytest

from taichi_plan.base.errors import PlanError
from taichi_plan.plan.format import save_plan
from taichi_plan.problem.core import build_problem
from taichi_plan.problem.partition.apply import apply_partitions
from taichi_plan.problem.partition.find import module_spans
from taichi_plan.problem.partition.span import as_partition
from taichi_plan.problem.partition.tensors import internal_tensors, whole_outputs
from taichi_plan.record import get_workload, record_workload
from taichi_plan.replay.measure import replay
from taichi_plan.simulate.core import Drop, simulate_plan
from taichi_plan.solve.heuristic import plan_heuristic
from taichi_plan.solve.result import Decisions, make_plan
from tests.partition_replay import innermost_with_outputs, recorded, whole_output_drops

LLAMA = dict(model="llama", layers=2, hidden=64, heads=4, seq=64, batch=4, vocab=256)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return recorded(tmp_path_factory.mktemp("whole") / "t", **LLAMA)


def _norms(p):
    return [s for s in module_spans(p) if s.module.endswith("layernorm") and s.over == "batch"]


def test_a_norms_output_is_dropped_and_rebuilt_through_it(llama, tmp_path):
    """Every RMSNorm checkpointed whole, its output (the weight times the normalized input)
    dropped: predicted below the norms checkpointed alone, measured == predicted to the byte,
    gradients bitwise (the rebuilds re-run the norm's recorded ops)."""
    d, p = llama
    spans = _norms(p)
    assert len(spans) == 4
    for s in spans:
        (t,) = whole_outputs(p, s)
        assert p.op_name[p.producer[t]] == "aten.mul.Tensor" and p.producer[t] == s.fwd[1]
    parts = [as_partition(s, 1) for s in spans]
    drops = whole_output_drops(p, spans)
    alone, _ = simulate_plan(p, [], parts)
    both, _ = simulate_plan(p, drops, parts)
    assert both.peak_bytes < alone.peak_bytes < p.baseline_peak[0]
    plan = make_plan(p, None, "manual", Decisions(drops=drops, partitions=parts), 0.0, 0)
    plan.trace["path"] = str(d)
    save_plan(plan, tmp_path / "norms.plan.json")
    r = replay(tmp_path / "norms.plan.json", steps=2)
    assert r["predicted_peak_bytes"] == both.peak_bytes
    assert r["measured_peak_bytes"] == r["predicted_peak_bytes"], r
    assert r["grads_match"] and r["grads_check"].startswith("bitwise"), r


def test_only_outputs_of_a_module_checkpointed_whole_may_be_dropped(llama):
    """Split into chunks, a module's output is joined from pieces and cannot be dropped; whole,
    what it saves for its own backward still cannot."""
    _d, p = llama
    span = _norms(p)[0]
    (drop,) = whole_output_drops(p, [span])
    with pytest.raises(PlanError, match="partitions a module that reads or makes it"):
        apply_partitions(p, [as_partition(span, 2)], [drop])
    saved = set(internal_tensors(p, span)[1].tolist())
    inside = [Drop(int(t), int(a), int(b)) for t, a, b in zip(p.candidates, p.cand_free_after, p.cand_remat_before,
                                                              strict=True) if int(t) in saved]
    assert inside and not saved & whole_outputs(p, span)
    with pytest.raises(PlanError, match="partitions a module that reads or makes it"):
        apply_partitions(p, [as_partition(span, 1)], inside[:1])


def test_the_heuristic_checkpoints_norms_and_drops_their_outputs(monkeypatch):
    """A fake bf16 8-layer Llama (SGD: the peak in backward, not in AdamW's step), planned for
    the least peak the heuristic reaches: with modules checkpointed whole and their outputs
    dropped among its options, lower than without (51.9 MB against 54.8 MB when written),
    and its plan does both."""
    from taichi_plan.solve import heuristic

    p = build_problem(record_workload(get_workload(model="llama", layers=8, hidden=256, heads=4, seq=256, batch=4,
                                                   vocab=256, dtype="bf16", optimizer="sgd"), fake=True, device_profile="a100-40gb"))

    def least():
        dec = plan_heuristic(p, 1, time_limit=60)
        return dec, simulate_plan(p, dec.drops, dec.partitions)[0].peak_bytes

    dec, peak = least()
    with monkeypatch.context() as m:
        m.setattr(heuristic, "whole_outputs", lambda *a: set())
        _, peak_without = least()
    assert peak < peak_without, (peak, peak_without)
    spans = {s.module: s for s in _norms(p)}
    whole = [q.module for q in dec.partitions if q.chunks == 1 and q.module in spans]
    outs = set().union(*(whole_outputs(p, spans[m]) for m in whole))
    assert whole and outs & {d.tensor for d in dec.drops}, (dec.partitions, len(dec.drops))


@pytest.mark.parametrize("sizes", [
    pytest.param(dict(model="gpt2", layers=2, hidden=64, heads=4, seq=32, batch=4, vocab=128, kv_cache=False),
                 id="gpt2-dropout"),
    pytest.param(dict(model="bert", layers=2, hidden=64, heads=4, seq=32, batch=4, vocab=128), id="bert",
                 marks=pytest.mark.bench),
    pytest.param(dict(model="vit", layers=2, hidden=64, heads=4, batch=4), id="vit", marks=pytest.mark.bench),
])
def test_every_innermost_module_whole_with_its_outputs_dropped_replays_as_predicted(sizes, tmp_path):
    """Any innermost module with droppable outputs (found from the trace: GPT-2's MLP linears,
    its activation and a dropout, which draws random numbers; BERT's and ViT's projections),
    all checkpointed whole with those outputs dropped: measured == predicted to the byte,
    gradients bitwise (a dropout re-run draws the masks it drew)."""

    d, p = recorded(tmp_path / "t", **sizes)
    leaf = innermost_with_outputs(p)
    assert leaf
    drops = whole_output_drops(p, leaf, every=False)
    plan = make_plan(p, None, "manual", Decisions(drops=drops, partitions=[as_partition(s, 1) for s in leaf]), 0.0, 0)
    assert plan.predicted["planned_peak_bytes"] < plan.predicted["baseline_peak_bytes"]
    save_plan(plan, tmp_path / "leaf.plan.json")
    r = replay(tmp_path / "leaf.plan.json", steps=2)
    assert r["measured_peak_bytes"] == r["predicted_peak_bytes"], r
    assert r["grads_match"] and r["grads_check"].startswith("bitwise"), r
