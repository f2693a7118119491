"""Tensor partition: run a module on ``k`` chunks of its input (MegTaiChi's second lever).

What the simulator models for a partitioned module ``m`` (called once per step, with a
contiguous forward span and a contiguous backward span in the trace):

* each chunk runs checkpointed (``runtime/partition.py``: the inputs ``split`` along dim 0,
  non-reentrant ``torch.utils.checkpoint`` per chunk, the outputs joined by ``cat``), so the
  module keeps only its inputs across the step;
* the span's own tensors are modelled event by event (:func:`_chunked_peaks`): each of its
  ops runs ``k`` times on ``1/k`` pieces, the chunks' outputs wait for the ``cat``, the
  backward runs the chunks one after the other, each re-running its forward (early stop)
  before its first op that reads a saved tensor, holding the input-gradient pieces until
  ``split``'s backward joins them, and adding each later chunk's parameter gradients to the
  first chunk's out of place; the timeline gets, at each op of the span, the bytes of the
  span's own tensors at the worst of those moments, so measured == predicted to the byte
  (tests/test_partition_exact.py);
* the module's outputs and input gradients re-enter the timeline whole after the span,
  joined; chunk counts divide the batch, so every piece is exactly ``1/k``;
* extra compute: the module's forward once more, plus a launch overhead per op per chunk; on
  a real recording, what the runtime measured on the model's own modules instead
  (:func:`partition_cost`).

One chunk (``k = 1``) is the module checkpointed whole: the same model with nothing shrunk
and nothing joined (no concatenation, no gradient pieces, each parameter's gradient made
once); its outputs stay droppable (:func:`whole_outputs`: rebuilt through its insides from
its held inputs, which the runtime does by re-running the module's recorded ops). It needs
no batch dimension, only that no forward op of the module mixes samples or writes a
parameter or buffer (a re-run would update a running statistic twice); a module
that draws random numbers is an option at ``k = 1`` without the opt-in below, since the
re-run restores the RNG state its forward ran with and draws the same numbers.

A module qualifies along dim 0 (the batch) when none of its ops mixes samples (no batch
norm) and every tensor it makes has a leading size that is a multiple of the batch.
Imported graphs have no modules and are never partitioned; nor are traces without a workload
(hand-built ones), which have no model whose modules a replay could wrap.

A module whose forward draws random numbers (dropout) is a planner's option only when the
solve opts in (``Problem.partition_random``, ``solve --partition-random``): its chunks draw
their own numbers, so training changes, statistically. The plan records it per partition
(``Partition.random_draws``, :func:`random_draws`): ``"as-unpartitioned"`` where the chunks
provably draw what the whole batch would have (one dropout in the module, a real CPU run:
the CPU generator fills a Bernoulli mask element by element, so chunk ``c`` draws the next
slice of the same stream and leaves the generator where the whole-batch op would), else
``"per-chunk"``. A plan naming a random module without that record is refused.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import numpy as np

from ...base.errors import PlanError
from ..core import Problem, batch_and_seq, read_args, rebuild_set

MIXES_BATCH = ("batch_norm", "native_batch_norm", "_batch_norm", "cudnn_batch_norm", "group_norm_backward")
# Random ops draw different numbers per chunk than for the whole batch: such a module's
# partitioned gradients would not match the unpartitioned ones, so it is partitioned only on
# the solve's opt-in (see the module docstring).
RANDOM = ("bernoulli", "dropout", "rand", "normal", "multinomial")
# Random ops whose chunks draw exactly the whole batch's numbers when alone in a module on
# CPU: one number per element, in memory order (dropout's mask; tests/test_partition_random.py
# checks it on tensors and by replay). Other random ops are not claimed: normal_ draws in
# blocks of 16, and the rest is untested.
SAME_DRAWS_ON_CPU = ("aten.bernoulli_.float",)
DEFAULT_LAUNCH_S = 1e-5
CHUNK_CHOICES = (2, 4, 8)


@dataclass(frozen=True)
class Span:
    """A module partitioned along dim 0 (its batch), or checkpointed whole (one chunk). Token
    spans (a head and its loss, partitioned over tokens) are
    :class:`taichi_plan.problem.partition.token_span.TokenSpan`; both have ``module``, ``over``, ``fwd``/``bwd``
    and ``chunk_choices``."""

    module: str
    fwd: tuple[int, int]
    bwd: tuple[int, int]
    batch: int
    random_ops: tuple[int, ...] = ()  # forward ops of the module that draw random numbers
    over: str = "batch"
    # May it be split into chunks of its batch (independent along dim 0, and, when it draws
    # random numbers, the solve opted in)? Otherwise one chunk only: checkpointed whole.
    split: bool = True
    # over="sequence" (taichi_plan/problem/partition/position_span.py): the workload's (batch, seq), whose product
    # ``batch`` then is, and the chunk counts offered (they divide it).
    positions: tuple[int, int] | None = None
    choices: tuple[int, ...] = ()
    # The (fwd, bwd) spans of the module in the step's later micro-batches (gradient
    # accumulation: the module runs once per micro-batch, partitioned in each).
    more: tuple = ()

    @property
    def chunk_choices(self) -> tuple[int, ...]:
        if self.over == "sequence":
            return self.choices
        # Chunks of equal size only (k divides the batch): each tensor's piece is exactly 1/k.
        return (1, *(c for c in CHUNK_CHOICES if c <= self.batch and self.batch % c == 0)) if self.split else (1,)


def span_key(x) -> tuple[str, str]:
    """(module, over) of a span or a partition: what names it in a plan."""
    return x.module, getattr(x, "over", "batch")


def as_partition(span, chunks: int):
    """The plan's :class:`~taichi_plan.plan.format.Partition` of ``span`` into ``chunks``."""
    from ...plan.format import Partition

    return Partition(span.module, 1 if span.over == "sequence" else 0, int(chunks), over=span.over)


def find_span(problem: Problem, part):
    """The span a partition names (module and ``over``), or None."""
    key = span_key(part)
    return next((s for s in partitionable_spans(problem) if span_key(s) == key), None)


def is_under(name: str, module: str) -> bool:
    """Is module ``name`` ``module`` itself or nested in it (by its dotted name)?"""
    return name == module or name.startswith(module + ".")


def ops_under(op_module: list[str]) -> dict[str, np.ndarray]:
    """Each module that ran ops, and each module above one -> the ids, ascending, of the ops
    run in it or in a module below it (``is_under``). One pass over the ops and one over the
    distinct names: a trace's modules repeat (one name per op), so this costs the ops times
    the nesting depth, not the ops times the modules."""
    by_name: dict[str, list[int]] = {}
    for i, x in enumerate(op_module):
        by_name.setdefault(x, []).append(i)
    parts_of: dict[str, list] = {}
    for x, ids in by_name.items():
        parts = x.split(".") if x else []
        for i in range(1, len(parts) + 1):
            parts_of.setdefault(".".join(parts[:i]), []).append(ids)
    return {m: np.sort(np.concatenate([np.asarray(ids, dtype=np.int64) for ids in lists]))
            for m, lists in parts_of.items()}


# Ops by which autograd stores a parameter's gradient (its AccumulateGrad: the gradient kept, or
# added in place into one there before), not another node.
_STORE_OPS = frozenset({"aten.detach.default", "aten.alias.default", "aten.add_.Tensor"})
MAX_SPANS = 48  # options considered, split and whole apart: the most bytes inside per forward second


