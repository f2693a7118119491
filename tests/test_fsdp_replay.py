"""A plan of rank 0's sharded step, run for real: 2 gloo ranks on loopback, FSDP2 on CPU.

Every rank's measured peak equals the predicted one, and its gradient and parameter shards
are bitwise those of the unplanned sharded run (``replay --nproc 2``); the user's own
torchrun script (examples/train_fsdp_with_plan.py) trains with ``apply``; a plan is refused
on another layout. The ranks are processes this test starts and waits for.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner
from ranks import record_cli, replay_measures_the_prediction, torchrun_losses

from taichi_plan.base.errors import PlanError
from taichi_plan.cli import main
from tests.partition_replay import whole_output_drops

TINY = ["--model", "gpt2", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "500", "--seq", "128",
        "--batch", "4"]


@pytest.fixture(scope="module")
def fsdp2_plan(tmp_path_factory):
    return _half_plan(tmp_path_factory.mktemp("fsdp2"))


def _half_plan(d, *flags: str):
    """The tiny GPT-2's 2-rank job (``flags``: more of record's), recorded on the fake process
    group under ``d`` and solved at half its per-rank peak; the plan's path."""
    record_cli(*TINY, "--fake", "--fsdp", "2", *flags, "-o", str(d / "traces" / "t"))
    plan = d / "plans" / "t.plan.json"
    r = CliRunner().invoke(main, ["solve", str(d / "traces" / "t"), "--budget", "50%", "--method", "heuristic",
                                  "-o", str(plan)])
    assert r.exit_code == 0, r.output
    return plan


def test_replay_two_gloo_ranks_measured_equals_predicted(fsdp2_plan):
    replay_measures_the_prediction(fsdp2_plan)


def test_ranks_take_the_callers_environment_of_the_moment(fsdp2_plan, monkeypatch):
    """The ranks are forked by a server that keeps the environment it started with; each rank
    takes the caller's as it is at the call (multiprocessing already gives it the caller's
    directory and sys.path), as a new process would: gloo set to a network interface that does
    not exist after the server is up makes the ranks fail, with gloo's own words."""
    from taichi_plan.replay.distributed import replay_sharded
    from taichi_plan.torch_common.processes import spawn_ranks

    with pytest.raises(PlanError):  # the server is up (started here, or by an earlier test)
        spawn_ranks(2, "taichi_plan.replay.distributed:replay_rank", {"no_such_argument": 1}, timeout_s=120)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no_such_if0")
    with pytest.raises(PlanError, match="no_such_if0"):
        replay_sharded(fsdp2_plan, 2, steps=1)


def test_torchrun_script_applies_the_plan(fsdp2_bf16_plan):
    """The user's own torchrun script (examples/train_fsdp_with_plan.py), here with the job's
    MixedPrecisionPolicy (its second argument; without one it runs the same code with FSDP's
    default policy): one torchrun run, since each starts fresh interpreters (about 10 s of the
    gloo tests' time)."""
    losses = torchrun_losses("train_fsdp_with_plan.py", str(fsdp2_bf16_plan), "bf16")
    assert set(losses) == {0, 1} and losses[0] == losses[1], losses  # same batch on both ranks: same loss


def test_a_rank_that_dies_is_reported_with_its_output():
    """A rank that fails before it reports (here: a job its function cannot take) ends the run
    with a sentence naming the rank and the last lines it printed (each rank's output goes to
    a log beside the job: the ranks are forked by a forkserver, not piped)."""
    from taichi_plan.torch_common.processes import spawn_ranks

    with pytest.raises(PlanError, match=r"(?s)Rank \d of the 2-rank run exited with code 1 before reporting.*TypeError"):
        spawn_ranks(2, "taichi_plan.replay.distributed:replay_rank", {"no_such_argument": 1}, timeout_s=120)


