"""Partitions of one chunk: a module checkpointed whole (its forward re-runs in backward, only
its inputs are kept). A planner's option beside the chunk counts, also for modules with dropout
(the re-run restores the RNG state, so it draws the same masks: no opt-in, bitwise gradients)
and for modules whose tensors have no batch dimension to split."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from taichi_plan.base.errors import PlanError
from taichi_plan.cli import main
from taichi_plan.plan.format import Partition, load_plan, save_plan
from taichi_plan.problem.core import build_problem
from taichi_plan.problem.partition.apply import apply_partitions
from taichi_plan.problem.partition.find import find_span, module_spans, partitionable_spans
from taichi_plan.record import get_workload, record_workload
from taichi_plan.replay.measure import replay
from taichi_plan.simulate.core import simulate_plan
from taichi_plan.solve.result import Decisions, make_plan
from taichi_plan.trace.format import write_trace
from tests.kv_cache import ENTRY

# Dropout on (transformers' defaults, 0.1): every block, attn and mlp draws random numbers.
# tests/kv_cache.py: the tiny GPT-2 with its KV cache off (with it on, no block or attention is
# partitioned: partition.leaves_state).
SIZES = dict(entry=ENTRY, batch=4)
BLOCK, ATTN, MLP = "transformer.h.0", "transformer.h.1.attn", "transformer.h.1.mlp"


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt") / "tiny-gpt2-dropout"
    trace = record_workload(get_workload(**SIZES), fake=False)
    write_trace(trace, d)
    return d, trace, build_problem(trace)


def test_random_modules_are_checkpoint_options_without_the_opt_in(traced):
    _d, _t, p = traced
    spans = {s.module: s for s in module_spans(p)}
    assert spans[BLOCK].random_ops and spans[BLOCK].chunk_choices == (1,)
    assert spans[MLP].chunk_choices == (1,)
    assert spans["transformer.h.0.mlp.c_fc"].chunk_choices == (1, 2, 4)
    # Split into chunks, a random module still needs the opt-in; whole, it does not.
    with pytest.raises(PlanError, match="--partition-random"):
        apply_partitions(p, [Partition(MLP, 0, 2)])
    apply_partitions(p, [Partition(MLP, 0, 1)])
    with pytest.raises(PlanError, match="use 1..4"):
        apply_partitions(p, [Partition("transformer.h.0.mlp.c_fc", 0, 5)])
    with pytest.raises(PlanError, match="2 or more"):
        apply_partitions(p, [Partition("lm_head", 0, 1, over="tokens")])


def test_checkpointed_whole_saves_what_its_forward_saves(traced):
    """Whole, the block keeps its input only: every tensor it saves for its backward is gone
    between its forward and its backward, and comes back for that backward."""
    _d, _t, p = traced
    span = next(s for s in partitionable_spans(p) if s.module == BLOCK)
    sim, parted = simulate_plan(p, [], [Partition(BLOCK, 0, 1)])
    gap = (span.fwd[1] + 1 + span.bwd[0]) // 2
    assert parted.baseline_live[gap] < p.baseline_live[gap]
    # Its forward once more, plus what checkpointing costs per forward op, as measured on this
    # model (trace v5; one chunk: no op runs a further time), and one checkpoint call (v7).
    cal = p.trace.meta["runtime_overhead"]
    assert cal["checkpoint_call_s"] > 0
    assert sim.partition_cost == pytest.approx(float(p.op_cost[span.fwd[0]:span.fwd[1] + 1].sum())
                                               + (span.fwd[1] - span.fwd[0] + 1) * cal["checkpoint_op_s"]
                                               + cal["checkpoint_call_s"])


def test_checkpointed_blocks_replay_bitwise_and_as_predicted(traced, tmp_path):
    """A plan that checkpoints a whole block and a sibling attn and mlp (all with dropout):
    measured peak == predicted to the byte, gradients and parameters bitwise equal to the
    unplanned run's (the re-runs draw the same masks)."""
    d, _t, p = traced
    parts = [Partition(BLOCK, 0, 1), Partition(ATTN, 0, 1), Partition(MLP, 0, 1)]
    plan = make_plan(p, None, "manual", Decisions(partitions=parts), 0.0, 0)
    assert plan.predicted["planned_peak_bytes"] < plan.predicted["baseline_peak_bytes"]
    assert all(q.random_draws == "as-unpartitioned" and "checkpointing" in q.why for q in plan.partitions)
    path = tmp_path / "ckpt.plan.json"
    save_plan(plan, path, force=True)
    assert load_plan(path).partitions[0].chunks == 1
    out = CliRunner().invoke(main, ["inspect", str(path)])
    assert out.exit_code == 0, out.output
    assert f"{BLOCK} " in out.output and " whole " in out.output and "checkpointing" in out.output
    r = replay(path, steps=1)
    assert r["measured_peak_bytes"] == r["predicted_peak_bytes"], r
    assert r["grads_match"] and r["grads_check"].startswith("bitwise"), r
    assert "same dropout masks" in r["random_draws"]


