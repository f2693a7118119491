"""The memory timeline of a plan: the series behind the figure (``timeline_data``) and the
PNG (``write_timeline_png``, matplotlib on the Agg canvas, imported only when drawing).

Baseline (no plan) is a line; the planned step is stacked areas by tensor kind, from the
simulator. Recompute groups run *between* ops, so their peaks are markers just before the
op they precede. Traces longer than ``MAX_POINTS`` are drawn one point per bucket of ops,
each the op where the bucket's total is largest, so no peak is lost.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..base.atomic import check_output, write_with_atomic
from ..base.units import unit_scale
from ..plan.format import Plan
from ..problem.core import Problem
from ..trace.format import KINDS, PHASES, baseline_live_bytes
from .verdict import resimulate

MAX_POINTS = 5000  # longer traces are downsampled
BUCKETS = 2000  # points drawn for a downsampled trace
MAX_GROUP_MARKERS = 150  # more recompute groups are drawn as the highest per bucket

KIND_COLORS = {
    "parameter": "#4c72b0",
    "buffer": "#8c8c8c",
    "gradient": "#dd8452",
    "optimizer_state": "#8172b3",
    "input": "#64b5cd",
    "activation": "#55a868",
    "temporary": "#ccb974",
    # sharded traces (record --fsdp): what FSDP gathers and frees around each unit
    "unsharded_parameter": "#a1c9f4",
    "unsharded_gradient": "#ffb482",
    "all_gather": "#d0bbff",
    "reduce_scatter": "#debb9b",
    "ddp_bucket": "#fab0e4",  # record --ddp: the reducer's gradient buckets
    "post_forward_shard": "#b9f2f0",  # an int reshard_after_forward: shards on the smaller mesh
}
KIND_LABELS = {"optimizer_state": "optimizer state", "parameter": "parameters", "gradient": "gradients",
               "activation": "activations", "temporary": "temporaries", "input": "inputs", "buffer": "buffers",
               "unsharded_parameter": "gathered parameters", "unsharded_gradient": "unsharded gradients",
               "all_gather": "all-gather buffers", "reduce_scatter": "reduce-scatter buffers",
               "ddp_bucket": "DDP gradient buckets", "post_forward_shard": "post-forward shards"}
# Stacking order, bottom to top: what lives all step first, then what comes and goes.
STACK_ORDER = ("parameter", "buffer", "optimizer_state", "gradient", "ddp_bucket", "input", "unsharded_parameter",
               "post_forward_shard", "all_gather", "unsharded_gradient", "reduce_scatter", "activation", "temporary")
PHASE_COLORS = {"forward": "#dbe8f6", "backward": "#fbe3d0", "optimizer": "#dcefd6", "other": "#ececec"}


def _spans(phases: list[str]) -> list[dict]:
    """Maximal runs of one phase: ``[{"phase", "start", "end"}]``, ``end`` inclusive."""
    out: list[dict] = []
    for i, ph in enumerate(phases):
        if out and out[-1]["phase"] == ph:
            out[-1]["end"] = i
        else:
            out.append({"phase": ph, "start": i, "end": i})
    return out


def timeline_data(problem: Problem, plan: Plan) -> dict:
    """Per op: baseline and planned live bytes by kind (numpy int64 arrays, summing to
    ``baseline_live`` and ``planned_live``), the phase, phase spans; the budget, both
    peaks (the planned one from the simulator, possibly inside a recompute group) and
    every recompute group's peak. Raises :class:`PlanError` if the plan does not apply."""
    sim, _parted = resimulate(problem, plan)
    trace = problem.trace
    base_by_kind = {k: np.asarray(v, dtype=np.int64) for k, v in baseline_live_bytes(trace, by_kind=True).items()}
    plan_by_kind = {k: np.asarray(sim.live_by_kind[k], dtype=np.int64) for k in KINDS}
    n = problem.num_ops
    base_live = problem.baseline_live.astype(np.int64)
    base_peak, base_op = problem.baseline_peak
    groups = [{"before_op": int(g.before_op), "peak_bytes": int(g.peak_bytes), "cost": float(g.cost),
               "num_ops": len(g.ops)} for _, g in sorted(sim.groups.items())]
    return {
        "name": trace.name,
        "num_ops": n,
        "budget_bytes": plan.budget_bytes,
        "cost_unit": trace.cost_unit,
        "extra_compute": sim.extra_cost,
        "extra_compute_pct": sim.extra_pct,
        "kinds": list(KINDS),
        "phase": list(problem.op_phase),
        "phase_spans": _spans(list(problem.op_phase)),
        "baseline_by_kind": base_by_kind,
        "baseline_live": base_live,
        "planned_by_kind": plan_by_kind,
        "planned_live": np.asarray(sim.live_bytes, dtype=np.int64) if n else np.zeros(0, dtype=np.int64),
        "baseline_peak": {"nbytes": int(base_peak), "op_id": int(base_op)},
        "planned_peak": {"nbytes": int(sim.peak_bytes), "op_id": int(sim.peak_op),
                         "in_recompute": bool(sim.peak_in_recompute)},
        "groups": groups,
    }


