"""A plan as one self-contained HTML page (``taichi-plan inspect PLAN --html FILE``).

The page needs no network: inline CSS, inline JavaScript, an SVG chart drawn by that
script. The page's template, style and script are package data (``report/assets/report.html``,
``report.css``, ``report.js``, read with :mod:`importlib.resources`) copied into every page. Everything it shows is one JSON blob in ``<script type="application/json"
id="plan-data">`` (read it back with :func:`read_plan_data`); the header is also written
as static HTML so the key numbers show without JavaScript.

The blob holds the ``inspect --json`` summary (``summary``), every recompute decision
(``decisions``: columns and rows), the solver's statistics and, when the trace the plan was
solved for is found, the memory timeline (``timeline``). Long traces are cut to at most
``TIMELINE_POINTS`` buckets of consecutive ops; each bucket keeps the op where the planned
live bytes are largest (with its bytes by kind) and, separately, the largest baseline, so
no peak is lost. Tables are paged in the browser.
"""

from __future__ import annotations

import functools
import html
import json
import math
from importlib import resources
from pathlib import Path
from string import Template

import numpy as np

from ..base.atomic import check_output, write_text_atomic
from ..base.errors import PlanError, UsageError
from ..base.units import format_bytes, format_cost
from ..base.version import __version__
from ..plan.format import Plan, load_plan
from ..problem.core import Problem
from ..problem.optimizer.plan import problem_for_plan
from .plan_text import peak_where
from .timeline import KIND_COLORS, KIND_LABELS, PHASE_COLORS, STACK_ORDER, downsample

TIMELINE_POINTS = 2000  # at most this many buckets of ops in the timeline
MAX_GROUP_MARKERS = 2000  # recompute groups beyond this: the highest per bucket of groups
MAX_PHASE_SPANS = 2000  # more phase runs than this: one phase per bucket of ops
DECISION_COLUMNS = ("tensor", "op", "op_name", "module", "nbytes", "free_after", "remat_before", "why")
# Each decision row ends with ``rebuilt_before``: the simulator's recompute group for that
# tensor (``remat_before``, or earlier when another rebuild needs it), null without the trace.
OFFLOAD_COLUMNS = ("tensor", "op", "op_name", "module", "nbytes", "after", "before", "freed_after", "prefetch_at",
                   "copy_out_s", "copy_in_s", "stall_s", "why")  # v14 plans that allowed offloading
GROUP_COLUMNS = ("before_op", "peak_bytes", "num_ops", "cost")
UNIT_NAMES = {"GB": "GB", "GIB": "GiB", "MB": "MB", "MIB": "MiB", "AUTO": "auto"}


# ---------------------------------------------------------------------------------------------
# The data blob
# ---------------------------------------------------------------------------------------------


@functools.cache
def asset(name: str) -> str:
    """The text of ``taichi_plan/report/assets/<name>`` (the page's template, CSS or script)."""
    try:
        return (resources.files(__package__) / "assets" / name).read_text(encoding="utf-8")
    except (FileNotFoundError, OSError) as e:
        raise UsageError(f"taichi-plan's HTML report asset {name!r} is missing from the installed package "
                         f"({e}); reinstall taichi-plan (pip install --force-reinstall taichi-plan).") from e


def _buckets(n: int, points: int) -> tuple[int, int]:
    """(ops per bucket, number of buckets): one op per bucket up to ``points`` ops."""
    if n <= points:
        return 1, n
    size = math.ceil(n / points)
    return size, math.ceil(n / size)


def _phase_spans(phases: list[str], size: int) -> list[list]:
    """``[[phase, start, end]]`` runs of one phase (end inclusive); with more than
    ``MAX_PHASE_SPANS`` runs, each bucket of ``size`` ops takes the phase of its first op."""
    def runs(seq, step):
        out: list[list] = []
        for i, ph in enumerate(seq):
            if out and out[-1][0] == ph:
                out[-1][2] = i
            else:
                out.append([ph, i, i])
        return [[ph, a * step, min((b + 1) * step, len(phases)) - 1] for ph, a, b in out]

    spans = runs(phases, 1)
    if len(spans) > MAX_PHASE_SPANS and size > 1:
        spans = runs(phases[::size], size)
    return spans


