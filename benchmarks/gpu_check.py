"""The GPU check of issue 13: record, solve and replay small models for real on a GPU, and
compare the caching allocator's measured peaks with the plan's predicted ones.

On the GPU machine (Python 3.12, its own torch CUDA build and transformers, no package index,
no OR-Tools), from the repository root::

    python -m benchmarks.gpu_check                 # writes benchmarks/gpu_check.json
    python -m benchmarks.gpu_check --device cpu --tiny --out /tmp/gpu_check.json   # dry run

For each workload (GPT-2 4 layers h256, BERT 4 layers h256, ResNet-50 on small images) it
records a real step on the device, solves it with ``--method heuristic`` (no OR-Tools needed) at
70% and 50% of the baseline peak on allocated bytes and at 50% on reserved bytes, and replays
each plan (``taichi_plan.replay.measure.replay``: an unplanned and a planned run; on CUDA the
last timed step is read with ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``).
Then one ``--fake`` recording of GPT-2 for the H200 profile, made on the device (fake CUDA
tensors), is solved and applied there: does the replay guard accept its op stream? And the GPU
mapping of CPU fake recordings (``taichi_plan.record.gpu_ops``) is measured against the device:
a ``--fake`` recording of the CPU-built GPT-2 for the device's profile is compared op by op with
the real GPU recording (first differing op, op counts, baseline peaks), and ``choose_sdpa``'s
backend is compared with ``torch._fused_sdp_choice`` over a grid of dtypes, head dims, masks.

Every step is guarded: a failure is written into the JSON and the run goes on. The JSON is
rewritten after every row, so a run cut short still leaves what it measured. ``make bench``
turns it into a section of docs/benchmarks.md (:func:`section`).

``taichi_plan.solve`` imports OR-Tools when it is imported (for ``--method ilp``); where
OR-Tools is missing, a stand-in module that refuses to be used is installed first, so the
heuristic and the baselines run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "gpu_check.json"
ENTRY = "benchmarks.gpu_check:on_device"
METHOD = "heuristic"
RUNS = (("allocated", 0.7), ("allocated", 0.5), ("reserved", 0.5))
FAKE_PROFILE = "h200-141gb"
WORKLOADS = {  # label -> (built-in model, sizes); full size, then --tiny
    "GPT-2 4L h256 b8 s256": ("gpt2", {"layers": 4, "hidden": 256, "heads": 4, "vocab": 8192, "seq": 256,
                                       "batch": 8}),
    "BERT 4L h256 b8 s256": ("bert", {"layers": 4, "hidden": 256, "heads": 4, "vocab": 8192, "seq": 256,
                                      "batch": 8}),
    "ResNet-50 b32 128px": ("resnet50", {"batch": 32, "image_size": 128}),
}
TINY = {
    "GPT-2 2L h64 b4 s128 (tiny)": ("gpt2", {"layers": 2, "hidden": 64, "heads": 2, "vocab": 256, "seq": 128,
                                              "batch": 4}),
    "BERT 2L h64 b4 s128 (tiny)": ("bert", {"layers": 2, "hidden": 64, "heads": 2, "vocab": 256, "seq": 128,
                                             "batch": 4}),
    "ResNet-50 b2 32px (tiny)": ("resnet50", {"batch": 2, "image_size": 32}),
}


def _stand_in_ortools() -> bool:
    """Install a stand-in ``ortools.sat.python.cp_model`` when OR-Tools is missing; True if so.
    It has what ``taichi_plan.solve`` (``solve.cpsat``) touches when imported (a base class) and refuses
    anything else, so ``--method ilp``/``auto`` fail with a clear message."""
    if importlib.util.find_spec("ortools") is not None:
        return False
    why = "OR-Tools is not installed here: the GPU check solves with --method heuristic only."

    class CpSolverSolutionCallback:
        def __init__(self, *args, **kwargs):
            raise RuntimeError(why)

    def refuse(name):
        raise RuntimeError(f"{why} (ortools.sat.python.cp_model.{name})")

    cp_model = types.ModuleType("ortools.sat.python.cp_model")
    cp_model.CpSolverSolutionCallback = CpSolverSolutionCallback  # type: ignore[attr-defined]
    cp_model.__getattr__ = refuse  # type: ignore[attr-defined]
    for name in ("ortools", "ortools.sat", "ortools.sat.python"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["ortools.sat.python.cp_model"] = cp_model
    sys.modules["ortools.sat.python"].cp_model = cp_model  # type: ignore[attr-defined]
    return True


def _in_fake_mode() -> bool:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())


def on_device(builtin: str, device: str = "cuda", dtype: str = "fp32", **sizes):
    """``--entry`` of a built-in workload moved to ``device`` (recorded there and rebuilt there
    by replay). Inside a fake recording it builds fake tensors and moves them (fake CUDA)."""
    from taichi_plan.record.workloads import builtin_workload
    from taichi_plan.replay.measure.workload import move_workload

    parts = builtin_workload(builtin, dtype=dtype, **sizes).build(_in_fake_mode())
    return move_workload(*parts, device)


def _workload(builtin: str, device: str, sizes: dict):
    from taichi_plan.record import get_workload

    return get_workload(entry=ENTRY, builtin=builtin, device=device, **sizes)


def _peaks(report: dict, run: str, device: str) -> dict:
    """Measured and predicted peaks of one run (``planned`` or ``unplanned``) of a replay report."""
    if device == "cuda" and report.get("cuda"):
        c = report["cuda"][run]
        return {k: c[k] for k in ("measured_allocated_bytes", "measured_reserved_bytes", "predicted_allocated_bytes",
                                  "predicted_allocator_allocated_bytes", "predicted_reserved_bytes",
                                  "allocated_ratio", "reserved_ratio", "start_allocated_bytes")}
    planned = run == "planned"
    measured = report["measured_peak_bytes" if planned else "baseline_measured_peak_bytes"]
    predicted = report["predicted_peak_bytes" if planned else "baseline_predicted_peak_bytes"]
    return {"measured_allocated_bytes": measured, "measured_reserved_bytes": None,
            "predicted_allocated_bytes": predicted, "predicted_reserved_bytes": None,
            "allocated_ratio": measured / predicted if predicted else None, "reserved_ratio": None,
            "note": "CPU: the recorder's live-storage peak; no caching allocator"}


def _row(label, trace, on, frac, device, steps, time_limit) -> dict:
    from taichi_plan.base.errors import InfeasibleBudgetError
    from taichi_plan.problem.core import build_problem
    from taichi_plan.replay.measure import replay
    from taichi_plan.solve import solve

    problem = build_problem(trace)
    budget = int(problem.baseline_peak[0] * frac)
    row = {"workload": label, "ops": problem.num_ops, "on": on, "budget_fraction": frac, "budget_bytes": budget}
    t0 = time.perf_counter()
    try:
        plan = solve(trace, budget, METHOD, time_limit=time_limit, problem=problem, on=on)
    except InfeasibleBudgetError as e:
        return {**row, "status": "infeasible", "error": str(e), "solve_s": time.perf_counter() - t0}
    row["solve_s"] = time.perf_counter() - t0
    p = plan.predicted
    row.update(status="solved", extra_compute_pct=p["extra_compute_pct"], tensors_dropped=len(plan.recompute),
               partitions=len(plan.partitions), predicted_planned_peak_bytes=p["planned_peak_bytes"],
               predicted_planned_reserved_bytes=p["planned_reserved_peak_bytes"])
    t0 = time.perf_counter()
    report = replay(plan, steps=steps, trace=trace, force=device == "cpu")
    row.update(status="replayed", replay_s=time.perf_counter() - t0, device=report["device"],
               planned=_peaks(report, "planned", report["device"]),
               unplanned=_peaks(report, "unplanned", report["device"]),
               grads_match=report.get("grads_match"), step_s_unplanned=report["step_s_unplanned"],
               step_s_planned=report["step_s_planned"], within_budget=report["within_budget"])
    return row


def _fake_row(builtin, sizes, device, steps, time_limit) -> dict:
    """A --fake recording for the H200 profile, made on ``device``, solved and applied there."""
    from taichi_plan.base.errors import TaichiError
    from taichi_plan.record import record_workload

    row = {"workload": f"{builtin} fake ({FAKE_PROFILE} profile)", "on": "allocated", "budget_fraction": 0.7}
    try:
        trace = record_workload(_workload(builtin, device, sizes), fake=True, device_profile=FAKE_PROFILE)
    except Exception as e:  # noqa: BLE001 - what fails on a device is the finding
        return {**row, "status": "record failed", "error": f"{type(e).__name__}: {e}"}
    row["trace_device"] = trace.meta.get("device")
    try:
        out = _row(row["workload"], trace, "allocated", 0.7, device, steps, time_limit)
    except TaichiError as e:  # the replay guard's mismatch is a PlanError
        return {**row, "status": "replay refused", "error": str(e)}
    return {**out, "trace_device": trace.meta.get("device")}


def compare_ops(real, mapped) -> dict:
    """A GPU recording (``real``) against a CPU fake recording mapped to the GPU's kernels
    (``mapped``): where their op streams first differ, which op names each has more of, and
    both baseline peaks. Equal streams mean the mapping recorded what the GPU ran."""
    from collections import Counter

    from taichi_plan.trace.format import baseline_peak

    a, b = real.ops["op"].tolist(), mapped.ops["op"].tolist()
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))

    def at(trace, ops, i):
        return None if i is None or i >= len(ops) else f"{ops[i]} in {trace.ops['module'].iloc[i] or '<top level>'}"

    ca, cb = Counter(a), Counter(b)
    diff = {k: ca[k] - cb[k] for k in sorted(set(ca) | set(cb)) if ca[k] != cb[k]}
    return {"same_ops": first is None, "real_ops": len(a), "mapped_ops": len(b), "first_difference": first,
            "real_op": at(real, a, first), "mapped_op": at(mapped, b, first),
            "count_difference": dict(sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:20]),
            "real_peak_bytes": baseline_peak(real)[0], "mapped_peak_bytes": baseline_peak(mapped)[0],
            "mapping": mapped.meta.get("gpu_kernels")}


def _mapping_row(builtin, sizes, device, real_trace) -> dict:
    """The GPU mapping measured: a CPU fake recording for ``FAKE_PROFILE`` vs ``real_trace``."""
    from taichi_plan.record import get_workload, record_workload

    row = {"workload": f"{builtin} fake on cpu, mapped to {FAKE_PROFILE} kernels"}
    try:
        mapped = record_workload(get_workload(model=builtin, **sizes), fake=True, device_profile=FAKE_PROFILE)
    except Exception as e:  # noqa: BLE001
        return {**row, "status": "record failed", "error": f"{type(e).__name__}: {e}"}
    return {**row, "status": "compared", "against": f"real recording on {device}", **compare_ops(real_trace, mapped)}


def sdpa_choices(device: str) -> dict:
    """``gpu_ops.choose_sdpa`` against this device's own ``torch._fused_sdp_choice`` over a grid
    of dtypes, head dims, masks and causal flags (CUDA only)."""
    if device != "cuda":
        return {"status": "skipped: no CUDA device"}
    import torch
    from torch.nn.attention import SDPBackend

    from taichi_plan.record.gpu_ops import choose_sdpa

    cc = tuple(torch.cuda.get_device_capability(0))
    rows, agree = [], 0
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for d in (64, 128, 200, 256, 264):
            for mask in (False, True):
                for causal in ((False,) if mask else (False, True)):
                    q, k, v = (torch.randn(2, 4, 256, d, device="cuda", dtype=dtype, requires_grad=True)
                               for _ in range(3))
                    m = torch.ones(256, 256, dtype=torch.bool, device="cuda") if mask else None
                    theirs = SDPBackend(int(torch._fused_sdp_choice(q, k, v, m, 0.1, causal))).name.lower()
                    ours = choose_sdpa(q, k, v, m, 0.1, causal, False, cc)[0]
                    same = theirs.startswith(ours)
                    agree += same
                    rows.append({"dtype": str(dtype).replace("torch.", ""), "head_dim": d, "mask": mask,
                                 "causal": causal, "torch": theirs, "mapped": ours, "same": same})
    return {"status": "compared", "compute_capability": list(cc), "agree": agree, "cases": len(rows), "rows": rows}


def machine(device: str) -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "device": device,
           "cuda": torch.version.cuda}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        out["transformers"] = None
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpu_memory_bytes"] = int(torch.cuda.get_device_properties(0).total_memory)
    return out


def run(device: str, tiny: bool, out: Path, steps: int = 3, time_limit: float = 10.0,
        say=lambda msg: print(msg, file=sys.stderr, flush=True)) -> dict:
    from taichi_plan.base.atomic import write_json_atomic
    from taichi_plan.record import record_workload

    stand_in = _stand_in_ortools()
    started = time.perf_counter()
    result = {"machine": machine(device), "tiny": tiny, "method": METHOD, "time_limit_s": time_limit,
              "steps": steps, "ortools": not stand_in, "rows": [], "fake": None, "mapping": None,
              "sdpa_choices": None, "wall_s": None}

    def save():
        result["wall_s"] = time.perf_counter() - started
        write_json_atomic(out, result, what="GPU check results")

    for label, (builtin, sizes) in (TINY if tiny else WORKLOADS).items():
        say(f"{label}: recording on {device}")
        t0 = time.perf_counter()
        try:
            trace = record_workload(_workload(builtin, device, sizes), fake=False)
        except Exception as e:  # noqa: BLE001
            result["rows"].append({"workload": label, "status": "record failed", "error": f"{type(e).__name__}: {e}"})
            save()
            continue
        record_s = time.perf_counter() - t0
        if result["mapping"] is None and builtin == "gpt2":
            say(f"{label}: the GPU mapping of a CPU fake recording, op by op against this one")
            result["mapping"] = _mapping_row(builtin, sizes, device, trace)
            save()
        for on, frac in RUNS:
            say(f"{label}: {frac:.0%} on {on}")
            try:
                row = _row(label, trace, on, frac, device, steps, time_limit)
            except Exception as e:  # noqa: BLE001
                row = {"workload": label, "on": on, "budget_fraction": frac, "status": "failed",
                       "error": f"{type(e).__name__}: {e}"}
            row["record_s"] = record_s
            result["rows"].append(row)
            save()
    builtin, sizes = next(iter((TINY if tiny else WORKLOADS).values()))
    say(f"fake {builtin} for {FAKE_PROFILE}, applied on {device}")
    result["fake"] = _fake_row(builtin, sizes, device, steps, time_limit)
    save()
    say("SDPA backend choice: mapped vs torch")
    try:
        result["sdpa_choices"] = sdpa_choices(device)
    except Exception as e:  # noqa: BLE001
        result["sdpa_choices"] = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
    save()
    return result


# ---------------------------------------------------------------------------------------------
# The docs/benchmarks.md section
# ---------------------------------------------------------------------------------------------


def _b(x) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def _r(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def markdown(result: dict) -> str:
    m = result["machine"]
    gpu = m.get("gpu") or m["device"]
    lines = [f"Measured by `python -m benchmarks.gpu_check` on {gpu} (torch {m['torch']}, Python {m['python']}"
             f"{', tiny models (dry run)' if result.get('tiny') else ''}); method `{result['method']}`, "
             f"{result['steps']} steps per run, the last one measured. MiB; ratio = measured / predicted. "
             "Allocated: `max_memory_allocated` against the simulator's peak; reserved: "
             "`max_memory_reserved` against the allocator model's (docs/allocator.md).", "",
             "| workload | budget | status | allocated measured / predicted (ratio) | reserved measured / "
             "predicted (ratio) | unplanned allocated (ratio) | unplanned reserved (ratio) | grads | step s unplanned / planned |",
             "|---|---|---|---|---|---|---|---|---|"]
    rows = list(result["rows"]) + ([result["fake"]] if result.get("fake") else [])
    for r in rows:
        budget = f"{r.get('budget_fraction', 0):.0%} on {r.get('on')}"
        if r.get("status") != "replayed":
            lines.append(f"| {r['workload']} | {budget} | {r.get('status')}: {str(r.get('error', ''))[:120]} "
                         "| - | - | - | - | - | - |")
            continue
        p, u = r["planned"], r["unplanned"]
        lines.append(
            f"| {r['workload']} | {budget} | replayed on {r['device']} "
            f"| {_b(p['measured_allocated_bytes'])} / {_b(p['predicted_allocated_bytes'])} ({_r(p['allocated_ratio'])}) "
            f"| {_b(p['measured_reserved_bytes'])} / {_b(p['predicted_reserved_bytes'])} ({_r(p['reserved_ratio'])}) "
            f"| {_b(u['measured_allocated_bytes'])} ({_r(u['allocated_ratio'])}) "
            f"| {_b(u['measured_reserved_bytes'])} ({_r(u['reserved_ratio'])}) "
            f"| {'equal' if r.get('grads_match') else 'DIFFER'} "
            f"| {r['step_s_unplanned']:.4f} / {r['step_s_planned']:.4f} |")
    m = result.get("mapping")
    if m:
        lines += ["", f"GPU mapping of a CPU fake recording ({m['workload']}), against the {m.get('against', '-')}: "
                  + (f"{m.get('status')}: {m.get('error', '')}" if m.get("status") != "compared" else
                     ("the same op stream" if m["same_ops"] else
                      f"first difference at op {m['first_difference']}: real `{m['real_op']}`, mapped "
                      f"`{m['mapped_op']}`") + f"; {m['real_ops']} / {m['mapped_ops']} ops, baseline peak "
                     f"{_b(m['real_peak_bytes'])} / {_b(m['mapped_peak_bytes'])} MiB (real / mapped).")]
    c = result.get("sdpa_choices")
    if c and c.get("status") == "compared":
        lines += ["", f"SDPA backend: the mapping's choice agrees with `torch._fused_sdp_choice` in {c['agree']} of "
                  f"{c['cases']} cases on sm{''.join(map(str, c['compute_capability']))}."]
    lines.append("")
    lines.append(f"Whole run: {result['wall_s']:.0f} s." if result.get("wall_s") is not None else "")
    return "\n".join(lines)


def section(path: Path = DEFAULT_OUT) -> str:
    """The docs/benchmarks.md section: the table of ``path``, or "not measured yet"."""
    head = "## GPU check: measured vs predicted allocated and reserved peaks\n\n"
    if not Path(path).is_file():
        return (head + f"Not measured yet: there is no `benchmarks/{Path(path).name}`. On a GPU machine, from the "
                "repository root, `python -m benchmarks.gpu_check` records GPT-2 (4 layers, h256), BERT (4 layers) "
                "and ResNet-50 (128 px) for real on the GPU, solves each with `--method heuristic` at 70% and 50% "
                "of its peak (and at 50% on reserved bytes), replays every plan reading "
                "`max_memory_allocated`/`max_memory_reserved`, applies one `--fake` H200-profile plan there, and "
                "writes that file; `make bench` then puts its table here (what the machine needs: "
                "docs/allocator.md). No GPU number in this file was measured.")
    return head + markdown(json.loads(Path(path).read_text()))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="tiny models (a dry run of the whole script)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=10.0, help="seconds per solve")
    a = ap.parse_args(argv)
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("gpu_check: no CUDA device here; use --device cpu --tiny for a dry run.")
    run(a.device, a.tiny, a.out, steps=a.steps, time_limit=a.time_limit)
    print(f"Wrote {a.out}")


if __name__ == "__main__":
    main()
