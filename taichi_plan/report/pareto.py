"""Pareto curves of ``compare`` rows: extra compute against the memory budget, one line per
planner (``pareto_data`` gathers the series, ``write_pareto_png`` draws them with matplotlib
on the Agg canvas, imported only when drawing). Infeasible points are left out.

x is the budget as a percentage of the baseline peak (``x="fraction"``) or in bytes in a
unit (``x="bytes"``, ``units`` GB/GiB/MB/MiB or auto); y is the extra compute as a
percentage of the step's compute.

Points of two planners that coincide (same budget, same extra compute) would hide each
other: ``pareto_data`` lists them (``coincident``) and says, per baseline, where it equals
ours (``notes``, e.g. "ours (auto) = dtr at 90%, 80%"); the figure rings each hidden
baseline point in its colour around ours and puts the notes under the legend.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..base.atomic import check_output, write_with_atomic
from ..base.errors import UsageError
from ..base.units import unit_scale

# Ours drawn solid and on top; baselines dashed.
METHOD_STYLE = {
    "auto": ("#d62728", "o", "-"),
    "ilp": ("#9467bd", "s", "-"),
    "heuristic": ("#ff7f0e", "D", "-"),
    "none": ("#7f7f7f", "x", "--"),
    "full": ("#1f77b4", "^", "--"),
    "sqrt-n": ("#2ca02c", "v", "--"),
    "dtr": ("#8c564b", "P", "--"),
    "selective-mm": ("#17becf", "*", "--"),
}


def _auto_unit(nbytes: int) -> tuple[float, str]:
    for u in ("GB", "MB", "KB"):
        scale, label = unit_scale(u)
        if nbytes >= scale:
            return scale, label
    return 1.0, "bytes"


def pareto_data(rows: list[dict], x: str = "fraction", units: str | None = None) -> dict:
    """``{"x_label", "y_label", "series": [{"method", "ours", "x": [...], "y": [...]}],
    "omitted": [(method, budget_bytes), ...], "coincident": [{"x", "y", "methods"}],
    "notes": [str]}``; each series sorted by x, feasible points only. ``coincident``: every
    point two or more planners share (methods in row order); ``notes``: for each baseline
    that shares points with ours, which of ours and at which budgets."""
    if x not in ("fraction", "bytes"):
        raise UsageError(f"x must be 'fraction' or 'bytes', not {x!r}.")
    if x == "bytes":
        top = max((r["budget_bytes"] for r in rows), default=1)
        scale, label = _auto_unit(top) if units in (None, "auto") else unit_scale(units)
        x_label = f"memory budget ({label})"
        unit_label = label
    else:
        if any(r["budget_fraction"] is None for r in rows):
            raise UsageError("The trace has no baseline peak: draw the budget in bytes instead.")
        scale, x_label = 1.0, "memory budget (% of the unplanned peak)"
        unit_label = "%"
    series: dict[str, dict] = {}
    omitted = []
    for r in rows:
        s = series.setdefault(r["method"], {"method": r["method"], "ours": r["ours"], "x": [], "y": []})
        if not r["feasible"]:
            omitted.append((r["method"], r["budget_bytes"]))
            continue
        s["x"].append(100.0 * r["budget_fraction"] if x == "fraction" else r["budget_bytes"] / scale)
        s["y"].append(r["extra_pct"])
    for s in series.values():
        pts = sorted(zip(s["x"], s["y"], strict=True))
        s["x"], s["y"] = [p[0] for p in pts], [p[1] for p in pts]
    coincident = coinciding_points(list(series.values()))
    return {"x_label": x_label, "y_label": "extra compute (% of the step)",
            "series": list(series.values()), "omitted": omitted, "coincident": coincident,
            "notes": coincidence_notes(coincident, {s["method"]: s["ours"] for s in series.values()},
                                       unit_label)}


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def coinciding_points(series: list[dict]) -> list[dict]:
    """Points shared by two or more series (same x, y within 1e-9): ``[{"x", "y", "methods"}]``,
    by x then y, methods in series order."""
    groups: list[dict] = []
    for s in series:
        for xv, yv in zip(s["x"], s["y"], strict=True):
            g = next((g for g in groups if _same(g["x"], xv) and _same(g["y"], yv)), None)
            if g is None:
                groups.append({"x": xv, "y": yv, "methods": [s["method"]]})
            elif s["method"] not in g["methods"]:
                g["methods"].append(s["method"])
    return sorted((g for g in groups if len(g["methods"]) > 1), key=lambda g: (g["x"], g["y"]))


def _x_text(xv: float, unit_label: str) -> str:
    return f"{xv:.0f}%" if unit_label == "%" and _same(xv, round(xv)) else (
        f"{xv:.1f}%" if unit_label == "%" else f"{xv:.4g} {unit_label}")


def coincidence_notes(coincident: list[dict], ours: dict[str, bool], unit_label: str) -> list[str]:
    """One line per baseline that shares points with ours: ``"ours (auto, ilp) = dtr at 90%,
    80%"``, budgets from the loosest to the tightest."""
    notes = []
    baselines = [m for m, o in ours.items() if not o]
    for base in baselines:
        hits = [g for g in coincident if base in g["methods"] and any(ours.get(m) for m in g["methods"])]
        if not hits:
            continue
        who = [m for m in ours if ours[m] and any(m in g["methods"] for g in hits)]
        xs = sorted({g["x"] for g in hits}, reverse=True)
        notes.append(f"ours ({', '.join(who)}) = {base} at {', '.join(_x_text(v, unit_label) for v in xs)}")
    return notes


