"""maxbatch: the search (exact on a known threshold), per-planner results on synthetic and
fake-recorded workloads (mlp, a tiny gpt2), and the CLI's errors."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from synthetic import chain_trace

from taichi_plan.base.errors import UsageError
from taichi_plan.cli import main
from taichi_plan.explore.maxbatch import (
    Probe,
    fake_recorder,
    max_batch,
    parse_overhead,
    probe_planner,
    render_max_batch,
    search,
)
from taichi_plan.problem.core import build_problem
from taichi_plan.solve import solve

# ---------------------------------------------------------------------------------------------
# The search
# ---------------------------------------------------------------------------------------------


def threshold(n: int, seen: list[int] | None = None):
    def probe(b: int) -> Probe:
        if seen is not None:
            seen.append(b)
        return Probe(b, b <= n, b, 0.0, "fits" if b <= n else "over budget")
    return probe


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8, 9, 100, 1000])
def test_search_finds_the_threshold(n):
    seen = []
    r = search(threshold(n, seen), None, limit=4096)
    assert r.max_batch == n and not r.capped
    assert len(seen) == len(set(seen))  # no batch probed twice
    if n:
        assert n + 1 in seen
    start = Probe(max(n // 3, 1), True, 0, 0.0, "fits") if n else None
    assert search(threshold(n), start, limit=4096).max_batch == n


def peaked(n: int, peak, seen: list[int]):
    """Fits up to ``n``; the probe's peak is ``peak(batch)`` (the search sees only that)."""
    def probe(b: int) -> Probe:
        seen.append(b)
        return Probe(b, b <= n, peak(b), 0.0, "fits" if b <= n else "over budget")
    return probe


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 9, 57, 100, 201, 1000])
def test_guided_search_on_a_linear_peak_needs_few_probes(n):
    # peak = 2 GB + 0.3 GB per sample; the budget is crossed between n and n + 1
    per, fixed = 300_000_000, 2_000_000_000
    target = fixed + per * n + per // 2
    plain, guided = [], []
    assert search(peaked(n, lambda b: fixed + per * b, plain), None, 4096).max_batch == n
    r = search(peaked(n, lambda b: fixed + per * b, guided), None, 4096, target=target)
    assert r.max_batch == n and r.stop is not None and r.stop.batch == n + 1
    assert len(guided) == len(set(guided))
    assert len(guided) <= 4  # 1, 2, then the line's crossing and the batch after it
    assert len(guided) <= len(plain)