def module_spans(problem: Problem) -> list:
    """The planners' partition options: the modules that can be partitioned along dim 0, with
    their forward and backward spans, random ones split only where ``problem.partition_random``
    (else checkpointed whole, one chunk), and the position-wise ones that cannot, over their
    positions (:mod:`taichi_plan.problem.partition.position_span`) (of those that can be split, and apart of those that
    can only be checkpointed whole, the ``MAX_SPANS`` with the most bytes made inside them per
    second of their forward: what a partition can save, per what it runs again), then the
    head + loss spans that can be partitioned over tokens
    (:func:`taichi_plan.problem.partition.token_span.token_spans`)."""
    cached = getattr(problem, "_module_spans", None)
    if cached is not None:
        return cached
    if problem.trace.meta.get("compiled") is not None:
        return []  # a compiled step's plan runs through compile's partitioner: no partitions yet
    from .token_span import token_spans

    # A random module without the opt-in is still checkpointed whole: its one chunk re-runs
    # with the RNG state it first ran with, so it draws the same numbers (module docstring).
    spans = [s if problem.partition_random or not s.random_ops else dataclasses.replace(s, split=False)
             for s in _batch_spans(problem)]
    # Over positions: where the batch cannot be split (a batch of one, tensors not batch-major),
    # so a trace whose batch splits keeps the options it had; a random module only with the
    # opt-in (none is checkpointed whole over positions: that is its batch span's one chunk).
    # One that casts a weight (autocast) only where the trace says when the cast is let go
    # of, as along the batch.
    by_batch = {s.module for s in _batch_spans(problem) if s.split}
    refs = "python_refs" in problem.trace.meta
    spans += [s for s in _sequence_spans(problem)
              if s.module not in by_batch and (problem.partition_random or not s.random_ops)
              and (refs or not casts_parameter(problem, *s.fwd))]
    # Capped apart: modules that can be split (along the batch or the sequence), and those that
    # can only be checkpointed whole (outer ones hold the most bytes and would crowd the split
    # ones out of one cap).
    keep: set[tuple[str, str]] = set()
    for split in (True, False):
        group = [s for s in spans if s.split == split]
        inside = {span_key(s): sum(int(problem.nbytes[a].sum()) for a in internal_tensors(problem, s)) for s in group}
        cost = {span_key(s): float(problem.op_cost[s.fwd[0]:s.fwd[1] + 1].sum()) for s in group}
        keep.update(_capped_by_class(inside, MAX_SPANS, cost))
    spans = [s for s in spans if span_key(s) in keep] + token_spans(problem)
    problem._module_spans = spans
    return spans


_BLOCK_INDEX = re.compile(r"\.\d+(?=\.|$)")


def module_class(module: str) -> str:
    """A module's name with its block indices replaced (``model.layers.3.mlp`` ->
    ``model.layers.#.mlp``): the repeats of one module in a stack of blocks share it."""
    return _BLOCK_INDEX.sub(".#", module)


def _capped_by_class(inside: dict, most: int, cost: dict) -> list:
    """Of the spans ``inside`` (key -> bytes made inside), whole classes of repeats at a time
    (:func:`module_class`), at most ``most`` spans: the classes with the most bytes in one
    repeat per second of forward (``cost``: key -> recorded seconds of its forward, what
    checkpointing it re-runs) first; a class that no
    longer fits is passed over for the ones after it, but the first class is taken whole
    whatever its size (an 80-layer model's norms). Repeats tie in bytes, so a cap by bytes
    alone kept an arbitrary part of a class (24 of the 32 input norms of a 32-layer Llama): a
    plan of a class in part moves a repeated peak to the repeats left out instead of lowering
    it. By bytes alone, a 32-layer Llama's attentions (20.8 GB inside each at batch 34, 13.8 ms
    of forward) crowded out its norms (14.8 GB, 3.1 ms), which a plan frees at a quarter of
    the cost per byte."""
    def rank(k) -> float:
        return inside[k] / max(cost[k], 1e-12)

    classes: dict[tuple, list] = {}
    for key in sorted(inside, key=lambda k: -rank(k)):
        classes.setdefault((module_class(key[0]), key[1]), []).append(key)
    out: list = []
    for members in sorted(classes.values(), key=lambda c: -rank(c[0])):
        if not out or len(out) + len(members) <= most:
            out.extend(members)
    return out


def state_keepers(problem: Problem) -> list[str]:
    """The innermost modules left out of partitioning because their forward leaves a tensor
    in the model's Python state (:func:`leaves_state`: a Hugging Face attention's KV cache;
    the blocks and the model around them are left out too, and not named)."""
    _batch_spans(problem)
    keeps = getattr(problem, "_keeps_state", None) or []
    return [m for m in keeps if not any(o.startswith(m + ".") for o in keeps)]


def partitionable_spans(problem: Problem) -> list:
    """Every span a plan may name, random modules included: what a plan's partitions are
    looked up in (the planners choose from :func:`module_spans`)."""
    from .token_span import token_spans

    if problem.trace.meta.get("compiled") is not None:
        return []
    return _batch_spans(problem) + _sequence_spans(problem) + token_spans(problem)


def _batch_spans(problem: Problem) -> list[Span]:
    """Every module that can be partitioned along dim 0, random ones included (cached)."""
    cached = getattr(problem, "_partitionable_spans", None)
    if cached is None:
        cached = problem._partitionable_spans = _module_spans(problem)
    return cached


def _sequence_spans(problem: Problem) -> list[Span]:
    """The position-wise modules, split over their positions, random ones included (cached:
    :func:`taichi_plan.problem.partition.position_span.sequence_spans`)."""
    cached = getattr(problem, "_sequence_spans", None)
    if cached is None:
        from .position_span import sequence_spans

        cached = problem._sequence_spans = sequence_spans(problem, _batch_spans(problem))
    return cached


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


def _called_modules(problem: Problem, under: dict) -> set[str]:
    """The modules whose forward the step called (trace v8 ``meta.called_modules``): replay
    partitions a module by wrapping its forward, and a container (``ModuleList``,
    ``ModuleDict``) runs its children's ops without ever being called, so a wrapper on it
    would never run. Older traces: every module with ops under it except those that look like
    such a container, with no ops of their own and only numbered children (a ``Sequential``
    of that shape is left out too: one option fewer, never a plan that cannot run)."""
    known = problem.trace.meta.get("called_modules")
    if known is not None:
        return set(known)
    own = set(problem.op_module)
    children: dict[str, list[str]] = {}
    for m in under:
        if "." in m:
            parent, last = m.rsplit(".", 1)
            children.setdefault(parent, []).append(last)
    return {m for m in under
            if m in own or m not in children or not all(c.isdigit() for c in children[m])}


