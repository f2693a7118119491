"""Stepping a ``foreach`` optimizer in groups of parameters (no torch).

A ``foreach`` step (PyTorch's default on GPU) runs each update as one op over every
parameter: ``_foreach_sqrt(exp_avg_sqs)`` makes a temporary per parameter, all alive at once.
Stepped over groups of parameters, one after the other, only a group's temporaries are. The
view of the step in ``k`` groups (:func:`groups_view`) splits every ``foreach`` op of the step
into one op per group, holding that group's elements; ops of one parameter (AdamW's
``_local_scalar_dense`` of its ``step``) go with their parameter; ops that touch no
parameter's tensors (``lift_fresh`` of the scalar ``1`` added to every ``step``) run once per
group, on their own copy (copies have tensor ids from :data:`COPY_ID_BASE` down). A tensor
made and freed in the step is made in its group's run and freed at the same point of it.

Elements: a ``foreach`` op's accesses are its flattened list arguments, each list as long as
the number of storages it writes (in place, the first list; else its outputs), so element
``e`` of the op is at argument positions ``e, e + n, e + 2n, ...``; positions past the last
whole list are shared (a scalar tensor). Tensors of one element across ops form one
parameter's share; a share holding two parameters is refused.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from ...plan.check import COPY_ID_BASE


class Components:
    """Union-find over tensor ids: which storages belong together."""

    def __init__(self):
        self.parent: dict[int, int] = {}

    def find(self, x: int) -> int:
        parent = self.parent
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, ts: list[int]) -> None:
        for t in ts[1:]:
            self.parent[self.find(t)] = self.find(ts[0])


@dataclass
class ForeachStep:
    params: list[int]  # parameter tensor ids, in the step's order (elements of its foreach ops)
    unit_of: dict[int, int]  # tensor id -> index into params (its parameter's share)
    ops: list[int]  # the optimizer-phase op ids
    shared_made: set[int]  # tensors made in the step that belong to no parameter


def foreach_step(trace) -> ForeachStep | str:
    """The optimizer step's parameter shares, or a sentence saying why it has none."""
    ops, acc, tensors = trace.ops, trace.accesses, trace.tensors
    phase = ops["phase"].to_numpy()
    opt = np.nonzero(phase == "optimizer")[0].tolist()
    if not opt:
        return "the trace has no optimizer step"
    names = ops["op"].tolist()
    kind = dict(zip(tensors["tensor_id"].tolist(), tensors["kind"].tolist(), strict=True))
    producer = dict(zip(tensors["tensor_id"].tolist(), tensors["producer_op"].tolist(), strict=True))
    sub = acc[np.isin(acc["op_id"].to_numpy(), opt)]
    by_op: dict[int, list[tuple[int, str, int]]] = {}
    for o, t, r, i in zip(sub["op_id"].tolist(), sub["tensor_id"].tolist(), sub["role"].tolist(),
                          sub["arg_index"].tolist(), strict=True):
        by_op.setdefault(o, []).append((t, r, i))
    sets = Components()
    parent, find, union = sets.parent, sets.find, sets.union
    order: list[int] = []  # parameters by first access
    lists: dict[int, list[int]] = {}  # foreach op -> one tensor of each element, in element order
    for o in opt:
        entries = by_op.get(o, [])
        for t, _r, _i in entries:
            find(t)
            if kind[t] == "parameter" and t not in order:
                order.append(t)
        elements = element_map(names[o], entries, producer, o)
        if elements is None:
            union([t for t, _r, _i in entries])
            continue
        per: dict[int, list[int]] = {}
        for t, e in elements.items():
            if e >= 0:
                per.setdefault(e, []).append(t)
        for ts in per.values():
            union(ts)
        if per and sorted(per) == list(range(len(per))):
            lists[o] = [per[e][0] for e in range(len(per))]
    _tie_by_position(lists, sets, {t for t in parent if kind[t] == "parameter"})
    share: dict[int, int] = {}
    for t in list(parent):
        root = find(t)
        if kind[t] == "parameter":
            if root in share:
                return "one op of its optimizer step updates two parameters together (not a foreach op)"
            share[root] = order.index(t)
    unit_of = {t: share[find(t)] for t in parent if find(t) in share}
    alloc = dict(zip(tensors["tensor_id"].tolist(), tensors["alloc_op"].tolist(), strict=True))
    made = {t for t in parent if t not in unit_of and alloc[t] in set(opt)}
    return ForeachStep(order, unit_of, opt, made)


