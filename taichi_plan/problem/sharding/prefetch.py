"""FSDP2's prefetching per unit, derived from a recorded trace (no torch).

Each time FSDP2 gathers a unit's parameters (its *gathering*: a param group's ``unshard``,
which allocates the all-gather buffer, copies the shard in and issues the all-gather), it
later copies the result out into the unsharded parameters (``wait_for_unshard``), in the
unit's pre-forward or pre-backward hook. Where the ``unshard`` runs is the prefetch setting:

- **own** (FSDP's default in forward): at the start of the unit's own pre-hook, right before
  its copy-out;
- **early**: at the end of the pre-hook of the unit gathered just before it in that pass, so
  that the all-gather runs during that unit's compute. In forward that is
  ``set_modules_to_forward_prefetch([unit])`` on the earlier unit (FSDP runs it after that
  unit's pre-forward); in backward it is FSDP's default (``pre_backward`` ends by gathering
  the unit that ran forward just before), which ``set_modules_to_backward_prefetch([itself])``
  on the earlier unit turns off (an empty list would mean the default).

An early gathering holds its all-gather buffer (the unit's unsharded bytes) from the end of the
earlier unit's pre-hook, over that unit's compute, to its own copy-out: the memory cost. Its
gain is time, and only in a model of overlap (:func:`overlapped_step_time`).

:func:`prefetch_view` turns a recorded step into the step with other gatherings early or own,
as FSDP2 runs it: each moved gathering's ops (the innermost ``meta.fsdp.op_spans`` span that
allocates an all-gather buffer) move as a block; the pre-hook spans that contain them change
accordingly; a tensor freed between two ops is freed, in the view, before the next op that did
not move (one the moved ops made or last read moves with them); op and tensor ids are
renumbered in order, as a recording of that setting numbers them; the moved ops take the module
of the hook they now run in. ``tests/test_reshard.py`` holds the view equal, table by table, to
fake-PG recordings made with that setting.

Only these two places are modelled: a gathering issued two or more units early (a longer
prefetch list), or early in backward where the recording has none (the default has none for the
first unit of backward), is not derived.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...base.errors import PlanError
from ...trace.layout import fsdp_meta, innermost_spans

__all__ = ["Gathering", "gatherings", "prefetch_view", "setting_of", "view_of_prefetch"]

PHASES = ("forward", "backward")


@dataclass(frozen=True)
class Gathering:
    """One gathering of a unit's parameters in the recorded step (recorded op ids)."""
    unit: int                # index in meta.fsdp.units
    phase: str               # forward | backward
    span: int                # index of its unshard span in meta.fsdp.op_spans
    start: int               # its ops: start..end
    end: int
    wait: int                # first op of the unit's copy-out (wait_for_unshard) span
    hook: int                # index of the unit's own pre-hook span (holding the copy-out)
    early: bool              # issued before its own pre-hook (prefetched)
    by: int | None           # the unit that issues it early: the unit gathered before it in this pass
    by_hook_end: int | None  # last op of that unit's pre-hook span


