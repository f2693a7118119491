"""Partition over positions: a position-wise module run on ``k`` runs of its positions.

A module is *position-wise* when its output at position ``t`` (one token of one sample)
depends only on its input at ``t``: an MLP, a norm, an activation, a linear layer. Such a
module may be split along the sequence, which a batch of one sample cannot be along its
batch. Chunks are runs of the ``N = batch * seq`` positions in memory order (the module's
inputs viewed as ``[1, N, ...]``, cut along dim 1): with batch 1, runs of the sequence; with
a larger batch, runs that may cross samples, so ``k`` need only divide ``N``. Where ``k``
divides the batch, a run is exactly a batch chunk; those counts stay the batch partition's.

Whether a module is position-wise is decided from the trace, op by op, on the storages each
forward op of the module reads and makes (never from module names). With ``(B, S)`` the
workload's batch and sequence, a storage is *positional* when its shape starts with
``(B, S)`` or with ``N`` (the same positions flattened). The module qualifies when:

* every op is one whose result at a position needs only that position (:data:`POINTWISE`
  elementwise ops and copies, :data:`VIEW_STEMS` views, ``native_layer_norm`` whose mean and
  rstd are positional (it normalizes within each position), a reduction whose output keeps
  the positions (RMSNorm's ``mean`` over the last dim), ``mm``/``addmm`` whose row operand is
  positional and whose other operands are parameters or constants (a linear layer));
* every storage an op reads that is not a parameter or buffer is positional, or a constant
  without a positions-sized dimension, made outside the module or inside it from parameters
  alone (autocast's cast of a weight, which each chunk casts alike or finds in autocast's
  cache: the batch partition's model of that cache holds here too, measured to the byte
  under bf16 autocast in ``tests/test_partition_sequence.py``); every storage an op makes is
  positional, or a constant without a positions-sized dimension (position ids or rotary
  tables made inside would differ per chunk);
* a reduction that drops dimensions cannot be mistaken for one over the sequence (no dimension
  after the positions is ``S`` or ``N``), and no parameter the module reads has a dimension of
  size ``N`` (so a weight-shaped tensor is never mistaken for a positional one);
* it is called once, its forward and backward spans contiguous, with no batch norm and no
  write to a parameter or buffer (the batch partition's conditions,
  :func:`taichi_plan.problem.partition.find._module_spans`).

The simulator models the run exactly as the batch partition's
(:func:`taichi_plan.problem.partition.peaks.chunked_peaks`), a positional storage being a ``1/k`` piece;
replay is :mod:`taichi_plan.runtime.partition` (``over="sequence"``).
"""

from __future__ import annotations

import dataclasses

from ..core import Problem, batch_and_seq, op_stem, read_args
from .qualify import constant_tensor

SEQ_CHUNK_CHOICES = (2, 4, 8, 16, 32)
# Elementwise ops (and their in-place forms), copies, dtype casts, fills of a tensor's shape,
# and dropout's mask draws: each output element needs only the same element of each input.
POINTWISE = {
    "add", "sub", "rsub", "mul", "div", "pow", "neg", "abs", "exp", "log", "sqrt", "rsqrt", "reciprocal",
    "tanh", "sigmoid", "gelu", "silu", "relu", "leaky_relu", "elu", "hardtanh", "softplus", "mish", "erf",
    "clamp", "clamp_min", "clamp_max", "minimum", "maximum", "where", "square", "_to_copy", "clone",
    "contiguous", "copy", "empty_like", "zeros_like", "ones_like", "full_like", "bernoulli", "native_dropout",
    "threshold", "lift_fresh", "scalar_tensor",
}
VIEW_STEMS = {"view", "_unsafe_view", "reshape", "alias", "detach", "t", "unsqueeze", "squeeze", "expand",
              "transpose", "permute", "slice", "split", "split_with_sizes", "unbind", "select"}
LINEAR = {"mm": 0, "addmm": 1}  # stem -> argument index of the row operand
NORMS = {"native_layer_norm"}
REDUCTIONS = {"mean", "sum", "amax", "amin", "var", "std", "var_mean"}


def positions(problem: Problem) -> tuple[int, int] | None:
    """(batch, seq) of the recorded workload (:func:`taichi_plan.problem.core.batch_and_seq`: named
    or read from its model calls' inputs), or None when either is unknown."""
    b, s = batch_and_seq(problem.trace.meta)
    if b is not None and s is not None and s > 1:
        return b, s
    return None


def positional(shape, pos: tuple[int, int]) -> bool:
    """Does a storage of ``shape`` hold one row per position (leading ``(B, S)`` or ``B * S``)?"""
    shape = [int(x) for x in shape]
    return (len(shape) >= 2 and (shape[0], shape[1]) == pos) or (len(shape) >= 1 and shape[0] == pos[0] * pos[1])


