"""What a checkpointed span's own tensors hold as it runs, event by event.

The checkpoint's re-run of the forward in backward (:func:`forward_lives`: how a checkpointed
forward holds what it makes; :func:`rerun_at`: the op before which it re-runs;
:func:`rerun_copy_end`: until when each re-made copy is held, before the autograd engine's sums
after a node, :func:`apply_end`; :func:`rerun_peak`: its most bytes), and the span run in
``k`` chunks (:func:`chunked_peaks`: the bytes of its own tensors at the worst moment of each
op, the chunks' outputs and input gradients waiting to be joined, each later chunk's parameter
gradients added to the first's).
"""

from __future__ import annotations

import numpy as np

from ..core import Problem
from .position_span import chunk_piece
from .qualify import constant_tensor
from .span import Span
from .tensors import module_inputs

# Ops by which autograd stores a parameter's gradient (its AccumulateGrad: the gradient kept, or
# added in place into one there before), not another node.
_STORE_OPS = frozenset({"aten.detach.default", "aten.alias.default", "aten.add_.Tensor"})


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


def forward_lives(problem: Problem, span: Span) -> tuple[list[int], set[int], list[int], dict[int, int], list[int]]:
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


def rerun_at(problem: Problem, span: Span, needed: list[int]) -> int | None:
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


def rerun_copy_end(problem: Problem, t: int, span: Span, unread: int) -> int:
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


def rerun_peak(problem: Problem, span: Span, made_f: list[int], fwd_life: dict[int, int], needed: list[int],
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


def chunked_peaks(problem: Problem, span: Span, k: int, nbytes, start, end) -> dict[int, int]:
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
            return chunk_piece(problem, span, t, k, shapes)
        nb = int(problem.nbytes[t])
        shp = shapes[t] if t < len(shapes) else []
        if constant_tensor(problem, t) or problem.kind[t] == "gradient" or not len(shp) or shp[0] < batch or shp[0] % batch:
            return nb
        return -(-nb // k)

    made_f, held, outputs, fwd_life, needed = forward_lives(problem, span)
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
    r = rerun_at(problem, span, needed)
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
            back_until[t] = e = rerun_copy_end(problem, t, span, r)
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
        rec_peak = rerun_peak(problem, span, made_f, fwd_life, needed, piece)
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