@pytest.mark.parametrize("n", [3, 40, 201, 999])
@pytest.mark.parametrize("shape", ["quadratic", "steps", "flat", "wrong side"])
def test_guided_search_stays_exact_where_the_line_is_wrong(n, shape):
    # peaks that mislead the line: it must still end on n, with at most about twice bisection's probes
    peak = {"quadratic": lambda b: b * b, "steps": lambda b: 1000 * (b // 16), "flat": lambda b: 5,
            "wrong side": lambda b: (n + 1) * 10 - b}[shape]
    plain, guided = [], []
    search(peaked(n, peak, plain), None, 4096)
    start = Probe(1, True, None, 0.0, "fits")
    for target in (n * n, 1000 * (n // 16), 10, 0):
        guided.clear()
        r = search(peaked(n, peak, guided), start, 4096, target=target)
        assert r.max_batch == n and len(guided) == len(set(guided))
        assert len(guided) <= 2 * len(plain) + 2


def test_search_stops_at_the_limit():
    r = search(threshold(10**9), None, limit=100)
    assert r.max_batch == 100 and r.capped
    r = search(threshold(99), None, limit=100)
    assert r.max_batch == 99 and not r.capped


@pytest.mark.parametrize("text,pct", [("33%", 33.0), ("100%", 100.0), ("0.5%", 0.5), (" 1000% ", 1000.0)])
def test_parse_overhead(text, pct):
    assert parse_overhead(text) == pct


@pytest.mark.parametrize("text", ["0%", "1001%", "-5%", "33", "0.33", "abc", "inf%", ""])
def test_parse_overhead_rejects(text):
    with pytest.raises(UsageError):
        parse_overhead(text)


# ---------------------------------------------------------------------------------------------
# A synthetic workload: an 8-layer chain whose activations grow with the batch.
# ---------------------------------------------------------------------------------------------


def chain_at(batch: int):
    return chain_trace([10 * batch] * 8, temp_bytes=5 * batch, param_bytes=10)


def test_synthetic_max_batch_none_exact_ours_at_least_none():
    budget, overhead = 2000, 30.0
    res = max_batch(chain_at, budget, method="auto", max_overhead_pct=overhead, time_limit=5, limit=1000)
    by = {r["planner"]: r for r in res["planners"]}
    none, ours, sq = by["none"]["max_batch"], by["auto"]["max_batch"], by["sqrt-n"]["max_batch"]
    # none is exact: its peak fits at the answer and not one batch above.
    assert build_problem(chain_at(none)).baseline_peak[0] <= budget < build_problem(chain_at(none + 1)).baseline_peak[0]
    assert ours >= none and sq >= none and ours > sq  # sqrt-n runs its last segment plain
    # ours fits at its answer within the overhead and one batch above did not fit.
    plan = solve(chain_at(ours), budget, "auto", time_limit=5)
    assert plan.predicted["planned_peak_bytes"] <= budget and plan.predicted["extra_compute_pct"] <= overhead
    assert plan.predicted["planned_peak_bytes"] == by["auto"]["peak_bytes"]
    assert any(p["batch"] == ours + 1 and not p["fits"] for p in by["auto"]["probes"])
    assert not probe_planner(build_problem(chain_at(ours + 1)), ours + 1, budget, "auto", overhead,
                             time_limit=5).fits
    assert res["ratios"]["ours/none"] == pytest.approx(ours / none)


def test_a_planner_stopped_by_the_overhead_cap_is_named_with_why():
    """sqrt-n's plan on the chain costs about 12% of the step at every batch: under a 10% cap
    it is excluded above no planning's batch, and the table says so with the batch, the plan's
    peak (within budget) and its extra compute. The budget, not the cap, stops no planning."""
    from taichi_plan.explore.maxbatch import render_max_batch

    budget = 2000
    res = max_batch(chain_at, budget, method="heuristic", max_overhead_pct=10.0, time_limit=5, limit=1000)
    by = {r["planner"]: r for r in res["planners"]}
    sq = by["sqrt-n"]
    assert sq["max_batch"] == by["none"]["max_batch"] and sq["extra_pct"] == 0.0
    stop = sq["stop"]
    assert stop["batch"] == sq["max_batch"] + 1 and stop["reason"] == "over overhead"
    assert stop["extra_pct"] > 10.0 and stop["peak_bytes"] <= budget
    plan = solve(chain_at(stop["batch"]), budget, "sqrt-n", time_limit=5)  # the same plan, by hand
    assert plan.predicted["extra_compute_pct"] == pytest.approx(stop["extra_pct"])
    assert sq["excluded"] == (f"sqrt(n): stops at batch {sq['max_batch']}, excluded above by the overhead cap: "
                              f"its plan at batch {stop['batch']} fits ({stop['peak_bytes'] / 1000:.2f} KB) but "
                              f"costs +{stop['extra_pct']:.1f}% > 10%.")
    assert by["none"]["stop"]["reason"] == "over budget" and by["none"]["excluded"] is None
    for r in res["planners"]:
        assert (r["excluded"] is not None) == (r["stop"] is not None and r["stop"]["reason"] == "over overhead")
    text = " ".join(line.strip() for line in render_max_batch(res).splitlines())
    assert sq["excluded"] in text


def test_synthetic_too_big_at_batch_one():
    res = max_batch(chain_at, 50, method="heuristic", time_limit=5)  # params and grads alone: 160 B
    assert [r["max_batch"] for r in res["planners"]] == [0, 0, 0, 0, 0]
    assert res["ratios"] == {"ours/none": None, "ours/sqrt-n": None, "ours/full": None, "ours/dtr": None}


def test_max_batch_rejects_bad_arguments():
    with pytest.raises(UsageError):
        max_batch(chain_at, 2000, method="sqrt-n")
    with pytest.raises(UsageError):
        max_batch(chain_at, 0)
    with pytest.raises(UsageError):
        max_batch(chain_at, 2000, max_overhead_pct=0)


# ---------------------------------------------------------------------------------------------
# Fake-recorded workloads
# ---------------------------------------------------------------------------------------------


def test_mlp_small_budget():
    record = fake_recorder("mlp", layers=2, hidden=64, optimizer="sgd", device_profile="v100-16gb")
    budget = 200_000
    res = max_batch(record, budget, method="heuristic", max_overhead_pct=100.0, time_limit=5, limit=4096)
    by = {r["planner"]: r for r in res["planners"]}
    none = by["none"]["max_batch"]
    assert none >= 1 and by["heuristic"]["max_batch"] >= none
    assert build_problem(record(none)).baseline_peak[0] <= budget < build_problem(record(none + 1)).baseline_peak[0]


@pytest.mark.bench
def test_cli_tiny_gpt2_json():
    args = ["maxbatch", "--model", "gpt2", "--seq", "32", "--layers", "1", "--hidden", "64", "--heads", "2",
            "--vocab", "256", "--budget", "8MB", "--device-profile", "v100-16gb", "--max-overhead", "33%",
            "--time-limit", "2"]
    r = CliRunner().invoke(main, [*args, "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    by = {p["planner"]: p for p in res["planners"]}
    none, ours = by["none"]["max_batch"], by["auto"]["max_batch"]
    assert none >= 1 and ours >= none
    assert by["auto"]["extra_pct"] <= 33.0 and by["auto"]["peak_bytes"] <= 8 * 10**6
    assert by["none"]["peak_bytes"] <= 8 * 10**6
    assert any(p["batch"] == none + 1 and not p["fits"] for p in by["none"]["probes"])
    assert res["device_profile"] == "v100-16gb" and res["budget_bytes"] == 8 * 10**6


def test_cli_model_too_big_says_max_batch_0():
    r = CliRunner().invoke(main, ["maxbatch", "--model", "mlp", "--layers", "1", "--hidden", "64",
                                  "--budget", "1KB", "--method", "heuristic", "--time-limit", "2"])
    assert r.exit_code == 0, r.output
    assert "does not fit even at batch 1 (max batch 0)" in r.output
    assert all(len(line) <= 80 for line in r.output.splitlines())


@pytest.mark.parametrize("args,code", [
    (["--budget", "abc"], 4),
    (["--budget", "50%"], 4),
    (["--budget", "-3GB"], 4),
    (["--max-overhead", "0%"], 2),
    (["--max-overhead", "2000%"], 2),
    (["--max-overhead", "33"], 2),
    (["--device-profile", "nope"], 2),
    (["--time-limit", "0"], 2),
])
def test_cli_bad_input(args, code):
    r = CliRunner().invoke(main, ["maxbatch", "--model", "mlp", *args])
    assert r.exit_code == code, r.output
    assert r.output.startswith("Error:")


def test_cli_needs_a_workload():
    r = CliRunner().invoke(main, ["maxbatch", "--budget", "1GB"])
    assert r.exit_code == 2 and "--model" in r.output
    r = CliRunner().invoke(main, ["maxbatch", "--model", "nope", "--budget", "1GB"])
    assert r.exit_code == 7


def test_render_keeps_every_note_whole():
    """The notes under the table are wrapped, never cut: the capped-search footnote (longer
    than 80 columns with a five-digit limit) reads to its end."""
    from taichi_plan.explore.maxbatch import MAX_BATCH, render_max_batch

    res = max_batch(lambda b: chain_trace([1] * 4, temp_bytes=1, param_bytes=1), 10**9, method="heuristic",
                    time_limit=5, limit=MAX_BATCH)
    assert all(r["capped"] for r in res["planners"])
    text = render_max_batch(res, "a title " * 20)
    assert "…" not in text
    assert all(len(line) <= 80 for line in text.splitlines())
    joined = " ".join(line.strip() for line in text.splitlines())
    assert (f"+ the search stopped at its limit (batch {MAX_BATCH}): the step's memory may not grow "
            "with the batch.") in joined
    assert f"batch sizes {', '.join(map(str, res['batches_recorded']))}." in joined
    assert "a title " * 19 in joined + " "


@pytest.mark.parametrize("n", [0, 1, 5, 37, 100])
@pytest.mark.parametrize("guess", [0, 1, 4, 5, 6, 36, 37, 38, 99, 100, 500])
def test_search_from_a_guess_finds_the_threshold(n, guess):
    seen = []
    r = search(threshold(n, seen), None, limit=4096, guess=guess)
    assert r.max_batch == n and not r.capped
    assert len(seen) == len(set(seen))
    if n:
        assert n + 1 in seen and r.stop is not None and r.stop.batch == n + 1
    if guess == n and n:  # a right guess costs two probes
        assert seen == [n, n + 1]
    if guess == n + 1 and n:  # one above: the guess, then the batch below it
        assert seen == [n + 1, n]


def test_search_from_a_guess_at_the_limit():
    r = search(threshold(10**9), None, limit=100, guess=100)
    assert r.max_batch == 100 and r.capped and [p.batch for p in r.probes] == [100]


class Counted:
    def __init__(self, record):
        self.record, self.batches = record, []

    def __call__(self, batch: int):
        self.batches.append(batch)
        return self.record(batch)


@pytest.mark.parametrize("budget", [2000, 5000])
def test_guided_search_gives_the_unguided_answers_from_fewer_recordings(budget):
    """The chain's sizes are affine in the batch, so the drawn steps are its steps: each guess
    is the answer, each planner's real search makes two probes, and no batch is recorded twice."""
    plain = max_batch(Counted(chain_at), budget, method="heuristic", time_limit=5, limit=1000)
    rec = Counted(chain_at)
    guided = max_batch(rec, budget, method="heuristic", time_limit=5, limit=1000, guide=True)
    assert [r["max_batch"] for r in guided["planners"]] == [r["max_batch"] for r in plain["planners"]]
    assert guided["guide"]["why_not"] is None and guided["guide"]["drawn"]
    best_baseline = max(r["max_batch"] for r in guided["planners"][1:])
    for r in guided["planners"]:
        probes = r["probes"]
        if r is guided["planners"][0] and probes and probes[0]["batch"] == best_baseline:
            probes = probes[1:]  # (ours is first tried at the best baseline's answer, a batch already recorded)
        assert r["guess"] == r["max_batch"] and len(probes) <= 2
        assert r["stop"]["batch"] == r["max_batch"] + 1
    assert len(rec.batches) == len(set(rec.batches)) < len(plain["batches_recorded"])
    assert "Guided: each search ran first on steps drawn" in " ".join(render_max_batch(guided).split())


def test_compared_planners_can_be_chosen():
    res = max_batch(chain_at, 2000, method="heuristic", time_limit=5, limit=1000, compared=("none", "full"))
    assert [r["planner"] for r in res["planners"]] == ["heuristic", "none", "full"]
    assert set(res["ratios"]) == {"ours/none", "ours/full"}
    assert "sqrt-n" not in render_max_batch(res)
    with pytest.raises(UsageError):
        max_batch(chain_at, 2000, compared=("full",))


def test_cli_guide_on_a_recorded_mlp():
    """``--guide`` on fake recordings: the guesses come from steps drawn through batch 2 and 3,
    the answers from recordings (``none``'s checked here against recordings by hand)."""
    args = ["maxbatch", "--model", "mlp", "--layers", "2", "--hidden", "64", "--optimizer", "sgd", "--budget",
            "200KB", "--device-profile", "v100-16gb", "--max-overhead", "100%", "--method", "heuristic",
            "--time-limit", "2", "--limit", "4096", "--guide"]
    r = CliRunner().invoke(main, [*args, "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["guide"]["batches"] == [2, 3] and res["guide"]["why_not"] is None
    by = {p["planner"]: p for p in res["planners"]}
    none = by["none"]["max_batch"]
    assert by["none"]["guess"] is not None and {2, 3} <= set(res["batches_recorded"])
    record = fake_recorder("mlp", layers=2, hidden=64, optimizer="sgd", device_profile="v100-16gb")
    assert build_problem(record(none)).baseline_peak[0] <= 200_000 < build_problem(record(none + 1)).baseline_peak[0]
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert r.exit_code == 0 and "Guided:" in r.output


def test_a_line_through_flat_peaks_does_not_send_the_search_far_off():
    """At small batches the peak can be where nothing grows with the batch (parameters and the
    optimizer's state): an 8 MB GPT-2's batches 1 and 2 peaked 512 B apart, and the line through
    them crossed the budget at batch 10467 where 17 was the answer; the search recorded fake
    steps of 10467, 5234 and 2625. Where the peak grew much slower than the batch, no step goes
    past GUESS_REACH times the largest batch that fits."""
    from taichi_plan.explore.maxbatch import GUESS_REACH

    n, fixed = 17, 2_641_216
    seen: list[int] = []

    def peak(b: int) -> int:
        return fixed + 512 * (b - 1) if b <= 2 else fixed + 300_000 * (b - 2)  # flat, then linear

    r = search(peaked(n, peak, seen), None, 1 << 16, target=fixed + 300_000 * (n - 2) + 150_000)
    assert r.max_batch == n and r.stop is not None and r.stop.batch == n + 1
    assert max(seen) <= GUESS_REACH * n, seen


def test_a_sharded_probe_asks_solve_not_the_recorded_settings_floor(monkeypatch):
    """On a sharded trace solve() chooses FSDP's prefetching and resharding, under which the
    floor is not the recorded setting's (the fake 7B at batch 36 fit 85.33 GB under that floor,
    87.35 GB): the probe asks solve() itself. Here the recorded floor is made to read above the
    budget; the probe still finds solve()'s plan."""
    import numpy as np

    from taichi_plan.explore import maxbatch
    from taichi_plan.problem.core import build_problem

    trace = maxbatch.fake_recorder("llama", device_profile="h100-80gb", fsdp=2, layers=2, hidden=64, heads=4,
                                   vocab=500, seq=64)(4)
    p = build_problem(trace)
    budget = int(0.8 * p.baseline_peak[0])
    fits = maxbatch.probe_planner(p, 4, budget, "heuristic", 100.0, time_limit=30)
    assert fits.fits, fits
    monkeypatch.setattr(maxbatch, "floor_bytes", lambda _p: np.full(p.num_ops, 10 * budget))
    monkeypatch.setattr(maxbatch, "min_live_bytes", lambda _p: np.full(p.num_ops, 10 * budget))
    again = maxbatch.probe_planner(p, 4, budget, "heuristic", 100.0, time_limit=30)
    assert again.fits and again.peak_bytes == fits.peak_bytes, again


def test_offload_row_at_least_ours_and_its_answer_fits():
    """The chain's ops take 1 s each and its activations 10 B per sample: on a 1000 B/s link
    their copies hide behind compute, so ours with offload fits at least ours' batch (it starts
    there), and at its answer the offload plan fits within the overhead and one batch above it
    does not."""
    from taichi_plan.explore.maxbatch import render_max_batch
    from taichi_plan.problem.offload import OffloadConfig, allow_offload

    budget, overhead, off = 2000, 30.0, OffloadConfig(1000.0)
    res = max_batch(chain_at, budget, method="heuristic", max_overhead_pct=overhead, time_limit=5, limit=1000,
                    offload=off)
    by = {r["planner"]: r for r in res["planners"]}
    ours, mine = by["heuristic"]["max_batch"], by["heuristic+offload"]["max_batch"]
    assert mine > ours and by["heuristic+offload"]["ours"]
    assert res["ratios"]["ours+offload/none"] == pytest.approx(mine / by["none"]["max_batch"])
    plan = solve(chain_at(mine), budget, "heuristic", time_limit=5, offload=off)
    assert plan.offloads and plan.predicted["planned_peak_bytes"] <= budget
    assert plan.predicted["extra_compute_pct"] <= overhead
    assert not probe_planner(build_problem(chain_at(mine + 1)), mine + 1, budget, "heuristic+offload", overhead,
                             time_limit=5, offload=off).fits
    assert allow_offload(build_problem(chain_at(1)), off).offload == off
    assert "+offload: ours with saved activations also copied" in " ".join(render_max_batch(res).split())
    # No offload unless asked: the table of before.
    plain = max_batch(chain_at, budget, method="heuristic", max_overhead_pct=overhead, time_limit=5, limit=1000)
    assert [r["planner"] for r in plain["planners"]] == ["heuristic", "none", "sqrt-n", "full", "dtr"]
    assert plain["offload"] is None and "+offload" not in render_max_batch(plain)


@pytest.mark.parametrize("args, message", [
    (["--host-budget", "1GB"], "only apply with --offload"),
    (["--offload", "--fsdp", "2"], "not planned for sharded jobs"),
    (["--offload", "--host-link", "-1"], "above 0 GB/s"),
])
def test_cli_offload_refusals(args, message):
    r = CliRunner().invoke(main, ["maxbatch", "--model", "mlp", "--budget", "8MB", *args])
    assert r.exit_code != 0 and message in " ".join(r.output.split()) and "Traceback" not in r.output
