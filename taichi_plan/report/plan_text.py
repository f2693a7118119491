"""What a plan holds and why, as JSON-ready data (``plan_summary``) and as text as wide as
the terminal (``render_plan_summary``). ``taichi-plan inspect PLAN.plan.json`` prints one or
the other (``inspect_plan``), and with ``--png`` also draws the memory timeline
(:mod:`taichi_plan.report.timeline`).

The plan alone knows its budget, the simulator's prediction, the solver's status and
every decision. The trace it was solved for adds op names and modules, the per-module
table (which needs the simulator's recompute groups) and the timeline; when that trace is
gone or has changed, everything the plan alone knows is still shown and the report says
what is missing.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

from ..base.errors import PlanError, TraceError, UsageError
from ..base.units import format_bytes
from ..plan.format import Plan, load_plan, peak_from_schedule
from ..problem.core import Problem
from ..problem.fit import check_plan_against_trace
from ..problem.optimizer.plan import problem_for_plan
from ..simulate.core import SimResult
from ..trace.format import Trace, read_trace
from .trace_text import cut_cell, format_cost_cell, terminal_width, wrap_lines
from .verdict import resimulate

TOP_DECISIONS = 10
TOP_MODULES = 20
NEEDS = "the timeline and per-module table need it"


# ---------------------------------------------------------------------------------------------
# Finding the trace
# ---------------------------------------------------------------------------------------------


def locate_trace(plan: Plan, plan_path: str | Path | None = None,
                 trace: Trace | str | Path | None = None) -> tuple[Trace | None, dict]:
    """Find the trace ``plan`` was solved for and check it by content hash.

    ``trace`` overrides the search: a trace directory (or a :class:`Trace`) to use instead
    of the one the plan names; it must still have the plan's content hash. Otherwise these
    are tried in turn, and the first whose content hash matches wins: ``trace['path']``
    relative to the plan file (``plan_path``, else the file the plan was loaded from),
    ``trace['path']`` as it is (relative to the working directory: plans made in memory and
    format-v1 files), and ``trace['path_absolute']``.

    Returns ``(trace or None, status)``; ``status`` has ``state`` (``found``, ``missing``,
    ``changed``, ``unreadable`` or ``no_path``), ``path`` (where the trace was read, or
    looked for), ``reason`` (a clause saying what is wrong, or None) and ``message``
    (``reason`` and what inspect cannot show without the trace). A trace that is found is
    also cross-checked against the plan (:class:`PlanError` if they disagree).
    """
    where = f"Plan {str(plan_path or plan.source)!r}" if (plan_path or plan.source) else "The plan"
    want = plan.trace.get("content_hash")
    if trace is not None:
        given = trace if isinstance(trace, Trace) else read_trace(trace)
        label = str(given.path) if given.path is not None else "the trace given"
        got = _hash(given)
        if want and got != want:
            return None, _status("changed", label,
                                 f"the trace given ({label}) is not the one the plan was solved for (content "
                                 f"hash {got[:12]}, the plan's is {str(want)[:12]})")
        check_plan_against_trace(plan, given, where=where)
        return given, _status("found", label, None)
    candidates = _candidates(plan, plan_path)
    if not candidates:
        return None, _status("no_path", None, "the plan names no trace path")
    first_bad = None
    for p in candidates:
        if not p.exists():
            continue
        try:
            found = read_trace(p)
        except TraceError as e:
            first_bad = first_bad or _status("unreadable", str(p), f"the trace at {p} cannot be read ({e})")
            continue
        got = _hash(found)
        if want and got != want:
            first_bad = first_bad or _status(
                "changed", str(p), f"the trace at {p} has changed since the plan was solved (content hash "
                f"{got[:12]}, the plan's is {str(want)[:12]})")
            continue
        check_plan_against_trace(plan, found, where=where)
        return found, _status("found", str(p), None)
    if first_bad is not None:
        return None, first_bad
    looked = " nor at ".join(str(p) for p in candidates)
    return None, _status("missing", str(candidates[0]), f"trace not found at {looked}")


def _candidates(plan: Plan, plan_path: str | Path | None) -> list[Path]:
    """Where the plan's trace may be, in the order :func:`locate_trace` tries them."""
    raw, absolute = plan.trace.get("path"), plan.trace.get("path_absolute")
    source = Path(plan_path) if plan_path is not None else plan.source
    out: list[Path] = []
    if raw:
        if not Path(raw).is_absolute() and source is not None:
            out.append(Path(os.path.normpath(source.parent / raw)))
        out.append(Path(raw))
    if absolute:
        out.append(Path(absolute))
    unique: dict[str, Path] = {}
    for p in out:
        unique.setdefault(os.path.abspath(p), p)
    return list(unique.values())


