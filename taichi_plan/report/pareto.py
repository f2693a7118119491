"""Pareto curves of ``compare`` rows: extra compute against the memory budget, one line per
planner (``pareto_data`` gathers the series, ``write_pareto_png`` draws them with matplotlib
on the Agg canvas, imported only when drawing). Infeasible points are left out.

x is the budget as a percentage of the baseline peak (``x="fraction"``) or in bytes in a
unit (``x="bytes"``, ``units`` GB/GiB/MB/MiB or auto); y is the extra compute as a
percentage of the step's compute.
"""

from __future__ import annotations

from pathlib import Path

from ..atomic import check_output, write_with_atomic
from ..errors import UsageError
from ..units import unit_scale

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
    "omitted": [(method, budget_bytes), ...]}``; each series sorted by x, feasible points
    only."""
    if x not in ("fraction", "bytes"):
        raise UsageError(f"x must be 'fraction' or 'bytes', not {x!r}.")
    if x == "bytes":
        top = max((r["budget_bytes"] for r in rows), default=1)
        scale, label = _auto_unit(top) if units in (None, "auto") else unit_scale(units)
        x_label = f"memory budget ({label})"
    else:
        if any(r["budget_fraction"] is None for r in rows):
            raise UsageError("The trace has no baseline peak: draw the budget in bytes instead.")
        scale, x_label = 1.0, "memory budget (% of the unplanned peak)"
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
    return {"x_label": x_label, "y_label": "extra compute (% of the step)",
            "series": list(series.values()), "omitted": omitted}


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


__all__ = ["METHOD_STYLE", "pareto_data", "write_pareto_png"]
