"""Position-wise modules split over their positions (taichi_plan/problem/partition/position_span.py): which
modules qualify is read from the trace's ops, the simulator models the chunked run event by
event, and a replayed plan measures its predicted peak to the byte with gradients allclose,
on two architectures (Llama: RMSNorm, SiLU-gated MLP, no dropout; GPT-2: Conv1D, NewGELU,
dropout), with batch 1 (runs of the sequence) and batch 2 (runs crossing samples)."""

from __future__ import annotations

import pytest

from taichi_plan.base.errors import PlanError
from taichi_plan.plan.format import Partition
from taichi_plan.problem.core import build_problem
from taichi_plan.problem.partition import find as partition
from taichi_plan.problem.partition.apply import apply_partitions
from taichi_plan.problem.partition.find import find_span, module_spans, partitionable_spans
from taichi_plan.problem.partition.position_span import not_position_wise, positions
from taichi_plan.problem.partition.qualify import allow_random
from taichi_plan.problem.partition.span import ops_under
from taichi_plan.record import get_workload, record_workload
from taichi_plan.simulate.core import simulate_plan
from taichi_plan.solve.config import HeuristicConfig, TimeConfig
from taichi_plan.solve.heuristic import plan_heuristic
from taichi_plan.trace.format import write_trace
from tests.partition_replay import assert_measured_as_predicted, replay_partitions

# 48 positions: no parameter has a dimension of 48 (hidden 32, Llama's MLP 256, GPT-2's 128).
# SGD: no optimizer state, so the step's peak is in the backward, where the partitions are.
TINY = dict(layers=2, hidden=32, heads=2, vocab=64, optimizer="sgd")


def _traced(tmp_path_factory, model: str, seq: int, batch: int):
    d = tmp_path_factory.mktemp("seq") / f"tiny-{model}-b{batch}"
    trace = record_workload(get_workload(model=model, seq=seq, batch=batch, **TINY), fake=False)
    write_trace(trace, d)
    return build_problem(trace)


@pytest.fixture(scope="module")
def llama_b1(tmp_path_factory):
    return _traced(tmp_path_factory, "llama", 48, 1)


@pytest.fixture(scope="module")
def gpt2_b1(tmp_path_factory):
    return _traced(tmp_path_factory, "gpt2", 48, 1)


@pytest.fixture(scope="module")
def gpt2_b2(tmp_path_factory):
    return _traced(tmp_path_factory, "gpt2", 24, 2)


def _seq(module: str, k: int) -> Partition:
    return Partition(module, 1, k, over="sequence")


def _in_span(problem, parts, op: int) -> bool:
    spans = [find_span(problem, q) for q in parts]
    return any(s.fwd[0] <= op <= s.fwd[1] or s.bwd[0] <= op <= s.bwd[1] for s in spans)


def test_mlps_and_norms_qualify_attention_does_not(llama_b1, gpt2_b2):
    """Decided from the ops: the MLP, its linear layers, the RMSNorms and GPT-2's activation
    are position-wise; attention (its matmuls over the sequence) never is."""
    for p, yes in ((llama_b1, ("model.layers.1.mlp", "model.layers.1.post_attention_layernorm",
                               "model.norm")),
                   (gpt2_b2, ("transformer.h.1.mlp", "transformer.h.0.mlp.act", "transformer.h.0.mlp.c_fc"))):
        seq = {s.module for s in partitionable_spans(p) if s.over == "sequence"}
        assert set(yes) <= seq, seq
        assert not any(m.endswith(("self_attn", ".attn")) for m in seq), seq
        under = ops_under(p.op_module)
        attn = next(m for m in under if m.endswith(("self_attn", ".attn")))
        fwd = [i for i in under[attn].tolist() if p.op_phase[i] == "forward"]
        assert not_position_wise(p, (fwd[0], fwd[-1]), positions(p)) is not None


def test_chunk_counts_divide_the_positions_and_skip_batch_chunks(llama_b1, gpt2_b2):
    s = find_span(llama_b1, _seq("model.layers.1.mlp", 2))
    assert s.chunk_choices == (2, 4, 8, 16)  # batch 1: every count dividing 48
    g = find_span(gpt2_b2, _seq("transformer.h.0.mlp.act", 4))
    assert 2 not in g.chunk_choices and set(g.chunk_choices) == {4, 8, 16}  # 2 is a batch chunk of batch 2
    with pytest.raises(PlanError, match="runs of its 48 positions"):
        apply_partitions(llama_b1, [_seq("model.layers.1.mlp", 32)])


def test_offered_where_the_batch_cannot_split_random_ones_on_opt_in(gpt2_b1, gpt2_b2):
    """The planners offer runs of positions where the batch cannot be split (batch 1), not
    where it can (batch 2 plans as before; a plan may still name them). GPT-2's MLP draws its
    dropout mask: offered over positions only when the solve opts in."""
    def offered(p):
        return {s.module for s in module_spans(p) if s.over == "sequence"}

    assert "transformer.h.1.mlp.c_fc" in offered(gpt2_b1) and not offered(gpt2_b2)
    assert "transformer.h.1.mlp" not in offered(gpt2_b1)
    assert "transformer.h.1.mlp" in offered(allow_random(gpt2_b1, True))