def _hash(trace: Trace) -> str:
    """The trace's content hash: ``meta.json``'s (``read_trace`` checked it against the
    tables), else computed."""
    return trace.meta.get("content_hash") if trace.path is not None and trace.meta.get("content_hash") \
        else trace.content_hash()


def _status(state: str, path: str | None, reason: str | None) -> dict:
    return {"state": state, "path": path, "reason": reason,
            "message": None if reason is None else f"{reason}: {NEEDS}" + (
                ", with the trace the plan was solved for" if state == "changed" else "")}


def _partition_costs(problem: Problem, plan: Plan, total: float) -> dict[str, float]:
    """Extra compute of each partitioned module (its forward re-run and launches), summing
    to ``total``; what cannot be attributed goes to '(partitions)'."""
    out: dict[str, float] = {}
    if not plan.partitions or total == 0:
        return out
    try:
        from ..problem.partition.cost import partition_cost
        from ..problem.partition.find import find_span

        for part in plan.partitions:
            span = find_span(problem, part)
            if span is None:
                raise KeyError(part.module)
            out[part.module] = out.get(part.module, 0.0) + float(partition_cost(problem, span, part.chunks))
    except (ImportError, KeyError, TypeError, AttributeError):
        out = {}
    rest = total - sum(out.values())
    if abs(rest) > 1e-9 * max(1.0, abs(total)):
        out = {"(partitions)": total} if not out else {**out, "(partitions)": rest}
    return out


# ---------------------------------------------------------------------------------------------
# Gathering
# ---------------------------------------------------------------------------------------------


def _op_info(problem: Problem | None, op: int | None) -> dict:
    if problem is None or op is None or not (0 <= op < problem.num_ops):
        return {"op": None, "module": None, "phase": None}
    return {"op": problem.op_name[op], "module": problem.op_module[op], "phase": problem.op_phase[op]}


def module_table(problem: Problem, plan: Plan, sim: SimResult, parted: Problem | None = None) -> list[dict]:
    """Per module FQN ('' shown as '(none)'): tensors dropped and bytes freed (the plan's
    decisions, by their producer's module) and extra compute (each re-run op of every
    recompute group charged to that op's module, each partition's cost to its module).
    ``parted`` is the problem ``sim`` describes (partitions applied), default ``problem``.
    Sorted by bytes freed, then extra."""
    parted = parted or problem
    rows: dict[str, dict] = defaultdict(lambda: {"tensors_dropped": 0, "nbytes_freed": 0,
                                                 "extra_compute": 0.0, "ops_rerun": 0})
    for r in plan.recompute:
        row = rows[r.module or ""]
        row["tensors_dropped"] += 1
        row["nbytes_freed"] += int(r.nbytes)
    for g in sim.groups.values():
        for op in g.ops:
            row = rows[parted.op_module[op] or ""]
            row["extra_compute"] += float(parted.op_cost[op])
            row["ops_rerun"] += 1
    for module, c in _partition_costs(problem, plan, float(getattr(sim, "partition_cost", 0.0))).items():
        rows[module]["extra_compute"] += c
    step = problem.step_cost
    out = []
    for module, row in rows.items():
        pct = 100.0 * row["extra_compute"] / step if step > 0 else 0.0
        out.append({"module": module or "(none)", **row, "extra_compute_pct": pct})
    out.sort(key=lambda r: (-r["nbytes_freed"], -r["extra_compute"], r["module"]))
    return out


