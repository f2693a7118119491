"""FSDP2's ``reshard_after_forward`` per unit, derived from a recorded trace (no torch).

A sharded trace (``record --fsdp N``) is recorded with every unit's ``reshard_after_forward``
fixed. A unit that reshards frees its gathered parameters when its forward ends and gathers
them again in backward (an all-gather, a copy-out into the same storages: a second row of each
storage, ``meta.fsdp.incarnations``). A unit that does not reshard keeps the forward's
gathering until its backward is done, and runs no backward all-gather at all.

:func:`reshard_view` turns the recorded step into the step with some resharding units set
to ``False``, exactly as FSDP2 would run it: the ops FSDP ran for those units' backward
unshard (the innermost ``meta.fsdp.op_spans`` of the unit in backward that allocate an
all-gather buffer or write its unsharded parameters) are removed, with the tensors only they
touched (the all-gather buffer); each unsharded parameter's backward row merges into its
forward row, which then lives until the backward row was freed; op and tensor ids are
renumbered in order, as a recording of that setting numbers them. ``tests/test_reshard.py``
holds the view equal, table by table, to a recording made with that setting.

The view's memory cost is the unit's unsharded bytes from the end of its forward to its
backward; its gain is the backward all-gather's time (the removed ops' duration, costed on the
profile's interconnect) and, for a planner, rebuild options: a rebuild may read a gathered
parameter while a row of it is live (:meth:`taichi_plan.problem.Problem.held`), and the kept
row is live through the whole gap.

Not derived: ``reshard_after_forward`` as an int (reshard to a smaller mesh after forward:
the backward all-gather then runs over that smaller group, from a buffer the trace never saw;
a recording with that setting would be needed), and a unit recorded *without* resharding
cannot be turned into one that reshards (its backward gathering was never recorded).
"""

from __future__ import annotations

import numpy as np

from .errors import PlanError
from .sharding import fsdp_meta, incarnations, innermost_spans

__all__ = ["choice_units", "describe", "problem_for_choice", "regather_ops", "reshard_problem", "reshard_units",
           "reshard_view", "unit_index", "view_of_choice"]


def reshard_units(meta: dict) -> list[int]:
    """Indices (in ``meta.fsdp.units``) of the units recorded resharding after forward whose
    backward gathering the trace holds: those a plan may set to ``False``."""
    f = fsdp_meta(meta)
    if f is None:
        return []
    return [k for k, u in enumerate(f.get("units", [])) if u.get("reshard_after_forward") is True]


def unit_index(meta: dict, module: str) -> int:
    f = fsdp_meta(meta) or {}
    for k, u in enumerate(f.get("units", [])):
        if u["module"] == module:
            return k
    raise PlanError(f"The plan sets reshard_after_forward for FSDP unit {module or '<root>'!r}, which its trace "
                    "does not have: the plan was made for another trace. Solve this trace again.")


def regather_ops(trace, units: set[int] | list[int]) -> np.ndarray:
    """Op ids of the backward gathering of each unit in ``units``: the ops of its innermost
    backward spans (``meta.fsdp.op_spans``) that allocate an all-gather buffer or write one
    of the unit's backward rows of an unsharded parameter (the all-gather itself, the copy-in,
    the views and copy-out)."""
    by_unit = _regather_by_unit(trace)
    parts = [by_unit[int(u)] for u in set(int(u) for u in units) if int(u) in by_unit]
    return np.sort(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)


def _regather_by_unit(trace) -> dict[int, np.ndarray]:
    """:func:`regather_ops` of every unit at once (cached on the trace)."""
    cached = trace.__dict__.get("_regather_by_unit")
    if cached is not None:
        return cached
    f = fsdp_meta(trace.meta) or {}
    spans = f.get("op_spans", [])
    n = len(trace.ops)
    inner = innermost_spans(spans, n)
    phase = trace.ops["phase"].to_numpy()
    tensors = trace.tensors
    kind = tensors["kind"].to_numpy()
    alloc = tensors["alloc_op"].to_numpy().astype(np.int64)
    second = np.asarray(sorted({int(rows[j]) for rows in incarnations(trace.meta) for j in range(1, len(rows))}),
                        dtype=np.int64)
    acc = trace.accesses
    w_op = acc["op_id"].to_numpy().astype(np.int64)[acc["role"].to_numpy() == "write"]
    w_t = acc["tensor_id"].to_numpy().astype(np.int64)[acc["role"].to_numpy() == "write"]
    gathers = alloc[(kind == "all_gather") & (alloc >= 0)]
    copies = w_op[np.isin(w_t, second)]
    marks = {int(k) for k in inner[np.concatenate([gathers, copies]).astype(np.int64)] if k >= 0}  # spans that gather
    out: dict[int, list[int]] = {}
    for k in sorted(marks):
        s, e, u = (int(x) for x in spans[k][:3])
        if phase[s] == "backward":
            out.setdefault(u, []).extend(i for i in range(s, e + 1) if inner[i] == k)
    result = {u: np.asarray(sorted(ops), dtype=np.int64) for u, ops in out.items()}
    trace._regather_by_unit = result
    return result


