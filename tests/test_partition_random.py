"""Partitioning modules that draw random numbers (dropout): an explicit opt-in
(``solve(partition_random=True)``, ``solve --partition-random``) that the plan, ``inspect`` and
``replay`` state; exact where the chunks provably draw the whole batch's masks (one dropout in
the module, CPU), statistical elsewhere; never without the opt-in."""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from taichi_plan.base.errors import PlanError
from taichi_plan.cli import main
from taichi_plan.plan.format import FORMAT_VERSION as PLAN_VERSION
from taichi_plan.plan.format import Partition, load_plan, save_plan
from taichi_plan.problem.core import build_problem
from taichi_plan.problem.partition.apply import apply_partitions
from taichi_plan.problem.partition.find import module_spans, partitionable_spans
from taichi_plan.problem.partition.qualify import allow_random, draws_random, random_draws
from taichi_plan.record import get_workload, record_workload
from taichi_plan.simulate.core import Drop
from taichi_plan.solve import solve
from taichi_plan.solve.result import Decisions, make_plan
from taichi_plan.trace.format import read_trace, write_trace
from tests.kv_cache import ENTRY

# A tiny GPT-2 with dropout on (transformers' defaults, 0.1): each block's mlp has one dropout,
# its attn two (attention probabilities, residual).
SIZES = dict(model="gpt2", layers=2, hidden=64, heads=2, vocab=64, seq=16, batch=4)
# The same GPT-2 with its KV cache off (tests/kv_cache.py): with it on, attentions are never
# partitioned (partition.leaves_state).
NO_CACHE = dict(entry=ENTRY, batch=4)
MLP, ATTN = "transformer.h.0.mlp", "transformer.h.0.attn"


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("prand") / "tiny-gpt2-dropout"
    write_trace(record_workload(get_workload(**NO_CACHE), fake=False), d)
    return d


@pytest.fixture(scope="module")
def problem(trace_dir):
    return build_problem(read_trace(trace_dir))


def _plan(problem, tmp_path, modules, drops=()):
    plan = make_plan(allow_random(problem, True), None, "heuristic",
                     Decisions(drops=list(drops), partitions=[Partition(m, 0, 2) for m in modules]), 0.0, 0)
    path = tmp_path / "p.plan.json"
    save_plan(plan, path, force=True)
    return path


# ---------------------------------------------------------------------------------------------
# The mechanism, at the torch level
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(4, 5), (6, 7), (8, 3, 33), (16, 64, 30)])
@pytest.mark.parametrize("chunks", [2, 4])
def test_one_cpu_dropout_draws_the_same_masks_chunk_by_chunk(shape, chunks):
    """The CPU generator fills a Bernoulli mask element by element: chunks along dim 0 draw
    the whole batch's mask, slice by slice, and leave the generator where it would be. With
    two dropouts in the chunked span the order of draws changes, and so do the masks."""
    def run(k, ops):
        torch.manual_seed(0)
        x = torch.ones(*shape)
        out = x
        if k == 1:
            for op in ops:
                out = op(out)
        else:
            parts = []
            for c in x.chunk(k):
                for op in ops:
                    c = op(c)
                parts.append(c)
            out = torch.cat(parts)
        return out, torch.get_rng_state()

    one = [lambda t: F.dropout(t, 0.1, True)]
    whole, state = run(1, one)
    chunked, state_c = run(chunks, one)
    assert torch.equal(whole, chunked) and torch.equal(state, state_c)
    two = one + [lambda t: F.dropout(t, 0.5, True)]
    whole, state = run(1, two)
    chunked, state_c = run(chunks, two)
    assert not torch.equal(whole, chunked)
    assert torch.equal(state, state_c)  # as many numbers drawn, in another order


# ---------------------------------------------------------------------------------------------
# The opt-in
# ---------------------------------------------------------------------------------------------


def test_random_modules_are_options_only_with_the_opt_in(problem):
    # Without the opt-in a random module is an option of one chunk only (checkpointed whole,
    # its masks re-drawn as they were: tests/test_checkpoint_whole.py), never split.
    plain = {s.module for s in module_spans(problem) if max(s.chunk_choices) > 1}
    opted = {s.module: s for s in module_spans(allow_random(problem, True))}
    every = {s.module: s for s in partitionable_spans(problem)}
    assert MLP in every and ATTN in every and MLP not in plain and ATTN not in plain
    assert max(opted[MLP].chunk_choices) > 1 and max(opted[ATTN].chunk_choices) > 1
    assert all(not every[m].random_ops for m in plain)
    assert [problem.op_name[i] for i in every[MLP].random_ops] == ["aten.bernoulli_.float"]
    assert len(every[ATTN].random_ops) == 2
    # A plan naming a random module without the record is refused; with it, it is simulated.
    with pytest.raises(PlanError, match="--partition-random"):
        apply_partitions(problem, [Partition(MLP, 0, 2)])
    apply_partitions(problem, [Partition(MLP, 0, 2, random_draws="as-unpartitioned")])


