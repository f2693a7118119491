"""Every planner, ours and the baselines, on one trace at one or more budgets.

:func:`compare` calls :func:`taichi_plan.solve.solve` once per (budget, method), so each row
is exactly what solving that planner alone gives (same seed, same budget, same numbers), and
returns one JSON-ready row per pair. :func:`render_compare` prints the rows as an 80-column
table. No torch.

The *gap* of a row is measured against OUR lower bound: the best (largest) lower bound that
any of ``auto``, ``ilp`` and ``heuristic`` proved at that budget, ``(cost - bound) / cost``.
That bound holds for every plan in taichi-plan's plan space; a baseline that leaves it
(``dtr`` may free a tensor in another gap) can show a negative gap.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..base.errors import InfeasibleBudgetError, UsageError
from ..base.units import format_bytes
from ..problem.core import Problem, build_problem
from ..simulate.core import simulate_plan
from ..solve import methods as all_methods
from ..solve import run_method, solve
from ..solve.messages import OURS
from ..trace.format import Trace

DEFAULT_SWEEP = (0.9, 0.8, 0.6, 0.4, 0.3)
DEFAULT_TIME_LIMIT = 30.0
WIDTH = 80


def check_methods(names: list[str] | None) -> list[str]:
    """The methods to run, in the order of :func:`taichi_plan.solve.methods`; a clear
    :class:`UsageError` for an unknown or repeated name."""
    known = all_methods()
    if names is None:
        return known
    names = [n.strip() for n in names]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise UsageError(f"Unknown method(s) {', '.join(map(repr, unknown)) or '(none given)'}; "
                         f"choose from {', '.join(known)} (comma-separated).")
    if len(set(names)) != len(names):
        raise UsageError(f"--methods names a method twice: {', '.join(names)}.")
    return [m for m in known if m in names]


def parse_sweep(text: str) -> list[float]:
    """``"0.9,0.8,0.6"`` -> fractions of the baseline peak, each in (0, 1]."""
    from ..base.errors import BudgetError

    out = []
    for part in str(text).split(","):
        part = part.strip()
        try:
            f = float(part)
        except ValueError:
            raise BudgetError(
                f"--sweep {text!r}: {part!r} is not a number. Give fractions of the baseline peak "
                "separated by commas, each in (0, 1], e.g. --sweep 0.9,0.8,0.6,0.4,0.3.") from None
        if not (0 < f <= 1):
            raise BudgetError(
                f"--sweep {text!r}: {part} is outside (0, 1]. Each value is a fraction of the trace's "
                "baseline peak (1 = the unplanned peak); e.g. --sweep 0.9,0.8,0.6,0.4,0.3.")
        out.append(f)
    if len(set(out)) != len(out):
        raise BudgetError(f"--sweep {text!r} repeats a value.")
    return out


def compare(trace: Trace, budgets: list[int], methods: list[str] | None = None, *,
            time_limit: float = DEFAULT_TIME_LIMIT, seed: int = 0,
            progress: Callable[[int, int, str], None] | None = None,
            problem: Problem | None = None) -> list[dict]:
    """One row per (budget, method), budgets in the order given, methods in
    :func:`~taichi_plan.solve.methods` order. ``progress(done, total, label)`` is called
    before each solve and once at the end.

    Row keys: ``budget_bytes``, ``budget_fraction`` (of the baseline peak), ``method``,
    ``ours``, ``feasible``, ``status``, ``peak_bytes`` (the simulated peak; for an infeasible
    row the lowest peak it reached when known, else None), ``peak_pct`` (of the baseline),
    ``peak_source`` (``plan``, ``reached`` or None), ``extra_compute``, ``extra_pct`` (of
    the step's compute), ``cost_unit``, ``solve_s``, ``lower_bound`` (the method's own),
    ``our_bound`` (the best bound of ours at that budget), ``gap`` (to ``our_bound``),
    ``error`` (an infeasible row's message).
    """
    names = check_methods(methods)
    if not budgets:
        raise UsageError("compare needs at least one budget.")
    for b in budgets:
        if not isinstance(b, int) or b <= 0:
            raise UsageError(f"Budgets are positive byte counts, got {b!r}.")
    problem = problem or build_problem(trace)
    base_peak = problem.baseline_peak[0]
    unit = trace.cost_unit
    total, done = len(budgets) * len(names), 0
    rows: list[dict] = []
    for budget in budgets:
        group = []
        for method in names:
            if progress:
                progress(done, total, f"{method} at {format_bytes(budget)}")
            group.append(_row(trace, problem, budget, method, base_peak, unit, time_limit, seed))
            done += 1
        bounds = [r["lower_bound"] for r in group if r["ours"] and r["feasible"] and r["lower_bound"] is not None]
        our_bound = max(bounds) if bounds else None
        for r in group:
            r["our_bound"] = our_bound
            r["gap"] = _gap(r["extra_compute"], our_bound) if r["feasible"] else None
        rows += group
    if progress:
        progress(total, total, "done")
    return rows


def _gap(cost: float | None, bound: float | None) -> float | None:
    if cost is None or bound is None:
        return None
    if cost <= 1e-12:
        return 0.0
    return (cost - bound) / cost


def _row(trace: Trace, problem: Problem, budget: int, method: str, base_peak: int, unit: str,
         time_limit: float, seed: int) -> dict:
    row = {"budget_bytes": budget, "budget_fraction": budget / base_peak if base_peak else None,
           "method": method, "ours": method in OURS, "cost_unit": unit}
    t0 = time.perf_counter()
    try:
        # every planner on the same step: the recorded optimizer step (the options are another lever)
        plan = solve(trace, budget, method, time_limit=time_limit, seed=seed, problem=problem, optimizer="as-recorded")
    except InfeasibleBudgetError as e:
        peak, source = _reached_peak(problem, budget, method, seed, time_limit, e)
        row.update(feasible=False, status="infeasible", peak_bytes=peak, peak_source=source,
                   extra_compute=None, extra_pct=None, solve_s=time.perf_counter() - t0,
                   lower_bound=None, error=str(e))
    else:
        p, s = plan.predicted, plan.solver
        row.update(feasible=True, status=s["status"], peak_bytes=int(p["planned_peak_bytes"]), peak_source="plan",
                   extra_compute=float(p["extra_compute"]), extra_pct=float(p["extra_compute_pct"]),
                   solve_s=float(s["wall_s"]), lower_bound=s["lower_bound"], error=None)
    row["peak_pct"] = 100.0 * row["peak_bytes"] / base_peak if row["peak_bytes"] is not None and base_peak else None
    return row


def _reached_peak(problem: Problem, budget: int, method: str, seed: int, time_limit: float,
                  err: InfeasibleBudgetError) -> tuple[int | None, str | None]:
    """The lowest peak an infeasible method reached, when it is known cheaply: a baseline
    is re-run (they are deterministic and fast) and simulated; for ours, the lowest peak
    taichi-plan's planner reaches on this trace, which the error carries."""
    if method in OURS:
        reach = err.min_budget_bytes
        return (int(reach), "reached") if reach is not None and reach > budget else (None, None)
    dec = run_method(problem, budget, method, time_limit=time_limit, seed=seed)
    sim, _ = simulate_plan(problem, dec.drops, dec.partitions)
    return int(sim.peak_bytes), "reached"


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


def render_compare(rows: list[dict], trace: Trace, problem: Problem, units: str = "auto") -> str:
    """The rows as one table for an 80-column terminal."""

    def size(b):
        return format_bytes(b, units)

    base_peak, base_op = problem.baseline_peak
    unit = trace.cost_unit
    step = problem.step_cost
    step_text = f"{step:.4g} s" if unit == "s" else f"{step:.4g} units"
    lines = [
        _cut(f"Trace {trace.name} ({problem.num_ops} ops)"),
        f"Baseline peak {size(base_peak)} at op {base_op}; step compute {step_text}",
        "",
        f"{'budget':<16} {'method':<12} {'fits':<4} {'peak':>10} {'%base':>6} {'extra%':>7} "
        f"{'solve s':>7} {'gap':>7}",
        "-" * 77,
    ]
    last_budget = None
    for r in rows:
        if last_budget is not None and r["budget_bytes"] != last_budget:
            lines.append("")
        budget = ""
        if r["budget_bytes"] != last_budget:
            frac = r["budget_fraction"]
            budget = f"{100 * frac:.0f}% " if frac is not None else ""
            budget = _cut(budget + size(r["budget_bytes"]), 16)
        last_budget = r["budget_bytes"]
        method = r["method"] + ("*" if r["ours"] else "")
        peak = size(r["peak_bytes"]) if r["peak_bytes"] is not None else "-"
        pct = f"{r['peak_pct']:.0f}%" if r["peak_pct"] is not None else "-"
        extra = f"{r['extra_pct']:.2f}" if r["extra_pct"] is not None else "-"
        gap = f"{100 * r['gap']:.1f}%" if r["gap"] is not None else "-"
        lines.append(f"{budget:<16} {method:<12} {'yes' if r['feasible'] else 'no':<4} {peak:>10} {pct:>6} "
                     f"{extra:>7} {r['solve_s']:>7.2f} {gap:>7}")
    lines += [
        "",
        "* ours. peak: simulated; where a method does not fit, the lowest peak it reached",
        "  (for ours, the lowest the heuristic reaches on this trace), or '-'.",
        "extra%: extra compute as % of the step. gap: (extra - our lower bound) / extra,",
        "  the bound being the best that auto/ilp/heuristic proved at that budget.",
        "Every planner plans activations of the step with its optimizer as recorded; solve's",
        "  default (--optimizer auto) may also step it in backward or in groups to go lower.",
    ]
    return "\n".join(_cut(line) for line in lines) + "\n"


def _cut(text: str, width: int = WIDTH) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


__all__ = ["DEFAULT_SWEEP", "check_methods", "compare", "parse_sweep", "render_compare"]
