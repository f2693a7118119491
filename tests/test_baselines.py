"""Baseline planners: every one is executable in the simulator, deterministic, and does what it says."""

from __future__ import annotations

import collections
import random

import numpy as np
import pytest
from conftest import graph_files
from synthetic import TraceBuilder, chain_trace, random_training_trace

from taichi_plan.base.errors import PlanError
from taichi_plan.problem.core import build_problem
from taichi_plan.simulate.core import Drop, simulate
from taichi_plan.solve.baselines import (
    BASELINES,
    DESCRIPTIONS,
    executable,
    find_blocks,
    is_matmul_like,
    op_blocks,
    plan_dtr,
    plan_full,
    plan_sqrt_n,
)
from taichi_plan.solve.result import make_plan

NAMES = {"none", "full", "sqrt-n", "dtr", "selective-mm"}
CANDIDATE_ONLY = NAMES - {"dtr"}


def synthetic_traces():
    yield "chain", chain_trace([64] * 12, temp_bytes=32)
    for i in range(30):
        yield f"random{i}", random_training_trace(random.Random(i))


def cand_gaps(problem) -> set[tuple[int, int, int]]:
    return set(zip(problem.candidates.tolist(), problem.cand_free_after.tolist(),
                   problem.cand_remat_before.tolist()))


def within_cand_gaps(problem, drops) -> bool:
    """Each drop frees a candidate where its gap starts and rebuilds it no later than the gap's
    end (``full`` and ``sqrt-n`` rebuild a region's drops together, at its first rebuild)."""
    end = {(t, a): b for t, a, b in cand_gaps(problem)}
    return all((d.tensor, d.free_after) in end and d.remat_before <= end[(d.tensor, d.free_after)]
               for d in drops)


def block_chain(layers: int, module: str = "layers.{i}"):
    """Each layer: h = mm(a) saved for backward (inside the block), a' = relu(h) the block output."""
    b = TraceBuilder()
    x = b.tensor(64, "input")
    params = [b.tensor(8, "parameter") for _ in range(layers)]
    acts, hidden = [x], []
    for i in range(layers):
        (h,) = b.op("aten.mm.default", [acts[-1], params[i]], [96], cost=2.0, module=module.format(i=i))
        (a,) = b.op("aten.relu.default", [h], [64], cost=0.5, module=module.format(i=i))
        hidden.append(h)
        acts.append(a)
    (loss,) = b.op("aten.sum.default", [acts[-1]], [4], cost=0.1, kind="temporary")
    (g,) = b.op("aten.ones_like.default", [loss], [64], phase="backward", cost=0.1, kind="temporary")
    for i in reversed(range(layers)):
        (g,) = b.op("aten.relu_backward", [g, acts[i + 1]], [96], phase="backward", cost=0.5,
                    module=module.format(i=i), kind="temporary")
        (g,) = b.op("aten.mm_backward", [g, hidden[i], acts[i], params[i]], [64], phase="backward",
                    cost=2.0, module=module.format(i=i), kind="temporary")
    return b.build("block_chain"), acts, hidden


def test_registry():
    assert set(BASELINES) == NAMES
    assert set(DESCRIPTIONS) == NAMES
    assert all(isinstance(d, str) and "\n" not in d for d in DESCRIPTIONS.values())


def test_every_baseline_on_synthetic_traces():
    for label, trace in synthetic_traces():
        problem = build_problem(trace)
        peak = problem.baseline_peak[0]
        budget = int(0.8 * peak)
        for name, planner in BASELINES.items():
            dec = planner(problem, budget)
            again = planner(problem, budget)
            assert dec.drops == again.drops, (label, name)  # deterministic
            plan = make_plan(problem, budget, name, dec, 0.0, 0)  # the simulator accepts it
            pred = plan.predicted
            if name in CANDIDATE_ONLY:
                assert within_cand_gaps(problem, dec.drops), (label, name)
            if name == "none":
                assert dec.drops == []
                assert pred["planned_peak_bytes"] == peak
                assert pred["extra_compute"] == 0.0
            if name == "dtr" and plan.solver["status"] != "infeasible":
                assert pred["planned_peak_bytes"] <= budget, label
            assert len({d.tensor for d in dec.drops}) == len(dec.drops)