def _module_spans(problem: Problem) -> list[Span]:
    if not problem.trace.meta.get("workload"):
        return []  # no model to run the module of (hand-built traces): nothing to replay
    phases = np.asarray(problem.op_phase)
    under = ops_under(problem.op_module)
    batch = _batch_size(problem) or 1
    shapes = problem.trace.tensors["shape"].tolist()
    writes_state = _writes_state(problem)
    called = _called_modules(problem, under)
    calls = problem.trace.meta.get("module_args") or {}  # trace v10: one entry per forward call
    keeps = problem._keeps_state = []
    out = []
    for m in sorted(under):
        if m not in called:
            continue  # a ModuleList or ModuleDict: never called, so nothing can run it on chunks
        ops = under[m]
        f = ops[phases[ops] == "forward"]
        b = ops[phases[ops] == "backward"]
        if len(f) < 2 or len(b) < 1:
            continue
        occ = _occurrences(f, b)
        if occ is None or len(calls.get(m, occ)) != len(occ):
            continue  # called more than once per forward (back to back, ALBERT), or interleaved: not modelled
        if any(any(k in problem.op_name[i] for k in MIXES_BATCH) for i in (*f.tolist(), *b.tolist())):
            continue
        if any(writes_state[f0:f1 + 1].any() for (f0, f1), _ in occ):
            continue  # a re-run forward would update a buffer (a running statistic) twice
        (f0, f1), bwd = occ[0]
        random_ops = tuple(i for i in range(f0, f1 + 1) if draws_random(problem, i))
        made = np.nonzero(np.logical_or.reduce([(problem.start >= a) & (problem.start <= z) for (a, z), _ in occ])
                          & ~problem.initial)[0]
        if any(leaves_state(problem, made, a, z) for (a, z), _ in occ):
            keeps.append(m)
            continue  # a re-run forward would add to that state again (leaves_state)
        ok = batch > 1
        for t in made.tolist() if ok else ():
            if t >= len(shapes):  # a partition's own bookkeeping tensor
                continue
            if problem.kind[t] not in ("activation", "temporary") or constant_tensor(problem, t):
                continue
            shp = shapes[t]
            if len(shp) == 0 or shp[0] < batch or shp[0] % batch:
                ok = False
                break
        if ok and "python_refs" not in problem.trace.meta and casts_parameter(problem, f0, f1):
            ok = False  # when autocast's cache lets go of a weight's cast is not known: not split
        out.append(Span(m, (f0, f1), bwd, batch, random_ops, split=ok, more=tuple(occ[1:])))
    return out


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
    (:func:`_chunked_peaks` models it, from when the step's code lets go of the cast: trace
    ``python_refs``; a trace without them, an older Trainer recording, does not split such
    modules), and so over positions (the cast is a constant of the span, not one row per
    position: :func:`taichi_plan.problem.partition.position_span.not_position_wise`)."""
    reads = read_args(problem)
    return any(_casts_weight(problem, i, reads) for i in range(f0, f1 + 1))


def _casts_weight(problem: Problem, op: int, reads: dict) -> bool:
    """Is op ``op`` a ``_to_copy`` of a parameter (``reads``: :func:`read_args`)?"""
    return problem.op_name[op] == "aten._to_copy.default" and any(
        problem.kind[t] == "parameter" for t in reads.get(op, ()))


def _occurrences(f: np.ndarray, b: np.ndarray) -> list[tuple[tuple[int, int], tuple[int, int]]] | None:
    """The module's (forward, backward) op spans, one per micro-batch: its forward ops in
    contiguous runs, as many backward runs, each backward after its forward and before the
    next forward (a module called twice in one forward has its backwards after both: None)."""
    def runs(x: np.ndarray) -> list[tuple[int, int]]:
        cut = np.nonzero(np.diff(x) != 1)[0]
        starts, ends = np.r_[x[0], x[cut + 1]], np.r_[x[cut], x[-1]]
        return [(int(a), int(z)) for a, z in zip(starts.tolist(), ends.tolist(), strict=True)]

    fr, br = runs(f), runs(b)
    if len(fr) != len(br):
        return None
    for i, ((_f0, f1), (b0, b1)) in enumerate(zip(fr, br, strict=True)):
        if not f1 < b0 or (i + 1 < len(fr) and not b1 < fr[i + 1][0]):
            return None
    if len({z - a for a, z in fr}) != 1:
        return None  # each micro-batch runs the same ops
    return list(zip(fr, br, strict=True))


def occurrence_spans(span) -> list:
    """``span`` once per micro-batch of the step: the first, then one per later (forward,
    backward) pair (a token span, or a module run once, is its own only occurrence)."""
    more = getattr(span, "more", ())
    if not more:
        return [span]
    return [dataclasses.replace(span, fwd=fw, bwd=bw, more=()) for fw, bw in ((span.fwd, span.bwd), *more)]


def _added_to_grads(problem: Problem, b0: int, b1: int) -> set[int]:
    """Tensors made in backward ops ``b0..b1`` that an op there adds in place into a gradient
    that existed before (gradient accumulation: a later micro-batch, or gradients kept by
    ``zero_grad(set_to_none=False)``). Chunked, each chunk makes its own whole one; autograd
    sums them in the parameter's input buffer as it does without old gradients (the first
    chunk's, then each later one added out of place), and the parameter's AccumulateGrad adds
    the sum into the old gradient in place once the last chunk's node is done."""
    writes = _written(problem)
    out: set[int] = set()
    for i in range(b0, b1 + 1):
        into = [t for t in writes.get(i, ()) if problem.kind[t] == "gradient" and problem.start[t] < b0]
        if into:
            out.update(t for t in problem.op_reads[i].tolist()
                       if b0 <= problem.producer[t] <= b1 and problem.kind[t] != "gradient" and t not in into)
    return out


def _written(problem: Problem) -> dict[int, list[int]]:
    """Op -> the storages it writes in place (cached)."""
    cached = getattr(problem, "_written_in_place", None)
    if cached is None:
        acc = problem.trace.accesses
        w = acc[acc["role"] == "write"]
        cached = {}
        for op, t in zip(w["op_id"].tolist(), w["tensor_id"].tolist(), strict=True):
            i = problem.index_of(int(t))
            if problem.producer[i] != op:
                cached.setdefault(int(op), []).append(i)
        problem._written_in_place = cached
    return cached


def _writes_state(problem: Problem) -> np.ndarray:
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


def _batch_size(problem: Problem) -> int | None:
    """The recorded step's batch size when above 1 (:func:`taichi_plan.problem.core.batch_and_seq`)."""
    b, _s = batch_and_seq(problem.trace.meta)
    return b if b is not None and b > 1 else None


def launch_overhead_s(problem: Problem) -> float:
    name = problem.trace.meta.get("device_profile")
    if name:
        try:
            from ...trace.devices import get_profile

            return float(get_profile(name).launch_overhead_s)
        except Exception:  # noqa: BLE001 - an unknown profile name in an old trace
            pass
    return DEFAULT_LAUNCH_S


def partition_cost(problem: Problem, span: Span, chunks: int) -> float:
    if getattr(span, "more", ()):  # once per micro-batch
        return sum(partition_cost(problem, s, chunks) for s in occurrence_spans(span))
    if span.over == "tokens":
        from . import token_span

        return token_span.cost(problem, span, chunks, launch_overhead_s(problem))
    f0, f1 = span.fwd
    b0, b1 = span.bwd
    n_fwd, n_bwd = f1 - f0 + 1, b1 - b0 + 1
    redo = float(problem.op_cost[f0:f1 + 1].sum())
    cal = problem.trace.meta.get("runtime_overhead") or {}
    if problem.trace.cost_unit == "s" and "chunk_op_s" in cal and "checkpoint_op_s" in cal:
        # Measured on the recorded model's own modules (taichi_plan.runtime.calibrate): what
        # checkpointing costs per forward op beyond the re-run, and what each further chunk
        # costs per op it runs again (forward, re-run, backward: each op launched once more);
        # and each chunk is one torch.utils.checkpoint call, whose own cost a small module
        # (a norm of a few ops) does not amortize (checkpoint_call_s, absent in older traces).
        return (redo + n_fwd * cal["checkpoint_op_s"] + (chunks - 1) * (2 * n_fwd + n_bwd) * cal["chunk_op_s"]
                + chunks * float(cal.get("checkpoint_call_s", 0.0)))
    return redo + chunks * (n_fwd + n_bwd) * launch_overhead_s(problem)


def internal_tensors(problem: Problem, span: Span) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(forward transients, saved-internal, backward transients) tensor indices of ``span``."""
    f0, f1 = span.fwd
    b0, b1 = span.bwd
    kinds_ok = _own_kinds(problem)
    made_f = kinds_ok & (problem.start >= f0) & (problem.start <= f1)
    made_b = kinds_ok & (problem.start >= b0) & (problem.start <= b1) & (problem.end <= b1)
    for t in np.nonzero(made_f | made_b)[0].tolist():
        if constant_tensor(problem, t):
            made_f[t] = made_b[t] = False
    f_trans = np.nonzero(made_f & (problem.end <= f1))[0]
    later = np.nonzero(made_f & (problem.end > f1))[0]
    # Saved for the module's own backward: used nowhere else, and alive until its backward (a
    # tensor freed between the two, such as a key/value cache the caller drops, keeps its size).
    saved = np.asarray([t for t in later.tolist()
                        if problem.end[t] >= b0
                        and np.all(((problem.uses[t] >= f0) & (problem.uses[t] <= f1))
                                  | ((problem.uses[t] >= b0) & (problem.uses[t] <= b1)))], dtype=np.int64)
    b_trans = np.nonzero(made_b)[0]
    return f_trans, saved, b_trans


def _own_kinds(problem: Problem) -> np.ndarray:
    """Per tensor: an activation or temporary the step makes and frees (not there before it,
    not outliving it). Once per problem: every span asks (4273 on a 93k-op trace)."""
    mask = problem.__dict__.get("_internal_kinds")
    if mask is None:
        mask = np.isin(problem.kind, ("activation", "temporary")) & ~problem.initial & ~problem.persists
        problem.__dict__["_internal_kinds"] = mask
    return mask


_SYNTHETIC_ID = -(10**12)  # ids of the concatenation transients (below any -1 - tensor_id)


def module_inputs(problem: Problem, span: Span) -> list[int]:
    """Tensors made before the module (not parameters) that its checkpoint holds: those its
    forward reads, and its call's other tensor arguments (trace v10 ``meta.module_args``: a
    decoder layer's position ids, passed and never read, stay held all the same)."""
    f0, f1 = span.fwd
    ins: set[int] = set()
    for i in range(f0, f1 + 1):
        for t in problem.op_reads[i].tolist():
            if (problem.start[t] < f0 or problem.initial[t]) and problem.kind[t] in ("activation", "temporary", "input"):
                ins.add(t)
    for t in _call_args(problem, span):
        if ((problem.start[t] < f0 <= problem.end[t] or problem.initial[t])
                and problem.kind[t] in ("activation", "temporary", "input")):
            ins.add(t)
    return sorted(ins)