def reshard_view(trace, units: set[int] | list[int]):
    """The trace of the step with each unit in ``units`` (indices in ``meta.fsdp.units``, all
    recorded resharding) set to ``reshard_after_forward=False``; see the module docstring.
    ``view.recorded`` is ``trace``; ``view.kept_ops`` maps a view op id to the recorded one, ``view.position``
    a recorded op id to the view's."""
    from .trace import Trace

    units = sorted(set(int(u) for u in units))
    if not units:
        return trace
    allowed = set(reshard_units(trace.meta))
    f = fsdp_meta(trace.meta)
    bad = [u for u in units if u not in allowed]
    if bad:
        names = [f["units"][u]["module"] if f and 0 <= u < len(f["units"]) else str(u) for u in bad]
        raise PlanError(f"FSDP unit(s) {', '.join(repr(x or '<root>') for x in names)} cannot be set to not reshard "
                        "after forward on this trace: the trace has no such unit, or it was recorded not resharding "
                        "(its backward gathering was never recorded). Record with resharding and solve again.")
    ops, tensors, acc = trace.ops, trace.tensors, trace.accesses
    n = len(ops)
    drop_ops = regather_ops(trace, units)
    keep = np.ones(n, dtype=bool)
    keep[drop_ops] = False
    new_op = np.cumsum(keep) - 1  # recorded op id -> view op id (for kept ops)
    dropped = ~keep

    tid = tensors["tensor_id"].to_numpy().astype(np.int64)
    row_of = {int(t): i for i, t in enumerate(tid.tolist())}
    alloc = tensors["alloc_op"].to_numpy().astype(np.int64)
    free = tensors["free_op"].to_numpy().astype(np.int64)
    producer = tensors["producer_op"].to_numpy().astype(np.int64)
    # Backward rows of unsharded parameters gathered by the removed ops -> their forward row.
    merge: dict[int, int] = {}
    for rows in incarnations(trace.meta):
        for prev, nxt in zip(rows, rows[1:]):
            j = row_of.get(int(nxt))
            if j is not None and alloc[j] >= 0 and dropped[alloc[j]]:
                merge[int(nxt)] = merge.get(int(prev), int(prev))
    # Tensors the removed ops made (all-gather buffers): removed, and nothing else may use them.
    made = {int(t) for t, a in zip(tid.tolist(), alloc.tolist()) if a >= 0 and dropped[a]} - set(merge)
    a_op = acc["op_id"].to_numpy().astype(np.int64)
    a_t = acc["tensor_id"].to_numpy().astype(np.int64)
    outside = [int(t) for t, o in zip(a_t.tolist(), a_op.tolist()) if t in made and not dropped[o]]
    if outside:
        raise PlanError(f"Tensor {outside[0]} of the backward all-gather is used outside FSDP's gathering: this "
                        "trace's FSDP step is not one taichi-plan can re-derive without resharding.")

    t_keep = np.asarray([int(t) not in made and int(t) not in merge for t in tid.tolist()], dtype=bool)
    new_free = free.copy()
    for nxt, prev in merge.items():
        new_free[row_of[prev]] = free[row_of[nxt]]

    kept_ids = np.nonzero(keep)[0]

    def remap(op_ids: np.ndarray, later: bool) -> np.ndarray:
        """Recorded op ids -> view ids (-1 stays). ``later``: a removed op maps to the next
        kept op (a free that happened there happens at the next op that runs)."""
        out = np.asarray(op_ids, dtype=np.int64).copy()
        ok = out >= 0
        ids = out[ok]
        gone = ~keep[ids]
        if gone.any() and not later:
            raise AssertionError("a kept tensor is allocated by a removed op")
        res = new_op[ids]
        res[gone] = np.searchsorted(kept_ids, ids[gone])
        out[ok] = res
        return out

    kept_tid = tid[t_keep]
    new_tid = {int(t): k for k, t in enumerate(kept_tid.tolist())}
    for nxt, prev in merge.items():
        new_tid[nxt] = new_tid[prev]
    t2 = tensors[t_keep].copy()
    t2["tensor_id"] = np.arange(len(t2), dtype=np.int64)
    t2["alloc_op"] = remap(alloc[t_keep], later=False).astype(np.int32)
    t2["producer_op"] = remap(producer[t_keep], later=False).astype(np.int32)
    t2["free_op"] = remap(new_free[t_keep], later=True).astype(np.int32)
    t2 = t2.reset_index(drop=True)

    a_keep = keep[a_op]
    a2 = acc[a_keep].copy()
    a2["op_id"] = new_op[a_op[a_keep]].astype(np.int32)
    a2["tensor_id"] = np.asarray([new_tid[int(t)] for t in a_t[a_keep].tolist()], dtype=np.int64)
    a2 = a2.reset_index(drop=True)

    o2 = ops[keep].copy()
    o2["op_id"] = np.arange(len(o2), dtype=np.int32)
    o2 = o2.reset_index(drop=True)

    meta = _view_meta(trace.meta, units, keep, new_op, new_tid, merge, trace.ops["phase"].to_numpy())
    view = Trace(ops=o2, tensors=t2, accesses=a2, meta=meta, path=trace.path)
    view.recorded = trace
    view.kept_ops = kept_ids
    # recorded op id -> its position in the view (a removed op: the next op that runs), as
    # optimizer views have it (taichi_plan.solve.result.recorded_baseline)
    view.position = np.where(keep, new_op, np.searchsorted(kept_ids, np.arange(n)))
    return view