def gatherings(trace) -> list[Gathering]:
    """Every gathering of the recorded step, per pass in the order of their copy-outs
    (cached on the trace)."""
    cached = trace.__dict__.get("_gatherings")
    if cached is not None:
        return cached
    f = fsdp_meta(trace.meta)
    if f is None or not f.get("op_spans"):
        trace._gatherings = []
        return []
    spans = [[int(x) for x in s[:3]] for s in f.get("op_spans", [])]
    n = len(trace.ops)
    inner = innermost_spans(spans, n)
    phase = trace.ops["phase"].to_numpy()
    kind = trace.tensors["kind"].to_numpy()
    alloc = trace.tensors["alloc_op"].to_numpy().astype(np.int64)
    acc = trace.accesses
    write = acc["role"].to_numpy() == "write"
    w_op = acc["op_id"].to_numpy().astype(np.int64)[write]
    w_t = acc["tensor_id"].to_numpy().astype(np.int64)[write]
    unsharded = np.nonzero(kind == "unsharded_parameter")[0]
    tid = trace.tensors["tensor_id"].to_numpy().astype(np.int64)
    unshard = sorted({int(inner[a]) for a in alloc[(kind == "all_gather") & (alloc >= 0)] if inner[a] >= 0})
    waits = sorted({int(inner[o]) for o in w_op[np.isin(w_t, tid[unsharded])] if inner[o] >= 0},
                   key=lambda k: spans[k][0])
    out: list[Gathering] = []
    found = []
    for k in unshard:
        s, e, u = spans[k]
        w = next((j for j in waits if spans[j][2] == u and spans[j][0] > e), None)
        if w is None:
            continue  # a gathering never copied out in this step
        ws, we = spans[w][:2]
        hooks = [j for j in range(len(spans)) if j != w and spans[j][2] == u and spans[j][0] <= ws
                 and spans[j][1] >= we and phase[spans[j][0]] == phase[s]]
        hook = min(hooks, key=lambda j: spans[j][1] - spans[j][0], default=w)
        found.append((ws, u, str(phase[s]), k, s, e, hook))
    for ph in PHASES:
        rows = sorted(x for x in found if x[2] == ph)
        for j, (ws, u, _, k, s, e, hook) in enumerate(rows):
            early = s < spans[hook][0]
            prev = rows[j - 1] if j > 0 else None
            if early:  # issued by the unit whose pre-hook holds it (backward), or ran just before (forward)
                holders = [i for i in range(len(spans)) if spans[i][2] != u and spans[i][0] <= s <= e <= spans[i][1]]
                if holders:
                    h = max(holders, key=lambda i: spans[i][1] - spans[i][0])
                    by, by_end = spans[h][2], spans[h][1]
                else:
                    by, by_end = (prev[1], spans[prev[6]][1]) if prev else (None, None)
            else:
                by, by_end = (prev[1], spans[prev[6]][1]) if prev else (None, None)
            out.append(Gathering(unit=u, phase=ph, span=k, start=s, end=e, wait=ws, hook=hook, early=early, by=by,
                                 by_hook_end=by_end))
    trace._gatherings = out
    return out


def setting_of(trace) -> dict[str, set[int]]:
    """The recorded setting: per pass, the units whose gathering is early."""
    return {ph: {g.unit for g in gatherings(trace) if g.phase == ph and g.early} for ph in PHASES}


def movable(trace) -> dict[str, list[Gathering]]:
    """Per pass, the gatherings a plan may move: in forward any with a unit gathered before it
    (early = ``set_modules_to_forward_prefetch``), in backward those the recording issues
    early (FSDP's default, which a plan may turn off)."""
    out: dict[str, list[Gathering]] = {ph: [] for ph in PHASES}
    for g in gatherings(trace):
        if g.phase == "forward" and g.by is not None:
            out["forward"].append(g)
        elif g.phase == "backward" and g.early:
            out["backward"].append(g)
    return out