def downsample(values: np.ndarray, buckets: int = BUCKETS, max_points: int = MAX_POINTS) -> np.ndarray:
    """Indices, one per bucket of consecutive values: where ``values`` is largest in it
    (all indices when there are at most ``max_points``)."""
    n = len(values)
    if n <= max_points:
        return np.arange(n)
    size = math.ceil(n / buckets)
    starts = np.arange(0, n, size)
    idx = np.empty(len(starts), dtype=np.int64)
    for j, s in enumerate(starts):
        idx[j] = s + int(np.argmax(values[s:s + size]))
    return idx


def _auto_unit(peak: int) -> tuple[float, str]:
    for u in ("GB", "MB", "KB"):
        scale, label = unit_scale(u)
        if peak >= scale:
            return scale, label
    return 1.0, "bytes"


def write_timeline_png(data: dict, path: str | Path, units: str | None = "GB", force: bool = False,
                       dpi: int = 120) -> Path:
    """Draw ``data`` (from :func:`timeline_data`) to the PNG ``path`` atomically; refuse
    an existing file unless ``force``. ``units``: GB, GiB, MB, MiB, or None/auto (GB, MB
    or KB by the size of the peak). Returns the path written."""
    target = check_output(path, force, what="PNG file")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    n = data["num_ops"]
    base, planned = data["baseline_live"], data["planned_live"]
    gpeaks = [g["peak_bytes"] for g in data["groups"]]
    top = max([int(base.max()) if n else 0, int(planned.max()) if n else 0, data["budget_bytes"] or 0, *gpeaks, 1])
    if units in (None, "auto"):
        scale, label = _auto_unit(top)
    else:
        scale, label = unit_scale(units)

    def fmt(b: float) -> str:
        v = b / scale
        return f"{v:,.2f} {label}" if abs(v) >= 1 or v == 0 else f"{v:.3g} {label}"

    fig = Figure(figsize=(12, 6.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax, strip = fig.subplots(2, 1, sharex=True, height_ratios=[16, 1])

    # Phases: faint bands behind the data, and a labelled strip under it.
    seen_phases = []
    for sp in data["phase_spans"]:
        lo, hi = sp["start"] - 0.5, sp["end"] + 0.5
        color = PHASE_COLORS.get(sp["phase"], "#eeeeee")
        ax.axvspan(lo, hi, color=color, alpha=0.55, lw=0, zorder=0)
        strip.axvspan(lo, hi, color=color, lw=0)
        if (hi - lo) >= 0.06 * max(n, 1):
            strip.text((lo + hi) / 2, 0.5, sp["phase"], ha="center", va="center", fontsize=8, color="#333333")
        if sp["phase"] not in seen_phases:
            seen_phases.append(sp["phase"])

    # Planned: stacked areas by kind (only kinds that ever hold memory).
    pidx = downsample(planned)
    kinds = [k for k in STACK_ORDER if k in data["planned_by_kind"] and data["planned_by_kind"][k].any()]
    if n and kinds:
        ax.stackplot(pidx, [data["planned_by_kind"][k][pidx] / scale for k in kinds],
                     colors=[KIND_COLORS[k] for k in kinds], alpha=0.9, lw=0, zorder=2,
                     labels=[f"planned: {KIND_LABELS.get(k, k)}" for k in kinds])
    # Baseline: a line.
    bidx = downsample(base)
    bp = data["baseline_peak"]
    if n:
        ax.plot(bidx, base[bidx] / scale, color="#222222", lw=1.3, zorder=4,
                label=f"baseline, no plan (peak {fmt(bp['nbytes'])})")
    # Recompute groups: peaks between ops.
    if data["groups"]:
        groups = data["groups"]
        gpk = np.array([g["peak_bytes"] for g in groups], dtype=np.int64)
        keep = downsample(gpk, MAX_GROUP_MARKERS, MAX_GROUP_MARKERS)
        gx = [groups[i]["before_op"] - 0.5 for i in keep]
        shown = "" if len(keep) == len(groups) else f"; the highest of every {-(-len(groups) // len(keep))} shown"
        ax.scatter(gx, gpk[keep] / scale, marker="v", s=16, color="#7b2d8e", zorder=5,
                   label=f"recompute group peak ({len(groups)} groups between ops{shown})")
    # Budget.
    if data["budget_bytes"] is not None:
        ax.axhline(data["budget_bytes"] / scale, color="#d62728", ls="--", lw=1.4, zorder=6,
                   label=f"budget {fmt(data['budget_bytes'])}")
    # Planned peak, annotated away from the data.
    pp = data["planned_peak"]
    if pp["op_id"] >= 0:
        px = pp["op_id"] - 0.5 if pp["in_recompute"] else pp["op_id"]
        py = pp["nbytes"] / scale
        where = f"recompute before op {pp['op_id']}" if pp["in_recompute"] else f"op {pp['op_id']}"
        ax.plot([px], [py], marker="o", ms=7, mfc="none", mec="#d62728", mew=1.8, zorder=7)
        # The label sits in the headroom above everything, beside the peak (so its arrow
        # is not mistaken for a data line), on the side with more room.
        frac = (px + 0.5) / max(n, 1)
        dx = 0.08 * max(n, 1)
        tx, ha = (px + dx, "left") if frac < 0.6 else (px - dx, "right")
        ax.annotate(f"planned peak {fmt(pp['nbytes'])} ({where})", xy=(px, py),
                    xytext=(tx, top / scale * 1.13), textcoords="data",
                    ha=ha, va="center", fontsize=9, zorder=8,
                    bbox={"boxstyle": "round,pad=0.3", "fc": "white", "ec": "#d62728", "alpha": 0.95},
                    arrowprops={"arrowstyle": "->", "color": "#d62728", "lw": 1.2, "shrinkB": 5})

    ax.set_xlim(-0.5, max(n - 0.5, 0.5))
    ax.set_ylim(0, top / scale * 1.22)
    ax.set_ylabel(f"live memory ({label})")
    ax.grid(axis="y", color="#bbbbbb", lw=0.5, alpha=0.6)
    ax.tick_params(axis="x", labelbottom=False)
    strip.set_yticks([])
    strip.set_xlabel("op index" + (f"  (downsampled: max over {math.ceil(n / BUCKETS)} ops per point)"
                                   if n > MAX_POINTS else ""))
    for side in ("top", "right", "left"):
        strip.spines[side].set_visible(False)

    budget = data["budget_bytes"]
    bits = [f"budget {fmt(budget)}" + (f" ({100 * budget / bp['nbytes']:.0f}% of baseline)" if bp["nbytes"] else "")
            if budget is not None else "no budget",
            f"planned peak {fmt(pp['nbytes'])}",
            f"extra compute {data['extra_compute_pct']:.2f}% of the step"]
    fig.suptitle(f"{data['name']}: memory timeline ({n} ops)\n" + ", ".join(bits), fontsize=11)

    handles, labels = ax.get_legend_handles_labels()
    handles += [Patch(color=PHASE_COLORS.get(p, "#eeeeee"), label=f"{p} phase") for p in PHASES if p in seen_phases]
    labels += [f"{p} phase" for p in PHASES if p in seen_phases]
    fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=8, frameon=False)

    def save(tmp: str) -> None:
        fig.savefig(tmp, format="png", dpi=dpi)

    return write_with_atomic(target, save)


__all__ = ["downsample", "timeline_data", "write_timeline_png"]