def test_dtr_without_budget_or_with_a_loose_one_drops_nothing():
    problem = build_problem(chain_trace([64] * 8))
    assert plan_dtr(problem, None).drops == []
    assert plan_dtr(problem, problem.baseline_peak[0]).drops == []


def test_dtr_fits_a_chain_and_frees_between_consecutive_uses():
    trace, _, _ = block_chain(16)
    problem = build_problem(trace)
    budget = int(0.6 * problem.baseline_peak[0])
    dec = plan_dtr(problem, budget)
    plan = make_plan(problem, budget, "dtr", dec, 0.0, 0)
    assert plan.solver["status"] == "feasible"
    assert plan.predicted["planned_peak_bytes"] <= budget
    assert 0 < plan.predicted["extra_compute"]
    for d in dec.drops:
        u = problem.uses[d.tensor].tolist()
        k = u.index(d.free_after)
        assert u[k + 1] == d.remat_before and d.remat_before - d.free_after >= 2


def test_dtr_on_a_long_trace():
    problem = build_problem(random_training_trace(random.Random(7), layers=2000))
    budget = int(0.8 * problem.baseline_peak[0])
    dec = plan_dtr(problem, budget)
    plan = make_plan(problem, budget, "dtr", dec, 0.0, 0, with_schedule=False)
    assert dec.drops
    if plan.solver["status"] != "infeasible":
        assert plan.predicted["planned_peak_bytes"] <= budget


@pytest.mark.parametrize("planner", [plan_full, plan_sqrt_n])
def test_full_and_sqrt_n_save_memory_at_a_compute_cost(planner):
    trace, _, _ = block_chain(16)
    problem = build_problem(trace)
    none_peak = problem.baseline_peak[0]
    plan = make_plan(problem, None, "x", planner(problem, None), 0.0, 0)
    assert plan.predicted["planned_peak_bytes"] <= none_peak
    assert plan.predicted["planned_peak_bytes"] < none_peak
    assert plan.predicted["extra_compute"] > 0


def test_full_and_sqrt_n_on_chain_trace_with_temporaries():
    problem = build_problem(chain_trace([64] * 16, temp_bytes=48))
    none_peak = problem.baseline_peak[0]
    sq = make_plan(problem, None, "sqrt-n", plan_sqrt_n(problem, None), 0.0, 0)
    assert sq.predicted["planned_peak_bytes"] <= none_peak
    assert sq.predicted["extra_compute"] > 0
    # In chain_trace every saved tensor is some layer's output, read by the next layer:
    # checkpointing every block keeps all of them, like torch would.
    full = plan_full(problem, None)
    assert full.drops == []
    assert make_plan(problem, None, "full", full, 0.0, 0).predicted["planned_peak_bytes"] == none_peak


def test_full_drops_exactly_the_block_internals():
    trace, acts, hidden = block_chain(8)
    problem = build_problem(trace)
    dropped = {int(problem.tensor_id[d.tensor]) for d in plan_full(problem, None).drops}
    assert dropped == set(hidden)
    assert not dropped & set(acts)


def test_sqrt_n_keeps_segment_boundaries_and_runs_the_last_segment_plain():
    layers = 16
    problem = build_problem(chain_trace([64] * layers))
    dec = plan_sqrt_n(problem, None)
    fwd = [problem.op_phase[problem.producer[t]] == "forward" for t in problem.candidates.tolist()]
    fwd_cands = {int(t) for t, f in zip(problem.candidates.tolist(), fwd) if f}
    kept = fwd_cands - {d.tensor for d in dec.drops}
    assert dec.stats["segments"] == 4
    # checkpoint_sequential(16 layers, 4): layers 0-3, 4-7 and 8-11 checkpointed, each keeping
    # only its output; 12-15 run plain and keep everything they make.
    modules = sorted(problem.op_module[problem.producer[t]] for t in kept)
    assert modules == sorted(["layers.3", "layers.7", "layers.11"] + [f"layers.{i}" for i in range(12, 16)])
    # Each checkpointed segment is rebuilt in one group.
    assert len(simulate(problem, dec.drops).groups) == 3