def _view_meta(meta: dict, units: list[int], keep: np.ndarray, new_op: np.ndarray, new_tid: dict[int, int],
               merge: dict[int, int], phase: np.ndarray | None = None) -> dict:
    import copy

    from .trace import remap_backward_nodes

    out = copy.deepcopy(meta)
    f = out["fsdp"]
    for u in units:
        f["units"][u]["reshard_after_forward"] = False
    spans = []
    for s, e, u, *rest in f.get("op_spans", []):
        kept = np.nonzero(keep[int(s):int(e) + 1])[0]
        if len(kept):
            spans.append([int(new_op[int(s) + kept[0]]), int(new_op[int(s) + kept[-1]]), int(u), *rest])
    f["op_spans"] = spans
    f["incarnations"] = [rows for rows in ([new_tid[int(t)] for t in rows if int(t) not in merge]
                                          for rows in f.get("incarnations", [])) if len(rows) > 1]
    f.pop("mem_tracker", None)  # FSDPMemTracker measured the recorded setting, not this one
    for c in out.get("model_calls") or []:
        for key in ("start", "end"):
            if c.get(key) is not None:
                c[key] = int(new_op[int(c[key])])
    if out.get("random_ops") is not None:  # trace v4: op ids (FSDP's gathering draws none)
        out["random_ops"] = [int(new_op[int(i)]) for i in out["random_ops"] if keep[int(i)]]
    if phase is not None:
        remap_backward_nodes(out, phase, np.nonzero(keep)[0])
    out.pop("python_refs", None)  # trace v4; never recorded for sharded traces (record --fsdp)
    out["num_ops"] = int(keep.sum())
    out["num_tensors"] = len(new_tid) - len(merge)
    out["reshard_view"] = {"units": [f["units"][u]["module"] for u in units]}
    return out


def choice_units(meta: dict, choice: dict[str, bool] | None) -> list[int]:
    """The units a setting (module -> ``reshard_after_forward``) turns off among those the
    trace recorded resharding; a unit set as recorded is no change."""
    f = fsdp_meta(meta) or {}
    recorded = {u["module"]: u["reshard_after_forward"] for u in f.get("units", [])}
    off = []
    for module, value in (choice or {}).items():
        k = unit_index(meta, module)
        if value == recorded.get(module):
            continue
        if value is not False:
            raise PlanError(f"The plan sets reshard_after_forward={value!r} for FSDP unit {module or '<root>'!r}, "
                            f"recorded with {recorded.get(module)!r}: only a unit recorded resharding can be set "
                            "not to. Record with resharding and solve again.")
        off.append(k)
    return sorted(off)


