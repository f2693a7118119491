"""``record --no-kv-cache``: a built-in decoder recorded as training runs it.

transformers builds GPT-2 and Llama with ``config.use_cache = True``: their forward appends
every layer's keys and values to a KV cache that the output holds to the end of the step, so
no attention or block can be partitioned (``partition.leaves_state``) and the cache's bytes
are in every plan's floor. ``--no-kv-cache`` builds the model with the cache off (what
``gradient_checkpointing_enable()`` sets); the trace says so (``meta.workload.args``), replay
rebuilds the same model, and the planner's note for a cached built-in names the flag.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from taichi_plan.cli import main
from taichi_plan.problem.core import build_problem
from taichi_plan.problem.partition.find import state_keepers
from taichi_plan.solve.messages import kv_cache_note
from taichi_plan.trace.format import read_trace

TINY = ["--model", "llama", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "256", "--seq", "128",
        "--batch", "8"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The cache off through the CLI (what a user runs; replayed below), and on through the
    library, uncalibrated (only its problem is compared)."""
    from taichi_plan.record import get_workload, record_workload
    from taichi_plan.trace.format import write_trace

    d = tmp_path_factory.mktemp("kv")
    r = CliRunner().invoke(main, ["record", *TINY, "--steps", "1", "--no-kv-cache", "-o", str(d / "traces" / "off")])
    assert r.exit_code == 0, r.output
    sizes = {TINY[i].lstrip("-"): TINY[i + 1] for i in range(0, len(TINY), 2)}
    model = sizes.pop("model")
    on = record_workload(get_workload(model=model, **{k: int(v) for k, v in sizes.items()}), steps=1, calibrate=False)
    return {True: write_trace(on, d / "traces" / "on"), False: d / "traces" / "off"}


def test_the_cache_off_frees_the_attentions(recorded):
    on, off = (build_problem(read_trace(recorded[k])) for k in (True, False))
    assert read_trace(recorded[False]).meta["workload"]["args"]["kv_cache"] is False
    assert "kv_cache" not in read_trace(recorded[True]).meta["workload"]["args"]  # traces before the flag read so
    # With the cache on, each attention's keys and values are held by the output to the end of
    # the forward; with it off, nothing is kept out of the plan, and no keys or values are joined
    # to a cache.
    assert state_keepers(on) and not state_keepers(off)
    assert kv_cache_note(on) is not None and "--no-kv-cache" in kv_cache_note(on)
    assert kv_cache_note(off) is None
    cats = [n for n in on.op_name if n == "aten.cat.default"]
    assert len(cats) > len([n for n in off.op_name if n == "aten.cat.default"])


def test_replay_rebuilds_the_model_without_its_cache(recorded, tmp_path):
    plan = tmp_path / "plans" / "off.plan.json"
    r = CliRunner().invoke(main, ["solve", str(recorded[False]), "--budget", "60%", "--method", "heuristic",
                                  "-o", str(plan)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["replay", str(plan), "--steps", "1", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output[r.output.index("{"):r.output.rindex("}") + 1])
    # A model rebuilt with its cache on would hold every layer's keys and values: over the prediction.
    assert report["measured_peak_bytes"] == report["predicted_peak_bytes"], report
    assert report["grads_match"]


@pytest.mark.parametrize("args, says", [
    (["--model", "resnet50", "--batch", "1", "--image-size", "32"], "applies to the decoders with a KV cache"),
    (["--entry", "tests.kv_cache:without_cache"], "an --entry builds its own model"),
])
def test_the_flag_where_there_is_no_cache_to_turn_off(args, says, tmp_path):
    r = CliRunner().invoke(main, ["record", *args, "--no-kv-cache", "-o", str(tmp_path / "t")])
    assert r.exit_code != 0 and says in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "t").exists()


def test_default_name_and_maxbatch_take_the_flag(tmp_path, monkeypatch):
    from taichi_plan.record import get_workload

    w = get_workload(model="gpt2", layers=2, hidden=64, heads=4, vocab=256, seq=32, batch=4, kv_cache=False)
    assert w.default_output_name().endswith("-nokv")
    r = CliRunner().invoke(main, ["maxbatch", "--model", "llama", "--layers", "2", "--hidden", "64", "--heads", "4",
                                  "--vocab", "256", "--seq", "32", "--budget", "8MB", "--method", "heuristic",
                                  "--limit", "4", "--no-kv-cache", "--json"])
    assert r.exit_code == 0, r.output
    result = json.loads(r.output[r.output.index("{"):r.output.rindex("}") + 1])
    assert result["workload"]["kv_cache"] is False