def test_sqrt_n_without_modules_segments_forward_ops():
    b = TraceBuilder()
    x = b.tensor(16, "input")
    acts = [x]
    for _ in range(16):
        (a,) = b.op("aten.relu.default", [acts[-1]], [16])
        acts.append(a)
    g = acts[-1]
    for i in reversed(range(16)):
        (g,) = b.op("aten.relu_backward", [g, acts[i + 1]], [16], phase="backward", kind="temporary")
    problem = build_problem(b.build())
    dec = plan_sqrt_n(problem, None)
    assert dec.stats["segments"] == 4
    kept = set(problem.candidates.tolist()) - {d.tensor for d in dec.drops}
    assert sorted(int(problem.producer[t]) for t in kept) == [3, 7, 11, 12, 13, 14]  # ops 12-15 run plain
    make_plan(problem, None, "sqrt-n", dec, 0.0, 0)


def test_block_detection_uses_exact_prefixes():
    b = TraceBuilder()
    x = b.tensor(64, "input")
    (e,) = b.op("aten.embedding.default", [x], [64], module="transformer.wte")
    cur, hidden, outs, decoy = e, [], [], None
    for i in range(4):
        (h,) = b.op("aten.mm.default", [cur], [96], module=f"transformer.h.{i}.attn")
        (cur,) = b.op("aten.gelu.default", [h], [64], module=f"transformer.h.{i}.mlp")
        hidden.append(h)
        outs.append(cur)
        if i == 1:
            (cur,) = b.op("aten.relu.default", [cur], [64], module="transformer.h.1x")
            decoy = cur
    (loss,) = b.op("aten.sum.default", [cur], [4], kind="temporary")
    g = b.op("aten.ones_like.default", [loss], [64], phase="backward", kind="temporary")[0]
    saved = hidden + outs + [decoy]
    for t in reversed(saved):
        (g,) = b.op("aten.some_backward", [g, t], [64], phase="backward", kind="temporary")
    problem = build_problem(b.build())

    blocks = find_blocks(problem.op_module)
    assert blocks == [f"transformer.h.{i}" for i in range(4)]
    ob = op_blocks(problem.op_module, blocks)
    by_module = dict(zip(problem.op_module, ob.tolist()))
    assert by_module["transformer.h.1x"] == -1
    assert by_module["transformer.h.1.attn"] == 1 and by_module["transformer.h.1.mlp"] == 1
    assert by_module["transformer.wte"] == -1

    dropped = {int(problem.tensor_id[d.tensor]) for d in plan_full(problem, None).drops}
    assert dropped == set(hidden)  # h.1's output is read by h.1x, outside h.1: kept
    assert decoy not in dropped and outs[1] not in dropped


def test_find_blocks_picks_the_shallowest_repeated_level():
    bert = ["bert.embeddings", "bert.encoder.layer.0.attention.self", "bert.encoder.layer.0.heads.0",
            "bert.encoder.layer.0.heads.1", "bert.encoder.layer.1.output.dense", "bert.pooler"]
    assert find_blocks(bert) == ["bert.encoder.layer.0", "bert.encoder.layer.1"]
    resnet = ["conv1", "layer1.0.conv1", "layer1.1.conv1", "layer2.0.conv1", "layer2.1.bn", "fc"]
    assert find_blocks(resnet) == ["layer1.0", "layer1.1", "layer2.0", "layer2.1"]
    assert find_blocks(["net.0", "net.lin", ""]) == []  # one child is no repetition
    assert find_blocks(["", ""]) == []
    assert find_blocks(["m.h.10", "m.h.2"]) == ["m.h.10", "m.h.2"]  # order of first appearance
    # HF's ResNet: a two-layer classifier head is the shallowest repetition, but the bottleneck
    # layers (deeper, more ops) are the blocks; stages and layers cover the same ops: more blocks win.
    hf_resnet = (["resnet.embedder.conv"] + [f"resnet.encoder.stages.{s}.layers.{j}.conv{c}"
                                             for s in range(2) for j in range(2) for c in range(3)]
                 + ["classifier.0", "classifier.1"])
    assert find_blocks(hf_resnet) == [f"resnet.encoder.stages.{s}.layers.{j}" for s in range(2) for j in range(2)]