def _call_args(problem: Problem, span: Span) -> list[int]:
    """The tensor arguments (problem indices) of the module call whose forward starts at the
    span's first op: the call of that order among the module's calls (its forward runs in the
    trace, one per call: ``_module_spans`` offers no other module). Empty for traces before v10."""
    calls = (problem.trace.meta.get("module_args") or {}).get(span.module)
    if not calls or span.over == "tokens":
        return []
    fwd = problem.__dict__.get("_forward_ops_under")
    if fwd is None:
        phases = np.asarray(problem.op_phase)
        fwd = problem.__dict__["_forward_ops_under"] = {m: ops[phases[ops] == "forward"]
                                                        for m, ops in ops_under(problem.op_module).items()}
    f = fwd.get(span.module)
    if f is None:
        return []
    k = int(np.sum((np.diff(f) != 1)[f[1:] <= span.fwd[0]])) if len(f) > 1 else 0  # runs before this one
    if k >= len(calls):
        return []
    index = problem._index
    return [index[int(tid)] for tid in calls[k][1] if int(tid) in index]


def span_tensors(problem: Problem, span: Span) -> set[int]:
    """Tensors a partition owns: everything its forward ops read or make (its inputs are held
    by the checkpointed chunks, its outputs are rebuilt by concatenation), plus its insides."""
    if span.over == "tokens":
        from . import token_span

        return token_span.span_tensors(problem, span)
    out: set[int] = set()
    for s in occurrence_spans(span):
        f0, f1 = s.fwd
        for i in range(f0, f1 + 1):
            out.update(problem.op_reads[i].tolist())
            out.update(problem.op_outputs[i].tolist())
        for arr in internal_tensors(problem, s):
            out.update(arr.tolist())
    return out


def whole_outputs(problem: Problem, span: Span) -> set[int]:
    """The outputs of a module checkpointed whole (one chunk) that a plan may still drop: made
    by its forward, read after it only by ops outside the module that run before its backward
    (never by its own backward, whose re-run re-makes what it reads, nor after it, when the
    checkpoint no longer holds the inputs). A drop of one is rebuilt through the module's insides,
    re-run from its inputs, which the checkpoint holds until its backward (the runtime rebuilds
    gone inputs recursively): so a norm checkpointed whole keeps its input alone, not its
    output too. Split into chunks, a module's outputs are joined pieces: never dropped."""
    if span.over == "tokens":
        return set()
    f0, f1 = span.fwd
    b0 = span.bwd[0]
    made = np.nonzero(_own_kinds(problem) & (problem.start >= f0) & (problem.start <= f1) & (problem.end > f1))[0]
    # What a re-run of the module reads from outside it: its inputs (held by the checkpoint)
    # and parameters, which must be in memory at the rebuild (under FSDP: its unit gathered).
    held_in = set(module_inputs(problem, span))
    outside = {u for i in range(f0, f1 + 1) for u in problem.op_reads[i].tolist()
               if problem.start[u] < f0 or problem.initial[u]} - held_in
    rebuild_at = problem.__dict__.get("_first_rebuild")  # per candidate tensor: its first rebuild point
    if rebuild_at is None:
        rebuild_at = {}
        for t, b in zip(problem.candidates.tolist(), problem.cand_remat_before.tolist(), strict=True):
            rebuild_at[t] = min(b, rebuild_at.get(t, b))
        problem.__dict__["_first_rebuild"] = rebuild_at
    out = set()
    for t in made.tolist():
        u = problem.uses[t]
        if ((u > f1).any() and not (u >= b0).any() and t in rebuild_at
                and all(problem.held(x, rebuild_at[t]) for x in outside)):
            out.add(t)
    return out


def blocked_tensors(problem: Problem, span, chunks: int) -> set[int]:
    """Tensors no drop may touch (nor re-make in its rebuild) when ``span`` is partitioned into
    ``chunks``: everything its forward reads or makes (:func:`span_tensors`), except, for one
    chunk, the outputs of :func:`whole_outputs`."""
    owned = span_tensors(problem, span)
    if chunks == 1 and span.over != "tokens":
        for s in occurrence_spans(span):
            owned = owned - whole_outputs(problem, s)
    return owned


def candidate_rebuild_sets(problem: Problem) -> list[set[int] | tuple]:
    """Per candidate of ``problem``: the tensors its lone rebuild at its rebuild point re-makes
    (:func:`~taichi_plan.problem.core.rebuild_set`; empty when it cannot be rebuilt alone).
    They do not depend on the plan: computed once per problem (every simulation of a plan with
    partitions asks, and on a 93k-op trace they took 0.1 s each time)."""
    cached = problem.__dict__.get("_cand_rebuild_sets")
    if cached is None or cached[0] is not problem.candidates:  # (the candidates they are for, sets)
        cached = (problem.candidates, [rebuild_set(problem, int(t), int(b)) or () for t, b in
                                       zip(problem.candidates.tolist(), problem.cand_remat_before.tolist(), strict=True)])
        problem.__dict__["_cand_rebuild_sets"] = cached
    return cached[1]


def apply_partitions(problem: Problem, partitions, drops=()) -> tuple[Problem, float]:
    """A problem with the partitions applied (see the module docstring), and their cost.
    ``drops`` may not touch a partitioned module's internal tensors."""
    if not partitions:
        return problem, 0.0
    return _apply_partitions(problem, partitions, drops, live_only=False)


def partitioned_live(problem: Problem, partitions) -> np.ndarray:
    """The unplanned live bytes per op with ``partitions`` applied: :func:`apply_partitions`'s
    ``baseline_live``, without building its problem (its candidates and indexes, which the
    floor's hundreds of partition options never read: 10 s of a 30 s limit on a 93k-op trace)."""
    if not partitions:
        return problem.baseline_live
    return _apply_partitions(problem, partitions, (), live_only=True)[0]


