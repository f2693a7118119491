"""Which modules qualify for a partition, op by op (no plan, no span search).

A module whose ops mix samples (:data:`MIXES_BATCH`: batch norms) is never split; which ops
draw random numbers (:func:`draws_random`) and what the chunks of a random module draw
(:func:`random_draws`, the solve's opt-in :func:`allow_random`); which ops write a parameter
or buffer in place (:func:`state_writes`: a re-run would update a running statistic twice);
whether a forward leaves a tensor behind in the model's Python state (:func:`leaves_state`: a
KV cache) or casts a weight (:func:`casts_parameter`: autocast's cache); and which tensors are
constants of a span, made from parameters, buffers or nothing (:func:`constant_tensor`).
"""

from __future__ import annotations

import numpy as np

from ..core import Problem, read_args
from .span import Span

MIXES_BATCH = ("batch_norm", "native_batch_norm", "_batch_norm", "cudnn_batch_norm", "group_norm_backward")
# Random ops draw different numbers per chunk than for the whole batch: such a module's
# partitioned gradients would not match the unpartitioned ones, so it is partitioned only on
# the solve's opt-in (see the package docstring, :mod:`taichi_plan.problem.partition`).
RANDOM = ("bernoulli", "dropout", "rand", "normal", "multinomial")
# Random ops whose chunks draw exactly the whole batch's numbers when alone in a module on
# CPU: one number per element, in memory order (dropout's mask; tests/test_partition_random.py
# checks it on tensors and by replay). Other random ops are not claimed: normal_ draws in
# blocks of 16, and the rest is untested.
SAME_DRAWS_ON_CPU = ("aten.bernoulli_.float",)


def allow_random(problem: Problem, allow: bool) -> Problem:
    """``problem`` with random modules among the planners' options (``allow``) or not
    (:meth:`Problem.with_options`)."""
    return problem.with_options(partition_random=allow)


def draws_random(problem: Problem, op: int) -> bool:
    """Did op ``op`` draw random numbers? From the trace's ``meta.random_ops`` (v4: decided from
    each call, so SDPA with ``dropout_p > 0`` is random and without it is not), else, for older
    traces, from the op's name."""
    if problem.random_ops is None:
        return any(k in problem.op_name[op] for k in RANDOM)
    return op in problem.random_ops


def random_draws(problem: Problem, span: Span, chunks: int = 2) -> str | None:
    """What the chunks of a partitioned ``span`` draw from the RNG: None when it draws nothing,
    ``"as-unpartitioned"`` when they provably draw the whole batch's numbers (one chunk, which
    draws as the unplanned module does; one Bernoulli op, a real run on CPU), else
    ``"per-chunk"`` (their own numbers: training changes statistically)."""
    if not span.random_ops:
        return None
    if chunks == 1:
        return "as-unpartitioned"
    meta = problem.trace.meta
    same = (len(span.random_ops) == 1 and problem.op_name[span.random_ops[0]] in SAME_DRAWS_ON_CPU
            and meta.get("mode") == "real" and meta.get("device") == "cpu")
    return "as-unpartitioned" if same else "per-chunk"


def leaves_state(problem: Problem, made: np.ndarray, f0: int, f1: int) -> bool:
    """Does the forward ``f0..f1`` leave a tensor behind in the model's Python state: one it
    makes that the step's code holds past ``f1`` (trace v4 ``python_refs``) although no later
    forward op reads it, such as the keys and values a Hugging Face attention appends to its
    KV cache (``DynamicCache.update``)? Checkpointed, the module's re-run in backward appends
    to that state again (a second, longer ``cat``) and the first copies stay held until then:
    on a 2-layer GPT-2 with the cache on, an attention checkpointed whole measured 393,216 B
    above the prediction. Such modules are neither split nor checkpointed; a model run with
    ``use_cache=False`` has no such tensors. Autocast's cached casts of a parameter are held
    so too; :func:`casts_parameter` rules on those. Unknown (False) for traces without
    ``python_refs``."""
    py = problem.python_release
    phase = problem.op_phase
    reads = read_args(problem)
    for t in made.tolist():
        if not f0 <= int(problem.start[t]) <= f1 or py[t] <= f1:
            continue
        p = int(problem.producer[t])
        if p >= 0 and _casts_weight(problem, p, reads):
            continue  # autocast's cast of a weight (casts_parameter)
        if not any(u > f1 and phase[u] == "forward" for u in problem.uses[t].tolist()):
            return True
    return False


def casts_parameter(problem: Problem, f0: int, f1: int) -> bool:
    """Does the forward ``f0..f1`` cast a parameter (``_to_copy`` of one: autocast's casts of
    weights to bf16/fp16)? Autocast keeps such a cast in its cache until its region ends: split
    along the batch, the first chunk casts and the others find it cached, one cast node for all
    (:func:`~taichi_plan.problem.partition.peaks.chunked_peaks` models it, from when the step's code lets go of the cast: trace
    ``python_refs``; a trace without them, an older Trainer recording, does not split such
    modules), and so over positions (the cast is a constant of the span, not one row per
    position: :func:`taichi_plan.problem.partition.position_span.not_position_wise`)."""
    reads = read_args(problem)
    return any(_casts_weight(problem, i, reads) for i in range(f0, f1 + 1))


def _casts_weight(problem: Problem, op: int, reads: dict) -> bool:
    """Is op ``op`` a ``_to_copy`` of a parameter (``reads``: :func:`~taichi_plan.problem.core.read_args`)?"""
    return problem.op_name[op] == "aten._to_copy.default" and any(
        problem.kind[t] == "parameter" for t in reads.get(op, ()))


def state_writes(problem: Problem) -> np.ndarray:
    """Per op: does it write a parameter or buffer in place (a running statistic)?"""
    acc = problem.trace.accesses
    out = np.zeros(problem.num_ops, dtype=bool)
    if len(acc) == 0:
        return out
    ops = acc["op_id"].to_numpy().astype(np.int64)
    rows = np.fromiter((problem.index_of(t) for t in acc["tensor_id"].tolist()), dtype=np.int64, count=len(acc))
    hit = (acc["role"].to_numpy() == "write") & np.isin(problem.kind[rows], ("parameter", "buffer"))
    out[ops[hit]] = True
    return out


def constant_tensor(problem: Problem, t: int) -> bool:
    """Made from parameters, buffers or nothing (masks, scalars): no batch in it, not split."""
    p = problem.producer[t]
    if p < 0:
        return False
    return all(problem.kind[u] in ("parameter", "buffer") for u in problem.op_reads[p].tolist())
