"""The step with some FSDP units set to reshard to a smaller mesh after forward (an int
``reshard_after_forward``), derived from a recorded trace (no torch).

:func:`smaller_mesh_view` derives the step with some resharding units set to an int K
(reshard to a K-rank mesh after forward): FSDP2's post-forward ops inserted per parameter, the
backward copy-in reading those shards, the backward all-gather over the K-rank group, costed on
the trace's device profile. :func:`smaller_mesh_saving` gives what such a setting holds and
saves without building the view. Not derived: a smaller mesh on a trace whose op times were
measured rather than estimated (the inserted ops' times would be guesses).
"""

from __future__ import annotations

import numpy as np

from ...base.errors import PlanError
from ...trace.layout import fsdp_meta
from .units import (
    gathered_rows,
    regather_by_unit,
    regather_ops,
    reshard_units,
    shard_group_size,
    smaller_mesh_factors,
)

# Bytes per element of the dtypes FSDP gathers parameters in (trace dtype names).
_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "int8": 1, "uint8": 1}


# The ops FSDP2 runs per parameter when it reshards to a smaller mesh after forward
# (FSDPParam.to_sharded_post_forward): narrow the gathered parameter to this rank's part of the
# smaller mesh, clone it (the post-forward shard), view it as the shard's shape, wrap it.
POST_FORWARD_OPS = ("aten.slice.Tensor", "aten.clone.default", "aten.as_strided.default", "aten.detach.default")


def _calling_module(meta: dict, module: str) -> str:
    """The module the recorder files a unit's post-forward ops under: FSDP runs them in the
    unit's forward hook, after its forward returned, so under its innermost ancestor whose
    forward is running (a ``ModuleList`` is never called: ``transformer.h.0`` -> ``transformer``)."""
    called = set(meta.get("called_modules") or [])
    parts = module.split(".") if module else []
    for k in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:k])
        if not called or name in called:
            return name
    return ""