def _apply_partitions(problem: Problem, partitions, drops, live_only: bool):
    if len({p.module for p in partitions}) != len(partitions):
        raise PlanError("The plan partitions the same module twice (along its batch and over tokens?); keep one.")
    names = [p.module for p in partitions]
    for x in names:
        for y in names:
            if x != y and is_under(y, x):
                raise PlanError(f"The plan partitions both {x!r} and {y!r}, which is inside it; keep one.")
    spans = {span_key(s): s for s in partitionable_spans(problem)}
    nbytes = problem.nbytes.copy()
    start = problem.start.copy()
    end = problem.end.copy()
    new_t, new_id, new_nb, new_s, new_e = [], [], [], [], []
    cost = 0.0
    internal: set[int] = set()  # no drop may touch these, nor re-make one in its rebuild
    through: set[int] = set()  # insides of modules checkpointed whole: a rebuild may re-run them
    recast: set[int] = set()  # of those, casts of weights the module re-makes (_saved_constants)
    whole_outs: set[int] = set()  # their outputs a plan may drop (whole_outputs)
    for part in partitions:
        span = spans.get(span_key(part))
        if span is None or part.dim != (1 if span.over == "sequence" else 0):
            what = {"tokens": "its loss over tokens", "sequence": "over its positions (the sequence)"}.get(
                span_key(part)[1], f"along dim {part.dim}")
            raise PlanError(
                f"The plan partitions module {part.module!r} {what}, but in this trace that module is not "
                "independent along it, leaves a tensor behind in the model's state that a re-run would "
                "make again (a KV cache: run the model with use_cache=False), or is not there. Partition "
                "only modules that `taichi-plan solve` proposes; the plan may be for another trace."
            )
        k = int(part.chunks)
        if k > 1 and span.random_ops and not (problem.partition_random or getattr(part, "random_draws", None)):
            raise PlanError(
                f"The plan partitions module {part.module!r}, which draws random numbers (op "
                f"{span.random_ops[0]}, {problem.op_name[span.random_ops[0]]}), but does not record that its chunks "
                "draw their own: partitioning it changes training. Solve again with --partition-random to allow it.")
        if span.over == "sequence" and k not in span.chunk_choices:
            raise PlanError(f"The plan splits {part.module!r} into {k} runs of its {span.batch} positions; use one of "
                            f"{', '.join(map(str, span.chunk_choices))} (they divide the positions and are not batch "
                            "chunks already).")
        if span.over == "tokens" and k < 2:
            raise PlanError(f"The plan computes {part.module!r}'s loss in {k} chunk(s) of its tokens; use 2 or more.")
        if k < 1 or k > span.batch or (k > 1 and not getattr(span, "split", True)):
            most = span.batch if getattr(span, "split", True) else 1
            raise PlanError(f"The plan splits {part.module!r} into {k} chunks; use 1..{most} (1: checkpointed "
                            "whole; more only where the module is independent along its batch).")
        if span.over == "tokens":
            from . import token_span

            added: list[tuple[int, int, int, int]] = []
            internal.update(token_span.apply(problem, span, k, nbytes, start, end, added))
            for like, nb, s0, s1 in added:
                new_t.append(like)
                new_id.append(_SYNTHETIC_ID - len(new_id))
                new_nb.append(nb)
                new_s.append(s0)
                new_e.append(s1)
            cost += partition_cost(problem, span, k)
            continue
        for occ in occurrence_spans(span):  # once per micro-batch
            if k == 1:
                owned = _checkpointed_whole(problem, occ, nbytes, end, new_t, new_id, new_nb, new_s, new_e)
                outs = whole_outputs(problem, occ)
                if outs:
                    through.update(t for t in owned if problem.start[t] >= occ.fwd[0] and t not in outs)
                    whole_outs.update(outs)
                    recast.update(_saved_constants(problem, occ))
                internal.update(owned - outs)
                continue
            internal.update(span_tensors(problem, occ))
            for at, nb in _chunked_peaks(problem, occ, k, nbytes, start, end).items():
                new_t.append(-1)
                new_id.append(_SYNTHETIC_ID - len(new_id))
                new_nb.append(nb)
                new_s.append(at)
                new_e.append(at)
        cost += partition_cost(problem, span, k)
    clash = [d.tensor for d in drops if d.tensor in internal]
    if clash:
        raise PlanError(
            f"The plan both drops tensor {int(problem.tensor_id[clash[0]])} and partitions a module that "
            "reads or makes it; a partitioned module keeps its inputs and recomputes its insides."
        )
    extra = np.asarray(new_t, dtype=np.int64)
    like = np.where(extra >= 0, extra, 0)
    kinds_new = np.where(extra >= 0, problem.kind[like], "temporary") if len(extra) else problem.kind[:0]
    if live_only:
        return _live_of(problem.num_ops, np.concatenate([start, np.asarray(new_s, dtype=np.int64)]),
                        np.concatenate([end, np.asarray(new_e, dtype=np.int64)]),
                        np.concatenate([nbytes, np.asarray(new_nb, dtype=np.int64)])), cost
    # Candidates left: outside every partition, and whose lone rebuild re-makes nothing of one.
    sets = candidate_rebuild_sets(problem)
    keep = np.fromiter((int(t) not in internal and internal.isdisjoint(r)
                        for t, r in zip(problem.candidates.tolist(), sets, strict=True)),
                       dtype=bool, count=len(problem.candidates))
    empty = np.zeros(0, dtype=np.int64)
    out = dataclasses.replace(
        problem,
        tensor_id=np.concatenate([problem.tensor_id, np.asarray(new_id, dtype=np.int64)]),
        nbytes=np.concatenate([nbytes, np.asarray(new_nb, dtype=np.int64)]),
        kind=np.concatenate([problem.kind, kinds_new]),
        producer=np.concatenate([problem.producer, np.full(len(extra), -1, dtype=np.int64)]),
        start=np.concatenate([start, np.asarray(new_s, dtype=np.int64)]),
        end=np.concatenate([end, np.asarray(new_e, dtype=np.int64)]),
        uses=problem.uses + [empty] * len(extra),
        # Replay runs a partitioned module's forward on chunks: none of the tensors it reads or
        # makes exists as the trace's op made it, so no rebuild can re-run one of those ops;
        # but a module checkpointed whole runs its forward as recorded, and a dropped output of
        # it is rebuilt through its insides (whole_outputs).
        rematerializable=np.concatenate([_set_mask(_set_mask(problem.rematerializable, internal - through, False), recast, True),
                                         np.zeros(len(extra), dtype=bool)]),
        rebuild_ops=_recast_ops(problem, recast) + [empty] * len(extra),
        remat_deadline=np.concatenate([problem.remat_deadline, np.zeros(len(extra), dtype=np.int64)]),
        initial=np.concatenate([problem.initial, np.zeros(len(extra), dtype=bool)]),
        persists=np.concatenate([problem.persists, np.zeros(len(extra), dtype=bool)]),
        candidates=problem.candidates[keep],
        cand_free_after=problem.cand_free_after[keep],
        cand_remat_before=problem.cand_remat_before[keep],
        cand_early_remat=problem.cand_early_remat[keep],
    )
    out.baseline_live = _live(out)
    if whole_outs:
        # A whole module's output has no early-rebuild point here (it was found with the
        # module's insides alive), and stays a candidate only where its rebuild through them
        # can run (whole_outputs checks the parameters; this, the whole chain).
        out.cand_early_remat = np.where(np.isin(out.candidates, list(whole_outs)), -1, out.cand_early_remat)
    lost = [k for k, (t, b) in enumerate(zip(out.candidates.tolist(), out.cand_remat_before.tolist(), strict=True))
            if t in whole_outs and rebuild_set(out, t, b) is None]
    if lost:
        ok = np.ones(len(out.candidates), dtype=bool)
        ok[lost] = False
        out.candidates, out.cand_free_after = out.candidates[ok], out.cand_free_after[ok]
        out.cand_remat_before, out.cand_early_remat = out.cand_remat_before[ok], out.cand_early_remat[ok]
    return out, cost


def _checkpointed_whole(problem: Problem, span: Span, nbytes, end, new_t, new_id, new_nb, new_s, new_e) -> set[int]:
    """One chunk: the module's saved tensors are gone from their last forward use (or when the
    step's code lets go of them, later) until its backward, and so are what it makes from
    parameters alone for its backward (:func:`_saved_constants`); its inputs are held until
    its backward is done (see the module docstring). The re-run before the backward's first
    read of them holds what it re-makes and its own transients at once: where that is more
    than the saved tensors and that op's outputs, the difference is on the timeline there
    (an XLNet layer's attention scores, made late in its forward: 8,832 B over before)."""
    _f_trans, saved, _b_trans = internal_tensors(problem, span)
    first = len(new_t)
    for t in saved.tolist() + _saved_constants(problem, span):
        last_fwd = problem.uses[t][problem.uses[t] <= span.fwd[1]]
        end[t] = int(last_fwd[-1]) if len(last_fwd) else int(problem.start[t])
        # held past its last use while the step's code holds it: autocast's cached cast of a
        # weight stays in the cache until the autocast region ends
        end[t] = problem.release_after(t, int(end[t]))
        new_t.append(t)
        new_id.append(-1 - int(problem.tensor_id[t]))
        new_nb.append(int(nbytes[t]))
        new_s.append(span.bwd[0])
        new_e.append(_rerun_copy_end(problem, t, span, int(problem.end[t])))
    made_f, _held, _outputs, fwd_life, needed = _forward_lives(problem, span)
    r = _rerun_at(problem, span, needed)
    if r is not None:
        there = sum(nb for nb, s0, s1 in zip(new_nb[first:], new_s[first:], new_e[first:], strict=True) if s0 <= r <= s1)
        there += int(problem.nbytes[problem.op_outputs[r]].sum())
        over = _rerun_peak(problem, span, made_f, fwd_life, needed, lambda t: int(problem.nbytes[t])) - there
        if over > 0:
            new_t.append(-1)
            new_id.append(_SYNTHETIC_ID - len(new_id))
            new_nb.append(over)
            new_s.append(r)
            new_e.append(r)
    for t in module_inputs(problem, span):
        if not problem.persists[t]:
            end[t] = max(int(end[t]), span.bwd[1])
    return span_tensors(problem, span)