def plan_summary(plan: Plan, trace: Trace | None, *, trace_status: dict | None = None,
                 plan_path: str | Path | None = None, problem: Problem | None = None,
                 sim: SimResult | None = None) -> dict:
    """Every fact ``inspect`` shows about ``plan``, as a dict of plain JSON values.

    ``trace`` is the trace the plan was solved for, or None; ``trace_status`` is what
    :func:`locate_trace` said (derived when not given). ``problem`` may be passed to avoid
    rebuilding it; ``sim`` too, when the plan has no partitions.
    """
    if trace_status is None:
        if trace is None:
            trace_status = {"state": "missing", "path": plan.trace.get("path"),
                            "message": f"no trace given: {NEEDS}"}
        else:
            trace_status = {"state": "found", "path": str(trace.path) if trace.path else None,
                            "message": None}
    pred, solver = plan.predicted, plan.solver
    if trace is not None:
        problem = problem_for_plan(plan, trace, problem)  # the step as the plan's optimizer option runs it
    parted = problem
    if problem is not None and sim is None:
        try:
            sim, parted = resimulate(problem, plan)
        except PlanError as e:
            where = trace_status.get("path")
            trace_status = {**trace_status, "state": "mismatch",
                            "message": f"the plan's decisions do not apply to the trace at {where} ({e}): {NEEDS}"}
            problem = None
    t = plan.trace
    summary: dict = {
        "plan_path": str(plan_path) if plan_path is not None else None,
        "format_version": plan.format_version,
        "trace": {
            "name": t.get("name"), "path": t.get("path"), "content_hash": t.get("content_hash"),
            "signature": t.get("signature"), "num_ops": t.get("num_ops"), "workload": t.get("workload"),
            "found": trace_status["state"] == "found" and problem is not None,
            "state": trace_status["state"], "read_from": trace_status.get("path"),
            "message": trace_status.get("message"),
        },
        "budget_bytes": plan.budget_bytes,
        "baseline_peak": {"nbytes": pred.get("baseline_peak_bytes"), "op_id": pred.get("baseline_peak_op"),
                          **_op_info(problem, pred.get("baseline_peak_op"))},
        "planned_peak": {"nbytes": pred.get("planned_peak_bytes"), "op_id": pred.get("planned_peak_op"),
                         "in_recompute": bool(pred.get("planned_peak_in_recompute")),
                         **_op_info(problem, pred.get("planned_peak_op"))},
        "extra_compute": {"cost": pred.get("extra_compute"), "pct_of_step": pred.get("extra_compute_pct"),
                          "step": pred.get("step_compute"), "unit": pred.get("cost_unit", "s"),
                          "ops_rerun": pred.get("recompute_ops")},
        "solver": {k: solver.get(k) for k in ("method", "status", "objective", "lower_bound", "gap",
                                              "wall_s", "seed", "notes")},
    }
    summary["reserved_peak"] = reserved_summary(plan)
    base, planned = summary["baseline_peak"]["nbytes"], summary["planned_peak"]["nbytes"]
    summary["planned_peak"]["pct_of_baseline"] = 100.0 * planned / base if base and planned is not None else None

    order = sorted(plan.recompute, key=lambda r: (-int(r.nbytes), int(r.tensor)))
    summary["decisions"] = {
        "tensors_dropped": len(plan.recompute),
        "nbytes_freed": int(sum(int(r.nbytes) for r in plan.recompute)),
        "top": [{"tensor": r.tensor, "op": r.op, "op_name": r.op_name, "module": r.module,
                 "nbytes": int(r.nbytes), "free_after": r.free_after, "remat_before": r.remat_before,
                 "why": r.why} for r in order[:TOP_DECISIONS]],
    }
    summary["offload"] = offload_summary(plan)
    summary["partitions"] = [{"module": p.module, "dim": p.dim, "chunks": p.chunks, "over": p.over, "why": p.why,
                              "random_draws": p.random_draws} for p in plan.partitions]
    summary["partition_random"] = bool(plan.solver.get("partition_random"))
    summary["reshard_after_forward"] = plan.reshard  # v5, sharded traces: FSDP2's setting per unit
    summary["fsdp_prefetch"] = getattr(plan, "prefetch", None)  # v6, sharded traces: FSDP2's prefetching
    summary["schedule_peak_bytes"] = peak_from_schedule(plan.schedule)[0] if plan.schedule else None
    summary["modules"] = module_table(problem, plan, sim, parted) if problem is not None else None
    summary["resimulated"] = None
    if problem is not None:
        summary["resimulated"] = {
            "peak_bytes": sim.peak_bytes, "peak_op": sim.peak_op, "extra_compute": sim.extra_cost,
            "agrees": (sim.peak_bytes == planned
                       and abs(sim.extra_cost - (pred.get("extra_compute") or 0.0))
                       <= 1e-9 * max(1.0, abs(sim.extra_cost))),
        }
    return summary


