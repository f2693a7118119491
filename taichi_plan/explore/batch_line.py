"""A step at any batch size, drawn through two recorded ones: the guide of the max-batch search.

Two fake recordings of one workload at batch sizes ``a < b`` usually hold the same ops, the
same storages and the same accesses, and differ only in sizes: every storage's bytes, every
shape, every op's FLOPs are affine in the batch (a Llama's recordings at 2 and 3 give those
at 5 exactly), and so are the roofline durations while no op changes regime.
:func:`line_trace` draws that line to another batch size. What it gives is a guess, never a
result: :func:`taichi_plan.explore.maxbatch.max_batch` searches each planner on drawn steps first (no
recording, only planning), then checks the answer with real recordings at it and one above,
and searches on recordings from there when they disagree. No torch here.
"""

from __future__ import annotations

import copy

import numpy as np
import pandas as pd

from ..trace.format import Trace

# Columns that must be equal in both recordings for a line through them to mean anything.
SAME_OPS = ("op", "phase", "mutates", "recomputable")
SAME_TENSORS = ("dtype", "kind", "producer_op", "alloc_op", "free_op")


def same_structure(lo: Trace, hi: Trace) -> str | None:
    """None when ``lo`` and ``hi`` differ only in sizes (what :func:`line_trace` needs), else
    what differs first."""
    for name, cols in (("ops", SAME_OPS), ("tensors", SAME_TENSORS), ("accesses", None)):
        x, y = getattr(lo, name), getattr(hi, name)
        if len(x) != len(y):
            return f"{len(x)} vs {len(y)} rows of {name}"
        for c in cols or x.columns:
            if not np.array_equal(x[c].to_numpy(), y[c].to_numpy()):
                return f"{name}.{c}"
    return None


def _line(x_lo, x_hi, b_lo: int, b_hi: int, b: int, integer: bool):
    x_lo, x_hi = np.asarray(x_lo), np.asarray(x_hi)
    if integer:
        step, rest = np.divmod(x_hi - x_lo, b_hi - b_lo)
        out = np.where(rest == 0, x_lo + (b - b_lo) * step, x_hi)  # not a whole step per batch: as at hi
        return np.maximum(out, 0)
    return np.maximum(x_lo + (b - b_lo) * (x_hi - x_lo) / (b_hi - b_lo), 0.0)


def _shape(s_lo, s_hi, b_lo: int, b_hi: int, b: int) -> list:
    if len(s_lo) != len(s_hi):
        return list(s_hi)
    return [int(v) for v in _line(s_lo, s_hi, b_lo, b_hi, b, integer=True)]


def line_trace(lo: Trace, b_lo: int, hi: Trace, b_hi: int, b: int) -> Trace:
    """The step at batch ``b`` on the line through ``lo`` (recorded at ``b_lo``) and ``hi`` (at
    ``b_hi``): bytes, shapes, FLOPs and durations affine in the batch, everything else as in
    ``hi`` (which :func:`same_structure` must find equal to ``lo``). ``meta.batch_line`` says
    it was drawn, from which batch sizes."""
    if not (0 < b_lo < b_hi):
        raise ValueError(f"line_trace needs 0 < b_lo < b_hi, got {b_lo}, {b_hi}")
    ops = hi.ops.copy()
    ops["flops"] = _line(lo.ops["flops"], hi.ops["flops"], b_lo, b_hi, b, integer=True)
    ops["duration_s"] = _line(lo.ops["duration_s"], hi.ops["duration_s"], b_lo, b_hi, b, integer=False)
    tensors = hi.tensors.copy()
    tensors["nbytes"] = _line(lo.tensors["nbytes"], hi.tensors["nbytes"], b_lo, b_hi, b, integer=True)
    tensors["shape"] = pd.Series([_shape(x, y, b_lo, b_hi, b) for x, y in
                                  zip(lo.tensors["shape"], hi.tensors["shape"], strict=True)],
                                 index=tensors.index, dtype=object)
    meta = copy.deepcopy(hi.meta)
    for key in ("name", "content_hash", "signature", "signatures"):
        meta.pop(key, None)
    args = meta.get("workload", {}).get("args")
    if isinstance(args, dict) and "batch" in args:
        args["batch"] = b
    calls_lo = lo.meta.get("model_calls") or []
    for c_lo, c in zip(calls_lo, meta.get("model_calls") or [], strict=False):
        for i_lo, inp in zip(c_lo.get("inputs", []), c.get("inputs", []), strict=False):
            inp[1] = _shape(i_lo[1], inp[1], b_lo, b_hi, b)
    meta["batch_line"] = {"from_batches": [b_lo, b_hi], "batch": b}
    return Trace(ops, tensors, hi.accesses, meta)
