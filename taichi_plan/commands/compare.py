"""``taichi-plan compare TRACE --budget B | --sweep F,F,...``: every planner, one table."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click

from ..base.atomic import check_output, is_png
from ..base.errors import UsageError
from ..base.units import parse_budget
from ..explore.compare import (
    DEFAULT_TIME_LIMIT,
    check_methods,
    compare,
    parse_sweep,
    render_compare,
)
from ..problem.core import build_problem
from ..trace.format import read_trace
from ._common import UNITS, Status, handle_errors, units_option


def _budget_unit(text: str) -> str | None:
    """The unit a byte budget was written in, if it is one the plot can use (GB, GiB, MB, MiB)."""
    m = re.search(r"([A-Za-z]+)$", text.strip())
    if not m:
        return None
    by_upper = {u.upper(): u for u in UNITS if u != "auto"}
    return by_upper.get(m.group(1).upper())


@click.command("compare")
@click.argument("trace_dir", metavar="TRACE", type=click.Path(path_type=Path))
@click.option("--budget", "-b", default=None, help="One budget: 16GB, 16GiB, 512MB or 60% (of the baseline peak).")
@click.option("--sweep", default=None, metavar="F,F,...",
              help="Budgets as fractions of the baseline peak, each in (0, 1], e.g. 0.9,0.8,0.6,0.4,0.3.")
@click.option("--methods", "-m", "methods_text", default=None, metavar="A,B,...",
              help="Only these planners [default: all: auto, ilp, heuristic, none, full, sqrt-n, dtr, selective-mm].")
@click.option("--time-limit", default=DEFAULT_TIME_LIMIT, show_default=True, type=float,
              help="Seconds each of auto and ilp may search, per budget.")
@click.option("--seed", default=0, show_default=True, type=int, help="Solver seed (same seed, same plans).")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON instead of the table.")
@click.option("--png", type=click.Path(path_type=Path), default=None,
              help="Also draw the Pareto curves (extra compute vs budget, one line per planner) to this PNG.")
@click.option("--force", is_flag=True, help="Replace the --png file if it exists (only a PNG, never other files).")
@units_option
@handle_errors
def command(trace_dir, budget, sweep, methods_text, time_limit, seed, as_json, png, force, units) -> None:
    """Run every planner (ours and the baselines) on TRACE at each budget and print one table:
    feasible or not, simulated peak, extra compute, solve time and the gap to our lower bound."""
    if (budget is None) == (sweep is None):
        raise UsageError("Give exactly one of --budget B (one budget) or --sweep F,F,... (fractions of "
                         "the baseline peak, e.g. --sweep 0.9,0.8,0.6,0.4,0.3).")
    names = check_methods(methods_text.split(",")) if methods_text is not None else None
    fractions = parse_sweep(sweep) if sweep is not None else None
    if png is not None:
        check_output(png, force, what="PNG file", option="--png", owned=is_png)
    trace = read_trace(trace_dir)
    problem = build_problem(trace)
    base_peak = problem.baseline_peak[0]
    if base_peak <= 0:
        raise UsageError(f"Trace {trace.name!r} has no memory to plan (its baseline peak is 0 bytes).")
    if fractions is not None:
        budgets = [max(1, int(base_peak * f)) for f in fractions]
    else:
        budgets = [parse_budget(budget, base_peak)]
    total = len(budgets) * len(names or check_methods(None))
    with Status("comparing", total) as status:
        rows = compare(trace, budgets, names, time_limit=time_limit, seed=seed, progress=status.step,
                       problem=problem)
    if as_json:
        out = {"trace": trace.name, "num_ops": problem.num_ops, "baseline_peak_bytes": base_peak,
               "baseline_peak_op": problem.baseline_peak[1], "cost_unit": trace.cost_unit,
               "step_compute": problem.step_cost, "seed": seed, "time_limit_s": time_limit, "rows": rows}
        click.echo(json.dumps(out, indent=1))
    else:
        click.echo(render_compare(rows, trace, problem, units or "auto"), nl=False)
    if png is not None:
        from ..report.pareto import write_pareto_png

        by_fraction = sweep is not None or budget.strip().endswith("%")
        path = write_pareto_png(rows, png, title=trace.name, x="fraction" if by_fraction else "bytes",
                                units=units or _budget_unit(budget or ""), force=force)
        click.echo(f"Wrote {path}", err=as_json)