def offload_summary(plan: Plan) -> dict | None:
    """The plan's offloads (v14 ``decisions.offload``), largest first, with the host memory they
    hold and the stalls they cost; None where the solve did not allow offloading."""
    off = getattr(plan, "offload", None)
    if off is None:
        return None
    order = sorted(plan.offloads, key=lambda o: (-int(o.nbytes), int(o.tensor)))
    return {
        "host_link_bytes_per_s": off.get("host_link_bytes_per_s"),
        "host_budget_bytes": off.get("host_budget_bytes"),
        "host_peak_bytes": plan.predicted.get("host_peak_bytes"),
        "stall_s": plan.predicted.get("stall_s"),
        "tensors_offloaded": len(plan.offloads),
        "nbytes_offloaded": int(sum(int(o.nbytes) for o in plan.offloads)),
        "top": [{"tensor": o.tensor, "op": o.op, "op_name": o.op_name, "module": o.module, "nbytes": int(o.nbytes),
                 "after": o.after, "before": o.before, "freed_after": o.freed_after, "prefetch_at": o.prefetch_at,
                 "copy_out_s": o.copy_out_s, "copy_in_s": o.copy_in_s, "stall_s": o.stall_s, "why": o.why}
                for o in order[:TOP_DECISIONS]],
    }


def reserved_summary(plan: Plan) -> dict:
    """The allocator model's verdict as the plan records it (docs/allocator.md): reserved peaks
    of the unplanned and planned step, the blocks handed out at most, and which bytes the budget
    was stated on. Plans of format v1/v2 have no reserved peaks (``predicted`` is false)."""
    pred, al = plan.predicted, plan.predicted.get("allocator") or {}
    planned = pred.get("planned_reserved_peak_bytes")
    on = plan.solver.get("budget_on") or "allocated"
    return {
        "predicted": planned is not None,
        "baseline_nbytes": pred.get("baseline_reserved_peak_bytes"),
        "planned_nbytes": planned,
        "planned_allocated_blocks_nbytes": al.get("planned_allocated_peak_bytes"),
        "expandable_segments": al.get("expandable_segments"),
        "budget_on": on,
        "fits_budget": (None if planned is None or plan.budget_bytes is None else planned <= plan.budget_bytes),
    }


# ---------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------


def peak_where(p: dict) -> str:
    """Where a peak happens, in words (shared by the text and HTML reports)."""
    if p.get("op_id") is None or p["op_id"] < 0:
        return ""
    at = f"in the recompute group before op {p['op_id']}" if p.get("in_recompute") else f"during op {p['op_id']}"
    if p.get("op"):
        at += f" ({p['op']}" + (f", {p['module']}" if p.get("module") else "") + f", {p['phase']})"
    return at


def _cut_left(text: str, width: int) -> str:
    """``text`` cut to ``width`` from the left: a module FQN keeps its most specific end."""
    return text if len(text) <= width else "…" + text[len(text) - width + 1:]