def _tie_by_position(lists: dict[int, list[int]], sets: Components, params: set[int]) -> None:
    """Tie the elements of a ``foreach`` op that touches no parameter's tensors (AdamW's
    ``_foreach_add_(state_steps, 1)``: the ``step`` counts) to the parameters, element by
    element, through the nearest ``foreach`` op of the same length whose elements each hold a
    different parameter's tensors (the next, else the previous). PyTorch's ``_multi_tensor_*``
    steps pass every list of one device and dtype group in the same order, so element ``e``
    of one op and element ``e`` of the next belong to the same parameter. Without this the
    counts were shared by every group of a view, which then re-ran their ops once per group."""
    roots = {sets.find(p) for p in params}

    def tied(ts: list[int]) -> bool:
        rs = [sets.find(t) for t in ts]
        return all(r in roots for r in rs) and len(set(rs)) == len(rs)

    ops = sorted(lists)
    good = [o for o in ops if tied(lists[o])]
    for o in ops:
        ts = lists[o]
        if any(sets.find(t) in roots for t in ts):
            continue
        same = [g for g in good if len(lists[g]) == len(ts)]
        after = [g for g in same if g > o]
        ref = after[0] if after else (same[-1] if same else None)
        if ref is not None:
            for t, u in zip(ts, lists[ref], strict=True):
                sets.union([u, t])


def element_map(name: str, entries: list[tuple[int, str, int]], producer: dict, op: int) -> dict[int, int] | None:
    """Tensor id -> element of a ``foreach`` op (-1: shared by all elements); None for an op
    that is not a ``foreach`` op."""
    if "._foreach_" not in name:
        return None
    writes = [i for _t, r, i in entries if r == "write"]
    if not writes:
        return None
    n = max(writes) + 1
    reads = [i for _t, r, i in entries if r == "read"]
    whole = (max(reads) + 1) // n * n if reads else 0
    out: dict[int, int] = {}
    for t, r, i in entries:
        if r == "write" and producer.get(t) == op:
            out[t] = i  # an output: position j among the outputs
        else:
            out.setdefault(t, i % n if i < whole else -1)
    return out


def balanced_groups(trace, step: ForeachStep, k: int) -> list[list[int]]:
    """``k`` contiguous runs of the step's parameter order, of about equal bytes."""
    nbytes = dict(zip(trace.tensors["tensor_id"].tolist(), trace.tensors["nbytes"].tolist(), strict=True))
    sizes = [int(nbytes[p]) for p in step.params]
    k = max(1, min(k, len(sizes)))
    total = sum(sizes)
    groups: list[list[int]] = [[]]
    acc = 0
    for i, s in enumerate(sizes):
        left = len(sizes) - i
        if groups[-1] and (acc >= total * len(groups) / k or left <= k - len(groups)) and len(groups) < k:
            groups.append([])
        groups[-1].append(i)
        acc += s
    return groups


