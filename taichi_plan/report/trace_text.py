"""What a trace holds, as JSON-ready data (``trace_summary``) and as text as wide as the
terminal (``render_trace_summary``). ``taichi-plan inspect TRACE`` prints one or the other.
"""

from __future__ import annotations

import shutil
import textwrap

import numpy as np

from ..base.units import format_bytes
from ..trace.format import (
    KINDS,
    PHASES,
    Trace,
    baseline_live_bytes,
    baseline_peak,
    data_sized_note,
    rerun_where,
)

TOP_TENSORS = 10
WIDTH = 80  # text width when stdout is not a terminal and COLUMNS is unset
MIN_WIDTH = 40  # narrower terminals get 40-column text (and wrap it themselves)


def terminal_width() -> int:
    """Columns for text reports: ``COLUMNS`` when set, else the width of the terminal stdout
    is on, else :data:`WIDTH` (80); never under :data:`MIN_WIDTH`."""
    return max(MIN_WIDTH, shutil.get_terminal_size((WIDTH, 24)).columns)


def _first(meta: dict, *keys: str):
    """The first present, non-empty value among dotted ``keys`` of ``meta``."""
    for key in keys:
        value = meta
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value not in (None, "", {}):
            return value
    return None


def _mode(meta: dict) -> str:
    mode = _first(meta, "mode")
    if mode:
        return str(mode)
    if "fake" in meta:
        return "fake" if meta["fake"] else "real"
    return "unknown"


def _workload(meta: dict) -> dict:
    w = meta.get("workload")
    if isinstance(w, dict):
        args = w.get("args")
        if args is None:
            args = {k: v for k, v in w.items() if k not in ("name", "args")}
        return {"name": w.get("name"), "args": args}
    return {"name": w, "args": meta.get("workload_args") or {}}


def trace_summary(trace: Trace) -> dict:
    """Every fact ``inspect`` shows about ``trace``, as a dict of plain JSON values."""
    meta = trace.meta or {}
    ops, tensors = trace.ops, trace.tensors
    n = len(ops)

    phase_counts = ops["phase"].value_counts()
    ops_per_phase = {p: int(phase_counts.get(p, 0)) for p in PHASES}

    at_start = tensors["alloc_op"].to_numpy() == -1
    kinds = tensors["kind"].to_numpy()
    nbytes = tensors["nbytes"].to_numpy().astype(np.int64)
    by_kind = {}
    for k in KINDS:
        m = kinds == k
        by_kind[k] = {
            "count": int(m.sum()),
            "nbytes": int(nbytes[m].sum()),
            "count_at_start": int((m & at_start).sum()),
            "nbytes_at_start": int(nbytes[m & at_start].sum()),
        }

    peak_bytes, peak_op = baseline_peak(trace) if n else (0, -1)
    peak = {"nbytes": peak_bytes, "op_id": peak_op, "op": None, "module": None, "phase": None,
            "by_kind": {k: 0 for k in KINDS}}
    if n:
        row = ops.iloc[peak_op]
        peak.update(op=str(row["op"]), module=str(row["module"]), phase=str(row["phase"]))
        live = baseline_live_bytes(trace, by_kind=True)
        peak["by_kind"] = {k: int(live[k][peak_op]) for k in KINDS}

    op_names = ops["op"].to_numpy()
    order = sorted(range(len(tensors)), key=lambda i: (-int(nbytes[i]), int(tensors["tensor_id"].iat[i])))
    largest = []
    for i in order[:TOP_TENSORS]:
        t = tensors.iloc[i]
        producer = int(t["producer_op"])
        largest.append(
            {
                "tensor_id": int(t["tensor_id"]),
                "kind": str(t["kind"]),
                "nbytes": int(t["nbytes"]),
                "shape": [int(d) for d in t["shape"]],
                "dtype": str(t["dtype"]),
                "producer_op": producer,
                "producer_op_name": str(op_names[producer]) if 0 <= producer < n else None,
                "alloc_op": int(t["alloc_op"]),
                "free_op": int(t["free_op"]),
            }
        )

    durations = ops.groupby("phase")["duration_s"].sum()
    cost = {
        "unit": trace.cost_unit,
        "total": float(ops["duration_s"].sum()),
        "by_phase": {p: float(durations.get(p, 0.0)) for p in PHASES},
    }

    return {
        "name": trace.name,
        "path": str(trace.path) if trace.path else None,
        "format_version": meta.get("format_version"),
        "mode": _mode(meta),
        "workload": _workload(meta),
        "device_profile": _first(meta, "device_profile", "device_profile.name", "device"),
        "dtype": _first(meta, "dtype"),
        "torch_version": _first(meta, "torch_version", "torch.version"),
        "torch_build": _first(meta, "torch_build", "torch.build"),
        "source": _first(meta, "source"),
        "kernels": kernels_line(meta),
        "gpu_kernels": meta.get("gpu_kernels"),
        "python_refs": python_refs_summary(meta, tensors),
        "forward_in_backward": meta.get("forward_in_backward"),
        "num_ops": n,
        "ops_per_phase": ops_per_phase,
        "num_tensors": int(len(tensors)),
        "num_accesses": int(len(trace.accesses)),
        "tensors_by_kind": by_kind,
        "baseline_peak": peak,
        "largest_tensors": largest,
        "regularity": {
            "steps_recorded": _first(meta, "steps_recorded"),
            "warmup_steps": _first(meta, "warmup_steps"),
            "kept_step": _first(meta, "kept_step"),
            "steps_match": meta.get("steps_match"),
            "first_mismatch": meta.get("first_mismatch"),
            "signature": trace.signature(),
            "data_sized": data_sized_note(meta),
        },
        "cost": cost,
    }