@pytest.mark.parametrize("name,imported,expected", [
    ("aten.mm.default", False, True),
    ("aten.addmm.default", False, True),
    ("aten.bmm.default", False, True),
    ("aten.baddbmm.default", False, True),
    ("aten._addmm_activation.default", False, True),
    ("aten.convolution.default", False, True),
    ("aten.cudnn_convolution.default", False, True),
    ("aten.conv2d.default", False, True),
    ("aten._scaled_dot_product_flash_attention.default", False, True),
    ("aten._scaled_dot_product_efficient_attention.default", False, True),
    ("aten.relu.default", False, False),
    ("aten.gelu.default", False, False),
    ("aten.summ.default", False, False),
    ("aten.native_layer_norm.default", False, False),
    ("block1_conv1", True, True),
    ("fc1000", True, True),
    ("predictions_Dense", True, True),
    ("conv1_bn", True, True),
    ("activation_3", True, False),
    ("17", True, False),
])
def test_matmul_like(name, imported, expected):
    assert is_matmul_like(name, imported) is expected


def test_executable_removes_drops_whose_rebuild_needs_a_gone_tensor():
    b = TraceBuilder()
    x = b.tensor(16, "input")
    (y,) = b.op("aten.rand_like.default", [x], [64], recomputable=False)  # freed after op 1
    (z,) = b.op("aten.relu.default", [y], [64])
    (w,) = b.op("aten.relu.default", [z], [64])
    (g,) = b.op("aten.x_backward", [w], [64], phase="backward", kind="temporary")
    b.op("aten.relu_backward", [g, z], [64], phase="backward", kind="temporary")
    problem = build_problem(b.build())
    zi = problem.index_of(z)
    # The problem already refuses z as a candidate: its lone rebuild is not executable.
    assert zi not in problem.candidates.tolist()
    uses = problem.uses[zi].tolist()
    drop = Drop(zi, uses[1], uses[2])
    with pytest.raises(PlanError):
        simulate(problem, [drop])
    kept, removed = executable(problem, [drop])
    assert kept == [] and removed == {zi}
    for name, planner in BASELINES.items():
        dec = planner(problem, int(0.7 * problem.baseline_peak[0]))
        assert zi not in {d.tensor for d in dec.drops}, name
        make_plan(problem, None, name, dec, 0.0, 0)


GRAPHS = graph_files()


@pytest.mark.parametrize("path", GRAPHS, ids=[p.stem for p in GRAPHS])
def test_public_graphs(path):
    from taichi_plan.trace.import_graph import import_graph

    problem = build_problem(import_graph(path))
    peak = problem.baseline_peak[0]
    budget = int(0.8 * peak)
    for name, planner in BASELINES.items():
        dec = planner(problem, budget)
        plan = make_plan(problem, budget, name, dec, 0.0, 0)
        pred = plan.predicted
        assert pred["baseline_peak_bytes"] == peak
        if name == "none":
            assert pred["planned_peak_bytes"] == peak
        if name == "dtr" and plan.solver["status"] != "infeasible":
            assert pred["planned_peak_bytes"] <= budget
        if name in CANDIDATE_ONLY:
            assert within_cand_gaps(problem, dec.drops)



# ---------------------------------------------------------------------------------------------
# full and sqrt-n as they run: each checkpointed region's forward re-run once in backward
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_9_layers():
    from taichi_plan.record import get_workload, record_workload

    w = get_workload(model="gpt2", layers=9, hidden=64, heads=2, vocab=500, seq=32, batch=2)
    return build_problem(record_workload(w, fake=True, device_profile="v100-16gb", steps=1))