def test_ilp_checkpoints_a_module_whole_where_nothing_else_reaches():
    """A module whose saved tensor no rebuild can make (its producer is not recomputable) and
    that cannot be split (its tensors have no batch dimension): checkpointing it whole is the
    only plan under its peak, and the ILP finds it; the schedule's peak is the prediction."""
    from taichi_plan.plan.format import peak_from_schedule
    from taichi_plan.solve import solve
    from tests.synthetic import TraceBuilder

    b = TraceBuilder()
    x = b.tensor(40, "input")
    (a,) = b.op("aten.mm.default", [x], [400], cost=1.0, module="m.a", recomputable=False)
    (y,) = b.op("aten.relu.default", [a], [40], cost=1.0, module="m.b")
    (big,) = b.op("aten.exp.default", [y], [300], cost=0.1, kind="temporary", recomputable=False)
    (loss,) = b.op("aten.sum.default", [big], [4], cost=0.1, kind="temporary")
    (gy,) = b.op("aten.ones_like.default", [loss], [40], phase="backward", cost=0.1, kind="temporary")
    b.op("aten.mm_backward.default", [gy, a], [40], phase="backward", cost=1.0, module="m.b", kind="temporary")
    for t in b.tensors:
        t["shape"] = [3, max(t["nbytes"] // 12, 1)]  # no multiple of the batch: not splittable
    trace = b.build("whole")
    trace.meta["workload"] = {"name": "synthetic", "args": {"batch": 4}}
    p = build_problem(trace)
    span = next(s for s in module_spans(p) if s.module == "m")
    assert span.chunk_choices == (1,) and not len(p.candidates)
    base, at = p.baseline_peak
    assert p.op_phase[at] == "forward"  # a is live there; checkpointed whole, m keeps only x
    plan = solve(trace, base - 200, "ilp", time_limit=20)
    assert [(q.module, q.chunks) for q in plan.partitions] == [("m", 1)]
    assert plan.predicted["planned_peak_bytes"] <= base - 200
    assert peak_from_schedule(plan.schedule)[0] == plan.predicted["planned_peak_bytes"]
    # Extra: m's forward once more (2.0) plus its 3 ops' launch overhead, one chunk.
    assert plan.predicted["extra_compute"] == pytest.approx(2.0 + 3 * 1e-5)


@pytest.mark.parametrize("batch,seq,layer", [(4, 32, "transformer.layer.1"), (2, 16, "transformer.layer.0")])
def test_the_re_run_of_a_module_checkpointed_whole_measures_as_predicted(tmp_path, batch, seq, layer):
    """The checkpoint re-runs the module's forward before its backward's first read of what it
    saved, and holds what it re-makes while the rest of the re-run makes its transients: an
    XLNet layer's attention makes score tensors late in its forward, and checkpointed whole it
    measured 8,832 B over a prediction that counted the saved tensors alone (the first case).
    A re-made copy is the node's apply's, freed before the engine sums a bias's gradient to its
    shape: the prediction held the feed-forward's input through that sum, 128 B over (the
    second case, whose peak is that sum)."""
    from tests.partition_replay import recorded, replay_partitions

    _d, p = recorded(tmp_path / "xlnet", entry="tiny_models:xlnet", batch=batch, seq=seq)
    parts = [Partition(layer, 0, 1)]
    sim, _ = simulate_plan(p, [], parts)
    assert sim.peak_op >= find_span(p, parts[0]).bwd[0]  # the peak is in the layer's backward: a real check
    _plan, r = replay_partitions(p, parts, tmp_path)
    assert r["measured_peak_bytes"] == r["predicted_peak_bytes"], r
    assert r["grads_match"] and r["grads_check"].startswith("bitwise"), r