# ---------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------


_FUSED_SDPA = {"aten._scaled_dot_product_flash_attention.default": "flash",
               "aten._scaled_dot_product_efficient_attention.default": "efficient"}


def python_refs_summary(meta: dict, tensors) -> dict | None:
    """What ``meta.python_refs`` (trace v4) says: ``known`` (False: a recorded trace without
    it, where a drop is taken to free its tensor at its last use), ``held`` and ``held_nbytes``
    (storages the step's Python code holds after their last forward use), ``into_backward``
    (of those, held when backward starts: no drop frees them), ``segments``/``segments_known``.
    None for imported graphs."""
    if meta.get("mode") == "imported":
        return None
    info = meta.get("python_refs")
    if info is None:
        return {"known": False}
    size = dict(zip(tensors["tensor_id"].tolist(), tensors["nbytes"].tolist(), strict=True))
    rel = info.get("release", [])
    return {"known": True, "held": len(rel), "held_nbytes": int(sum(size.get(t, 0) for t, _ in rel)),
            "into_backward": sum(1 for _, op in rel if op < 0), "segments": info.get("segments"),
            "segments_known": info.get("segments_known")}


def python_refs_line(s: dict | None, size) -> str | None:
    """The ``py refs`` line of ``inspect`` (:func:`python_refs_summary`)."""
    if s is None:
        return None
    if not s["known"]:
        return ("not recorded (a trace before v4, or a Trainer or --fsdp recording made before they had it): a drop is taken to free its "
                "tensor at its last use")
    text = (f"{s['held']} storages ({size(s['held_nbytes'])}) held by Python after their last use, "
            f"{s['into_backward']} of them into backward")
    if s["segments_known"] != s["segments"]:
        text += f"; {s['segments_known']} of {s['segments']} forward segments known"
    return text


def kernels_line(meta: dict) -> str | None:
    """Whose kernels the trace holds: a GPU's, mapped at record time (``meta.gpu_kernels``),
    or those of the torch build and device that recorded it."""
    g = meta.get("gpu_kernels")
    if isinstance(g, dict):
        counts = g.get("op_counts") or {}
        fused = [short for op, short in _FUSED_SDPA.items() if counts.get(op)]
        return (f"{g.get('profile')} sm{str(g.get('compute_capability', '')).replace('.', '')} (mapped): "
                f"native_dropout, {', '.join(f'{f} SDPA' for f in fused) or 'no fused SDPA'}, foreach")
    if meta.get("mode") == "imported":
        return None
    device, build = meta.get("device"), meta.get("torch_build")
    if device or build:
        return f"as run on {device or '-'} by a {build or '-'} build of torch"
    return None


def cut_cell(text: object, width: int) -> str:
    """``text`` (``-`` when empty) cut to ``width`` from the right, with an ellipsis."""
    s = "-" if text is None or text == "" else str(text)
    return s if len(s) <= width else s[: max(width - 1, 0)] + "…"


def format_cost_cell(value: float, unit: str) -> str:
    """A cost in its unit (``s``: seconds at a readable scale; other units: the number and the unit)."""
    if unit == "s":
        if abs(value) >= 1 or value == 0:
            return f"{value:,.3f} s"
        if abs(value) >= 1e-3:
            return f"{value * 1e3:.3f} ms"
        return f"{value * 1e6:.1f} us"
    return f"{value:,.6g} {unit}"


_SHORT_KIND = {"optimizer_state": "optim_state"}


def wrap_lines(text: str, indent: str, width: int) -> list[str]:
    """``text`` wrapped to ``width``, first line after ``indent`` (e.g. a field label), the
    others aligned under it."""
    rest = " " * len(indent)
    return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=rest, break_long_words=False,
                         break_on_hyphens=False) or [indent.rstrip()]


def _mismatch(m: object) -> list[str]:
    """Lines describing the recorder's ``first_mismatch`` (a dict with step, op_index,
    expected, got; anything else is shown as is)."""
    if isinstance(m, dict) and {"step", "op_index"} <= set(m):
        lines = [f"  first mismatch: step {m['step']}, op {m['op_index']}"]
        for key in ("expected", "got"):
            if key in m:
                lines.append(f"    {key:<9}{m[key]}")
        return lines
    if isinstance(m, dict):
        return ["  first mismatch: " + ", ".join(f"{k}={v}" for k, v in m.items())]
    return [f"  first mismatch: {m}"]