def write_pareto_png(rows: list[dict], path: str | Path, *, title: str = "", x: str = "fraction",
                     units: str | None = None, force: bool = False, dpi: int = 120) -> Path:
    """Draw the rows' Pareto curves to the PNG ``path`` atomically; refuse an existing file
    unless ``force`` and a missing directory. Returns the path written."""
    target = check_output(path, force, what="PNG file")
    data = pareto_data(rows, x, units)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 6), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    drawn = 0
    order = list(METHOD_STYLE)
    for s in sorted(data["series"], key=lambda s: (order.index(s["method"]) if s["method"] in order else len(order))):
        color, marker, ls = METHOD_STYLE.get(s["method"], ("#333333", "o", "-"))
        size = {"auto": 10, "ilp": 7, "heuristic": 5}.get(s["method"], 6)  # ours overlap: nested markers
        label = s["method"] + (" (ours)" if s["ours"] else "")
        if not s["x"]:
            label += ": no feasible budget"
        ax.plot(s["x"], s["y"], color=color, marker=marker, ls=ls, lw=2.0 if s["ours"] else 1.3,
                ms=size, zorder=(5 - size / 10) if s["ours"] else 2, label=label)
        drawn += len(s["x"])
    # A baseline point under one of ours (same x, same y) is ringed in its colour, so the
    # reader sees both planners there; the legend says where.
    is_ours = {s["method"]: s["ours"] for s in data["series"]}
    for g in data["coincident"]:
        hidden = [m for m in g["methods"] if not is_ours[m]]
        if len(hidden) == len(g["methods"]):  # baselines only: the last drawn shows, ring the others
            hidden = hidden[:-1]
        for k, m in enumerate(hidden):
            color = METHOD_STYLE.get(m, ("#333333",))[0]
            ax.plot([g["x"]], [g["y"]], ls="none", marker="o", ms=14 + 5 * k, mfc="none", mec=color, mew=1.6,
                    zorder=6)
    for note in data["notes"]:
        base = note.split(" = ", 1)[1].rsplit(" at ", 1)[0]  # "ours (...) = <baseline> at ..."
        ax.plot([], [], ls="none", marker="o", ms=10, mfc="none", mew=1.6,
                mec=METHOD_STYLE.get(base, ("#555555",))[0], label=note)
    ax.set_xlabel(data["x_label"])
    ax.set_ylabel(data["y_label"])
    ax.grid(color="#bbbbbb", lw=0.5, alpha=0.6)
    if x == "fraction":
        ax.invert_xaxis()  # tighter budgets to the right: cost grows left to right
    if not drawn:
        ax.text(0.5, 0.5, "no planner fits any of these budgets", transform=ax.transAxes,
                ha="center", va="center", fontsize=11, color="#555555")
    else:
        ax.set_ylim(bottom=min(0.0, *(v for s in data["series"] for v in s["y"])))
    sub = f"{len(data['omitted'])} infeasible (budget, planner) point(s) omitted" if data["omitted"] else \
        "every planner fits every budget"
    fig.suptitle((f"{title}: " if title else "") + "extra compute vs memory budget\n" + sub, fontsize=11)
    fig.legend(loc="outside right upper", fontsize=9, frameon=False)

    def save(tmp: str) -> None:
        fig.savefig(tmp, format="png", dpi=dpi)

    return write_with_atomic(target, save)


__all__ = ["METHOD_STYLE", "coincidence_notes", "coinciding_points", "pareto_data", "write_pareto_png"]