def prefetch_view(trace, early: dict[str, set[int] | list[int]]):
    """The trace of the step with, per pass, exactly the units in ``early[pass]`` gathered early
    (a pass not given stays as recorded); see the module docstring. ``view.recorded`` is
    ``trace``'s recorded trace, ``view.position`` maps a recorded op id to the view's."""
    from ...trace.format import Trace, renumber_tensors

    recorded = setting_of(trace)
    want = {ph: set(int(u) for u in early.get(ph, recorded[ph])) for ph in PHASES}
    moves = [g for g in gatherings(trace) if (g.unit in want[g.phase]) != g.early]
    if not moves:
        return trace
    ok = {(g.phase, g.unit) for ph, gs in movable(trace).items() for g in gs}
    units = (fsdp_meta(trace.meta) or {}).get("units", [])
    for g in moves:
        if (g.phase, g.unit) not in ok or (g.phase == "backward" and not g.early):
            name = units[g.unit]["module"] if g.unit < len(units) else str(g.unit)
            raise PlanError(f"FSDP unit {name or '<root>'!r} cannot have its {g.phase} all-gather "
                            f"{'issued early' if not g.early else 'issued by itself'} on this trace: taichi-plan "
                            "derives a gathering prefetched by the unit gathered just before it (forward) or FSDP's "
                            "default backward prefetch turned off, nothing else. Solve this trace again.")
    ops, tensors, acc = trace.ops, trace.tensors, trace.accesses
    n = len(ops)
    spans = [list(s) for s in (fsdp_meta(trace.meta) or {}).get("op_spans", [])]
    moved = np.zeros(n, dtype=bool)
    for g in moves:
        moved[g.start:g.end + 1] = True
    # The new op order: every op that does not move, with each moved block inserted at its place.
    after: dict[int, list[int]] = {}   # recorded op -> blocks to run right after it
    before: dict[int, list[int]] = {}  # recorded op -> blocks to run right before it
    members = [set(range(int(s[0]), int(s[1]) + 1)) for s in spans]
    for g in moves:
        block = list(range(g.start, g.end + 1))
        holders = [i for i, m in enumerate(members) if i != g.span and g.start in m and g.end in m
                   and not (int(spans[i][0]) >= g.start and int(spans[i][1]) <= g.end)]
        for i in holders:  # the hook that issued it no longer holds it
            members[i] -= set(block)
        if g.early:  # -> its own pre-hook, right before its copy-out
            before.setdefault(g.wait, []).extend(block)
            members[g.hook] |= set(block)
        else:        # -> right after the earlier unit's pre-hook (forward: outside any FSDP method)
            after.setdefault(int(g.by_hook_end), []).extend(block)
    order: list[int] = []
    for i in range(n):
        if moved[i]:
            continue
        order.extend(before.get(i, []))
        order.append(i)
        order.extend(after.get(i, []))
    if len(order) != n:
        raise AssertionError("a moved gathering lost its place")
    order_a = np.asarray(order, dtype=np.int64)
    pos = np.empty(n, dtype=np.int64)
    pos[order_a] = np.arange(n)

    # Tensors: allocations follow their op; a free between two ops happens before the next op
    # that did not move, unless the freed tensor was made or last read by the moved op before it.
    tid = tensors["tensor_id"].to_numpy().astype(np.int64)
    alloc = tensors["alloc_op"].to_numpy().astype(np.int64)
    free = tensors["free_op"].to_numpy().astype(np.int64)
    producer = tensors["producer_op"].to_numpy().astype(np.int64)
    a_op = acc["op_id"].to_numpy().astype(np.int64)
    a_t = acc["tensor_id"].to_numpy().astype(np.int64)
    row_of = np.full(int(tid.max()) + 1 if len(tid) else 0, -1, dtype=np.int64)
    row_of[tid] = np.arange(len(tid))
    last = np.full(len(tid), -1, dtype=np.int64)
    np.maximum.at(last, row_of[a_t], a_op)
    next_kept = np.full(n + 1, n, dtype=np.int64)  # first op at or after i that did not move
    for i in range(n - 1, -1, -1):
        next_kept[i] = i if not moved[i] else next_kept[i + 1]
    new_free = free.copy()
    for j in np.nonzero((free >= 0) & moved[np.clip(free, 0, n - 1)])[0]:
        x = int(free[j])
        if (alloc[j] >= 0 and moved[alloc[j]]) or last[j] == x:
            new_free[j] = -2 - pos[x]  # stays with the moved op (decoded below)
        else:
            y = int(next_kept[x + 1])
            new_free[j] = -2 - ((pos[y] - 1) if y < n else n - 1)

    def remap(ids: np.ndarray) -> np.ndarray:
        out = ids.copy()
        ok = out >= 0
        out[ok] = pos[out[ok]]
        low = out <= -2
        out[low] = -2 - out[low]
        return out

    t2, new_tid = renumber_tensors(tensors, remap(alloc), remap(producer), remap(new_free))  # ids in allocation order

    a_new = pos[a_op]
    a_order = np.argsort(a_new, kind="stable")
    a2 = acc.iloc[a_order].copy()
    a2["op_id"] = a_new[a_order].astype(np.int32)
    a2["tensor_id"] = new_tid[row_of[a_t[a_order]]]
    a2 = a2.reset_index(drop=True)

    o2 = ops.iloc[order_a].copy()
    module = o2["module"].to_numpy().copy()
    for g in moves:  # the moved ops run in the hook they now run in
        anchor = g.wait if g.early else int(g.by_hook_end)
        module[pos[g.start]:pos[g.end] + 1] = ops["module"].iat[anchor]
    o2["module"] = module
    o2["op_id"] = np.arange(n, dtype=np.int32)
    o2 = o2.reset_index(drop=True)

    early_forward = [g for g in gatherings(trace) if g.phase == "forward" and g.early]
    meta = _view_meta(trace.meta, spans, members, pos, new_tid, row_of, want, moves, early_forward,
                      trace.ops["phase"].to_numpy())
    view = Trace(ops=o2, tensors=t2, accesses=a2, meta=meta, path=trace.path)
    base_pos = getattr(trace, "position", None)
    view.recorded = getattr(trace, "recorded", None) or trace
    view.position = pos[base_pos] if base_pos is not None else pos
    view.kept_ops = (trace.kept_ops[order_a] if getattr(trace, "kept_ops", None) is not None else order_a)
    return view