@pytest.mark.parametrize("parts", [
    [("model.layers.1.mlp", 4), ("model.layers.1.post_attention_layernorm", 8)],
    [("model.layers.1.mlp", 8)],
], ids=["mlp-4+norm-8", "mlp-8"])
def test_llama_batch_1_measures_as_predicted(llama_b1, tmp_path, parts):
    """Runs of the sequence; the predicted peak is inside the MLP's backward."""
    parts = [_seq(m, k) for m, k in parts]
    sim, _ = simulate_plan(llama_b1, [], parts)
    assert _in_span(llama_b1, parts, sim.peak_op), sim.peak_op
    plan, r = replay_partitions(llama_b1, parts, tmp_path)
    assert r["measured_peak_bytes"] == r["predicted_peak_bytes"], r
    assert r["grads_match"] and r["grads_check"].startswith("allclose(rtol=1e-4, atol=1e-6) on the first"), r
    assert plan.partitions[0].over == "sequence" and "runs of its 48 positions" in plan.partitions[0].why


def test_gpt2_batch_2_runs_across_samples_measure_as_predicted(gpt2_b2, tmp_path):
    """Four and sixteen runs of 2 x 24 positions: runs cross samples (4 does not divide 2's
    runs into whole samples), the peak is inside a split module's backward."""
    parts = [_seq("transformer.h.1.mlp.c_proj", 16), _seq("transformer.h.1.mlp.act", 4),
             _seq("transformer.h.0.mlp.c_fc", 8)]
    sim, _ = simulate_plan(gpt2_b2, [], parts)
    assert _in_span(gpt2_b2, parts, sim.peak_op), sim.peak_op
    _plan, r = replay_partitions(gpt2_b2, parts, tmp_path)
    assert_measured_as_predicted(r)


def test_one_dropout_over_positions_draws_the_unplanned_masks(gpt2_b2, tmp_path):
    """GPT-2's whole MLP (one dropout) over positions on CPU: each run draws the next slice of
    the generator's stream, as the whole tensor would, so gradients stay allclose."""
    p = allow_random(gpt2_b2, True)
    plan, r = replay_partitions(p, [_seq("transformer.h.1.mlp", 4)], tmp_path)
    assert plan.partitions[0].random_draws == "as-unpartitioned"
    assert_measured_as_predicted(r)


def test_the_planner_reaches_as_low_with_sequence_partitions(llama_b1, monkeypatch):
    """Batch 1: nothing splits along the batch. With sequence partitions among its options the
    heuristic reaches at least as low as without them, and its plan at the budget the bisection
    asked for reaches that peak. Before the heuristic also swept by bytes alone, it reached
    strictly lower with them; since, drops alone reach the same floor on some recordings
    (963,784 B both ways on one clean-clone run), as CP-SAT did already (docs/planner.md)."""
    from taichi_plan.solve.reach import lowest_reachable

    with_seq, _op, asked = lowest_reachable(build_problem(llama_b1.trace))
    monkeypatch.setattr(partition, "_sequence_spans", lambda problem: [])
    without = build_problem(llama_b1.trace)
    assert not any(s.over == "sequence" for s in module_spans(without))
    without_seq = lowest_reachable(without)[0]
    monkeypatch.undo()
    assert with_seq <= without_seq, (with_seq, without_seq)
    bisecting = HeuristicConfig(local_max_s=TimeConfig().bisect_local_max_s)  # as lowest_reachable runs it
    dec = plan_heuristic(build_problem(llama_b1.trace), asked, config=bisecting)
    sim, _ = simulate_plan(llama_b1, dec.drops, dec.partitions)
    assert sim.peak_bytes == with_seq <= asked, (sim.peak_bytes, with_seq, asked)


def _autocast_traced(tmp_path, model: str, micro_batches: int):
    from taichi_plan.torch_common.loop import Loop

    trace = record_workload(get_workload(model=model, seq=48, batch=1, **TINY), fake=False,
                            loop=Loop(autocast="bf16", micro_batches=micro_batches), calibrate=False)
    write_trace(trace, tmp_path / f"ac-{model}")
    return build_problem(trace)


@pytest.mark.parametrize("model,micro_batches,parts", [
    ("gpt2", 2, [[("transformer.h.0.mlp.c_fc", 2)],
                 [("transformer.h.0.mlp.act", 4), ("transformer.h.1.attn.c_attn", 2)]]),
    ("llama", 1, [[("model.layers.1.mlp.down_proj", 4)]]),
])
def test_under_autocast_linears_split_over_positions_as_predicted(tmp_path, model, micro_batches, parts):
    """Batch 1 under bf16 autocast: a linear layer casts its weight inside the module (a
    constant of the span, not one row per position), which kept every linear layer from
    qualifying as position-wise before. Split over the sequence, the first run casts and the
    others find the cast in autocast's cache, as along the batch (test_partition_exact):
    measured == predicted to the byte, gradients within the stated bf16 roundings."""
    from taichi_plan.problem.partition.qualify import casts_parameter

    p = _autocast_traced(tmp_path, model, micro_batches)
    spans = {s.module: s for s in module_spans(p) if s.over == "sequence"}
    for group in parts:
        for m, k in group:
            if m.endswith(("c_fc", "c_attn", "down_proj")):
                assert casts_parameter(p, *spans[m].fwd) and k in spans[m].chunk_choices, m
        _plan, r = replay_partitions(p, [_seq(m, k) for m, k in group], tmp_path)
        assert r["measured_peak_bytes"] == r["predicted_peak_bytes"], (group, r)
        assert r["grads_match"] and "bf16 roundings" in r["grads_check"], (group, r)