def _saved_constants(problem: Problem, span: Span) -> list[int]:
    """Tensors the span's forward makes from parameters or buffers alone (no batch in them:
    :func:`constant_tensor`, left out of :func:`internal_tensors`) that only the span's own
    forward and backward use, and that the step's code lets go of before the backward
    starts: autocast's cast of a weight (the cache holds it until its region ends). Checkpointed
    whole, the module saves none of them: each is freed then and cast again by the re-run in
    backward (on a tiny GPT-2 under bf16 autocast with ``mlp.c_fc`` checkpointed: 131,072 B
    of its weight's cast, which the model held through the gap and the run did not)."""
    if "python_refs" not in problem.trace.meta:
        return []  # when the step's code lets go is not known: kept through the gap, the safe side
    f0, f1 = span.fwd
    b0, b1 = span.bwd
    out = []
    made = np.nonzero(_own_kinds(problem) & (problem.start >= f0) & (problem.start <= f1) & (problem.end >= b0))[0]
    for t in made.tolist():
        u = problem.uses[t]
        if (constant_tensor(problem, t) and np.all(((u >= f0) & (u <= f1)) | ((u >= b0) & (u <= b1)))
                and len(u[u >= b0]) and problem.release_after(t, int(u[u <= f1][-1]) if len(u[u <= f1]) else f0) < b0):
            out.append(t)
    return out


def _recast_ops(problem: Problem, recast: set[int]) -> list[np.ndarray]:
    """``problem.rebuild_ops`` with each tensor of ``recast`` re-made by its producer alone:
    a weight's cast that autocast caches (the recorder marks its op not recomputable, since
    dropping it frees nothing while the cache holds it) is gone once a module checkpointed
    whole has run its forward (:func:`_saved_constants`), and a rebuild of that module's
    output through its insides casts the weight again, as the checkpoint's own re-run does.
    Never a drop: these tensors stay internal to the module."""
    if not recast:
        return problem.rebuild_ops
    out = list(problem.rebuild_ops)
    for t in recast:
        out[t] = np.asarray([problem.producer[t]], dtype=np.int64)
    return out


def _set_mask(mask: np.ndarray, tensors: set[int], value: bool) -> np.ndarray:
    """A copy of ``mask`` with ``tensors`` set to ``value`` (``mask`` itself when none)."""
    out = mask.copy()
    if tensors:
        out[np.fromiter(tensors, dtype=np.int64, count=len(tensors))] = value
    return out


def _live(problem: Problem) -> np.ndarray:
    return _live_of(problem.num_ops, problem.start, problem.end, problem.nbytes)