def timeline_blob(timeline: dict, problem: Problem | None = None, points: int = TIMELINE_POINTS) -> dict:
    """The timeline's part of the blob, from :func:`taichi_plan.report.timeline.timeline_data`.

    ``planned``: per bucket, the op with the most planned live bytes (``op``, ``live``,
    ``by_kind`` for the kinds that ever hold memory, in stacking order; op name, module and
    phase when ``problem`` is given). ``baseline``: per bucket, the op with the most baseline
    live bytes. Bucket ``j`` covers ops ``j*bucket_ops`` to ``(j+1)*bucket_ops - 1``.
    """
    n = int(timeline["num_ops"])
    size, _count = _buckets(n, points)
    planned = np.asarray(timeline["planned_live"], dtype=np.int64)
    base = np.asarray(timeline["baseline_live"], dtype=np.int64)
    pidx = downsample(planned, points, points) if n else np.zeros(0, dtype=np.int64)
    bidx = downsample(base, points, points) if n else np.zeros(0, dtype=np.int64)
    by_kind = {k: np.asarray(timeline["planned_by_kind"][k], dtype=np.int64) for k in timeline["planned_by_kind"]}
    kinds = [k for k in STACK_ORDER if k in by_kind and by_kind[k].any()]
    kinds += [k for k in by_kind if k not in kinds and by_kind[k].any()]
    plan_pts: dict = {"op": pidx.tolist(), "live": planned[pidx].tolist(),
                      "by_kind": {k: by_kind[k][pidx].tolist() for k in kinds},
                      "phase": [timeline["phase"][i] for i in pidx]}
    if problem is not None:
        plan_pts["op_name"] = [problem.op_name[i] for i in pidx]
        plan_pts["module"] = [problem.op_module[i] for i in pidx]
    groups = timeline["groups"]
    keep = range(len(groups))
    if len(groups) > MAX_GROUP_MARKERS:
        gpk = np.array([g["peak_bytes"] for g in groups], dtype=np.int64)
        keep = downsample(gpk, MAX_GROUP_MARKERS, MAX_GROUP_MARKERS).tolist()
    return {
        "num_ops": n,
        "bucket_ops": size,
        "downsampled": size > 1,
        "budget_bytes": timeline["budget_bytes"],
        "cost_unit": timeline["cost_unit"],
        "kinds": kinds,
        "kind_labels": {k: KIND_LABELS.get(k, k) for k in kinds},
        "kind_colors": {k: KIND_COLORS.get(k, "#999999") for k in kinds},
        "phase_colors": PHASE_COLORS,
        "phase_spans": _phase_spans(list(timeline["phase"]), size),
        "planned": plan_pts,
        "baseline": {"op": bidx.tolist(), "live": base[bidx].tolist()},
        "baseline_peak": timeline["baseline_peak"],
        "planned_peak": timeline["planned_peak"],
        "groups": {"count": len(groups), "columns": list(GROUP_COLUMNS),
                   "rows": [[groups[i][c] for c in GROUP_COLUMNS] for i in keep]},
    }


def _reserved_card(rs: dict, version, size) -> tuple[str, str, str]:
    """The allocator model's reserved peak (docs/allocator.md), or why the plan has none."""
    if not rs.get("predicted"):
        return ("Reserved peak", "-", f"not predicted (plan format v{version}); solve again")
    fits = {True: "within the budget; ", False: "over the budget; ", None: ""}[rs.get("fits_budget")]
    return ("Reserved peak", size(rs["planned_nbytes"]),
            f"{fits}{size(rs['baseline_nbytes'])} unplanned; budget on {rs.get('budget_on')} bytes; "
            "CUDA caching allocator model" + (", expandable segments" if rs.get("expandable_segments") else ""))


def plan_data(plan: Plan, summary: dict, timeline: dict | None, problem: Problem | None = None,
              units: str | None = None, rebuilt_before: dict[int, int] | None = None) -> dict:
    """The JSON blob the page renders from (see the module docstring). ``rebuilt_before``:
    tensor id -> the op whose recompute group rebuilds it, from the simulator."""
    rebuilt_before = rebuilt_before or {}
    return {
        "report": {"format": "taichi-plan-html", "version": 1, "taichi_plan": __version__,
                   "units": _units(units)},
        "summary": summary,
        "decisions": {"columns": [*DECISION_COLUMNS, "rebuilt_before"],
                      "rows": [[*(getattr(r, c) for c in DECISION_COLUMNS), rebuilt_before.get(int(r.tensor))]
                               for r in plan.recompute]},
        **({"offloads": {"columns": list(OFFLOAD_COLUMNS),
                         "rows": [[getattr(o, c) for c in OFFLOAD_COLUMNS] for o in plan.offloads]}}
           if getattr(plan, "offload", None) is not None else {}),
        "solver_stats": plan.solver.get("stats") or {},
        "timeline": timeline_blob(timeline, problem) if timeline is not None else None,
    }


def _units(units: str | None) -> str:
    key = (units or "auto").upper()
    if key not in UNIT_NAMES:
        raise UsageError(f"Unknown unit {units!r}; use one of GB, GiB, MB, MiB (or none for automatic).")
    return UNIT_NAMES[key]


