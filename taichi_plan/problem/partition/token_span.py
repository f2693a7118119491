"""Partition over tokens: a linear head and the cross-entropy on its logits, chunk by chunk.

A *token span* is found in a trace as an op span, not a module: a forward ``mm``/``addmm``
that reads a 2-D parameter ``[V, H]`` (the head's weight) and runs inside a module that does
nothing else (the head, an ``nn.Linear``), whose output (the logits) is read, through
position-wise ops only (views, slices, ``clone``, a dtype ``_to_copy``, ``_log_softmax``), by
``nll_loss_forward`` and by nothing else. Its forward ops (``fwd_ops``) are the head module's
ops and those chain ops; its backward ops (``bwd_ops``) are the backward ops that read what
the chain made, or the vocabulary-wide gradients those make, up to the ops that read the
head's input or weight (they make the gradients of the hidden states and of the weight).
The loss may run inside the model's call or after it, in the caller's code; ops on the labels
in between are not part of the span.

Replay (:mod:`taichi_plan.runtime.chunked_loss`) runs the span as
``ChunkedLinearCrossEntropy`` over ``k`` chunks of its rows; what the simulator models is
what that function allocates, exactly. A loss reduced to one number (``mean``, ``sum``: the
loss op makes a scalar; ``fused``) is computed with its gradients in one pass, in forward
(``chunked_loss.fused``):

* none of the span's own storages exist (the logits, their log-softmax, the vocabulary-wide
  gradients): they get 0 bytes;
* forward, at the loss op: the int64 count of rows (the mean's divisor, and its reciprocal,
  a float32), then the gradients the span hands on (the hidden states', the weight's, the
  bias's) allocated whole and held until the backward hands them on; per chunk, its logits
  turned into their softmax in place (``ceil(rows/k) * V * compute`` bytes, element sizes in
  bytes; a cast from the head's dtype holds both for a moment, and a cast of the softmax to
  the weight's dtype both again), and a few per-row vectors (:meth:`TokenSpan.chunk_bytes`),
  freed before the next chunk, beside the running total of the chunks' losses (one compute
  element); nothing of a chunk is held into the next (``runtime/chunked_loss.py`` deletes it);
* backward allocates nothing: the span's gradients are scaled in place by the incoming one;
* the hidden states and the labels are held until that backward (the function saves them);
  when the chain sliced or copied the logits, the runtime copies the hidden rows instead
  (``rows * H`` elements, held as long);
* extra compute: a cost per op per chunk, against what the unsplit span's log-softmax and
  its backward cost (the fused pass makes each chunk's logits once and its softmax in
  place: on a 2-core CPU it runs faster than the span unsplit, so the measured extra may be
  below 0); measured on the model's own head and loss when the recording calibrated it
  (:func:`taichi_plan.problem.partition.cost.token_cost`).

A per-row loss (``none``, the loss op makes ``[rows]``) needs each row's incoming gradient:
forward holds each chunk's logits and their log-softmax (``ceil(rows/k) * V * max(head +
compute, 2 * compute)`` bytes) and writes the rows' losses into one ``[rows]`` tensor;
backward, at the span's first backward op, allocates the handed-on gradients whole and makes
each chunk's logits again, with their softmax (the same bytes as in forward): its extra
compute is the head's matmul and the log-softmax once more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..core import Problem, op_stem

HEAD_OPS = ("aten.mm.default", "aten.addmm.default")
HEAD_MODULE_STEMS = {"t", "view", "mm", "addmm", "_unsafe_view", "reshape", "expand", "alias"}
# Position-wise ops a chain may run on the logits (they keep each token's row apart).
VIEW_STEMS = {"view", "_unsafe_view", "reshape", "alias", "slice", "detach", "squeeze", "unsqueeze"}
COPY_STEMS = {"clone", "contiguous", "_to_copy"}
REDUCE_STEMS = {"nll_loss_forward"}
TOKEN_CHUNK_CHOICES = (2, 4, 8, 16, 32)
# The head's weight: a parameter, or under FSDP2 (a sharded trace) the unit's gathered parameter,
# a row per gathering (the forward's and the backward's are two rows of one storage).
WEIGHT_KINDS = ("parameter", "unsharded_parameter")


@dataclass(frozen=True)
class TokenSpan:
    """A head + loss span partitioned over its rows (tokens)."""

    module: str  # the head's FQN
    fwd_ops: tuple[int, ...]
    bwd_ops: tuple[int, ...]
    reduce_op: int  # where the chunked forward runs
    rows: int  # tokens the loss is over
    vocab: int
    hidden: int
    head_elem: int  # bytes per element of the head's output
    compute_elem: int  # bytes per element the softmax runs in
    copies_hidden: bool  # the chain copied (sliced) the logits: the runtime copies the hidden rows
    head_rows: int  # rows of the head's output (more than ``rows`` when the chain slices them)
    logits: int  # the head's output (tensor index)
    copy_op: int  # where the chain copies the logits (the runtime copies the hidden rows there)
    fused: bool = True  # the loss is one number: loss and gradients in one forward pass
    weight_elem: int = 4  # bytes per element of the head's weight
    bias_elem: int = 0  # bytes per element of the head's bias (0: no bias)
    over: str = "tokens"
    random_ops: tuple[int, ...] = ()  # the chain is position-wise ops and a loss: none draws numbers

    @property
    def fwd(self) -> tuple[int, int]:
        return self.fwd_ops[0], self.fwd_ops[-1]

    @property
    def bwd(self) -> tuple[int, int]:
        return self.bwd_ops[0], self.bwd_ops[-1]

    @property
    def batch(self) -> int:
        return self.rows

    @property
    def chunk_choices(self) -> tuple[int, ...]:
        return tuple(c for c in TOKEN_CHUNK_CHOICES if c <= self.rows)

    def chunk_bytes(self, chunks: int) -> int:
        """Bytes a chunk holds at its most. Fused: its logits (both dtypes for a moment when
        the head's is not the softmax's); their softmax in place beside the per-row vectors
        of the loss (valid, index: 1 + 8 bytes; max, loss, sum and its log: 4 compute
        elements); then, for the gradients, the softmax beside valid, index and sum, the
        softmax cast to the weight's dtype when that differs, and the bias gradient's column
        sum (``V`` elements). Else the logits and their (log-)softmax, forward or backward."""
        r = math.ceil(self.rows / chunks)
        v, c, w = self.vocab, self.compute_elem, self.weight_elem
        if not self.fused:
            return r * v * max(self.head_elem + c, 2 * c)
        cast = self.head_elem + c if self.head_elem != c else c
        grads = r * v * c + r * (9 + c) + (r * v * w if w != c else 0) + v * self.bias_elem
        return max(r * v * cast, r * v * c + r * (9 + 4 * c), grads)


def _numel(shape) -> int:
    return int(np.prod(shape)) if len(shape) else 1


def token_spans(problem: Problem) -> list[TokenSpan]:
    """Every head + loss span of the trace (see the module docstring)."""
    cached = getattr(problem, "_token_spans", None)
    if cached is not None:
        return cached
    out = []
    if problem.replayable_only:
        by_module: dict[str, list[int]] = {}
        for q in np.nonzero(np.asarray(problem.op_phase) == "forward")[0].tolist():
            by_module.setdefault(problem.op_module[q], []).append(q)
        for i in range(problem.num_ops):
            if problem.op_name[i] in HEAD_OPS and problem.op_phase[i] == "forward":
                span = _span_at(problem, i, by_module)
                if span is not None:
                    out.append(span)
    problem._token_spans = out
    return out


def _module_ops(problem: Problem, i: int, by_module: dict[str, list[int]]) -> list[int] | None:
    """The forward ops of the head module of op ``i``, or None if the module does more than
    a linear layer, or runs more than once (its forward ops are not one contiguous run)."""
    m = problem.op_module[i]
    ops = by_module.get(m, []) if m else []
    if not ops or ops[-1] - ops[0] + 1 != len(ops):
        return None
    if any(op_stem(problem.op_name[q]) not in HEAD_MODULE_STEMS for q in ops):
        return None
    return ops


def _span_at(problem: Problem, i: int, by_module: dict[str, list[int]]) -> TokenSpan | None:
    shapes = problem.trace.tensors["shape"]
    outs = problem.op_outputs[i].tolist()
    weights = [t for t in problem.op_reads[i].tolist() if problem.kind[t] in WEIGHT_KINDS and len(shapes[t]) == 2]
    if len(outs) != 1 or not weights or problem.op_call[i] < 0:
        return None
    w = weights[0]
    vocab, hidden = (int(x) for x in shapes[w])
    logits = outs[0]
    if len(shapes[logits]) < 2 or int(shapes[logits][-1]) != vocab:
        return None
    inputs = [t for t in problem.op_reads[i].tolist() if t != w and problem.kind[t] not in WEIGHT_KINDS]
    phase = problem.op_phase
    # Forward: follow the logits through position-wise ops to the loss.
    chain = {logits}
    fwd = {i}
    reduce_ops = []
    copies: list[int] = []
    frontier = [logits]
    while frontier:
        t = frontier.pop()
        for u in problem.uses[t].tolist():
            if u in fwd or phase[u] != "forward" or u < i:
                continue
            stem = op_stem(problem.op_name[u])
            made = problem.op_outputs[u].tolist()
            if stem in REDUCE_STEMS:
                reduce_ops.append(u)
                fwd.add(u)
                continue
            if stem not in VIEW_STEMS | COPY_STEMS | {"_log_softmax"}:
                return None
            if any(r not in chain for r in problem.op_reads[u].tolist()):
                return None
            fwd.add(u)
            if stem in ("clone", "contiguous"):
                copies.append(u)
            for x in made:
                if x not in chain:
                    chain.add(x)
                    frontier.append(x)
    if len(reduce_ops) != 1:
        return None
    head_ops = _module_ops(problem, i, by_module)
    if head_ops is None:
        return None
    fwd.update(head_ops)
    red = reduce_ops[0]
    red_in = [t for t in problem.op_reads[red].tolist() if t in chain]
    if not red_in:
        return None
    rows = _numel(shapes[red_in[0]]) // vocab
    head_elem = int(problem.nbytes[logits]) // max(_numel(shapes[logits]), 1)
    compute_elem = int(problem.nbytes[red_in[0]]) // max(_numel(shapes[red_in[0]]), 1)
    head_rows = _numel(shapes[logits]) // vocab
    copy_op = min(copies) if copies else red
    # Backward: what reads the chain's storages, and the vocabulary-wide gradients made from them.
    fwd_made = set(chain)
    red_out = set(problem.op_outputs[red].tolist())
    grads: set[int] = set()
    bwd: list[int] = []
    boundary_in = set(inputs) | {w}
    first = min((int(u) for t in chain for u in problem.uses[t].tolist() if phase[u] == "backward"), default=None)
    if first is None:
        return None
    for q in range(first, problem.num_ops):
        if phase[q] != "backward":
            continue
        reads = set(problem.op_reads[q].tolist())
        if not reads & (fwd_made | grads):
            continue
        bwd.append(q)
        if reads & boundary_in:
            continue
        grads.update(x for x in problem.op_outputs[q].tolist() if _numel(shapes[x]) in (rows * vocab,
                                                                                          head_rows * vocab))
    inside = set(fwd) | set(bwd)
    for t in chain | grads:
        if any(int(u) not in inside for u in problem.uses[t].tolist()):
            return None  # the logits (or their gradient) are used elsewhere: not lazy
    if not bwd or not red_out:
        return None
    fused = all(_numel(shapes[x]) == 1 for x in red_out)  # a scalar loss (mean, sum), not one per row
    weight_elem = int(problem.nbytes[w]) // max(_numel(shapes[w]), 1)
    biases = [t for t in problem.op_reads[i].tolist() if problem.kind[t] in WEIGHT_KINDS and len(shapes[t]) == 1]
    bias_elem = int(problem.nbytes[biases[0]]) // max(_numel(shapes[biases[0]]), 1) if biases else 0
    return TokenSpan(problem.op_module[i], tuple(sorted(fwd)), tuple(bwd), red, rows, vocab, hidden, head_elem,
                     compute_elem, bool(copies) or rows != head_rows, head_rows, logits, copy_op, fused, weight_elem,
                     bias_elem)


def internal(problem: Problem, span: TokenSpan) -> set[int]:
    """The span's own storages (none of them exists when it is partitioned)."""
    red_out = set(problem.op_outputs[span.reduce_op].tolist())
    out = set()
    for q in span.fwd_ops:
        out.update(x for x in problem.op_outputs[q].tolist() if x not in red_out)
    out.update(_bwd_made(problem, span)[0])
    return out