def groups_view(trace, step: ForeachStep, groups: list[list[int]]):
    """The trace of the step run over ``groups`` (lists of indices into ``step.params``).

    Built from row indices (no per-op table work): a per-parameter view of a large step has
    tens of thousands of ops. Checks the current deadline (:mod:`taichi_plan.base.deadline`)
    once per group."""
    import pandas as pd

    from ...base.deadline import check
    from ...trace.format import Trace, remap_backward_nodes

    ops, acc, tensors = trace.ops, trace.accesses, trace.tensors
    names = ops["op"].tolist()
    group_of = {u: g for g, us in enumerate(groups) for u in us}
    opt = step.ops
    first, last = opt[0], opt[-1]
    in_opt = np.isin(acc["op_id"].to_numpy(), opt)
    sub = acc[in_opt].reset_index(drop=True)
    nbytes = dict(zip(tensors["tensor_id"].tolist(), tensors["nbytes"].tolist(), strict=True))
    unit_of = step.unit_of
    # Per op: its rows of no parameter (kept in every group), its rows per parameter share,
    # and the bytes of each share (an op's work splits by them).
    shared_rows: dict[int, list[int]] = {}
    unit_rows: dict[int, dict[int, list[int]]] = {}
    unit_bytes: dict[int, dict[int, int]] = {}
    sub_tids = sub["tensor_id"].tolist()
    for r, (o, t) in enumerate(zip(sub["op_id"].tolist(), sub_tids, strict=True)):
        u = unit_of.get(t)
        if u is None:
            shared_rows.setdefault(o, []).append(r)
        else:
            unit_rows.setdefault(o, {}).setdefault(u, []).append(r)
            ub = unit_bytes.setdefault(o, {})
            ub[u] = ub.get(u, 0) + int(nbytes[t])
    emitted: list[tuple[int, int]] = []  # (original op, group) in view order
    share: list[float] = []  # per emitted op, the share of its original op's work it does
    keep_rows: list[list[int]] = []
    keep_pos: list[int] = []
    copies: dict[tuple[int, int], int] = {}  # (shared tensor, group) -> its copy's id
    for g, us in enumerate(groups):
        check("stepping the optimizer in groups (its view of the step)")
        uset = set(us)
        for o in opt:
            by_unit = unit_rows.get(o, {})
            mine = [u for u in us if u in by_unit] if len(us) < len(by_unit) else [u for u in by_unit if u in uset]
            if by_unit and not mine:
                continue  # another group's op, or a foreach op with no element here
            if len(mine) < len(by_unit) and "._foreach_" not in names[o]:
                return None
            pos = len(emitted)
            emitted.append((o, g))
            total = sum(unit_bytes.get(o, {}).values())
            share.append(sum(unit_bytes[o][u] for u in mine) / total if total else 1.0)
            rows = shared_rows.get(o, []) + [r for u in mine for r in by_unit[u]]
            if rows:
                rows.sort()
                keep_rows.append(rows)
                keep_pos.append(pos)
    rows_acc = []
    if keep_rows:
        flat = np.fromiter((r for rows in keep_rows for r in rows), dtype=np.int64)
        sel = sub.iloc[flat].copy()
        new_ids = []
        for rows, pos in zip(keep_rows, keep_pos, strict=True):
            g = emitted[pos][1]
            for r in rows:
                t = sub_tids[r]
                if t in step.shared_made:
                    t = copies.setdefault((t, g), COPY_ID_BASE - len(copies))
                new_ids.append(t)
        sel["tensor_id"] = new_ids
        sel["op_id"] = np.repeat(np.asarray(keep_pos, dtype=np.int64) + first, [len(r) for r in keep_rows])
        rows_acc.append(sel)
    n_old = len(ops)
    grown = len(emitted) - len(opt)
    new_pos = np.arange(n_old, dtype=np.int64)
    new_pos[last + 1:] += grown
    for pos, (o, _g) in reversed(list(enumerate(emitted))):
        new_pos[o] = first + pos  # a split op: its first group's part
    # op rows
    head, tail = ops.iloc[:first], ops.iloc[last + 1:]
    mid = ops.iloc[[o for o, _g in emitted]].copy()
    share_arr = np.asarray(share, dtype=np.float64)
    mid["duration_s"] = mid["duration_s"].to_numpy() * share_arr
    mid["flops"] = (mid["flops"].to_numpy() * share_arr).astype(np.int64)
    new_ops = pd.concat([head, mid, tail], ignore_index=True)
    new_ops["op_id"] = np.arange(len(new_ops), dtype=np.int32)
    other = acc[~in_opt].copy()
    other["op_id"] = new_pos[other["op_id"].to_numpy()]
    new_acc = pd.concat([other, *rows_acc], ignore_index=True).sort_values("op_id", kind="stable")
    new_acc["op_id"] = new_acc["op_id"].astype(np.int32)
    new_acc = new_acc.reset_index(drop=True)

    # Where each group's run sits: per group, its original ops and their view positions, in
    # order (both increase along a run); over all groups, per original op, the first and the
    # last view position of a part of it at or after / at or before it.
    runs: dict[int, tuple[list[int], list[int]]] = {}
    span = last - first + 1
    min_pos = np.full(span, np.iinfo(np.int64).max, dtype=np.int64)
    max_pos = np.full(span, -1, dtype=np.int64)
    for pos, (o, g) in enumerate(emitted):
        run = runs.setdefault(g, ([], []))
        run[0].append(o)
        run[1].append(first + pos)
        min_pos[o - first] = min(min_pos[o - first], first + pos)
        max_pos[o - first] = max(max_pos[o - first], first + pos)
    after_any = np.minimum.accumulate(min_pos[::-1])[::-1]  # first position of an op >= o
    before_any = np.maximum.accumulate(max_pos)  # last position of an op <= o

    def remap(g, col, v):
        if v < 0:
            return -1
        if v < first:
            return v
        if v > last:
            return int(new_pos[v])
        if g is None:
            p = int(before_any[v - first]) if col == "free_op" else int(after_any[v - first])
            p = None if p < 0 or p == np.iinfo(np.int64).max else p
        else:
            os_, ps = runs.get(g, ([], []))
            if col == "free_op":
                i = bisect.bisect_right(os_, v) - 1
                p = ps[i] if i >= 0 else None
            else:
                i = bisect.bisect_left(os_, v)
                p = ps[i] if i < len(ps) else None
        return p if p is not None else (first if col != "free_op" else first + len(emitted) - 1)

    rows = []
    for row in tensors.itertuples(index=False):
        t = int(row.tensor_id)
        targets = [(t, group_of[step.unit_of[t]])] if t in step.unit_of else \
            [(copies[(t, g)], g) for g in range(len(groups)) if (t, g) in copies] if t in step.shared_made else \
            [(t, None)]
        for tid, g in targets:
            r = row._asdict()
            r["tensor_id"] = tid
            for col in ("producer_op", "alloc_op", "free_op"):
                r[col] = remap(g, col, int(r[col]))
            rows.append(r)
    new_tensors = pd.DataFrame(rows, columns=list(tensors.columns))
    meta = dict(trace.meta)
    remap_backward_nodes(meta, ops["phase"].to_numpy(),
                         list(range(first)) + [o for o, _g in emitted] + list(range(last + 1, n_old)))
    view = Trace(ops=new_ops, tensors=new_tensors, accesses=new_acc, meta=meta, path=trace.path)
    view.position = new_pos
    return view