def test_sharded_plan_refused_where_the_layout_differs(fsdp2_plan):
    import taichi_plan
    from taichi_plan.record import get_workload

    model, _batch, _loss, _opt = get_workload(model="gpt2", layers=2, hidden=64, heads=4, vocab=500, seq=128,
                                              batch=4).build(False)
    with pytest.raises(PlanError, match="solved for 2 ranks.*applied to one process"):
        taichi_plan.apply(model, fsdp2_plan)
    r = CliRunner().invoke(main, ["replay", str(fsdp2_plan)])
    assert r.exit_code != 0 and "--nproc 2" in r.output
    r = CliRunner().invoke(main, ["replay", str(fsdp2_plan), "--nproc", "4"])
    assert r.exit_code != 0 and "--nproc 2" in r.output and "Traceback" not in r.output


@pytest.mark.bench
def test_real_two_rank_recording_agrees_with_the_fake_one(fsdp2_plan, tmp_path):
    """record --fsdp 2 without --fake: 2 gloo processes run the job, rank 0 records it. Its
    peak agrees with FSDPMemTracker's on the real step and with the fake recording's (the
    plan's trace), within 5%, at the same op; the model's forward is the same op sequence (the backward differs by a
    split and a copy per reduce-scatter that FSDP2 runs on gloo, not on the fake group)."""
    from taichi_plan.trace.format import baseline_peak, read_trace

    r = subprocess.run([sys.executable, "-m", "taichi_plan", "record", *TINY, "--fsdp", "2", "--steps", "1",
                        "-o", str(tmp_path / "real")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    real = read_trace(tmp_path / "real")
    fake = read_trace(fsdp2_plan.parent.parent / "traces" / "t")
    assert real.meta["mode"] == "real" and real.meta["fsdp"]["backend"] == "gloo"
    assert (real.ops["cost_source"] == "measured").all()
    # A real step's peak may include a storage a reference cycle keeps until Python's collector
    # runs (the recorder does not force a collection): seen once here at +2.01%. The gate's 5%.
    (pct,) = re.findall(r"FSDPMemTracker's peak for the same step is .* \(([+-][0-9.]+)%\)", r.stdout)
    assert abs(float(pct)) <= 5.0, r.stdout
    (real_peak, real_op), (fake_peak, fake_op) = baseline_peak(real), baseline_peak(fake)
    assert abs(real_peak - fake_peak) <= 0.05 * fake_peak and real_op == fake_op
    (c_real,), (c_fake,) = real.meta["model_calls"], fake.meta["model_calls"]
    assert (c_real["start"], c_real["end"]) == (c_fake["start"], c_fake["end"])
    span = slice(c_fake["start"], c_fake["end"] + 1)
    assert real.ops["op"][span].tolist() == fake.ops["op"][span].tolist()


LLAMA = ["--model", "llama", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "2000", "--seq", "128",
         "--batch", "4"]


@pytest.fixture(scope="module")
def llama_fsdp2(tmp_path_factory):
    """A tiny Llama (untied head, vocabulary 2000: the logits and their log-softmax are most of
    the step's peak) at 2 ranks, fake."""
    d = tmp_path_factory.mktemp("llama-fsdp2")
    record_cli(*LLAMA, "--fake", "--fsdp", "2", "-o", str(d / "traces" / "t"))
    return d


def test_head_and_loss_partition_over_tokens_in_a_sharded_trace(llama_fsdp2):
    """Under FSDP2 the head's weight is the unit's gathered parameter (two rows, forward and
    backward gathering, of one storage): the token span is found all the same, and partitioned,
    the logits and their log-softmax never exist."""
    from taichi_plan.plan.format import Partition
    from taichi_plan.problem.core import build_problem
    from taichi_plan.problem.partition.token_span import internal, token_spans
    from taichi_plan.simulate.core import simulate_plan
    from taichi_plan.trace.format import read_trace

    problem = build_problem(read_trace(llama_fsdp2 / "traces" / "t"))
    (span,) = token_spans(problem)
    head = next(q for q in span.fwd_ops if problem.op_name[q] == "aten.mm.default")
    assert span.module == "lm_head" and (span.rows, span.vocab) == (512, 2000)
    assert {problem.kind[t] for t in problem.op_reads[head].tolist()} == {"unsharded_parameter", "activation"}
    own = internal(problem, span)
    assert sum(int(problem.nbytes[t]) for t in own) >= 3 * 512 * 2000 * 4  # logits, log-softmax, its gradient
    base, _ = simulate_plan(problem, [], [])
    parted, _ = simulate_plan(problem, [], [Partition("lm_head", 0, 4, over="tokens")])
    assert parted.peak_bytes < base.peak_bytes - 2 * 512 * 2000 * 4


@pytest.mark.bench
def test_partitions_run_under_fsdp2_measured_equals_predicted(llama_fsdp2):
    """The heuristic's plan at 45% of the per-rank peak partitions the head and loss over tokens
    (with drops and its FSDP settings); 2 gloo ranks measure exactly the predicted peak, shards
    allclose to the unplanned run's. A plan partitioning modules along the batch, inside FSDP
    units whose parameters they read, measures as predicted too."""
    from taichi_plan.plan.format import Partition, save_plan
    from taichi_plan.problem.core import build_problem
    from taichi_plan.solve.result import Decisions, make_plan
    from taichi_plan.trace.format import read_trace

    plan = llama_fsdp2 / "plans" / "h.plan.json"
    r = CliRunner().invoke(main, ["solve", str(llama_fsdp2 / "traces" / "t"), "--budget", "45%", "--method",
                                  "heuristic", "-o", str(plan)])
    assert r.exit_code == 0, r.output
    _report, got = replay_measures_the_prediction(plan, fraction=0.45)
    assert any(p["over"] == "tokens" for p in got["decisions"]["partitions"])

    problem = build_problem(read_trace(llama_fsdp2 / "traces" / "t"))
    parts = [Partition("model.layers.1.mlp", 0, 2), Partition("model.layers.0.input_layernorm", 0, 4),
             Partition("model.layers.0.post_attention_layernorm", 0, 4)]
    batch = make_plan(problem, None, "heuristic", Decisions(partitions=parts), 0.0, 0)
    save_plan(batch, llama_fsdp2 / "plans" / "b.plan.json")
    r = CliRunner().invoke(main, ["replay", str(llama_fsdp2 / "plans" / "b.plan.json"), "--nproc", "2", "--steps",
                                  "1", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output[r.output.index("{"):r.output.rindex("}") + 1])
    assert report["predicted_peak_bytes"] < batch.predicted["baseline_peak_bytes"]
    for rank in report["ranks"]:
        assert rank["measured_peak_bytes"] == report["predicted_peak_bytes"], rank
        assert rank["grads_match"] and rank["params_match"], rank


def test_a_sharded_recording_knows_what_the_kv_cache_holds(fsdp2_plan):
    """record --fsdp probes when the step's code lets go of each storage (trace python_refs),
    as a one-process recording does: GPT-2's attentions, which append to its KV cache, and
    the blocks around them are not offered as partitions; its MLPs are."""
    from taichi_plan.problem.core import build_problem
    from taichi_plan.problem.partition.find import module_spans
    from taichi_plan.trace.format import read_trace

    trace = read_trace(fsdp2_plan.parent.parent / "traces" / "t")
    assert "python_refs" in trace.meta
    names = {s.module for s in module_spans(build_problem(trace))}
    assert "transformer.h.0.mlp" in names
    assert not any(n.endswith(".attn") or n in ("transformer.h.0", "transformer.h.1") for n in names), names


def test_norms_checkpointed_whole_with_their_outputs_dropped_run_under_fsdp2(llama_fsdp2):
    """Every RMSNorm checkpointed whole and its output dropped (plan v10, rebuilt through the
    norm from its held input with the unit's weight gathered again in backward): 2 gloo
    ranks measure exactly the predicted peak, shards bitwise."""
    from taichi_plan.plan.format import save_plan
    from taichi_plan.problem.core import build_problem
    from taichi_plan.problem.partition.find import module_spans
    from taichi_plan.problem.partition.span import as_partition
    from taichi_plan.solve.result import Decisions, make_plan
    from taichi_plan.trace.format import read_trace

    problem = build_problem(read_trace(llama_fsdp2 / "traces" / "t"))
    norms = [s for s in module_spans(problem) if s.module.endswith("layernorm") and s.over == "batch"]
    parts = [as_partition(s, 1) for s in norms]
    drops = whole_output_drops(problem, norms)
    assert len(norms) == 4 and len(drops) == 4
    plan = make_plan(problem, None, "manual", Decisions(drops=drops, partitions=parts), 0.0, 0)
    save_plan(plan, llama_fsdp2 / "plans" / "whole.plan.json")
    r = CliRunner().invoke(main, ["replay", str(llama_fsdp2 / "plans" / "whole.plan.json"), "--nproc", "2",
                                  "--steps", "1", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output[r.output.index("{"):r.output.rindex("}") + 1])
    assert report["predicted_peak_bytes"] < plan.predicted["baseline_peak_bytes"]
    for rank in report["ranks"]:
        assert rank["measured_peak_bytes"] == report["predicted_peak_bytes"], rank
        assert rank["grads_match"] and rank["params_match"] and rank["dropped_storages"] > 0, rank
    assert report["grads_check"].startswith("bitwise"), report["grads_check"]


@pytest.fixture(scope="module")
def fsdp2_bf16_plan(tmp_path_factory):
    """The tiny GPT-2's 2-rank job under FSDP2's mixed precision (bf16 parameters, fp32
    gradient reduction), recorded on the fake process group and solved at half its peak."""
    return _half_plan(tmp_path_factory.mktemp("fsdp2bf16"), "--fsdp-param-dtype", "bf16", "--fsdp-reduce-dtype", "fp32")


def test_mixed_precision_replays_on_two_gloo_ranks(fsdp2_bf16_plan):
    """Each rank measures the predicted peak, gradients and parameters as the unplanned
    mixed-precision run's (within bf16 roundings where the plan splits modules: its chunks
    compute in bf16); the user's torchrun script runs it with the same MixedPrecisionPolicy
    (test_torchrun_script_applies_the_plan)."""
    replay_measures_the_prediction(fsdp2_bf16_plan)


def test_mixed_precision_plan_refused_on_a_job_without_it(fsdp2_bf16_plan):
    """A plan of a bf16-gathered job holds nothing for an fp32 one (twice the gathered bytes):
    apply() names the difference before the plan costs memory."""
    _refused_on_a_plain_job(fsdp2_bf16_plan, r"param_dtype=bfloat16, reduce_dtype=float32.*applied to 2 ranks")


def _refused_on_a_plain_job(plan, match: str) -> None:
    """apply() of ``plan`` to the tiny GPT-2 sharded over 2 fake ranks on a 1-D mesh, no policy,
    raises PlanError matching ``match``."""
    import taichi_plan
    from taichi_plan.record import get_workload
    from taichi_plan.record.fsdp import fake_process_group, shard_model

    model, _batch, _loss, _opt = get_workload(model="gpt2", layers=2, hidden=64, heads=4, vocab=500, seq=128,
                                              batch=4).build(False)
    with fake_process_group(2) as mesh:
        shard_model(model, mesh)
        with pytest.raises(PlanError, match=match):
            taichi_plan.apply(model, plan)


@pytest.fixture(scope="module")
def hsdp2_plan(tmp_path_factory):
    """The tiny GPT-2 as an HSDP job of 2 replicas (a 2-D mesh (2, 1): each replica holds whole
    units, the gradients all-reduced across), recorded on the fake process group, solved at half."""
    return _half_plan(tmp_path_factory.mktemp("hsdp2"), "--hsdp", "2")


def test_hsdp_replays_on_two_gloo_ranks(hsdp2_plan):
    """replay --nproc 2 builds the recorded 2-D mesh: each rank measures the predicted peak,
    its gradients and parameters bitwise the unplanned HSDP run's."""
    replay_measures_the_prediction(hsdp2_plan)


def test_hsdp_plan_refused_on_a_one_dimensional_mesh(hsdp2_plan):
    _refused_on_a_plain_job(hsdp2_plan, r"mesh \[2, 1\] \(HSDP: 2 replicas of 1-rank shard groups\).*mesh \[2\]")