def _bwd_made(problem: Problem, span: TokenSpan) -> tuple[set[int], set[int]]:
    """(vocabulary-wide gradients, gradients handed on) made by the span's backward ops."""
    shapes = problem.trace.tensors["shape"]
    wide, handed = set(), set()
    for q in span.bwd_ops:
        for x in problem.op_outputs[q].tolist():
            wide_x = _numel(shapes[x]) in (span.rows * span.vocab, span.head_rows * span.vocab)
            (wide if wide_x and not set(problem.op_reads[q].tolist()) & _boundary(problem, span) else handed).add(x)
    return wide, handed


def _boundary(problem: Problem, span: TokenSpan) -> set[int]:
    """What the head's matmul reads: the hidden states and the weight (and bias)."""
    head = next(q for q in span.fwd_ops if problem.op_name[q] in HEAD_OPS)
    return set(problem.op_reads[head].tolist())


def span_inputs(problem: Problem, span: TokenSpan) -> list[int]:
    """Non-parameter storages the span's forward reads (the hidden states, the labels)."""
    own = internal(problem, span)
    out = set()
    for q in span.fwd_ops:
        for t in problem.op_reads[q].tolist():
            if t not in own and problem.kind[t] not in (*WEIGHT_KINDS, "buffer"):
                out.add(t)
    return sorted(out)