def render_trace_summary(summary: dict, units: str | None = None, width: int | None = None) -> str:
    """The summary as text ``width`` columns wide (default: :func:`terminal_width`); ``units``
    is GB, GiB, MB, MiB or None (auto, decimal)."""
    unit = units or "auto"
    width = width or terminal_width()

    def size(b: int) -> str:
        return format_bytes(b, unit)

    s = summary
    lines: list[str] = []
    title = f"Trace {s['name']}"
    if s.get("path"):
        title += f"  ({s['path']})"
    lines.append(cut_cell(title, width))
    w = s["workload"]
    args = w.get("args") or {}
    args_text = ", ".join(f"{k}={v}" for k, v in args.items()) if isinstance(args, dict) else str(args)
    torch_text = s["torch_version"]
    if torch_text and s["torch_build"]:
        torch_text = f"{torch_text} ({s['torch_build']} build)"
    fields = [
        ("mode", s["mode"]),
        ("workload", f"{w.get('name') or '-'}" + (f"  ({args_text})" if args_text else "")),
        ("device", s["device_profile"]),
        ("dtype", s["dtype"]),
        ("torch", torch_text),
    ]
    if s.get("kernels"):
        fields.append(("kernels", s["kernels"]))
    refs = python_refs_line(s.get("python_refs"), size)
    if refs:
        fields.append(("py refs", refs))
    fib = s.get("forward_in_backward") or {}
    if fib.get("ops"):
        fields.append(("own ckpt", f"{fib['ops']} backward ops re-run {rerun_where(fib)}: the model checkpoints itself"))
    if s.get("source"):
        fields.append(("source", s["source"]))
    phases = ", ".join(f"{p} {c}" for p, c in s["ops_per_phase"].items() if c)
    fields.append(("ops", f"{s['num_ops']}" + (f"  ({phases})" if phases else "")))
    fields.append(("tensors", f"{s['num_tensors']}  ({s['num_accesses']} accesses)"))
    for key, value in fields:
        lines.append(cut_cell(f"  {key:<10} {value if value not in (None, '') else '-'}", width))

    lines.append("")
    lines.append(f"  {'tensors by kind':<20}{'count':>7}{'bytes':>13}{'at step start':>17}{'bytes':>13}")
    for k, v in s["tensors_by_kind"].items():
        if v["count"]:
            lines.append(
                f"  {k:<20}{v['count']:>7}{size(v['nbytes']):>13}"
                f"{v['count_at_start']:>17}{size(v['nbytes_at_start']):>13}"
            )

    p = s["baseline_peak"]
    lines.append("")
    if p["op_id"] < 0:
        lines.append("Baseline peak: 0 B (the trace has no ops)")
    else:
        lines.append(f"Baseline peak {size(p['nbytes'])} ({p['nbytes']:,} bytes) during op {p['op_id']}")
        lines.append(cut_cell(f"  op {p['op']}", width))
        lines.append(cut_cell(f"  module {p['module'] or '-'}, phase {p['phase']}", width))
        lines.append("  live at the peak by kind:")
        for k, b in p["by_kind"].items():
            if b:
                share = 100.0 * b / p["nbytes"] if p["nbytes"] else 0.0
                lines.append(f"    {k:<20}{size(b):>13}{share:>8.1f}%")

    lines.append("")
    lines.append(f"Largest {len(s['largest_tensors'])} tensors")
    pw = max(12, width - 80 + 12)  # the producer column takes what a wider line leaves
    lines.append(f"  {'id':>6} {'kind':<12}{'bytes':>11}  {'shape':<13} {'dtype':<8} {'producer':<{pw}} live ops")
    for t in s["largest_tensors"]:
        shape = "[" + ", ".join(map(str, t["shape"])) + "]"
        live = f"{t['alloc_op']}..{t['free_op']}"
        lines.append(
            f"  {t['tensor_id']:>6} {_SHORT_KIND.get(t['kind'], t['kind']):<12}{size(t['nbytes']):>11}  "
            f"{cut_cell(shape, 13):<13} {cut_cell(t['dtype'], 8):<8} {cut_cell(t['producer_op_name'], pw):<{pw}} {live}"
        )

    r = s["regularity"]
    lines.append("")
    verdict = {True: "yes", False: "NO", None: "unknown"}.get(r["steps_match"], str(r["steps_match"]))
    steps = r["steps_recorded"] if r["steps_recorded"] is not None else "?"
    lines.append(f"Regularity: {steps} step(s) recorded, steps match: {verdict}, signature {r['signature']}")
    if r["first_mismatch"]:
        lines.extend(_mismatch(r["first_mismatch"]))
    if r.get("data_sized"):
        lines.extend(wrap_lines(r["data_sized"], "  ", width))

    c = s["cost"]
    lines.append("")
    lines.append(f"Compute cost ({c['unit']}): total {format_cost_cell(c['total'], c['unit'])}")
    for ph, v in c["by_phase"].items():
        if s["ops_per_phase"].get(ph):
            lines.append(f"  {ph:<10}{format_cost_cell(v, c['unit']):>20}")
    return "\n".join(cut_cell(line, width) if line else line for line in lines) + "\n"
