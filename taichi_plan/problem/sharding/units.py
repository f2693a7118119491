"""The FSDP units of a sharded trace and each one's backward gathering (no torch).

A unit recorded resharding after forward (:func:`reshard_units`) gathers its parameters again
in backward: the ops of its innermost backward spans (``meta.fsdp.op_spans``) that allocate an
all-gather buffer or write a second row of an unsharded parameter's storage
(``meta.fsdp.incarnations``), :func:`regather_ops`, and the forward rows they gather again,
:func:`gathered_rows`. A plan may set such a unit not to reshard
(:mod:`taichi_plan.problem.sharding.no_reshard`) or to reshard to a smaller mesh, one of
:func:`smaller_mesh_factors` of its shard group (:mod:`taichi_plan.problem.sharding.smaller_mesh`).
"""

from __future__ import annotations

import numpy as np

from ...base.errors import PlanError
from ...trace.layout import fsdp_meta, incarnations, innermost_spans


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
    by_unit = regather_by_unit(trace)
    parts = [by_unit[int(u)] for u in set(int(u) for u in units) if int(u) in by_unit]
    return np.sort(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)


def regather_by_unit(trace) -> dict[int, np.ndarray]:
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


def shard_group_size(meta: dict) -> int:
    """Ranks of a unit's shard group: the mesh's last dim (the whole job for FSDP, a row for HSDP)."""
    f = fsdp_meta(meta) or {}
    shape = f.get("mesh_shape") or [f.get("world_size", 1)]
    return int(shape[-1])


def smaller_mesh_factors(meta: dict) -> list[int]:
    """The ints ``reshard_after_forward`` may take on this trace's mesh: the factors of the
    shard group's size strictly between 1 and it (FSDP2 reads 1 as False, the size as True)."""
    s = shard_group_size(meta)
    return [k for k in range(2, s) if s % k == 0]


def gathered_rows(trace, unit: int) -> list[int]:
    """Tensor ids of the forward rows of a unit's gathered parameters that its backward
    gathering (:func:`regather_ops`) gathers again, in id order (FSDP's parameter order)."""
    t = trace.tensors
    alloc = dict(zip(t["tensor_id"].tolist(), t["alloc_op"].tolist()))
    gone = set(regather_ops(trace, [unit]).tolist())
    return sorted(int(rows[0]) for rows in incarnations(trace.meta)
                  if len(rows) > 1 and int(rows[0]) in alloc and alloc.get(int(rows[1]), -1) in gone)