def render_plan_summary(summary: dict, units: str | None = None, width: int | None = None) -> str:
    """The summary as text ``width`` columns wide (default: the terminal's, 80 off a terminal);
    ``units`` is GB, GiB, MB, MiB or None (auto, decimal). Paths are never cut: a path longer
    than a line gets a line of its own."""
    unit = units or "auto"
    width = width or terminal_width()

    def wrap(text: str, indent: str) -> list[str]:
        return wrap_lines(text, indent, width)

    def size(b) -> str:
        return "-" if b is None else format_bytes(b, unit)

    s = summary
    t, x, sv = s["trace"], s["extra_compute"], s["solver"]
    cu = x["unit"] or "s"

    def cost(v) -> str:
        return "-" if v is None else format_cost_cell(float(v), cu)

    lines = wrap(f"Plan for {t['name'] or '-'}", "")
    if s.get("plan_path"):
        lines += wrap(str(s["plan_path"]), f"  {'file':<10} ")
    if t["found"]:
        lines += wrap(f"{t['read_from']} (found; content hash matches the plan)", f"  {'trace':<10} ")
    else:
        lines += wrap(f"{t['path'] or '-'} ({t['state']})", f"  {'trace':<10} ")
    lines.append(f"  {'ops':<10} {t['num_ops']}    signature {t['signature']}")
    rs = s.get("reserved_peak") or {}
    lines.append(f"  {'budget':<10} {size(s['budget_bytes'])}" +
                 (f" ({s['budget_bytes']:,} bytes, on {rs.get('budget_on') or 'allocated'} bytes)"
                  if s["budget_bytes"] is not None else " (none)"))
    b, p = s["baseline_peak"], s["planned_peak"]
    lines += wrap(f"peak {size(b['nbytes'])} {peak_where(b)}", f"  {'baseline':<10} ")
    pct = f", {p['pct_of_baseline']:.1f}% of baseline" if p.get("pct_of_baseline") is not None else ""
    lines += wrap(f"peak {size(p['nbytes'])}{pct} {peak_where(p)}", f"  {'planned':<10} ")
    if rs.get("predicted"):
        fits = {True: ", within the budget", False: ", over the budget", None: ""}[rs.get("fits_budget")]
        lines += wrap(f"peak {size(rs['planned_nbytes'])} planned{fits}, {size(rs['baseline_nbytes'])} unplanned "
                      "(CUDA caching allocator model" +
                      (", expandable segments" if rs.get("expandable_segments") else "") + ")",
                      f"  {'reserved':<10} ")
    else:
        lines += wrap(f"not predicted (plan format v{s.get('format_version')}; solve again for the allocator "
                      "model's reserved peak)", f"  {'reserved':<10} ")
    xp = f"{x['pct_of_step']:.2f}%" if x["pct_of_step"] is not None else "-"
    off = s.get("offload")
    offloaded = (f", {off['tensors_offloaded']} offloaded, {cost(off['stall_s'])} of it waiting for copies"
                 if off else "")
    lines += wrap(f"{cost(x['cost'])} of compute, {xp} of the step's {cost(x['step'])} "
                   f"({x['ops_rerun']} ops re-run, {s['decisions']['tensors_dropped']} tensors dropped{offloaded})",
                   f"  {'extra':<10} ")
    if off:
        cap = f", host budget {size(off['host_budget_bytes'])}" if off["host_budget_bytes"] is not None else ""
        lines += wrap(f"peak {size(off['host_peak_bytes'])} of offloaded copies{cap}, host link "
                      f"{off['host_link_bytes_per_s'] / 1e9:g} GB/s each way", f"  {'host':<10} ")
    gap = f"{100 * sv['gap']:.2f}%" if sv["gap"] is not None else "-"
    wall = f"{sv['wall_s']:.2f} s" if sv["wall_s"] is not None else "-"
    lines += wrap(f"{sv['method']}: {sv['status']}, lower bound {cost(sv['lower_bound'])}, gap {gap}, "
                   f"wall {wall}, seed {sv['seed']}", f"  {'solver':<10} ")
    for i, note in enumerate(sv.get("notes") or []):
        lines += wrap(str(note), f"  {'notes' if i == 0 else '':<10} ")
    if t["message"]:
        lines.append("")
        lines += wrap(f"Note: {t['message']}.", "")
    sp = s.get("schedule_peak_bytes")
    if sp is not None and p["nbytes"] is not None and sp != p["nbytes"]:
        lines.append("")
        lines += wrap(f"Warning: the plan's own schedule peaks at {size(sp)}, not at the predicted "
                       f"{size(p['nbytes'])}; the plan file is inconsistent. Solve the trace again.", "")
    r = s.get("resimulated")
    if r and not r["agrees"]:
        lines.append("")
        lines += wrap(f"Warning: the simulator now predicts peak {size(r['peak_bytes'])} and extra "
                       f"{cost(r['extra_compute'])} for this plan, not what the plan file says; "
                       "solve the trace again.", "")

    d = s["decisions"]
    lines.append("")
    head = f"Recompute decisions: {d['tensors_dropped']} tensors dropped, {size(d['nbytes_freed'])} freed"
    if d["tensors_dropped"] > len(d["top"]):
        head += f"; the {len(d['top'])} largest:"
    lines.append(head if d["tensors_dropped"] else "Recompute decisions: none (every tensor is kept)")
    if d["top"]:
        lines.append(f"  {'tensor':>7} {'bytes':>10}  {'free..remat':<12} op (module), then why")
    for row in d["top"]:
        where = row["op_name"] + (f" in {row['module']}" if row["module"] else "")
        span = f"{row['free_after']}..{row['remat_before']}"
        lines += wrap(where, f"  {row['tensor']:>7} {size(row['nbytes']):>10}  {span:<12} ")
        lines += wrap(row["why"], " " * 10)

    if off:
        lines.append("")
        head = (f"Offload decisions: {off['tensors_offloaded']} tensors offloaded, {size(off['nbytes_offloaded'])} "
                "copied to host and back")
        if off["tensors_offloaded"] > len(off["top"]):
            head += f"; the {len(off['top'])} largest:"
        lines.append(head if off["tensors_offloaded"] else "Offload decisions: none (offload was allowed)")
        if off["top"]:
            lines.append(f"  {'tensor':>7} {'bytes':>10}  {'out..in':<12} {'prefetch':>8} op (module), then why")
        for row in off["top"]:
            where = row["op_name"] + (f" in {row['module']}" if row["module"] else "")
            span = f"{row['after']}..{row['before']}"
            lines += wrap(where, f"  {row['tensor']:>7} {size(row['nbytes']):>10}  {span:<12} {row['prefetch_at']:>8} ")
            lines += wrap(row["why"], " " * 10)

    if s["partitions"]:
        lines.append("")
        lines.append(f"Partitions: {len(s['partitions'])}")
        longest = max(len(q["module"] or "(none)") for q in s["partitions"])
        pw = max(40, min(width - 15, longest))  # wider for long names, as the line allows
        lines.append(f"  {'module':<{pw}} {'over':>7} {'chunks':>7}")
        for q in s["partitions"]:
            over = "whole" if q["chunks"] == 1 else q.get("over", "batch")  # one chunk: checkpointed whole
            lines.append(f"  {cut_cell(q['module'] or '(none)', pw):<{pw}} {over:>7} {q['chunks']:>7}")
            if q["why"]:
                lines += wrap(q["why"], " " * 6)
        own = [q["module"] for q in s["partitions"] if q.get("random_draws") == "per-chunk"]
        if own:
            lines += wrap(f"Training changes: the chunks of {', '.join(own)} draw their own dropout masks "
                          "(solved with --partition-random), so the planned run matches the unplanned one "
                          "statistically, not bitwise.", "  ")

    rs_units = (s.get("reshard_after_forward") or {}).get("units")
    if rs_units:
        lines.append("")
        saved = s["reshard_after_forward"].get("step_compute_saved")
        lines.append("FSDP units (reshard_after_forward)" +
                     (f": the plan saves {cost(saved)} of backward all-gathers" if saved else ""))
        uw = max(30, min(width - 30, max(len(u["module"] or "<root>") for u in rs_units)))
        lines.append(f"  {'unit':<{uw}} {'planned':>8} {'recorded':>9}")
        for u in rs_units:
            lines.append(f"  {cut_cell(u['module'] or '<root>', uw):<{uw}} {str(u['reshard_after_forward']):>8} "
                         f"{str(u['recorded']):>9}")
            if u.get("why"):
                lines += wrap(u["why"], " " * 6)

    pf = s.get("fsdp_prefetch")
    if pf and pf.get("units"):
        lines.append("")
        lines.append(f"FSDP prefetching: overlapped step {cost(pf['overlap']['step_time'])} "
                     f"(FSDP's defaults {cost(pf['recorded_overlap']['step_time'])}), before recomputation")
        for u in pf["units"]:
            said = ([f"forward prefetches {', '.join(t or '<root>' for t in u['forward_prefetch'])}"]
                    if u["forward_prefetch"] else []) + (["no backward prefetch"] if u["backward_prefetch"] == []
                                                         else [])
            lines.append(f"  {u['module'] or '<root>'}: {'; '.join(said)}")
        if pf.get("why"):
            lines += wrap(pf["why"], "  ")

    if s["modules"] is not None:
        lines.append("")
        lines.append("Per module (extra compute: each re-run op charged to its own module)")
        longest = max((len(m["module"]) for m in s["modules"][:TOP_MODULES]), default=0)
        mw = max(30, min(width - 47, longest))  # wider for long names, as the line allows
        lines.append(f"  {'module':<{mw}} {'dropped':>7} {'freed':>11} {'extra':>15} {'% step':>8}")
        for m in s["modules"][:TOP_MODULES]:
            lines.append(f"  {_cut_left(m['module'], mw):<{mw}} {m['tensors_dropped']:>7} {size(m['nbytes_freed']):>11} "
                         f"{cut_cell(cost(m['extra_compute']), 15):>15} {m['extra_compute_pct']:>7.2f}%")
        if len(s["modules"]) > TOP_MODULES:
            lines.append(f"  ... {len(s['modules']) - TOP_MODULES} more modules (all of them with --json)")
        tot_x = sum(m["extra_compute"] for m in s["modules"])
        lines.append(f"  {'total':<{mw}} {d['tensors_dropped']:>7} {size(d['nbytes_freed']):>11} "
                     f"{cut_cell(cost(tot_x), 15):>15} {(x['pct_of_step'] or 0.0):>7.2f}%")
    elif not t["found"]:
        lines.append("")
        lines.append("Per module: not shown, the trace is needed (see the note above).")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# The command's work
