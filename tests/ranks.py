"""Checks shared by the tests that run a plan on 2 gloo ranks (FSDP2 and DDP): replay a plan
with ``replay --nproc`` and check each rank against the prediction, and run a torchrun script
(the ranks are processes these helpers start and wait for)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from taichi_plan.cli import main
from taichi_plan.torch_common.processes import free_port

ROOT = Path(__file__).resolve().parents[1]


def record_cli(*args: str) -> str:
    """``taichi-plan record ARGS`` in this process (a recording leaves no process group and no
    patch behind: test_fsdp_record.py checks it); asserts it passed, returns its output. In
    process, the test worker's imports serve it: a new interpreter cost about 5 s a recording."""
    r = CliRunner().invoke(main, ["record", *args])
    assert r.exit_code == 0, r.output
    return r.output


def replay_measures_the_prediction(plan_path: Path, nproc: int = 2, fraction: float = 0.5) -> tuple[dict, dict]:
    """``replay PLAN --nproc N --steps 1``; asserts that it passed, that the plan is at
    ``fraction`` of its per-rank peak, and that every rank measured exactly the predicted peak
    planned and the trace's peak unplanned, rebuilt something, and kept gradients and
    parameters bitwise (allclose where the plan partitions). Returns (report, plan JSON)."""
    r = CliRunner().invoke(main, ["replay", str(plan_path), "--nproc", str(nproc), "--steps", "1", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output[r.output.index("{"):r.output.rindex("}") + 1])
    plan = json.loads(plan_path.read_text())
    assert report["predicted_peak_bytes"] == plan["predicted"]["planned_peak_bytes"]
    assert report["predicted_peak_bytes"] <= fraction * plan["predicted"]["baseline_peak_bytes"] + 1
    split = any(q["chunks"] > 1 for q in plan["decisions"].get("partitions") or [])
    # split: allclose in fp32; within roundings of the low-precision dtype the job computes in
    assert report["grads_check"].startswith(("allclose", "the first planned step's gradients within") if split
                                            else "bitwise"), report["grads_check"]
    assert len(report["ranks"]) == nproc
    for rank in report["ranks"]:
        assert rank["measured_peak_bytes"] == report["predicted_peak_bytes"], rank
        assert rank["baseline_measured_peak_bytes"] == plan["predicted"]["baseline_peak_bytes"], rank
        assert rank["grads_match"] and rank["params_match"], rank
        assert rank["dropped_storages"] > 0 and rank["recompute_ops"] > 0 and rank["mismatches"] == 0
    assert report["within_budget"] and report["grads_match"]
    return report, plan


# What a rank that aborts in gloo's teardown prints, after its training has finished: a C++
# thread of the process group still joinable when the interpreter exits (seen twice in about 40
# runs of the two torchrun tests, once in make test and once in a clean-clone CI run, with
# destroy_process_group called and the model let go; pytorch/pytorch#179291 describes the race).
TEARDOWN_ABORT = "terminate called without an active exception"


def torchrun_losses(script: str, *args: str, nproc: int = 2, step: int = 2) -> dict[int, str]:
    """Run ``examples/<script>`` under torchrun on ``nproc`` local ranks; each rank's printed
    loss at ``step`` (the scripts print ``rank R step S loss X``). A run whose only failure is a
    rank aborting in gloo's teardown (:data:`TEARDOWN_ABORT`) after every rank printed its last
    step is run once more; any other failure, or that one twice, fails."""
    for attempt in range(2):
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                            "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                            str(ROOT / "examples" / script), *args],
                           capture_output=True, text=True, timeout=300, cwd=ROOT,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        losses = {int(m[0]): m[1] for m in re.findall(rf"rank (\d) step {step} loss (-?[0-9]+\.[0-9]{{6}})", r.stdout)}
        if r.returncode == 0 or attempt == 1 or TEARDOWN_ABORT not in r.stdout + r.stderr or len(losses) < nproc:
            break
    assert r.returncode == 0, r.stdout + r.stderr
    return losses
