"""What a trace says about sharding (``meta.fsdp``, trace format v3; ``meta.ddp``, v4), read without torch.

A trace recorded with ``record --fsdp N`` is rank 0's step of an N-rank FSDP2 job. Its
``meta.fsdp`` names the layout (world size, mesh, the sharded modules and whether each
reshards after forward), the op spans FSDP ran for each unit (all-gathers, copies in and
out, reduce-scatters) and the rows of each storage FSDP resized (an unsharded parameter
is freed after forward and gathered again in backward: two rows, one storage). See
docs/sharding.md.
"""

from __future__ import annotations

import numpy as np

from ..base.errors import PlanError


def fsdp_meta(meta: dict) -> dict | None:
    """``meta.fsdp`` of a sharded trace, None for one process."""
    f = meta.get("fsdp")
    return f if isinstance(f, dict) else None


# What of meta.ddp (record --ddp N) a plan depends on, besides the world size.
DDP_SETTINGS = ("bucket_bytes_cap", "first_bucket_bytes_cap", "gradient_as_bucket_view", "find_unused_parameters",
                "static_graph")


def layout(meta: dict) -> dict | None:
    """The part of ``meta.fsdp`` a plan depends on: world size, mesh, and per unit its module
    and ``reshard_after_forward`` (a plan solved for one layout does not fit another). For a
    DDP trace (``meta.ddp``): its world size, no units, and ``ddp``: DDP's settings
    (:data:`DDP_SETTINGS`)."""
    d = meta.get("ddp")
    if isinstance(d, dict):
        n = int(d["world_size"])
        return {"world_size": n, "mesh_shape": [n], "units": [], "ddp": {k: d.get(k) for k in DDP_SETTINGS}}
    f = fsdp_meta(meta)
    if f is None:
        return None
    out = {
        "world_size": int(f["world_size"]),
        "mesh_shape": [int(x) for x in f.get("mesh_shape", [f["world_size"]])],
        "units": [[u["module"], u["reshard_after_forward"]] for u in f.get("units", [])],
    }
    # v16: the units whose parameters FSDP gathers, or whose gradients it reduces, in another
    # dtype (MixedPrecisionPolicy): [module, param_dtype, reduce_dtype]; absent when none does
    mixed = [[u["module"], u.get("param_dtype"), u.get("reduce_dtype")] for u in f.get("units", [])
             if u.get("param_dtype") or u.get("reduce_dtype")]
    if mixed:
        out["mixed_precision"] = mixed
    return out


def check_layout(want: dict | None, got: dict | None, where: str) -> None:
    """Refuse a plan whose layout (:func:`layout`) differs from the one it is applied to."""
    if want == got:
        return
    def say(x):
        if x is None:
            return "one process, unsharded"
        if x.get("ddp") is not None:
            return f"{x['world_size']} ranks, DistributedDataParallel with " + ", ".join(
                f"{k}={v}" for k, v in x["ddp"].items())
        mixed = {m: (p, r) for m, p, r in x.get("mixed_precision") or ()}

        def precision(m: str) -> str:
            if m not in mixed:
                return ""
            p, r = mixed[m]
            return f", param_dtype={p or 'as its parameters'}, reduce_dtype={r or 'as param_dtype'}"

        shape = x["mesh_shape"]
        hsdp = f" (HSDP: {shape[0]} replicas of {shape[1]}-rank shard groups)" if len(shape) == 2 else ""
        return (f"{x['world_size']} ranks, mesh {shape}{hsdp}, units "
                + ", ".join(f"{m or '<root>'} (reshard_after_forward={r}{precision(m)})" for m, r in x["units"]))
    raise PlanError(
        f"{where}: the plan was solved for {say(want)}, but it is applied to {say(got)}. A plan's "
        "per-rank memory holds only for the layout it was recorded with: record this layout "
        "(`taichi-plan record --fsdp N`, with --fsdp-param-dtype/--fsdp-reduce-dtype for FSDP's "
        "MixedPrecisionPolicy, or `--ddp N` with DDP's bucket settings) and solve again.")


def unit_of_ops(meta: dict, op_module: list[str]) -> np.ndarray:
    """Per op, the index of its FSDP unit in ``meta.fsdp.units`` (-1 outside every unit, and
    for every op of an unsharded trace): the unit FSDP was working for when it ran the op
    (its all-gather, copy-out, reshard, reduce-scatter: ``meta.fsdp.op_spans``), else the
    deepest unit whose module is, or contains, the op's module."""
    n = len(op_module)
    out = np.full(n, -1, dtype=np.int64)
    f = fsdp_meta(meta)
    if f is None:
        return out
    index = {u["module"]: k for k, u in enumerate(f.get("units", []))}
    memo: dict[str, int] = {}

    def unit_of(m: str) -> int:
        if m not in memo:
            parts = m.split(".") if m else []
            memo[m] = next((index[".".join(parts[:k])] for k in range(len(parts), -1, -1)
                            if ".".join(parts[:k]) in index), -1)
        return memo[m]

    for i, m in enumerate(op_module):
        out[i] = unit_of(m)
    # Longer spans first, so that a span nested in another (pre_backward prefetching the next
    # unit's all-gather) keeps its own unit.
    for start, end, unit in sorted(f.get("op_spans", []), key=lambda s: s[0] - s[1]):
        out[int(start):int(end) + 1] = int(unit)
    return out


def fsdp_internal_ops(meta: dict, n: int) -> np.ndarray:
    """Per op, whether FSDP ran it inside its own machinery (``meta.fsdp.op_spans``: a param
    group's unshard, wait, reshard, pre/post-forward): its all-gathers, copies, and the buffers
    its first step allocates. Replay leaves them out of its op count, as the runtime leaves out
    whatever runs inside those methods."""
    out = np.zeros(n, dtype=bool)
    for start, end, _unit in (fsdp_meta(meta) or {}).get("op_spans", []):
        out[int(start):int(end) + 1] = True
    return out


def innermost_spans(spans: list, n: int) -> np.ndarray:
    """Per op, the index of the innermost span holding it (-1 for none)."""
    out = np.full(n, -1, dtype=np.int64)
    for k in sorted(range(len(spans)), key=lambda k: spans[k][1] - spans[k][0]):  # shortest first
        s, e = int(spans[k][0]), int(spans[k][1])
        sel = out[s:e + 1] == -1
        out[s:e + 1][sel] = k
    return out


def incarnations(meta: dict) -> list[list[int]]:
    """Tensor ids of the rows of each resized storage, in order (``meta.fsdp.incarnations``)."""
    f = fsdp_meta(meta)
    return [list(map(int, rows)) for rows in (f or {}).get("incarnations", [])]


def planned_layout(recorded: dict | None, reshard: dict | None) -> dict | None:
    """The layout a plan runs the job in: the recorded one (``trace.layout``) with each unit's
    ``reshard_after_forward`` as the plan sets it (``decisions.reshard_after_forward``, v5)."""
    if recorded is None or not reshard:
        return recorded
    setting = {u["module"]: u["reshard_after_forward"] for u in reshard.get("units", [])}
    return {**recorded, "units": [[m, setting.get(m, r)] for m, r in recorded["units"]]}