# ---------------------------------------------------------------------------------------------


def inspect_plan(path: str | Path, as_json: bool = False, units: str | None = None,
                 png: str | Path | None = None, force: bool = False, width: int | None = None) -> str:
    """What ``taichi-plan inspect PLAN.plan.json`` prints; with ``png`` also writes the
    timeline there (refusing an existing file unless ``force``) and says so. ``width``:
    columns of the text (default: the terminal's, 80 off a terminal)."""
    from ..base.atomic import check_output

    if png is not None:
        check_output(png, force, what="PNG file")
    plan = load_plan(path)
    trace, status = locate_trace(plan, path)
    problem = problem_for_plan(plan, trace) if trace is not None else None
    summary = plan_summary(plan, trace, trace_status=status, plan_path=path, problem=problem)
    wrote = None
    if png is not None:
        if not summary["trace"]["found"]:
            raise UsageError(f"Cannot draw the timeline of {str(path)!r}: {summary['trace']['message']}. "
                             "Put the trace back at that path, or record or import it again and solve again.")
        from .timeline import timeline_data, write_timeline_png

        wrote = write_timeline_png(timeline_data(problem, plan), png, units=units, force=force)
    if as_json:
        if wrote is not None:
            summary["timeline_png"] = str(wrote)
        return json.dumps(summary, indent=1, ensure_ascii=False) + "\n"
    text = render_plan_summary(summary, units, width)
    return text + (f"Wrote {wrote}\n" if wrote is not None else "")


__all__ = ["inspect_plan", "locate_trace", "module_table", "plan_summary", "render_plan_summary",
           "resimulate"]