def span_tensors(problem: Problem, span: TokenSpan) -> set[int]:
    """Everything the span reads or makes: no plan may drop one of them."""
    out = internal(problem, span) | set(span_inputs(problem, span))
    for q in (*span.fwd_ops, *span.bwd_ops):
        out.update(problem.op_outputs[q].tolist())
    return out


def redo_ops(problem: Problem, span: TokenSpan) -> list[int]:
    """The span's ops whose time the split changes: the head's matmul and the log-softmax
    (run again by a per-row loss's backward; a fused pass makes the logits once and no
    log-softmax)."""
    return [q for q in span.fwd_ops if op_stem(problem.op_name[q]) in ("mm", "addmm", "_log_softmax")]


def cost_terms(problem: Problem, span: TokenSpan) -> tuple[float, int]:
    """(recorded seconds of :func:`redo_ops`, the span's forward and backward ops): what
    :func:`taichi_plan.problem.partition.cost.token_cost` scales (calibration fits its two rates on them)."""
    return float(problem.op_cost[redo_ops(problem, span)].sum()), len(span.fwd_ops) + len(span.bwd_ops)


def apply(problem: Problem, span: TokenSpan, chunks: int, nbytes: np.ndarray, start: np.ndarray, end: np.ndarray,
          new: list[tuple[int, int, int, int]]) -> set[int]:
    """Partition ``span`` into ``chunks`` on the arrays of a problem being built (see the
    module docstring); appends ``(like, bytes, start, end)`` of the storages the runtime adds
    to ``new``; returns the tensors it owns."""
    own = internal(problem, span)
    for t in own:
        nbytes[t] = 0
    if span.fused:  # the loss alone: no total_weight beside it (nll_loss_forward's second output)
        for t in problem.op_outputs[span.reduce_op].tolist()[1:]:
            nbytes[t] = 0
    b0 = span.bwd_ops[0]
    _, handed = _bwd_made(problem, span)
    boundary = _boundary(problem, span)
    row_bytes = span.hidden * span.head_elem
    made_at = span.reduce_op if span.fused else b0  # where the handed-on gradients are allocated
    for t in handed:
        start[t] = min(int(start[t]), made_at)
        if span.copies_hidden and _grad_of_hidden(problem, span, t):
            nbytes[t] = span.rows * row_bytes  # the function's gradient of the copied rows
    ops = set(span.fwd_ops) | set(span.bwd_ops)
    for t in span_inputs(problem, span):
        if problem.persists[t]:
            continue
        if span.copies_hidden and t in boundary:
            # The function holds its copy of the rows; the hidden states themselves live as long
            # as the (lazy) logits that hold them, and their other uses.
            outside = [int(u) for u in problem.uses[t].tolist() if int(u) not in ops]
            end[t] = max([*outside, int(problem.start[t]), int(problem.end[span.logits])])
        else:
            end[t] = max(int(end[t]), b0)
    work = span.chunk_bytes(chunks)
    if span.fused:
        # The count of rows (an int64, saved for the backward) and its reciprocal (float32),
        # made first; the running total of the chunks' losses (a later chunk's is added to it)
        # is the recorded loss's bytes, which exist at this op, where the loss itself (total /
        # count) is made after the chunks.
        new.append((-1, 8, span.reduce_op, b0))
        new.append((-1, work + 4, span.reduce_op, span.reduce_op))
    else:
        # The rows' losses, written chunk by chunk; each chunk's logits again in backward.
        new.append((-1, work, span.reduce_op, span.reduce_op))
        new.append((-1, work, b0, b0))
    if span.copies_hidden:
        new.append((-1, span.rows * row_bytes, span.copy_op, b0))
        # After the function, autograd scatters the rows' gradient back into all the rows.
        new.append((-1, span.head_rows * row_bytes, span.bwd_ops[-1], span.bwd_ops[-1]))
    return span_tensors(problem, span)


def _grad_of_hidden(problem: Problem, span: TokenSpan, t: int) -> bool:
    """Whether span-made ``t`` is the gradient of the hidden states (made by an op that reads
    the head's weight: ``grad @ W``)."""
    p = int(problem.producer[t])
    return p in span.bwd_ops and not _weight_rows(problem, span).isdisjoint(problem.op_reads[p].tolist()) \
        and int(problem.nbytes[t]) == span.head_rows * span.hidden * span.head_elem


def _weight_rows(problem: Problem, span: TokenSpan) -> set:
    """The head's weight: the parameter the head's matmul reads and, in a sharded trace, every
    gathering of it (the backward reads FSDP's second gathering, another row of the same
    storage: ``Problem.same_storage``)."""
    w = next(x for x in _boundary(problem, span) if problem.kind[x] in WEIGHT_KINDS)
    return {w, *problem.same_storage.get(w, ())}


__all__ = ["TOKEN_CHUNK_CHOICES", "TokenSpan", "apply", "cost_terms", "redo_ops", "span_inputs", "span_tensors", "token_spans"]