def _json_default(o):
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"{type(o).__name__} is not JSON serializable")


def _finite(o):
    """JSON has no NaN or infinity: they become null."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def _script_json(obj) -> str:
    """JSON safe inside a <script> element: no '<', '>' or '&' (escaped as \\u003c, ...)."""
    text = json.dumps(_finite(json.loads(json.dumps(obj, default=_json_default, allow_nan=True))),
                      ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def read_plan_data(page: str) -> dict:
    """The blob embedded in a page :func:`plan_html` wrote."""
    start_tag = '<script type="application/json" id="plan-data">'
    i = page.index(start_tag) + len(start_tag)
    j = page.index("</script>", i)
    return json.loads(page[i:j])


# ---------------------------------------------------------------------------------------------
# The static header
# ---------------------------------------------------------------------------------------------


def _header(s: dict, units: str) -> str:
    e = html.escape

    def size(b) -> str:
        return "-" if b is None else format_bytes(b, units)

    t, x, sv = s["trace"], s["extra_compute"], s["solver"]
    cu = x["unit"] or "s"

    def cost(v) -> str:
        return "-" if v is None else format_cost(float(v), cu)

    b, p, budget = s["baseline_peak"], s["planned_peak"], s["budget_bytes"]
    budget_pct = (f"{100 * budget / b['nbytes']:.1f}% of the baseline peak, " if budget and b["nbytes"] else "")
    fits = ""
    if budget is not None and p["nbytes"] is not None:
        fits = ("<span class='ok'>fits the budget</span>" if p["nbytes"] <= budget
                else "<span class='bad'>over the budget</span>")
    pct = f"{p['pct_of_baseline']:.1f}% of baseline, " if p.get("pct_of_baseline") is not None else ""
    xp = f"{x['pct_of_step']:.2f}%" if x["pct_of_step"] is not None else "-"
    gap = f"{100 * sv['gap']:.2f}%" if sv.get("gap") is not None else "-"
    wall = f"{sv['wall_s']:.2f} s" if sv.get("wall_s") is not None else "-"
    cards = [
        ("Budget", size(budget), budget_pct + (f"{budget:,} bytes" if budget is not None else "no budget")),
        ("Baseline peak", size(b["nbytes"]), peak_where(b) or "unplanned step"),
        ("Planned peak", size(p["nbytes"]), pct + peak_where(p)),
        _reserved_card(s.get("reserved_peak") or {}, s.get("format_version"), size),
        ("Extra compute", xp + " of the step",
         f"{cost(x['cost'])} of the step's {cost(x['step'])}; {x['ops_rerun']} ops re-run, "
         f"{s['decisions']['tensors_dropped']} tensors dropped, {size(s['decisions']['nbytes_freed'])} freed"),
        ("Solver", f"{sv['method']}: {sv['status']}",
         f"lower bound {cost(sv.get('lower_bound'))}, gap {gap}, wall {wall}, seed {sv.get('seed')}"),
    ]
    off = s.get("offload")
    if off:
        cap = f"host budget {size(off['host_budget_bytes'])}; " if off["host_budget_bytes"] is not None else ""
        cards.insert(5, ("Host memory", size(off["host_peak_bytes"]),
                         f"{cap}{off['tensors_offloaded']} tensors offloaded, {size(off['nbytes_offloaded'])} copied; "
                         f"waits for copies {cost(off['stall_s'])}; host link "
                         f"{off['host_link_bytes_per_s'] / 1e9:g} GB/s each way"))
    out = [f"<h1>Plan for <span class='name'>{e(str(t['name'] or '-'))}</span></h1>"]
    if t["found"]:
        trace_line = f"trace <code>{e(str(t['read_from']))}</code> (found; content hash matches the plan)"
    else:
        trace_line = f"trace <code>{e(str(t['path'] or '-'))}</code> ({e(str(t['state']))})"
    plan_line = f"plan <code>{e(str(s['plan_path']))}</code> &middot; " if s.get("plan_path") else ""
    out.append(f"<p class='sub'>{plan_line}{trace_line} &middot; {e(str(t['num_ops']))} ops &middot; "
               f"signature <code>{e(str(t['signature']))}</code></p>")
    out.append("<div class='cards'>")
    for i, (label, big, small) in enumerate(cards):
        extra = f" {fits}" if i == 2 and fits else ""
        out.append(f"<div class='card'><div class='label'>{e(label)}</div><div class='big'>{e(big)}</div>"
                   f"<div class='small'>{e(small)}{extra}</div></div>")
    out.append("</div>")
    notes = [str(n) for n in (sv.get("notes") or [])]
    if notes:
        out.append("<div class='notes'><span class='label'>Solver notes</span><ul>" +
                   "".join(f"<li>{e(n)}</li>" for n in notes) + "</ul></div>")
    warns = []
    if t["message"]:
        warns.append(f"Note: {t['message']}.")
    sp = s.get("schedule_peak_bytes")
    if sp is not None and p["nbytes"] is not None and sp != p["nbytes"]:
        warns.append(f"Warning: the plan's own schedule peaks at {size(sp)}, not at the predicted "
                     f"{size(p['nbytes'])}; the plan file is inconsistent. Solve the trace again.")
    r = s.get("resimulated")
    if r and not r["agrees"]:
        warns.append(f"Warning: the simulator now predicts peak {size(r['peak_bytes'])} and extra "
                     f"{cost(r['extra_compute'])} for this plan, not what the plan file says; solve the trace again.")
    out += [f"<p class='warn'>{e(w)}</p>" for w in warns]
    if off and off["top"]:
        out.append(f"<h2>Offload decisions</h2><p class='sub'>{off['tensors_offloaded']} tensors copied to host after "
                   "their last forward use and back before backward reads them"
                   + (f"; the {len(off['top'])} largest" if off["tensors_offloaded"] > len(off["top"]) else "")
                   + "</p><table class='offloads'><tr><th>tensor</th><th>bytes</th><th>op (module)</th>"
                   "<th>out after</th><th>freed after</th><th>copy-in before</th><th>needed before</th>"
                   "<th>why</th></tr>")
        for r in off["top"]:
            where = r["op_name"] + (f" in {r['module']}" if r["module"] else "")
            out.append(f"<tr><td>{r['tensor']}</td><td>{e(size(r['nbytes']))}</td><td>{e(where)}</td>"
                       f"<td>{r['after']}</td><td>{r['freed_after']}</td><td>{r['prefetch_at']}</td>"
                       f"<td>{r['before']}</td><td>{e(r['why'])}</td></tr>")
        out.append("</table>")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# The page
# ---------------------------------------------------------------------------------------------


def plan_html(plan: Plan, summary: dict, timeline: dict | None, *, problem: Problem | None = None,
              units: str | None = None, rebuilt_before: dict[int, int] | None = None) -> str:
    """The page for ``plan``: ``summary`` from :func:`~taichi_plan.report.plan_text.plan_summary`,
    ``timeline`` from :func:`~taichi_plan.report.timeline.timeline_data` (None when the trace
    is missing: the page says so and shows what the plan alone knows). ``problem`` adds op
    names and modules to the timeline's hover; ``units``: GB, GiB, MB, MiB or None (auto);
    ``rebuilt_before``: tensor id -> op before which the simulator rebuilds it."""
    unit = _units(units)
    data = plan_data(plan, summary, timeline, problem, unit, rebuilt_before)
    title = html.escape(f"taichi-plan: plan for {summary['trace']['name'] or '-'}")
    no_timeline = ""
    if timeline is None:
        why = summary["trace"]["message"] or "the trace the plan was solved for is not available"
        no_timeline = f"<p class='missing'>No timeline: {html.escape(why)}.</p>"
    page = Template(asset("report.html"))
    return page.substitute(title=title, css=asset("report.css"), header=_header(summary, unit),
                           no_timeline=no_timeline, data=_script_json(data), js=asset("report.js"))


def write_plan_html(plan_path: str | Path, out_path: str | Path, force: bool = False,
                    units: str | None = None) -> Path:
    """Read the plan at ``plan_path`` (and the trace it names, if still there) and write its
    page to ``out_path`` atomically; refuse an existing file unless ``force``. Returns the
    path written."""
    from .plan_text import locate_trace, plan_summary
    from .timeline import timeline_data
    from .verdict import resimulate

    target = check_output(out_path, force, what="HTML file")
    unit = _units(units)
    plan = load_plan(plan_path)
    trace, status = locate_trace(plan, plan_path)
    problem = problem_for_plan(plan, trace) if trace is not None else None
    sim = None
    if problem is not None:
        try:
            sim, _parted = resimulate(problem, plan)
        except PlanError:
            sim = None  # plan_summary says why the plan does not apply
    summary = plan_summary(plan, trace, trace_status=status, plan_path=plan_path, problem=problem,
                           sim=sim if not plan.partitions else None)
    timeline, rebuilt = None, {}
    if summary["trace"]["found"] and problem is not None and sim is not None:
        timeline = timeline_data(problem, plan)
        for r in plan.recompute:
            at = sim.remat_at.get(problem.index_of(r.tensor))
            if at is not None:
                rebuilt[int(r.tensor)] = int(at)
    else:
        problem = None
    page = plan_html(plan, summary, timeline, problem=problem, units=unit, rebuilt_before=rebuilt)
    return write_text_atomic(target, page)