def test_random_draws_says_where_chunks_reproduce_the_masks(problem):
    spans = {s.module: s for s in partitionable_spans(problem)}
    assert random_draws(problem, spans[MLP]) == "as-unpartitioned"  # one dropout, real CPU run
    assert random_draws(problem, spans[ATTN]) == "per-chunk"  # two dropouts
    assert random_draws(problem, spans["transformer.h.0.mlp.c_fc"]) is None
    fake = build_problem(record_workload(get_workload(**SIZES), fake=True, device_profile="v100-16gb"))
    fspans = {s.module: s for s in partitionable_spans(fake)}
    assert random_draws(fake, fspans[MLP]) == "per-chunk"  # a GPU's Philox stream: not claimed


def test_solve_partitions_random_modules_only_when_asked():
    """At 57% of this GPT-2's peak the heuristic partitions (at 60% its local search reaches the
    budget by drops alone; 56% is out of its reach since the trace says which tensors the
    model's Python code holds after their last use); without the opt-in none of its
    partitions draws random numbers and its options hold no random module; with it the
    options include the mlp modules (GPU kernels: native_dropout), whatever the heuristic then
    picks is recorded, and the plan says the solve allowed it. (A fake trace: roofline costs,
    so the heuristic's choices do not vary with measured times.)"""
    trace = record_workload(get_workload(model="gpt2", layers=2, hidden=128, heads=2, vocab=64, seq=64, batch=8),
                            fake=True, device_profile="a100-40gb")
    problem = build_problem(trace)
    budget = int(0.57 * problem.baseline_peak[0])
    every = {s.module: s for s in partitionable_spans(problem)}
    randoms = {m for m, s in every.items() if s.random_ops}
    assert {"transformer.h.0.mlp", "transformer.h.1.mlp"} <= randoms
    assert not randoms & {s.module for s in module_spans(problem) if max(s.chunk_choices) > 1}
    assert randoms <= {s.module for s in module_spans(allow_random(problem, True))}
    plain = solve(trace, budget, "heuristic", time_limit=120)
    assert plain.solver["partition_random"] is False and plain.partitions
    # Without the opt-in a random module is at most checkpointed whole: its masks as they were.
    assert all((p.random_draws is None and not every[p.module].random_ops)
               or (p.chunks == 1 and p.random_draws == "as-unpartitioned") for p in plain.partitions)
    opted = solve(trace, budget, "heuristic", time_limit=120, partition_random=True)
    assert opted.solver["partition_random"] is True
    assert all((p.random_draws == "per-chunk") == (bool(every[p.module].random_ops) and p.chunks > 1)
               for p in opted.partitions)
    assert opted.predicted["planned_peak_bytes"] <= budget


def test_plan_file_records_it_and_inspect_says_so(problem, trace_dir, tmp_path):
    path = _plan(problem, tmp_path, [ATTN, "transformer.h.1.mlp"])
    obj = json.loads(path.read_text())
    assert obj["format_version"] == PLAN_VERSION and obj["solver"]["partition_random"] is True
    assert {p["module"]: p["random_draws"] for p in obj["decisions"]["partitions"]} == {
        ATTN: "per-chunk", "transformer.h.1.mlp": "as-unpartitioned"}
    assert [p.random_draws for p in load_plan(path).partitions] == ["per-chunk", "as-unpartitioned"]
    r = CliRunner().invoke(main, ["inspect", str(path)])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert f"Training changes: the chunks of {ATTN} draw their own dropout masks" in text
    assert "statistically, not bitwise" in text
    obj["decisions"]["partitions"][0]["random_draws"] = "sometimes"
    bad = tmp_path / "bad.plan.json"
    bad.write_text(json.dumps(obj))
    with pytest.raises(PlanError, match="random_draws"):
        load_plan(bad)