def _rest(shape, pos) -> list[int]:
    """The dimensions after the positions."""
    shape = [int(x) for x in shape]
    return shape[2:] if len(shape) >= 2 and (shape[0], shape[1]) == pos else shape[1:]


def not_position_wise(problem: Problem, fwd: tuple[int, int], pos: tuple[int, int]) -> str | None:
    """Why the forward ops ``fwd`` are not position-wise (the first op that breaks a rule of
    the module docstring, in words), or None when they are."""
    shapes = problem.trace.tensors["shape"].tolist()
    n = pos[0] * pos[1]
    f0, f1 = fwd
    fixed = ("parameter", "buffer")

    def sized(t: int) -> bool:  # a dimension of the positions' size beyond the leading ones
        return pos[1] in _rest(shapes[t], pos) or n in _rest(shapes[t], pos) or positional(shapes[t], pos)

    for i in range(f0, f1 + 1):
        name, stem = problem.op_name[i], op_stem(problem.op_name[i]).rstrip("_")
        reads, outs = problem.op_reads[i].tolist(), problem.op_outputs[i].tolist()
        if any(problem.kind[t] in fixed and n in [int(x) for x in shapes[t]] for t in reads):
            return f"op {i} ({name}) reads a parameter with a dimension of {n}, the number of positions"
        for t in reads:
            if problem.kind[t] in fixed or positional(shapes[t], pos):
                continue
            if not (constant_tensor(problem, t) and not sized(t)):  # made before or in the span (a weight's cast)
                return f"op {i} ({name}) reads tensor {int(problem.tensor_id[t])} {list(shapes[t])}, not one row per position"
        for t in outs:
            if constant_tensor(problem, t) and not sized(t):
                continue
            if not positional(shapes[t], pos) or (constant_tensor(problem, t) and problem.kind[t] != "parameter"):
                return f"op {i} ({name}) makes tensor {int(problem.tensor_id[t])} {list(shapes[t])}, not one row per position"
        if stem in POINTWISE or stem in VIEW_STEMS or stem in NORMS:
            continue  # a norm's mean and rstd were checked positional above: it normalizes per position
        if stem in REDUCTIONS:
            ins = [t for t in reads if problem.kind[t] not in fixed]
            if any(len(_rest(shapes[o], pos)) < len(_rest(shapes[t], pos)) and sized(t) for o in outs for t in ins):
                return f"op {i} ({name}) reduces a tensor whose other dimensions could be the sequence"
            continue
        if stem in LINEAR:
            args = read_args(problem).get(i, [])
            row = LINEAR[stem]
            if len(args) <= row or not positional(shapes[args[row]], pos) or any(
                    not (problem.kind[t] in fixed or constant_tensor(problem, t)) for j, t in enumerate(args) if j != row):
                return f"op {i} ({name}) multiplies by something other than a parameter"
            continue
        return f"op {i} ({name}) may mix positions"
    return None


def sequence_spans(problem: Problem, batch_spans: list) -> list:
    """The position-wise modules among ``batch_spans`` (modules the batch partition's
    conditions allow), as spans ``over="sequence"`` with the chunk counts that divide the
    positions and are not batch chunks already (random modules included: the planners offer
    them only with the solve's opt-in)."""
    pos = positions(problem)
    if pos is None:
        return []
    n = pos[0] * pos[1]
    out = []
    for s in batch_spans:
        batch_ks = set(s.chunk_choices) if s.split else set()
        ks = tuple(k for k in SEQ_CHUNK_CHOICES if n % k == 0 and k not in batch_ks)
        if not ks or not_position_wise(problem, s.fwd, pos) is not None:
            continue
        out.append(dataclasses.replace(s, over="sequence", batch=n, split=True, positions=pos, choices=ks))
    return out


def chunk_piece(problem: Problem, span, t: int, k: int, shapes: list) -> int:
    """Bytes of tensor ``t``'s piece in one of ``k`` chunks of a sequence span: ``1/k`` of a
    positional storage, the whole of any other (a parameter's gradient, a constant).
    ``shapes``: the trace's tensor shapes, as a list (the caller's, not rebuilt per tensor)."""
    nb = int(problem.nbytes[t])
    if t >= len(shapes) or problem.kind[t] == "gradient" or not positional(shapes[t], span.positions):
        return nb
    assert nb % k == 0, (t, nb, k)
    return nb // k


__all__ = ["SEQ_CHUNK_CHOICES", "chunk_piece", "not_position_wise", "positional", "positions", "sequence_spans"]