def _view_meta(meta: dict, spans: list, members: list[set[int]], pos: np.ndarray, new_tid: np.ndarray,
               row_of: np.ndarray, want: dict[str, set[int]], moves: list[Gathering],
               early_forward: list[Gathering], phase: np.ndarray | None = None) -> dict:
    import copy

    from ...trace.format import remap_backward_nodes

    out = copy.deepcopy(meta)
    f = out["fsdp"]
    new_spans = []
    for s, m in zip(spans, members, strict=True):
        p = sorted(int(pos[i]) for i in m)
        if p and p[-1] - p[0] + 1 != len(p):
            raise AssertionError(f"FSDP span {s} is not contiguous in the prefetch view")
        if p:
            new_spans.append([p[0], p[-1], *s[2:]])
    f["op_spans"] = sorted(new_spans, key=lambda s: (s[1], -s[0]))  # in the order their methods returned
    f["incarnations"] = [[int(new_tid[row_of[int(t)]]) for t in rows] for rows in f.get("incarnations", [])]
    f.pop("mem_tracker", None)  # FSDPMemTracker measured the recorded setting, not this one
    for c in out.get("model_calls") or []:
        for key in ("start", "end"):
            if c.get(key) is not None:
                c[key] = int(pos[int(c[key])])
    if out.get("random_ops") is not None:
        out["random_ops"] = sorted(int(pos[int(i)]) for i in out["random_ops"])
    if phase is not None:
        remap_backward_nodes(out, phase, np.argsort(pos, kind="stable"))
    names = [u["module"] for u in f.get("units", [])]
    out["prefetch_view"] = {ph: [names[u] for u in sorted(want[ph])] for ph in PHASES}
    out["prefetch_view"]["units"] = unit_settings(meta, moves, names, early_forward)
    return out


def unit_settings(meta: dict, moves: list[Gathering], names: list[str],
                  recorded_early_forward: list[Gathering]) -> dict[str, dict]:
    """FSDP2's settings that run the view (:func:`taichi_plan.torch_common.fsdp.set_prefetch`): per
    unit that differs from FSDP's default, ``{"forward": [module, ...], "backward": [] | None}``
    (None: the default backward prefetch), from the base trace's own settings and ``moves``."""
    base = (meta.get("prefetch_view") or {}).get("units")
    out = {m: {"forward": list(v["forward"]), "backward": v["backward"]} for m, v in (base or {}).items()}
    if base is None:  # a recording: its forward prefetching shows in where its gatherings ran
        for g in recorded_early_forward:
            out.setdefault(names[g.by], {"forward": [], "backward": None})["forward"].append(names[g.unit])

    def entry(unit: int) -> dict:
        return out.setdefault(names[unit], {"forward": [], "backward": None})

    for g in moves:
        if g.phase == "forward" and not g.early:
            entry(g.by)["forward"].append(names[g.unit])
        elif g.phase == "forward":
            e = entry(g.by)
            e["forward"] = [m for m in e["forward"] if m != names[g.unit]]
        elif g.early:  # backward, turned off: the unit whose pre-backward issued it no longer does
            entry(g.by)["backward"] = []
    return {m: v for m, v in sorted(out.items()) if v["forward"] or v["backward"] is not None}


