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

from dataclasses import dataclass

import numpy as np

COPY_ID_BASE = -4 * 10**12  # tensor ids of a group's own copy of a tensor shared by all groups


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
    """The trace of the step run over ``groups`` (lists of indices into ``step.params``)."""
    from .trace import Trace

    ops, acc, tensors = trace.ops, trace.accesses, trace.tensors
    names = ops["op"].tolist()
    group_of = {u: g for g, us in enumerate(groups) for u in us}
    opt = step.ops
    first, last = opt[0], opt[-1]
    by_op = {o: part for o, part in acc[np.isin(acc["op_id"].to_numpy(), opt)].groupby("op_id")}
    emitted: list[tuple[int, int]] = []  # (original op, group) in view order
    rows_acc = []
    copies: dict[tuple[int, int], int] = {}  # (shared tensor, group) -> its copy's id
    next_copy = COPY_ID_BASE
    for g in range(len(groups)):
        for o in opt:
            part = by_op.get(o)
            tids = part["tensor_id"].tolist() if part is not None else []
            units = {step.unit_of[t] for t in tids if t in step.unit_of}
            mine = {u for u in units if group_of[u] == g}
            if units and not mine:
                continue  # another group's op, or a foreach op with no element here
            if units - mine and "._foreach_" not in names[o]:
                return None
            pos = len(emitted)
            emitted.append((o, g))
            if part is None:
                continue
            keep = [t not in step.unit_of or step.unit_of[t] in mine for t in tids]
            sel = part[keep].copy()
            new_ids = []
            for t in sel["tensor_id"].tolist():
                if t in step.shared_made:
                    if (t, g) not in copies:
                        copies[(t, g)] = next_copy
                        next_copy -= 1
                    t = copies[(t, g)]
                new_ids.append(t)
            sel["tensor_id"] = new_ids
            sel["op_id"] = first + pos
            rows_acc.append(sel)
    n_old = len(ops)
    grown = len(emitted) - len(opt)
    new_pos = np.arange(n_old, dtype=np.int64)
    new_pos[last + 1:] += grown
    for pos, (o, _g) in reversed(list(enumerate(emitted))):
        new_pos[o] = first + pos  # a split op: its first group's part
    # op rows
    import pandas as pd

    head, tail = ops.iloc[:first], ops.iloc[last + 1:]
    mid = ops.iloc[[o for o, _g in emitted]].copy()
    share = _byte_share(trace, step, emitted, groups, by_op)
    mid["duration_s"] = mid["duration_s"].to_numpy() * share
    mid["flops"] = (mid["flops"].to_numpy() * share).astype(np.int64)
    new_ops = pd.concat([head, mid, tail], ignore_index=True)
    new_ops["op_id"] = np.arange(len(new_ops), dtype=np.int32)
    other = acc[~np.isin(acc["op_id"].to_numpy(), opt)].copy()
    other["op_id"] = new_pos[other["op_id"].to_numpy()]
    new_acc = pd.concat([other, *rows_acc], ignore_index=True).sort_values("op_id", kind="stable")
    new_acc["op_id"] = new_acc["op_id"].astype(np.int32)
    new_acc = new_acc.reset_index(drop=True)

    # Where each group's run sits: per group, (original op, view position) in order.
    runs: dict[int, list[tuple[int, int]]] = {}
    for pos, (o, g) in enumerate(emitted):
        runs.setdefault(g, []).append((o, first + pos))
    everything = sorted(((o, first + pos) for pos, (o, g) in enumerate(emitted)), key=lambda x: x[1])

    def at_or_after(run, op):
        return next((p for o, p in run if o >= op), None)

    def at_or_before(run, op):
        return next((p for o, p in reversed(run) if o <= op), None)

    def remap(t, g, col, v):
        if v < 0:
            return -1
        if v < first:
            return v
        if v > last:
            return int(new_pos[v])
        run = runs.get(g) if g is not None else everything
        if col == "free_op":
            p = at_or_before(run, v)
        else:
            p = at_or_after(run, v)
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
                r[col] = remap(t, g, col, int(r[col]))
            rows.append(r)
    new_tensors = pd.DataFrame(rows, columns=list(tensors.columns))
    meta = dict(trace.meta)
    view = Trace(ops=new_ops, tensors=new_tensors, accesses=new_acc, meta=meta, path=trace.path)
    view.position = new_pos
    return view


def _byte_share(trace, step, emitted, groups, by_op) -> np.ndarray:
    """Per emitted op, the share of its original op's work it does (its elements' bytes over
    all elements' bytes; 1 for an op of one parameter or a copy)."""
    nbytes = dict(zip(trace.tensors["tensor_id"].tolist(), trace.tensors["nbytes"].tolist(), strict=True))
    out = np.ones(len(emitted))
    for i, (o, g) in enumerate(emitted):
        part = by_op.get(o)
        if part is None:
            continue
        tids = [t for t in part["tensor_id"].tolist() if t in step.unit_of]
        total = sum(nbytes[t] for t in tids)
        if total:
            out[i] = sum(nbytes[t] for t in tids if step.unit_of[t] in set(groups[g])) / total
    return out