def view_of_choice(trace, choice: dict[str, bool] | None):
    """The trace for a setting (module -> ``reshard_after_forward``): the recorded trace with
    the units it turns off (:func:`choice_units`) not resharding."""
    return reshard_view(trace, choice_units(trace.meta, choice))


def reshard_problem(problem, units: set[int] | list[int]):
    """The problem of the step with ``units`` not resharding (:func:`reshard_view`), from the
    recorded step's ``problem``; cached on the recorded trace. The view's problem keeps the
    recorded one (``recorded_problem``) for the unplanned baseline, as optimizer views do."""
    from .problem import build_problem

    rec = getattr(problem, "recorded_problem", None) or problem
    key = tuple(sorted(set(int(u) for u in units)))
    if not key:
        return rec
    cache = rec.__dict__.setdefault("_reshard_problems", {})
    if key not in cache:
        view = reshard_view(rec.trace, key)
        prob = build_problem(view)
        prob.partition_random = rec.partition_random
        prob.recorded_problem = rec
        cache[key] = prob
    return cache[key]


def units_off(problem) -> list[int]:
    """Indices of the units a problem's view sets not to reshard (none for a recorded step)."""
    info = problem.trace.meta.get("reshard_view")
    if info is None:
        return []
    return [unit_index(problem.trace.meta, m) for m in info["units"]]


def regather_cost(problem, unit: int) -> float:
    """Seconds the recorded step spends gathering ``unit`` again in backward (its all-gather
    on the interconnect, copy-in and copy-out): what not resharding it saves."""
    rec = getattr(problem, "recorded_problem", None) or problem
    return float(rec.op_cost[regather_ops(rec.trace, [unit])].sum())


def held_bytes(problem, unit: int) -> tuple[int, int, int]:
    """(bytes, first op, last op) a unit that does not reshard holds longer: its unsharded
    parameters from the end of its forward to its backward gathering (recorded op ids)."""
    rec = getattr(problem, "recorded_problem", None) or problem
    gone = regather_ops(rec.trace, [unit])
    if not len(gone):
        return 0, -1, -1
    first = int(gone[0])
    index = rec._index
    size, lo = 0, first
    removed = set(gone.tolist())
    for rows in incarnations(rec.trace.meta):
        fwd, bwd = index.get(int(rows[0])), index.get(int(rows[1]))
        if fwd is None or bwd is None or int(rec.start[bwd]) not in removed:
            continue
        size += int(rec.nbytes[fwd])
        lo = min(lo, int(rec.end[fwd]) + 1)
    return size, lo, first


def describe(problem) -> dict | None:
    """``decisions.reshard_after_forward`` of a plan on ``problem`` (plan v5): per FSDP unit,
    its setting and, for each one changed, why; None for a trace that is not sharded."""
    f = fsdp_meta(problem.trace.meta)
    if f is None:
        return None
    from .units import format_bytes, format_cost

    rec = getattr(problem, "recorded_problem", None) or problem
    recorded = fsdp_meta(rec.trace.meta)["units"]
    off = set(units_off(problem))
    unit = problem.trace.cost_unit
    units = []
    for k, u in enumerate(f["units"]):
        entry = {"module": u["module"], "reshard_after_forward": u["reshard_after_forward"],
                 "recorded": recorded[k]["reshard_after_forward"]}
        if k in off:
            size, lo, hi = held_bytes(rec, k)
            entry["why"] = (f"keeps {format_bytes(size)} of gathered parameters from op {lo} to op {hi} "
                            f"(recorded op ids), which saves its backward all-gather and copy-out: "
                            f"{format_cost(regather_cost(rec, k), unit)}")
        units.append(entry)
    saved = rec.step_cost - problem.step_cost
    return {"units": units, "step_compute_saved": saved, "chosen_by": None}


def problem_for_choice(problem, choice: dict | None):
    """The problem a plan's ``decisions.reshard_after_forward`` describes, from the recorded
    step's ``problem`` (the recorded one when the plan changes no unit)."""
    if not choice:
        return problem
    rec = getattr(problem, "recorded_problem", None) or problem
    return reshard_problem(rec, choice_units(rec.trace.meta,
                                             {u["module"]: u["reshard_after_forward"] for u in choice["units"]}))
