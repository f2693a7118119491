"""The step with some FSDP units set not to reshard after forward, derived from a recorded
trace (no torch).

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
parameter while a row of it is live (:meth:`taichi_plan.problem.core.Problem.held`), and the kept
row is live through the whole gap.
"""

from __future__ import annotations

import numpy as np

from ...base.errors import PlanError
from ...trace.layout import fsdp_meta, incarnations
from .units import regather_ops, reshard_units


def reshard_view(trace, units: set[int] | list[int]):
    """The trace of the step with each unit in ``units`` (indices in ``meta.fsdp.units``, all
    recorded resharding) set to ``reshard_after_forward=False``; see the module docstring.
    ``view.recorded`` is ``trace``; ``view.kept_ops`` maps a view op id to the recorded one, ``view.position``
    a recorded op id to the view's."""
    from ...trace.format import Trace

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
    view.recorded = getattr(trace, "recorded", None) or trace
    view.kept_ops = kept_ids
    # recorded op id -> its position in the view (a removed op: the next op that runs), as
    # optimizer views have it (taichi_plan.solve.result.recorded_baseline)
    position = np.where(keep, new_op, np.searchsorted(kept_ids, np.arange(n)))
    base = getattr(trace, "position", None)  # a view of a smaller-mesh view: through both
    view.position = position[base] if base is not None else position
    return view


def _view_meta(meta: dict, units: list[int], keep: np.ndarray, new_op: np.ndarray, new_tid: dict[int, int],
               merge: dict[int, int], phase: np.ndarray | None = None) -> dict:
    import copy

    from ...trace.format import remap_backward_nodes

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
    out.setdefault("reshard_view", {})["units"] = [f["units"][u]["module"] for u in units]
    return out