def smaller_mesh_view(trace, to: dict[int, int]):
    """The trace of the step with each unit in ``to`` (index in ``meta.fsdp.units`` -> K, all
    recorded resharding) set to ``reshard_after_forward=K``, as FSDP2 runs it: right after the
    unit's forward frees its gathered parameters, per parameter the four ops of
    :data:`POST_FORWARD_OPS` make its post-forward shard (kind ``post_forward_shard``, 1/K of
    the gathered bytes), each gathered parameter freed after its own; in backward the unit's
    copy-in reads those shards instead of the rank's parameter shards, its all-gather runs over
    the K-rank group (costed on the profile's link for K consecutive ranks), and the shards die
    at its copy-out. Op and tensor ids are renumbered as a recording numbers them
    (``tests/test_reshard_int.py`` holds the view equal to a recording made with that setting).
    ``view.position`` maps a recorded op id to the view's; ``view.recorded`` is ``trace``.

    The inserted ops are costed by the roofline of the trace's device profile (a fake trace's
    own estimates). Under a mixed-precision policy the backward copy-in fills a buffer of the
    gathered dtype the size of the shard it gathers from (1/group of the parameters, now 1/K):
    it is resized, and the ops that make and fill it re-costed. Refused: a trace without a
    device profile."""
    import copy

    import pandas as pd

    from ...trace.devices import get_profile
    from ...trace.format import Trace, renumber_tensors

    to = {int(u): int(k) for u, k in to.items()}
    if not to:
        return trace
    meta = trace.meta
    f = fsdp_meta(meta)
    units = f["units"] if f else []
    factors = smaller_mesh_factors(meta)
    allowed = set(reshard_units(meta))
    for u, k in sorted(to.items()):
        name = repr(units[u]["module"] or "<root>") if 0 <= u < len(units) else str(u)
        if u not in allowed:
            raise PlanError(f"FSDP unit {name} cannot be set to reshard to a smaller mesh on this trace: it has no "
                            "such unit, or it was not recorded resharding in full (its backward gathering, from "
                            "which the smaller mesh's is derived, was never recorded). Record with resharding.")
        if not units[u]["module"]:
            raise PlanError("The root FSDP unit cannot be set to reshard to a smaller mesh on a derived step: the "
                            "model's call returns around FSDP's post-forward ops there, and which of the step's "
                            "tensors it lets go of before them the trace does not say. Record it with its int "
                            "(`record_fsdp_workload(..., reshard_after_forward={'': K})`) instead.")
        if k not in factors:
            raise PlanError(f"FSDP unit {name} cannot reshard to {k} ranks: the shard group has "
                            f"{shard_group_size(meta)}, and an int reshard_after_forward must be one of its factors "
                            f"between 1 and itself ({', '.join(map(str, factors)) or 'none'}).")
    if not meta.get("device_profile"):
        raise PlanError("A smaller-mesh setting is costed on the trace's device profile, and this trace has none: "
                        "record it with --device-profile.")
    profile = get_profile(meta["device_profile"])

    ops, tensors, acc = trace.ops, trace.tensors, trace.accesses
    n = len(ops)
    tid = tensors["tensor_id"].to_numpy().astype(np.int64)
    row_of = {int(t): i for i, t in enumerate(tid.tolist())}
    alloc = tensors["alloc_op"].to_numpy().astype(np.int64)
    free = tensors["free_op"].to_numpy().astype(np.int64)
    nbytes = tensors["nbytes"].to_numpy().astype(np.int64)
    dtypes = tensors["dtype"].to_numpy()
    a_op = acc["op_id"].to_numpy().astype(np.int64)
    a_t = acc["tensor_id"].to_numpy().astype(np.int64)
    a_role = acc["role"].to_numpy()
    regather = regather_by_unit(trace)
    group = shard_group_size(meta)
    t_kind, _size, touched = _op_tables(trace)
    shard_reads = (a_role == "read") & np.asarray([t_kind[int(t)] == "parameter" for t in a_t.tolist()], dtype=bool)

    # Per unit: its gathered parameters' forward rows (in tensor order: FSDP's parameter order),
    # the op after which FSDP reshards them, and the op of its backward copy-out.
    after: dict[int, list[dict]] = {}   # recorded op X -> new ops to run right after it
    new_rows: list[dict] = []           # new tensor rows, their ops as ("new", j)
    new_acc: list[tuple] = []           # (("new", j), new row index, role, arg_index)
    fwd_free: dict[int, tuple] = {}     # recorded row -> ("new", j): freed at its own detach
    swap: dict[tuple[int, int], int] = {}  # (recorded op, recorded tensor id) -> new row index
    recost: dict[int, float] = {}       # recorded op -> its duration over the smaller group
    resized: dict[int, int] = {}        # recorded row -> its bytes (a mixed-precision copy-in buffer)
    spans_new: list[tuple[int, int, int]] = []  # (X, ops inserted, unit)
    new_ops: list[dict] = []
    for u, k in sorted(to.items()):
        gone = regather.get(u, np.zeros(0, dtype=np.int64))
        fwd = gathered_rows(trace, u)
        if not fwd or not len(gone):
            raise PlanError(f"FSDP unit {units[u]['module'] or '<root>'!r}: the trace holds no backward gathering "
                            "of its parameters, from which the smaller mesh's would be derived.")
        ends = {int(free[row_of[t]]) for t in fwd}
        if len(ends) != 1:
            raise PlanError(f"FSDP unit {units[u]['module'] or '<root>'!r}: its gathered parameters are not freed "
                            "together after forward; this trace's FSDP step cannot be re-derived.")
        x = ends.pop()
        copy_out = int(gone[-1])
        sel = shard_reads & np.isin(a_op, gone)  # its copy-in's reads of the rank's shards
        reads = list(zip(a_op[sel].tolist(), a_t[sel].tolist()))
        if len(reads) != len(fwd):
            raise PlanError(f"FSDP unit {units[u]['module'] or '<root>'!r}: its backward copy-in reads "
                            f"{len(reads)} parameter shards for {len(fwd)} gathered parameters; not derivable.")
        module = _calling_module(meta, units[u]["module"])
        step, phase = ops["step"].iat[x], ops["phase"].iat[x]
        block = []
        for p, t in enumerate(fwd):
            r = row_of[t]
            size = int(nbytes[r])
            item = _ITEMSIZE.get(str(dtypes[r]))
            shard_row = row_of[reads[p][1]]  # (in the parameters' own dtype: a policy gathers in another)
            shard_item = _ITEMSIZE.get(str(dtypes[shard_row]))
            if (item is None or shard_item is None or size % (k * item)
                    or int(nbytes[shard_row]) // shard_item * group != size // item):
                raise PlanError(f"FSDP unit {units[u]['module'] or '<root>'!r}: parameter {p} does not split "
                                f"evenly over {k} ranks in this trace; not derivable.")
            j0 = len(new_ops) + len(block)
            row = len(new_rows)
            new_rows.append({"nbytes": size // k, "dtype": str(dtypes[r]), "shape": [size // k // item],
                             "kind": "post_forward_shard", "op": ("new", j0 + 1), "free": ("old", copy_out)})
            for q, name in enumerate(POST_FORWARD_OPS):
                dur = _clone_s(profile, size // k, str(dtypes[r])) if q == 1 else 0.0
                block.append({"step": step, "phase": phase, "op": name, "module": module, "duration_s": dur})
            j = ("new", j0), ("new", j0 + 1), ("new", j0 + 2), ("new", j0 + 3)
            new_acc.extend([(j[0], ("old", r), "read", 0), (j[1], ("old", r), "read", 0),
                            (j[1], ("new", row), "write", 0), (j[2], ("new", row), "read", 0),
                            (j[3], ("new", row), "read", 0)])
            fwd_free[r] = j[3]
            swap[reads[p]] = row
        after.setdefault(x, []).append((len(new_ops), len(block), u))
        new_ops.extend(block)
        spans_new.append((x, len(block), u))
        recost.update(_gathers_over(trace, gone, k, profile))
        _resize_copy_in(trace, units[u]["module"], gone, k, profile, resized, recost,
                        {key: new_rows[j]["nbytes"] for key, j in swap.items()})

    # The new op order: each recorded op, then the post-forward ops inserted after it.
    order: list[tuple[str, int]] = []
    for i in range(n):
        order.append(("old", i))
        for j0, count, _u in after.get(i, []):
            order.extend(("new", j) for j in range(j0, j0 + count))
    where = {e: k for k, e in enumerate(order)}
    position = np.asarray([where[("old", i)] for i in range(n)], dtype=np.int64)

    def op_id(e) -> int:
        return where[e] if isinstance(e, tuple) else (int(position[e]) if e >= 0 else -1)

    # Tensors: the recorded rows (the gathered parameters' forward rows freed at their detach),
    # then the post-forward shards; ids in allocation order, as a recording numbers them.
    t_alloc = np.asarray([op_id(int(a)) for a in alloc] + [op_id(r["op"]) for r in new_rows], dtype=np.int64)
    t_prod = np.asarray([op_id(int(a)) for a in tensors["producer_op"].to_numpy()] + [op_id(r["op"]) for r in new_rows],
                        dtype=np.int64)
    moved = _after_hook(meta.get("module_args") or {}, units, spans_new, position)

    def freed(i: int, e: int) -> int:
        if i in fwd_free:
            return op_id(fwd_free[i])
        if e in moved and int(alloc[i]) < moved[e][0]:  # held by the unit's caller (_after_hook)
            return moved[e][1]
        return op_id(e)

    t_free = np.asarray([freed(i, int(e)) for i, e in enumerate(free.tolist())]
                        + [op_id(r["free"]) for r in new_rows], dtype=np.int64)
    extra = pd.DataFrame({"tensor_id": np.zeros(len(new_rows), dtype=np.int64),
                          "nbytes": [r["nbytes"] for r in new_rows], "dtype": [r["dtype"] for r in new_rows],
                          "shape": [r["shape"] for r in new_rows], "kind": [r["kind"] for r in new_rows],
                          "producer_op": 0, "alloc_op": 0, "free_op": 0})
    rows = tensors
    if resized:
        rows = tensors.copy()
        item = {r: int(nbytes[r]) // max(int(np.prod(rows["shape"].iat[r])), 1) for r in resized}
        rows["nbytes"] = [resized.get(r, int(b)) for r, b in enumerate(nbytes.tolist())]
        rows["shape"] = [[resized[r] // item[r]] if r in resized else s for r, s in enumerate(rows["shape"].tolist())]
    t2, rank = renumber_tensors(pd.concat([rows, extra[tensors.columns]], ignore_index=True), t_alloc, t_prod, t_free)
    new_tid = {int(t): int(rank[i]) for i, t in enumerate(tid.tolist())}
    n_old = len(tid)

    # Accesses: the recorded ones (the copy-in reading the post-forward shards), then the new ops'.
    a_ids = np.asarray([rank[n_old + swap[(o, t)]] if (o, t) in swap else new_tid[t]
                        for o, t in zip(a_op.tolist(), a_t.tolist())], dtype=np.int64)
    add = pd.DataFrame({"op_id": [where[o] for o, *_ in new_acc],
                        "tensor_id": [int(rank[n_old + t[1]]) if t[0] == "new" else new_tid[int(tid[t[1]])]
                                      for _o, t, *_ in new_acc],
                        "role": [r for *_, r, _i in new_acc], "arg_index": [i for *_, i in new_acc]})
    a1 = acc.copy()
    a1["op_id"] = position[a_op]
    a1["tensor_id"] = a_ids
    a2 = pd.concat([a1, add[acc.columns]], ignore_index=True)
    a2 = a2.iloc[np.argsort(a2["op_id"].to_numpy(), kind="stable")].reset_index(drop=True)
    for c in acc.columns:
        a2[c] = a2[c].astype(acc[c].dtype)

    # Ops: the recorded ones (the smaller group's all-gathers re-costed), the new ones in place.
    o1 = ops.copy()
    dur = o1["duration_s"].to_numpy().copy()
    for o, d in recost.items():
        dur[o] = d
    o1["duration_s"] = dur
    cost_source = ops["cost_source"].iat[0] if n else "estimated"
    o_new = pd.DataFrame([{**b, "op_id": 0, "flops": 0, "cost_source": cost_source, "recomputable": True,
                           "mutates": False} for b in new_ops])
    o2 = pd.concat([o1, o_new[ops.columns]], ignore_index=True)
    o2 = o2.iloc[np.argsort(np.concatenate([position, [where[("new", j)] for j in range(len(new_ops))]]),
                            kind="stable")].reset_index(drop=True)
    o2["op_id"] = np.arange(len(o2), dtype=np.int32)
    for c in ops.columns:
        o2[c] = o2[c].astype(ops[c].dtype)

    out = copy.deepcopy(meta)
    _remap_meta(out, position, len(order), new_tid, units, to, spans_new,
                [int(rank[n_old + i]) for i in range(len(new_rows))], dict(zip(tid.tolist(), alloc.tolist())))
    view = Trace(ops=o2, tensors=t2, accesses=a2, meta=out, path=trace.path)
    view.recorded = getattr(trace, "recorded", None) or trace
    base = getattr(trace, "position", None)
    view.position = position[base] if base is not None else position
    return view


def _resize_copy_in(trace, module: str, gone, k: int, profile, resized: dict[int, int], recost: dict[int, float],
                    shard_bytes: dict[tuple[int, int], int]) -> None:
    """Under a mixed-precision policy a unit's backward copy-in fills a buffer of the gathered
    dtype the size of the shard it gathers from: 1/group of the parameters, at K ranks 1/K. Adds
    each such buffer's new bytes to ``resized`` (row -> bytes) and re-costs, into ``recost``, the
    ops that make or fill it by the bytes they touch, as the recorder costs an op (checked on
    their recorded cost). ``shard_bytes``: (op, tensor id) -> bytes, the post-forward shards an op
    reads instead of the rank's shards. Nothing to do without a policy (no such buffer)."""
    from ...trace.roofline import estimate_duration_s

    tensors, ops = trace.tensors, trace.ops
    kind = tensors["kind"].to_numpy()
    nbytes = tensors["nbytes"].to_numpy().astype(np.int64)
    row_of = {int(t): i for i, t in enumerate(tensors["tensor_id"].tolist())}
    group = shard_group_size(trace.meta)
    buffers = np.nonzero(np.isin(tensors["alloc_op"].to_numpy(), gone) & (kind == "temporary"))[0].tolist()
    for r in buffers:
        if len(tensors["shape"].iat[r]) != 1 or (int(nbytes[r]) * group) % k:
            raise PlanError(f"FSDP unit {module or '<root>'!r}: its backward gathering makes a buffer taichi-plan "
                            "cannot resize to a smaller mesh; not derivable.")
        resized[r] = int(nbytes[r]) * group // k
    if not buffers:
        return
    _kind, _size, touched = _op_tables(trace)
    for o in np.asarray(gone, dtype=np.int64).tolist():
        ts = touched(o)
        if o in recost or ops["duration_s"].iat[o] == 0 or not any(
                row_of[t] in resized or (o, t) in shard_bytes for t in ts):
            continue
        if not np.isclose(estimate_duration_s(profile, 0, sum(int(nbytes[row_of[t]]) for t in ts)),
                          ops["duration_s"].iat[o], rtol=1e-9, atol=0):
            raise PlanError(f"FSDP unit {module or '<root>'!r}: op {o} of its backward gathering was not costed by "
                            "the bytes it touches; not derivable.")
        recost[o] = estimate_duration_s(profile, 0, sum(
            shard_bytes.get((o, t), resized.get(row_of[t], int(nbytes[row_of[t]]))) for t in ts))


def _clone_s(profile, nbytes: int, dtype: str) -> float:
    """A post-forward shard's clone on ``profile``, as a fake recording costs it (its slice
    read and its copy written)."""
    from ...trace.roofline import estimate_duration_s

    return estimate_duration_s(profile, 0, 2 * int(nbytes), {"float16": "fp16", "bfloat16": "bf16"}.get(dtype, "fp32"))


def _gathers_over(trace, ops_of_unit, k: int, profile) -> dict[int, float]:
    """The all-gathers among ``ops_of_unit`` (a unit's backward gathering), each costed over a
    group of ``k`` consecutive ranks (op id -> seconds)."""
    from ...trace.roofline import collective_duration_s, collective_kind

    ops = trace.ops
    kind, size, touched = _op_tables(trace)
    out = {}
    for o in np.asarray(ops_of_unit, dtype=np.int64).tolist():
        name = ops["op"].iat[o]
        if collective_kind(name) in ("allgather", "all_gather"):
            full = sum(int(size[x]) for x in touched(o) if kind[x] == "all_gather")
            out[o] = collective_duration_s(profile, name, full, k, k > profile.devices_per_node)
    return out


def _op_tables(trace):
    """(tensor id -> kind, tensor id -> bytes, op -> the set of tensor ids it touches), built
    once per trace (the screen asks for every unit; the table's rows may come in any order)."""
    cached = trace.__dict__.get("_op_tables")
    if cached is None:
        t, acc = trace.tensors, trace.accesses
        by_op = np.argsort(acc["op_id"].to_numpy(), kind="stable")
        a_op, a_t = acc["op_id"].to_numpy()[by_op], acc["tensor_id"].to_numpy()[by_op]

        def touched(o: int) -> set[int]:
            return set(a_t[np.searchsorted(a_op, o, "left"):np.searchsorted(a_op, o, "right")].tolist())

        cached = (dict(zip(t["tensor_id"].tolist(), t["kind"].tolist())),
                  dict(zip(t["tensor_id"].tolist(), t["nbytes"].tolist())), touched)
        trace._op_tables = cached
    return cached


def smaller_mesh_saving(problem, unit: int, k: int) -> tuple[int, float]:
    """(bytes of post-forward shards the unit would hold, seconds of the step it would save)
    resharding to ``k`` ranks instead of its whole shard group: its backward all-gathers over
    the smaller group, less the post-forward clones (the costs :func:`smaller_mesh_view`
    gives, without building the view)."""
    from ...trace.devices import get_profile

    rec = getattr(problem, "recorded_problem", None) or problem
    trace = rec.trace
    profile = get_profile(trace.meta["device_profile"])
    dtype = trace.tensors["dtype"].to_numpy()
    kept, saved = 0, 0.0
    for r in (rec._index[t] for t in gathered_rows(trace, unit)):
        kept += int(rec.nbytes[r]) // k
        saved -= _clone_s(profile, int(rec.nbytes[r]) // k, str(dtype[r]))
    gone = regather_ops(trace, [unit])
    saved += sum(float(rec.op_cost[o]) - d for o, d in _gathers_over(trace, gone, k, profile).items())
    return kept, saved


def _after_hook(module_args: dict, units: list, spans_new: list, position: np.ndarray) -> dict[int, tuple[int, int]]:
    """What is let go of right after a unit's last forward op (recorded op X) is let go of where
    its holder does: what the unit's call made, by its return, before FSDP's post-forward ops
    (its forward hook runs them); what existed before the call (its arguments, its callers'
    tensors), by the callers' code after the hook, after those ops. Per X: (the call's first
    op, recorded; the view's last post-forward op), for the units with a recorded call there."""
    out = {}
    for x, c, u in spans_new:
        starts = [int(e[0]) for e in (module_args.get(units[u]["module"]) or [])
                  if len(e) > 2 and e[2] is not None and int(e[2]) == int(x) + 1]
        if starts:
            out[int(x)] = (starts[0], int(position[x]) + c)
    return out


def _remap_meta(out: dict, position: np.ndarray, n_new: int, new_tid: dict[int, int], units: list, to: dict,
                spans_new: list, shard_ids: list[int], born: dict[int, int]) -> None:
    """``meta`` of :func:`smaller_mesh_view`, in place: every op and tensor id it holds mapped
    into the view (``position``: recorded op -> view op; ``new_tid``: recorded tensor id -> the
    view's), the units' setting, FSDP's spans of the new post-forward ops. ``born``: recorded
    tensor id -> its recorded alloc op."""
    import copy

    n = len(position)

    def op(i) -> int:
        i = int(i)
        return -1 if i < 0 else (n_new if i >= n else int(position[i]))

    f = out["fsdp"]
    for u, k in to.items():
        f["units"][u]["reshard_after_forward"] = k
    spans = [[op(s), op(e), int(un), *rest] for s, e, un, *rest in f.get("op_spans", [])]
    for x, count, u in sorted(spans_new):
        first = int(position[x]) + 1
        new = [first, first + count - 1, u]
        at = next((i for i, s in enumerate(spans) if s[1] > int(position[x])), len(spans))
        spans[at:at] = [list(new), list(new)]  # FSDP's reshard, inside its post_forward
    f["op_spans"] = spans
    f["incarnations"] = [[new_tid[int(t)] for t in rows] for rows in f.get("incarnations", [])]
    f.pop("mem_tracker", None)  # FSDPMemTracker measured the recorded setting
    for c in out.get("model_calls") or []:
        for key in ("start", "end"):
            if c.get(key) is not None:
                c[key] = op(c[key])
    if out.get("random_ops") is not None:
        out["random_ops"] = [op(i) for i in out["random_ops"]]
    if out.get("backward_nodes") is not None:
        out["backward_nodes"] = [op(i) for i in out["backward_nodes"]]
    # a unit's own call (and the calls inside it) ends before its post-forward ops, which its
    # forward hook runs after the call returned
    ends_at = {int(x) + 1: units[u]["module"] for x, _c, u in spans_new}
    meta_args = copy.deepcopy(out.get("module_args") or {})  # recorded ids, for python_refs below
    for name, entries in (out.get("module_args") or {}).items():
        for e in entries:
            e[0] = op(e[0])
            e[1] = [new_tid[int(t)] for t in e[1]]
            if len(e) > 2 and e[2] is not None:
                owner = ends_at.get(int(e[2]))
                inside = owner is not None and (name == owner or name.startswith(owner + ".") or owner == "")
                e[2] = op(int(e[2]) - 1) + 1 if inside else op(e[2])
    refs = out.get("python_refs")
    if isinstance(refs, dict) and refs.get("release") is not None:
        moved = _after_hook(meta_args, units, spans_new, position)

        def release(t: int, o: int) -> int:
            if o < 0:
                return o
            if o in moved and born.get(t, -1) < moved[o][0]:
                return moved[o][1]
            return op(o)

        rel = [[new_tid[int(t)], release(int(t), int(o))] for t, o in refs["release"]]
        rel += [[t, -1] for t in shard_ids]  # FSDP's state: the step's code never lets go of them
        refs["release"] = sorted(rel)
    ds = out.get("data_sized")
    if isinstance(ds, dict):
        ds["tensors"] = [new_tid[int(t)] for t in ds.get("tensors", [])]
        ds["ops"] = [op(i) for i in ds.get("ops", [])]
    out["num_ops"] = n_new
    out["num_tensors"] = len(new_tid) + len(shard_ids)
    view = out.setdefault("reshard_view", {"units": []})
    view["to"] = {units[u]["module"]: k for u, k in sorted(to.items())}