def test_solve_cli_flag(trace_dir, tmp_path):
    out = tmp_path / "cli.plan.json"
    r = CliRunner().invoke(main, ["solve", str(trace_dir), "--budget", "99%", "--method", "heuristic",
                                  "--partition-random", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["solver"]["partition_random"] is True


# ---------------------------------------------------------------------------------------------
# Replay: exact where it is exact, statistical elsewhere, and the runtime's rebuilds alongside
# ---------------------------------------------------------------------------------------------


def test_replay_one_dropout_is_exact_next_to_rebuilt_dropout_masks(problem, tmp_path):
    """The mlp's chunks draw the whole batch's masks, so gradients match to rounding, while
    the runtime drops and rebuilds block 1's dropout masks (with their recorded RNG state)
    around it: neither disturbs the other's random draws, and the peak is the predicted one."""
    from taichi_plan.replay.measure import replay

    opted = allow_random(problem, True)
    parted, _ = apply_partitions(opted, [Partition(MLP, 0, 2)])
    drops = [Drop(int(t), int(a), int(b)) for t, a, b in zip(parted.candidates, parted.cand_free_after,
                                                            parted.cand_remat_before, strict=True)
             if problem.op_module[problem.producer[t]].startswith("transformer.h.1.")
             and any("bernoulli" in problem.op_name[q] for q in problem.rebuild_ops[t])]
    assert drops
    report = replay(_plan(problem, tmp_path, [MLP], drops), steps=2)
    assert report["grads_match"] and report["grads_check"].startswith("allclose")
    assert report["recompute_ops"] > 0
    assert report["measured_peak_bytes"] == report["predicted_peak_bytes"]
    assert "draw the whole batch's dropout masks" in report["random_draws"]


def test_replay_per_chunk_masks_compares_statistically(problem, tmp_path):
    from taichi_plan.replay.measure import replay

    report = replay(_plan(problem, tmp_path, [ATTN]), steps=2)
    assert report["grads_check"].startswith("statistical")
    assert report["grads_match"]
    d = report["grads_distance"]["grads"]
    assert 0 < d["planned"] <= 2 * d["reseeded"]  # masks differ: not bitwise, within the seed spread
    assert "draw their own dropout masks" in report["random_draws"]
    assert report["measured_peak_bytes"] == report["predicted_peak_bytes"]


def test_loss_curves_with_per_chunk_masks_match_statistically(problem, trace_dir, tmp_path):
    """Train the tiny dropout GPT-2 for 20 steps from the same weights, plain and with its
    blocks' attention partitioned (chunks draw their own masks). Test: the mean loss over the
    last 8 steps of the planned run is within 3 standard deviations of the plain run's own
    last-8 losses around their mean, and both runs learned (last-8 mean below the first
    loss by at least half the plain run's drop)."""
    import taichi_plan

    plan = _plan(problem, tmp_path, [ATTN, "transformer.h.1.attn"])
    assert all(p.random_draws == "per-chunk" for p in load_plan(plan).partitions)

    def train(planned: bool) -> list[float]:
        torch.manual_seed(0)
        model, batch, loss_fn, opt = get_workload(**NO_CACHE).build(False)
        if planned:
            model = taichi_plan.apply(model, plan, optimizer=opt)
        losses = []
        for _ in range(20):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(**batch), batch)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        if planned:
            taichi_plan.finish(model)
        return losses

    plain, parted = train(False), train(True)
    assert plain != parted  # other masks: not the same run
    k = 8
    mean_plain, mean_parted = statistics.mean(plain[-k:]), statistics.mean(parted[-k:])
    spread = statistics.stdev(plain[-k:])
    assert abs(mean_parted - mean_plain) <= 3 * spread, (mean_plain, mean_parted, spread)
    drop = plain[0] - mean_plain
    assert drop > 0 and parted[0] - mean_parted >= drop / 2
    assert np.isfinite(parted).all()


@pytest.mark.parametrize("entry, random", [("tiny_models:sdpa_blocks", True),
                                           ("tiny_models:sdpa_blocks_no_dropout", False)])
def test_random_ops_are_decided_from_the_call_not_the_op_name(entry, random):
    """SDPA is tagged ``nondeterministic_seeded`` whether or not it drops: the recording keeps
    the ops that drew (``meta.random_ops``), so an attention module whose only dropout is
    SDPA's ``dropout_p`` (a GPU's fused kernel, as a fake a100 recording maps it) is random
    (a span holding it is never partitioned without the opt-in), and with ``dropout_p=0`` not.
    A trace without ``meta.random_ops`` (v3) falls back to names, which miss it."""
    trace = record_workload(get_workload(entry=entry, batch=4), fake=True, device_profile="a100-40gb")
    sdpa = [i for i, n in enumerate(trace.ops["op"]) if "scaled_dot_product" in n and trace.ops["phase"][i] == "forward"]
    assert len(sdpa) == 2
    assert all((i in trace.meta["random_ops"]) == random for i in sdpa)
    problem = build_problem(trace)
    assert [draws_random(problem, i) for i in sdpa] == [random] * 2
    del trace.meta["random_ops"]  # a v3 trace: found by op name, which misses SDPA's dropout
    assert not any(draws_random(build_problem(trace), i) for i in sdpa)