@pytest.mark.parametrize("name", ["sqrt-n", "full"])
def test_each_checkpointed_region_re_runs_its_forward_once(gpt2_9_layers, name):
    """Non-reentrant checkpoint re-runs a region's forward once, when backward first needs
    it. Counted on a fake 9-layer GPT-2: one recompute group per region, every re-run op a
    forward op of that region, none re-run twice, and the re-run FLOPs are the region's
    forward FLOPs exactly (every matmul once: its output or its input is saved)."""
    from taichi_plan.solve.baselines import _segments

    problem = gpt2_9_layers
    flops = problem.trace.ops["flops"].to_numpy()
    fwd = np.asarray([p == "forward" for p in problem.op_phase])
    if name == "sqrt-n":
        region, nseg, _ = _segments(problem, fwd)
        assert nseg == 3  # blocks 0-2 and 3-5 checkpointed, 6-8 run plain
        regions = {0, 1}
    else:
        region = op_blocks(problem.op_module, find_blocks(problem.op_module))
        region[~fwd] = -1
        regions = set(range(9))
    drops = BASELINES[name](problem, None).drops
    sim = simulate(problem, drops)
    times = collections.Counter(op for g in sim.groups.values() for op in g.ops)
    assert max(times.values()) == 1
    by_region = {}
    for g in sim.groups.values():
        (r,) = set(region[g.ops].tolist())  # one region per group
        assert r >= 0 and r not in by_region
        by_region[r] = g
    assert set(by_region) == regions
    for r, g in by_region.items():
        ops = np.nonzero(region == r)[0]
        assert flops[g.ops].sum() == flops[ops].sum() > 0
        assert problem.op_cost[g.ops].sum() <= problem.op_cost[ops].sum()
    checkpointed = np.isin(region, list(regions))
    # each re-run op at what the runtime takes to re-run it, and each drop's own cost
    assert sim.extra_cost == pytest.approx(sum(g.cost for g in by_region.values()) + problem.drop_cost * len(drops))
    assert sim.extra_cost <= problem.rerun_cost[checkpointed].sum() + problem.drop_cost * len(drops)


@pytest.fixture(scope="module")
def gpt2_cpu_attention():
    """A 4-layer GPT-2 with this torch's CPU attention (its S x S matrices saved): the greedy
    sweep alone stopped above checkpointing every block here."""
    from taichi_plan.record import get_workload, record_workload

    w = get_workload(model="gpt2", layers=4, hidden=64, heads=2, vocab=512, seq=64, batch=4)
    return build_problem(record_workload(w, fake=True, device_profile="v100-16gb", steps=1, gpu_kernels=False))


def test_the_heuristic_never_ends_above_one_line_checkpointing(gpt2_cpu_attention):
    """Asked for checkpointing's own peak (every block, sqrt(n)), the heuristic (remat only,
    and with partitions) returns a plan that fits: its sweep also starts from their drops and
    adds per-tensor drops where still over (the sweep alone fails at every block's peak on
    this model). The lowest peak its bisection reaches is never above every block's either."""
    from taichi_plan.simulate.core import simulate_plan
    from taichi_plan.solve.heuristic import plan_heuristic
    from taichi_plan.solve.reach import least_reached

    problem = gpt2_cpu_attention
    for name in ("full", "sqrt-n"):
        peak = simulate(problem, BASELINES[name](problem, None).drops).peak_bytes
        for partitions in (False, True):
            dec = plan_heuristic(problem, peak, partitions=partitions)
            assert simulate_plan(problem, dec.drops, dec.partitions)[0].peak_bytes <= peak, (name, partitions)
    full = simulate(problem, BASELINES["full"](problem, None).drops).peak_bytes
    reached = least_reached(problem, lambda p, b: plan_heuristic(p, b, partitions=False))[0]
    assert reached <= full