def view_of_prefetch(trace, choice: dict | None):
    """The trace for a plan's prefetch setting (``{"forward": [module, ...], "backward":
    [module, ...]}``: the units gathered early in each pass)."""
    if not choice:
        return trace
    f = fsdp_meta(trace.meta) or {}
    index = {u["module"]: k for k, u in enumerate(f.get("units", []))}
    early = {}
    for ph in PHASES:
        if ph not in choice:
            continue
        missing = [m for m in choice[ph] if m not in index]
        if missing:
            raise PlanError(f"The plan prefetches FSDP unit {missing[0] or '<root>'!r}, which its trace does not "
                            "have: the plan was made for another trace. Solve this trace again.")
        early[ph] = {index[m] for m in choice[ph]}
    return prefetch_view(trace, early)


def prefetch_problem(problem, early: dict[str, set[int]]):
    """The problem of the step with ``early`` gatherings per pass (:func:`prefetch_view` of
    ``problem``'s trace, which may be a reshard view); cached on the recorded problem. Its
    ``recorded_problem`` is the recorded step's, for the unplanned baseline."""
    from ..core import build_problem

    rec = getattr(problem, "recorded_problem", None) or problem
    info = problem.trace.meta.get("reshard_view") or {}
    key = (tuple(sorted(info.get("units", []))), tuple(sorted((info.get("to") or {}).items())),
           tuple(tuple(sorted(int(u) for u in early.get(ph, ()))) if ph in early else None for ph in PHASES))
    cache = rec.__dict__.setdefault("_prefetch_problems", {})
    if key not in cache:
        view = prefetch_view(problem.trace, early)
        if view is problem.trace:
            cache[key] = problem
        else:
            prob = build_problem(view)
            prob.partition_random = rec.partition_random
            prob.recorded_problem = rec
            cache[key] = prob
    return cache[key]


def problem_for_prefetch(problem, choice: dict | None):
    """The problem a plan's ``decisions.fsdp_prefetch`` describes, from the problem of its
    reshard setting (``problem`` itself when the plan keeps the recorded prefetching)."""
    if not choice or choice.get("units") is None:
        return problem
    return problem_for_early(problem, {ph: choice.get(ph, []) for ph in PHASES})


def problem_for_early(problem, choice: dict[str, list[str]]):
    f = fsdp_meta(problem.trace.meta) or {}
    index = {u["module"]: k for k, u in enumerate(f.get("units", []))}
    missing = [m for ph in PHASES for m in choice.get(ph, []) if m not in index]
    if missing:
        raise PlanError(f"The plan prefetches FSDP unit {missing[0] or '<root>'!r}, which its trace does not "
                        "have: the plan was made for another trace. Solve this trace again.")
    return prefetch_problem(problem, {ph: {index[m] for m in choice.get(ph, [])} for ph in PHASES})


def describe(problem) -> dict | None:
    """``decisions.fsdp_prefetch`` of a plan on ``problem`` (plan v6): the units whose
    all-gather is issued early in each pass, the FSDP2 settings per unit that run it so
    (``units``; those at FSDP's default are left out), and the step's time in the overlap
    model (:func:`taichi_plan.problem.sharding.overlap.overlapped_step_time`) beside the recorded setting's;
    None for a trace that is not FSDP-sharded."""
    from .overlap import overlapped_step_time

    f = fsdp_meta(problem.trace.meta)
    if f is None:
        return None
    names = [u["module"] for u in f["units"]]
    pv = problem.trace.meta.get("prefetch_view")
    if pv is None:
        setting = setting_of(problem.trace)
        early = {ph: [names[u] for u in sorted(setting[ph])] for ph in PHASES}
        units = unit_settings(problem.trace.meta, [], names,
                              [g for g in gatherings(problem.trace) if g.phase == "forward" and g.early])
    else:
        early = {ph: list(pv[ph]) for ph in PHASES}
        units = pv["units"]
    rec = getattr(problem, "recorded_problem", None) or problem
    return {**early, "units": [{"module": m, "forward_prefetch": v["forward"], "backward_prefetch": v["backward"]}
                               for m, v in units.items()],
            "overlap": overlapped_step_time(problem).to_json(),
            "recorded_overlap": overlapped_step_time(rec).to_json(), "chosen_by": None}