def _live_of(n: int, start: np.ndarray, end: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Bytes live during each of ``n`` ops, each tensor from ``start`` through ``end``."""
    delta = np.zeros(n + 1, dtype=np.int64)
    np.add.at(delta, start, nbytes)
    np.add.at(delta, end + 1, -nbytes)
    return np.cumsum(delta)[:n]


def partition_savings(problem: Problem, span: Span, chunks: int) -> np.ndarray:
    """Bytes the partition frees at each op (baseline minus partitioned live bytes). Cached on
    the problem per (module, over, chunks): the floor and the ILP's options ask for the same
    ones (246 options on a 93k-op trace: :func:`partitioned_live`)."""
    cache = problem.__dict__.setdefault("_partition_savings", {})
    key = (*span_key(span), int(chunks))
    if key not in cache:
        sav = problem.baseline_live - partitioned_live(problem, [as_partition(span, chunks)])
        sav.setflags(write=False)  # shared by every caller
        cache[key] = sav
    return cache[key]


def floor_bytes(problem: Problem) -> np.ndarray:
    """Bytes that must be live during each op under any plan: everything droppable dropped,
    less, at each op, the most that modules partitioned at once can save there (each module's
    best chunk count at that op; since partitions do not nest, a module or the best set of
    modules inside it, whichever saves more). Cached on the problem."""
    spans = module_spans(problem)
    cached = getattr(problem, "_floor_bytes", None)
    if cached is not None and cached[0] is spans:  # (the options it was computed for, floor)
        return cached[1]
    from ...base.deadline import check
    from ..live import min_live_bytes

    floor = min_live_bytes(problem).astype(np.int64)
    own: dict[str, np.ndarray] = {}  # module -> the most any partition of it saves, per op
    for span in spans:
        check("finding the least memory any plan needs (the floor)")
        for k in span.chunk_choices:
            sav = np.maximum(partition_savings(problem, span, k), 0)
            own[span.module] = np.maximum(own[span.module], sav) if span.module in own else sav
    best: dict[str, np.ndarray] = {}
    for m in sorted(own, key=lambda x: -x.count(".")):  # innermost first
        inner = [c for c in best if c != m and is_under(c, m) and not any(
            d != c and d != m and is_under(c, d) and is_under(d, m) for d in own)]
        best[m] = np.maximum(own[m], sum((best[c] for c in inner), np.zeros_like(own[m])))
    for m, sav in best.items():
        if not any(d != m and is_under(m, d) for d in own):  # outermost: disjoint, so they add
            floor = floor - sav
    problem._floor_bytes = (spans, floor)
    return floor


# What the autograd engine runs after a node's apply, on the gradients it returned
# (validate_outputs: a broadcast input's gradient summed to its shape), and views between.
_ENGINE_TAIL_OPS = frozenset({"aten.sum.dim_IntList", "aten.view.default", "aten._unsafe_view.default",
                              "aten.reshape.default", "aten.t.default", "aten.detach.default"})


def apply_end(problem: Problem, last: int, end: int) -> int:
    """The last op of the node that read a saved tensor last at op ``last`` and freed it at
    ``end`` in the trace: ``end``, or, where the ops after ``last`` through ``end`` are only
    the engine's sums of a broadcast input's gradient to its shape (with views), the op before
    the first of them. Unplanned, the node's saved variable holds the tensor until the engine
    releases the node, after those sums; re-made by a checkpoint's re-run, it is held only
    while the node's apply runs, before them (measured: a bias-sized gradient sum, 128 B, at
    the peak of a ConvNeXt layer's and of a residual block's backward split in chunks)."""
    e = end
    while e > last and problem.op_name[e] in _ENGINE_TAIL_OPS:
        e -= 1
    sums = [i for i in range(e + 1, end + 1) if problem.op_name[i] == "aten.sum.dim_IntList"]
    if sums and all(_keeps_dims(problem, i) for i in sums):
        return e
    return end


def _keeps_dims(problem: Problem, op: int) -> bool:
    """Does the sum at ``op`` keep the dimensions it reduces, as the engine's ``sum_to`` does
    (``keepdim=True``, then a view: its output has a dimension of size 1)? A sum that drops them
    (``.sum(0)`` in a custom ``autograd.Function``'s backward) is the node's own code, run while
    its apply still holds what it unpacked (measured: 512 B above the prediction when it was
    taken for the engine's). Read from the shape its output storage was made with."""
    cache = problem.__dict__.setdefault("_sum_keeps_dims", {})
    if op not in cache:
        shapes = problem.__dict__.get("_tensor_shapes")
        if shapes is None:
            t = problem.trace.tensors
            shapes = problem.__dict__["_tensor_shapes"] = dict(zip(t["tensor_id"].tolist(), t["shape"], strict=True))
        acc = problem.trace.accesses
        rows = acc[(acc["op_id"].to_numpy() == op) & (acc["role"].to_numpy() == "write")]
        out = [shapes.get(int(t)) for t in rows["tensor_id"]]
        cache[op] = bool(out) and out[0] is not None and 1 in list(out[0])
    return cache[op]


def _uses_in(problem: Problem, t: int, lo: int, hi: int) -> np.ndarray:
    u = problem.uses[t]
    return u[(u >= lo) & (u <= hi)]


def _forward_lives(problem: Problem, span: Span) -> tuple[list[int], set[int], list[int], dict[int, int], list[int]]:
    """How a checkpointed run of ``span``'s forward holds what it makes: (the tensors it makes,
    those the step's code holds past it (``held``), its outputs, each other tensor's last op in
    a checkpointed forward (the checkpoint keeps none for the backward), the tensors its
    backward needs, re-made by the re-run)."""
    f0, f1 = span.fwd
    b0, b1 = span.bwd
    own = problem.__dict__.get("_made_by_step")  # the same for every span: computed once per problem
    if own is None:
        own = problem.__dict__["_made_by_step"] = (np.isin(problem.kind, ("activation", "temporary", "input", "gradient"))
                                                   & ~problem.initial & ~problem.persists)
    made_f = np.nonzero(own & (problem.start >= f0) & (problem.start <= f1))[0].tolist()
    # Made from parameters alone and held past the span by the step's code, never by a chunk:
    # autocast's cast of a weight, which its cache keeps until the region ends. The first
    # chunk casts it, the others find it cached; each chunk's re-run in backward, in an autocast
    # region of its own, casts it again for that chunk's backward.
    held = {t for t in made_f if constant_tensor(problem, t) and f1 < int(problem.python_release[t]) < b0
            and len(_uses_in(problem, t, b0, b1))}
    outputs, fwd_life, needed = [], {}, []
    for t in made_f:
        in_b = _uses_in(problem, t, b0, b1)
        if t in held:
            needed.append(t)
            continue
        after = problem.uses[t][(problem.uses[t] > f1) & ((problem.uses[t] < b0) | (problem.uses[t] > b1))]
        if len(after) or (problem.end[t] > f1 and not len(in_b) and problem.end[t] < b0) or problem.end[t] > b1:
            outputs.append(t)
            fwd_life[t] = f1
        elif problem.end[t] > f1:  # saved for the backward: gone after its last forward use
            last = _uses_in(problem, t, f0, f1)
            last = int(last[-1]) if len(last) else int(problem.start[t])
            fwd_life[t] = min(problem.release_after(t, last), f1)
        else:
            fwd_life[t] = int(problem.end[t])
        if len(in_b):
            needed.append(t)
    return made_f, held, outputs, fwd_life, needed


def _outside_read_in_backward(problem: Problem, span: Span, made_f: list[int]) -> set[int]:
    """Tensors made outside ``span``'s forward, alive into its backward and freed there, that
    its backward reads (the output's gradient, an input the backward reads)."""
    b0, b1 = span.bwd
    made = set(made_f)
    return {t for t in np.nonzero((problem.start < b0) & (problem.end >= b0) & (problem.end <= b1) & ~problem.persists
                                  & ~np.isin(problem.kind, ("parameter", "buffer", "optimizer_state")))[0].tolist()
            if t not in made and len(_uses_in(problem, t, b0, b1))}


def _rerun_at(problem: Problem, span: Span, needed: list[int]) -> int | None:
    """The op of ``span``'s backward before which a checkpoint re-runs its forward: the first
    that reads what the forward saved (a tensor it made, a parameter, or one made before it
    that the backward frees: an input it saved); None when the backward needs nothing of it."""
    if not needed:
        return None
    f0 = span.fwd[0]
    b0, b1 = span.bwd
    needed_set = set(needed)
    kind, start, end, persists = problem.kind, problem.start, problem.end, problem.persists
    for i in range(b0, b1 + 1):
        for x in problem.op_reads[i].tolist():
            if x in needed_set or kind[x] == "parameter" or (
                    start[x] < f0 and b0 <= end[x] <= b1 and not persists[x]
                    and kind[x] not in ("buffer", "optimizer_state")):
                return i
    return None


def _rerun_copy_end(problem: Problem, t: int, span: Span, unread: int) -> int:
    """The last op of ``span``'s backward that holds the copy of ``t`` a checkpoint's re-run
    made: freed when the node that reads it last is done (the trace's own end there: a node
    that reads it in its first op and runs more, autocast's cast of a weight under an addmm's
    backward), but before the engine's sums that follow the node's apply (:func:`apply_end`:
    the copy is the apply's, not a saved variable's), or when the step's code lets go, if
    later. ``unread``: the answer where the backward does not read it."""
    b0, b1 = span.bwd
    last = _uses_in(problem, t, b0, b1)
    if not len(last):
        return min(unread, b1)
    e = int(problem.release_after(t, int(last[-1])))
    if int(last[-1]) <= int(problem.end[t]) <= b1:
        e = max(e, apply_end(problem, int(last[-1]), int(problem.end[t])))
    return min(e, b1)


def _rerun_peak(problem: Problem, span: Span, made_f: list[int], fwd_life: dict[int, int], needed: list[int],
                piece) -> int:
    """The most bytes of ``span``'s own tensors alive while a checkpoint re-runs its forward in
    backward (early stop: up to the last op making a tensor the backward needs, each of which
    it holds from then on; the others live as in forward), each tensor ``piece(t)`` bytes."""
    f0 = span.fwd[0]
    needed_set = set(needed)
    stop = max(int(problem.producer[t]) if problem.producer[t] >= 0 else f0 for t in needed)
    rec = np.zeros(stop - f0 + 2, dtype=np.int64)
    for t in made_f:
        s = int(problem.start[t])
        if s > stop:
            continue
        e = stop if t in needed_set else min(fwd_life[t], stop)
        rec[s - f0] += piece(t)
        rec[e - f0 + 1] -= piece(t)
    return int(np.cumsum(rec)[:-1].max())


def _chunked_peaks(problem: Problem, span: Span, k: int, nbytes, start, end) -> dict[int, int]:
    """The span run in ``k`` chunks, each checkpointed (``runtime/partition.py``), event by
    event: the bytes of the span's own tensors at the worst moment of each of its ops, over
    the ``k`` times each op runs (and the re-run forward and the joins in between).

    The span's own tensors (made by its forward or backward ops) leave the per-op timeline
    (``nbytes`` 0); its outputs and input gradients re-enter it whole, joined, after the
    span; the returned bytes stand for all the rest. A chunk runs the span's ops as the trace
    did, each of its tensors a ``1/k`` piece (a full copy for one with no batch rows), with
    the trace's lifetimes, except:

    * forward: a tensor its backward uses is freed at its last forward use (the checkpoint
      keeps none); each chunk's outputs wait for the others; then ``cat`` holds the pieces
      and the joined outputs at once;
    * backward (the chunks in reverse order, each whole before the next): before the first
      op that reads what the forward saved, the chunk's forward is re-run up to the last
      tensor its backward needs (non-reentrant checkpoint's early stop); each chunk's input
      gradients wait for the others and are joined after the last chunk (``split``'s
      backward); a parameter's gradient is made by the first chunk and every later chunk's
      is added to it out of place (old, new and sum at once); a tensor made before the span
      and freed inside it (the output's gradient, an input the backward reads) stays until
      the last chunk is done with it.
    """
    f0, f1 = span.fwd
    b0, b1 = span.bwd
    shapes = problem.trace.tensors["shape"].tolist()
    batch = span.batch

    accumulated = _added_to_grads(problem, b0, b1)

    def piece(t: int) -> int:
        if t in accumulated:
            return int(problem.nbytes[t])  # a parameter's whole gradient, made by each chunk
        if span.over == "sequence":
            from .position_span import chunk_piece

            return chunk_piece(problem, span, t, k, shapes)
        nb = int(problem.nbytes[t])
        shp = shapes[t] if t < len(shapes) else []
        if constant_tensor(problem, t) or problem.kind[t] == "gradient" or not len(shp) or shp[0] < batch or shp[0] % batch:
            return nb
        return -(-nb // k)

    made_f, held, outputs, fwd_life, needed = _forward_lives(problem, span)
    made_b = np.nonzero(~problem.initial & (problem.start >= b0) & (problem.start <= b1)
                        & (problem.producer >= b0) & (problem.producer <= b1))[0].tolist()
    made_b = [t for t in made_b if problem.kind[t] != "parameter"]

    for t in made_f:
        nbytes[t] = 0
    for t in held:  # on the step's timeline: from the span's start (the first chunk) to its release
        nbytes[t] = problem.nbytes[t]
        start[t] = f0
        end[t] = int(problem.python_release[t])
    for t in outputs:  # joined after the forward span, whole
        start[t] = f1 + 1
        nbytes[t] = problem.nbytes[t]
    out_piece = sum(piece(t) for t in outputs)

    # Forward: the last chunk, with the k - 1 chunks' outputs before it waiting; then the cat.
    peaks: dict[int, int] = {}
    delta = np.zeros(f1 - f0 + 2, dtype=np.int64)
    for t in made_f:
        if t in held:
            continue
        delta[int(problem.start[t]) - f0] += piece(t)
        delta[fwd_life[t] - f0 + 1] -= piece(t)
    live = np.cumsum(delta)[:-1] + (k - 1) * out_piece
    for i in range(f0, f1 + 1):
        peaks[i] = int(live[i - f0])
    peaks[f1] = max(peaks[f1], k * out_piece + sum(int(problem.nbytes[t]) for t in outputs))
    # The inputs: each chunk's checkpoint holds its piece until that chunk's backward, so an
    # input the trace frees before the backward (saved only as a cast, under autocast) lives
    # until the last chunk's backward is done; one the backward reads is handled below (ext).
    for t in module_inputs(problem, span):
        if not problem.persists[t]:
            end[t] = max(int(end[t]), b1 if int(problem.end[t]) < b0 else f1)

    # Backward.
    grads = [t for t in made_b if problem.kind[t] == "gradient"]
    in_grads = [t for t in made_b if problem.kind[t] != "gradient" and problem.end[t] > b1]
    local_b = [t for t in made_b if problem.kind[t] != "gradient" and problem.end[t] <= b1]
    added = [t for t in local_b if t in accumulated]
    local_b = [t for t in local_b if t not in accumulated]
    for t in made_b:
        nbytes[t] = 0
    for t in in_grads + grads:  # joined (or accumulated) after the backward span, whole
        start[t] = b1 + 1
        nbytes[t] = problem.nbytes[t]
    # A parameter cast once for every chunk (``held``: autocast's cached cast) has one cast node
    # in the graph: the chunks' gradients w.r.t. the cast (in the cast's dtype) are summed in
    # that node's input buffer, and the cast's backward makes the parameter's gradient once,
    # after the last chunk. So those are what the chunks accumulate, and the gradient (or the
    # one added into an old gradient) appears at the span's end.
    cast_of: dict[int, int] = {}
    if held:
        local_set = set(local_b)
        for t in grads + added:
            pr = int(problem.producer[t])
            ins = [d for d in problem.op_reads[pr].tolist() if d in local_set]
            if problem.op_name[pr] == "aten._to_copy.default" and len(ins) == 1:
                cast_of[t] = ins[0]
        local_b = [t for t in local_b if t not in set(cast_of.values())]
    acc_grads = [cast_of.get(t, t) for t in grads]
    acc_added = [cast_of.get(t, t) for t in added]
    cast_made = sum(int(problem.nbytes[t]) for t in cast_of)
    ext = _outside_read_in_backward(problem, span, made_f)
    r = _rerun_at(problem, span, needed)
    n = b1 - b0 + 1
    base = np.zeros(n + 1, dtype=np.int64)  # one chunk's own backward tensors, per op
    for t in local_b:
        base[int(problem.start[t]) - b0] += piece(t)
        base[int(problem.end[t]) - b0 + 1] -= piece(t)
    gpiece = np.zeros(n + 1, dtype=np.int64)
    for t in in_grads:
        gpiece[int(problem.producer[t]) - b0] += piece(t)
    gpiece = np.cumsum(gpiece)[:-1]
    saved_b = np.zeros(n + 1, dtype=np.int64)
    back_until: dict[int, int] = {}  # a re-made tensor the backward needs -> its last op
    if r is not None:
        for t in needed:
            back_until[t] = e = _rerun_copy_end(problem, t, span, r)
            saved_b[r - b0] += piece(t)
            saved_b[e - b0 + 1] -= piece(t)
    own_b = np.cumsum(base)[:-1] + gpiece + np.cumsum(saved_b)[:-1]
    ext_after = np.zeros(n, dtype=np.int64)  # outside tensors the last chunk has freed by op i
    for t in ext:
        e = int(problem.end[t])
        if e < b1:
            ext_after[e - b0 + 1:] += int(problem.nbytes[t])
    grad_w = np.zeros(n, dtype=np.int64)  # the parameters' gradients made by op i
    for t in acc_grads + acc_added:
        grad_w[int(problem.producer[t]) - b0:] += int(problem.nbytes[t])
    # A later chunk's parameter gradients are added to the first chunk's once the node that
    # made them is done: after the first op from their making on that frees a tensor (its
    # saved inputs), i.e. before the next op; where the gradient passes through a later node
    # first (an op of the span other than its storing reads it after that: nn.Linear's weight
    # gradient through the transpose's backward, so its bias is added before it), at its last
    # op in the span. Old, new and one sum at a time are live then, beside the other gradients
    # made and not yet added. (Measured: tests/test_partition_exact.py, the --entry example's
    # blocks split in 8 and 2, and in 4 and 2.)
    accumulate: dict[int, list[int]] = {}
    frees_at = np.zeros(n, dtype=bool)
    ends = problem.end[(problem.end >= b0) & (problem.end <= b1)]
    frees_at[ends - b0] = True
    def after_node(e: int) -> int:
        while e < b1 and not frees_at[e - b0]:
            e += 1
        return min(e + 1, b1)

    def add_point(t: int) -> int:
        at = after_node(int(problem.producer[t]))
        used = [u for u in problem.uses[t].tolist() if at <= u <= b1]
        if any(problem.op_name[u] not in _STORE_OPS for u in used):  # through a later node first
            return max(used)
        return at

    for t in acc_grads + acc_added:
        accumulate.setdefault(add_point(t), []).append(t)
    pending = np.zeros(n + 1, dtype=np.int64)  # a later chunk's gradients, made, not yet added
    for at, ts in accumulate.items():
        for t in ts:
            pending[int(problem.producer[t]) - b0] += int(problem.nbytes[t])
            pending[at - b0] -= int(problem.nbytes[t])
    pending = np.cumsum(pending)[:-1]

    all_w = int(sum(int(problem.nbytes[t]) for t in acc_grads + acc_added))
    # Gradients there before the span (accumulation: ``added``) are summed over the chunks as
    # above, then added in place into the old ones once the last chunk's node is done, and freed.
    added_w = np.zeros(n, dtype=np.int64)
    if acc_added:
        added_w[max(at for at, ts in accumulate.items() if set(ts) & set(acc_added)) - b0 + 1:] = sum(
            int(problem.nbytes[t]) for t in acc_added)
    in_piece = sum(piece(t) for t in in_grads)
    if r is not None:
        rec_peak = _rerun_peak(problem, span, made_f, fwd_life, needed, piece)
        # this chunk's tensors alive right before op r: started before it and not freed before it
        before_r = sum(piece(t) for t in local_b if problem.start[t] < r <= problem.end[t])
        before_r += sum(piece(t) for t in in_grads if problem.producer[t] < r)
    for q in range(k):  # q chunks' backward done before this one's
        waiting = q * in_piece  # the input-gradient pieces of the chunks done
        last = q == k - 1
        v = waiting + own_b + (all_w + pending if q else grad_w) + (0 if last else ext_after) - (added_w if last else 0)
        if r is not None:
            j = r - b0
            wr = (all_w if q else int(grad_w[j - 1]) if j else 0)
            v[j] = max(v[j], waiting + before_r + rec_peak + wr + (0 if last else int(ext_after[j])))
        for at, ts in accumulate.items() if q else ():
            j = at - b0
            carried = sum(piece(t) for t in local_b if problem.start[t] < at <= problem.end[t])
            carried += sum(piece(t) for t in in_grads if problem.producer[t] < at)
            carried += sum(piece(t) for t, e in back_until.items() if r < at <= e)
            new = sum(int(problem.nbytes[t]) for t in ts) + max(int(problem.nbytes[t]) for t in ts)
            v[j] = max(v[j], waiting + carried + all_w + int(pending[j]) + new + (0 if last else int(ext_after[j])))
        for i in range(b0, b1 + 1):
            peaks[i] = max(peaks.get(i, 0), int(v[i - b0]))
    join = k * in_piece + sum(int(problem.nbytes[t]) for t in in_grads) + all_w - int(added_w[-1]) + cast_made
    peaks[b1] = max(peaks[b1], join)
    return {i: nb for i, nb in peaks.items() if nb > 0}
