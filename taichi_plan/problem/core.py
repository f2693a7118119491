"""What a planner can decide, built from a trace (no torch).

A *candidate* is a tensor whose memory can be given back between two consecutive uses:
it is freed after use ``free_after`` and rematerialized before use ``remat_before`` by
re-running its *rebuild ops*: its producer, then any forward op that wrote it in place
(dropout masks: empty_like, bernoulli_, div_). For a recorded step the natural gap is
forward -> backward; for a public graph it is the longest gap between two uses. A
candidate qualifies when its producer is recomputable, its in-place writers are forward
ops that write nothing else, no input of its rebuild ops is overwritten before
``remat_before`` (the rebuilt value would differ), and its lone rebuild is executable
(every input gone by then can itself be rebuilt).

The options a planner picks from are in :mod:`taichi_plan.problem.options`, the bytes they free
in :mod:`taichi_plan.problem.live`, how messages name an op in :mod:`taichi_plan.problem.describe`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..trace.format import Trace, backward_node_starts, baseline_live_bytes, live_intervals
from ..trace.layout import incarnations

# Kinds no plan frees: model state, inputs, and what FSDP allocates and frees itself (its
# unsharded parameters and gradients, its communication buffers, the shards of an int
# reshard_after_forward's smaller mesh), and DDP's gradient buckets.
FIXED_KINDS = ("parameter", "buffer", "gradient", "optimizer_state", "input", "unsharded_parameter",
               "unsharded_gradient", "all_gather", "reduce_scatter", "ddp_bucket", "post_forward_shard")


@dataclass
class Problem:
    """Arrays indexed by op id or tensor index (row in ``trace.tensors``)."""

    trace: Trace
    num_ops: int
    op_cost: np.ndarray  # cost of each op (seconds, or abstract units for imported graphs)
    op_name: list[str]
    op_module: list[str]
    op_phase: list[str]
    tensor_id: np.ndarray  # tensor index -> tensor_id
    nbytes: np.ndarray
    kind: np.ndarray
    producer: np.ndarray  # producer op or -1
    start: np.ndarray  # first op holding memory (inclusive)
    end: np.ndarray  # last op holding memory (inclusive)
    op_reads: list[np.ndarray]  # per op: tensor indices read (excluding its own outputs)
    op_outputs: list[np.ndarray]  # per op: tensor indices it produced
    uses: list[np.ndarray]  # per tensor: sorted op ids that access it
    rematerializable: np.ndarray  # bool per tensor: it can be rebuilt by re-running ``rebuild_ops``
    rebuild_ops: list[np.ndarray]  # per tensor: producer, then its in-place forward writers
    remat_deadline: np.ndarray  # per tensor: a rebuild must happen at or before this op
    baseline_live: np.ndarray  # live bytes during each op, unplanned
    initial: np.ndarray  # bool per tensor: exists before the step (alloc_op == -1)
    persists: np.ndarray  # bool per tensor: outlives the step (free_op == -1)
    candidates: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    cand_free_after: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    cand_remat_before: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # Per candidate: the last op before which its producer's inputs are all still live, if
    # that is earlier than ``cand_remat_before`` (a rebuild there needs no other rebuild),
    # else -1. Planners may rebuild early there: it frees less but costs only the producer.
    cand_early_remat: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # May planners partition modules that draw random numbers (dropout)? Their chunks then
    # draw their own numbers: training changes. Off unless a solve opts in (partition.py).
    partition_random: bool = False
    # Offload allowed (a taichi_plan.problem.offload.OffloadConfig: host link, host budget), or None:
    # planners keep or drop only (the default).
    offload: object = None
    # Op ids that drew random numbers (trace v4 ``meta.random_ops``); None for older traces.
    random_ops: frozenset | None = None
    # Per tensor index of a storage FSDP resized (meta.fsdp.incarnations): the other rows of
    # that storage. An unsharded parameter freed after forward is gathered again for backward:
    # a rebuild that read its forward row reads the row live when the rebuild runs, if any.
    same_storage: dict[int, list[int]] = field(default_factory=dict)
    # tensor -> last op a rebuilt copy of it is held where that is past its own end (a compiled
    # step: an input the recorded kernel wrote its output into in place, meta.compiled.rebuilt_ends)
    rebuilt_hold: dict[int, int] = field(default_factory=dict)
    # op -> last op of the compiled kernel it is part of, where that is later (meta.compiled.kernel_ends):
    # what the op reads is held to there
    kernel_end: dict[int, int] = field(default_factory=dict)

    def held(self, u: int, r: int) -> bool:
        """Is tensor ``u``'s value in memory when a rebuild runs right before op ``r``: ``u``
        itself, or another row of its storage (FSDP's unsharded parameter, gathered again)?
        A rebuild never reads a parameter FSDP has resharded."""
        if self.start[u] <= r - 1 and self.end[u] >= r:
            return True
        return any(self.start[v] <= r - 1 and self.end[v] >= r for v in self.same_storage.get(u, ()))

    @property
    def replayable_only(self) -> bool:
        """Recorded steps are replayed, and replay can only free a tensor that autograd alone
        keeps: one made in forward and used next in backward. Imported graphs have no such limit."""
        return self.trace.meta.get("mode") != "imported"

    @property
    def every_gap(self) -> bool:
        """Is every gap between two uses a candidate (a tensor freed and rebuilt once per
        gap), rather than the longest one only? On imported graphs without a backward
        (forward-only graphs, where tensors have many uses and no long gap): there, several
        rebuilds are what reaches a budget. Training graphs keep their forward -> backward
        gap, and recorded steps must (replay rebuilds a tensor once)."""
        return not self.replayable_only and "backward" not in self._phase_array

    def gap_allowed(self, producer: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Which (producer, free_after, remat_before) gaps a plan may use (see replayable_only)."""
        if not self.replayable_only:
            return np.ones(np.shape(a), dtype=bool)
        phase = self._phase_array
        p = np.maximum(producer, 0)
        call = self.op_call
        return ((producer >= 0) & (phase[p] == "forward") & (phase[a] == "forward") & (phase[b] == "backward")
                & (call[p] >= 0) & (call[a] == call[p]))

    @property
    def last_write(self) -> np.ndarray:
        """Per tensor: the last of its rebuild ops (its producer, or -1 if none)."""
        return np.fromiter((int(r[-1]) if len(r) else int(p) for r, p in zip(self.rebuild_ops, self.producer)),
                           dtype=np.int64, count=len(self.producer))

    @property
    def rebuild_cost(self) -> np.ndarray:
        """Per tensor: the cost of re-running its rebuild ops once (0 if it has none)."""
        cost = self.rerun_cost
        return np.fromiter((float(cost[r].sum()) for r in self.rebuild_ops), dtype=np.float64,
                           count=len(self.rebuild_ops))

    @property
    def folds_runtime(self) -> bool:
        """Whether the runtime's per-re-run and per-drop costs are part of the simulator's cost
        (:attr:`rerun_cost`, :attr:`drop_cost`): for real recordings that carry
        ``meta.runtime_overhead``, whose op times and runtime costs were timed on one machine.
        A fake recording's op times are a device profile's (a GPU's microseconds) while its
        runtime costs are this CPU's microbenchmark: adding them up would mix two clocks, so
        there they stay in the plan's predicted runtime overhead, added after the solve."""
        return (self.trace.cost_unit == "s" and self.trace.meta.get("mode") == "real"
                and bool(self.trace.meta.get("runtime_overhead")))

    @property
    def rerun_cost(self) -> np.ndarray:
        """Per op: what re-running it in a rebuild costs, in the trace's cost unit. For a real
        recording that measured the replay runtime (:attr:`folds_runtime`,
        :mod:`taichi_plan.problem.partition.overhead`): its recorded seconds times the measured
        ``rebuild_time_ratio`` of its op name (1 where none), plus ``rebuild_op_s``, the
        runtime's bookkeeping per re-run op; else its recorded cost. The simulator charges this
        per re-run, and the planners weigh it, so a plan of many small rebuilds pays what the
        runtime makes it pay. Computed once per problem."""
        cached = getattr(self, "_rerun_cost", None)
        if cached is None:
            cal = self.trace.meta.get("runtime_overhead") if self.folds_runtime else None
            cached = np.asarray(self.op_cost, dtype=np.float64)
            if cal:
                ratio = cal.get("rebuild_time_ratio") or {}
                if ratio:
                    cached = cached * np.fromiter((float(ratio.get(n, 1.0)) for n in self.op_name),
                                                  dtype=np.float64, count=self.num_ops)
                cached = cached + float(cal.get("rebuild_op_s", 0.0) or 0.0)
            self._rerun_cost = cached
        return cached

    @property
    def drop_cost(self) -> float:
        """What each dropped tensor costs the step beyond its rebuild's re-run ops, in the
        trace's cost unit: the runtime's ``drop_s`` measured on a plan of the model's own (trace
        v6, ``meta.runtime_overhead``: packing the handle, the group's bookkeeping, unpacking,
        the backward around a rebuilt tensor), else 0. The simulator charges it once per drop."""
        if not self.folds_runtime:
            return 0.0
        return float((self.trace.meta.get("runtime_overhead") or {}).get("drop_s", 0.0) or 0.0)

    @property
    def step_cost(self) -> float:
        return float(self.op_cost.sum())

    @property
    def baseline_peak(self) -> tuple[int, int]:
        if self.num_ops == 0:
            return 0, -1
        i = int(np.argmax(self.baseline_live))
        return int(self.baseline_live[i]), i

    def index_of(self, tensor_id: int) -> int:
        try:
            return self._index[int(tensor_id)]
        except KeyError:
            from ..base.errors import PlanError

            raise PlanError(
                f"The plan names tensor {tensor_id}, which this trace does not have: the plan was "
                "made for another trace. Solve this trace again."
            ) from None

    def __post_init__(self):
        self._index = {int(t): i for i, t in enumerate(self.tensor_id.tolist())}
        self._phase_array = np.asarray(self.op_phase)
        self.op_call = model_call_of_ops(self.trace)  # per op: its grad model call, or -1
        # per tensor: the last op the step's own Python code holds it (-1: not known)
        self.python_release = python_release(self.trace.meta, self._index, self.end)
        self.unpack_at = unpack_points(self.trace.meta, self._phase_array)

    def unpack_point(self, op: int) -> int:
        """Where a tensor that backward op ``op`` reads from autograd's saved tensors is
        unpacked: the first op of ``op``'s autograd node (trace v9 ``meta.backward_nodes``;
        ``op`` itself for older traces and outside backward)."""
        return int(self.unpack_at[op])

    def with_options(self, **changes) -> Problem:
        """This instance with planner options changed (``partition_random``, ``offload``).
        What else it carries (an optimizer view's ``recorded_problem``) goes along; caches
        (``_``-prefixed) do not, since what they hold depends on the options."""
        import dataclasses

        if all(getattr(self, k) == v for k, v in changes.items()):
            return self
        out = dataclasses.replace(self, **changes)
        for key, value in vars(self).items():
            if not key.startswith("_") and key not in vars(out):
                setattr(out, key, value)
        return out

    def release_after(self, t: int, last_use: int) -> int:
        """The op after which dropping ``t`` (last used by op ``last_use`` before a gap) really
        frees it: when the step's Python code lets go of it, if that is later (``meta.python_refs``)."""
        return max(int(last_use), int(self.python_release[t]))


def unpack_points(meta: dict, phase: np.ndarray) -> np.ndarray:
    """Per op: the first op of its autograd node for backward ops (``meta.backward_nodes``,
    trace v9: :func:`~taichi_plan.trace.format.backward_node_starts`), itself otherwise. A node
    unpacks its saved tensors before it runs any op, and replay rebuilds a dropped one there,
    not at the op that reads it (a linear layer's backward computes its input's gradient
    before the weight's, which reads the saved input)."""
    ops = np.arange(len(phase), dtype=np.int64)
    node = backward_node_starts(meta, phase)
    return ops if node is None else np.where(node >= 0, node, ops)


def grad_model_calls(meta: dict) -> list[dict] | None:
    """The grad-enabled, finished model calls of a recorded step (``meta.model_calls``), in
    order; None when the trace does not list them (imported graphs, older recordings)."""
    calls = meta.get("model_calls")
    if calls is None:
        return None
    return [c for c in calls if c.get("grad") and c.get("end") is not None]


INTEGER_DTYPES = ("int64", "int32", "int16", "int8", "uint8")


def batch_and_seq(meta: dict) -> tuple[int | None, int | None]:
    """(batch, sequence length) of a recorded step's model calls: the workload's ``batch`` and
    ``seq`` arguments where it names them (``record --batch/--seq``, the Trainer's batch size),
    else read from the first grad-enabled model call's inputs (``meta.model_calls``, as the
    step called the model: an ``--entry`` or ``record_step`` that builds its own batch):
    the batch is the leading size every input with a dimension shares, the sequence length
    the second size every integer input with two or more dimensions shares (token ids, their
    labels and attention masks). None for what is not named and cannot be read, or where the
    inputs disagree. The partition rules check every tensor against these sizes, so a size
    read here only offers options the trace's shapes bear out."""
    args = ((meta.get("workload") or {}).get("args")) or {}
    b, s = args.get("batch"), args.get("seq")
    b = b if isinstance(b, int) and b >= 1 else None
    s = s if isinstance(s, int) and s >= 1 else None
    calls = grad_model_calls(meta) or []
    inputs = [(list(shape), str(dtype)) for _name, shape, dtype in calls[0].get("inputs", [])] if calls else []
    if b is None:
        leading = {shape[0] for shape, _ in inputs if len(shape) >= 1}
        b = int(leading.pop()) if len(leading) == 1 else None
    if s is None:
        second = {shape[1] for shape, dtype in inputs if len(shape) >= 2 and dtype in INTEGER_DTYPES}
        s = int(second.pop()) if len(second) == 1 else None
    return b, s


def python_release(meta: dict, index: dict[int, int], end: np.ndarray) -> np.ndarray:
    """Per tensor index: the last op the step's own Python code holds the storage
    (``meta.python_refs.release``, trace v4), its ``end`` when Python still holds it when
    backward starts, -1 when not known or not later than its last forward use."""
    out = np.full(len(end), -1, dtype=np.int64)
    info = meta.get("python_refs") or {}
    for tid, op in info.get("release", ()):
        i = index.get(int(tid))
        if i is not None:
            out[i] = int(end[i]) if op < 0 else int(op)
    return out


def model_call_of_ops(trace: Trace) -> np.ndarray:
    """Per op: which grad-enabled call of the model it ran in (``meta.model_calls``), -1 for
    ops outside every call (a loss computed outside the model, the loop's own ops, backward).
    Replay applies a plan inside the model's calls only, so a recorded tensor can be dropped
    only if its producer and its last forward use ran in the same call. Traces that do not
    list the calls (imported graphs, older recordings) put every op in call 0."""
    n = len(trace.ops)
    calls = grad_model_calls(trace.meta)
    if calls is None:
        return np.zeros(n, dtype=np.int64)
    out = np.full(n, -1, dtype=np.int64)
    for k, c in enumerate(calls):
        out[int(c["start"]):int(c["end"]) + 1] = k
    return out


def build_problem(trace: Trace) -> Problem:
    ops, tensors, acc = trace.ops, trace.tensors, trace.accesses
    n = len(ops)
    m = len(tensors)
    tensor_id = tensors["tensor_id"].to_numpy().astype(np.int64)
    index = {int(t): i for i, t in enumerate(tensor_id.tolist())}
    producer = tensors["producer_op"].to_numpy().astype(np.int64)
    start, end = live_intervals(trace)
    kind = tensors["kind"].to_numpy()
    nbytes = tensors["nbytes"].to_numpy().astype(np.int64)

    a_op = acc["op_id"].to_numpy().astype(np.int64)
    a_t = np.fromiter((index[int(t)] for t in acc["tensor_id"].tolist()), dtype=np.int64, count=len(acc))
    a_write = (acc["role"].to_numpy() == "write")

    # Per-op reads (inputs that are not the op's own fresh outputs) and outputs.
    is_output = a_write & (producer[a_t] == a_op) if len(a_t) else a_write
    op_reads = _grouped(a_op[~is_output], a_t[~is_output], n)
    # Tensors produced by an op count as its outputs even without a recorded write access.
    made = producer >= 0
    op_outputs = _grouped(np.concatenate([a_op[is_output], producer[made]]),
                          np.concatenate([a_t[is_output], np.nonzero(made)[0]]), n)

    # Uses per tensor (any access) and every op that writes it.
    uses = _grouped(a_t, a_op, m)
    writers = _grouped(a_t[a_write], a_op[a_write], m)

    # A tensor can be rebuilt by re-running its producer and then, in order, the forward
    # ops that wrote it in place (dropout's empty_like -> bernoulli_ -> div_). Those
    # in-place ops must write nothing else.
    recomputable = ops["recomputable"].to_numpy().astype(bool)
    mutates = ops["mutates"].to_numpy().astype(bool)
    forward = ops["phase"].to_numpy() == "forward"
    writes_per_op = np.bincount(a_op[a_write], minlength=n) if len(a_op) else np.zeros(n, dtype=np.int64)
    call = model_call_of_ops(trace)
    remat = np.zeros(m, dtype=bool)
    rebuild_ops: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * m
    for t in np.nonzero((producer >= 0) & ~np.isin(kind, FIXED_KINDS))[0].tolist():
        p = int(producer[t])
        if not recomputable[p] or mutates[p] or call[p] == -1:
            continue
        extra = writers[t][writers[t] != p]
        if len(extra) and not (np.all(forward[extra]) and np.all(writes_per_op[extra] == 1) and np.all(extra > p)
                               and np.all(call[extra] == call[p])):
            continue
        remat[t] = True
        rebuild_ops[t] = np.concatenate([[p], extra]).astype(np.int64)

    # A rebuild must happen before any input of its ops is overwritten: the first later
    # write to any of those inputs.
    deadline = np.full(m, n, dtype=np.int64)
    for t in np.nonzero(remat)[0].tolist():
        last = int(rebuild_ops[t][-1])
        for q in rebuild_ops[t].tolist():
            for u in op_reads[q].tolist():
                if u == t:
                    continue
                w = writers[u]
                k = np.searchsorted(w, last, side="right")
                if k < len(w):
                    deadline[t] = min(deadline[t], int(w[k]))

    cost = ops["duration_s"].to_numpy().astype(np.float64)
    prob = Problem(
        trace=trace,
        num_ops=n,
        op_cost=cost,
        op_name=ops["op"].tolist(),
        op_module=ops["module"].tolist(),
        op_phase=ops["phase"].tolist(),
        tensor_id=tensor_id,
        nbytes=nbytes,
        kind=kind,
        producer=producer,
        start=start.astype(np.int64),
        end=end.astype(np.int64),
        op_reads=op_reads,
        op_outputs=op_outputs,
        uses=uses,
        rematerializable=remat,
        rebuild_ops=rebuild_ops,
        remat_deadline=deadline,
        baseline_live=baseline_live_bytes(trace),
        random_ops=None if trace.meta.get("random_ops") is None else frozenset(trace.meta["random_ops"]),
        initial=tensors["alloc_op"].to_numpy() < 0,
        persists=tensors["free_op"].to_numpy() < 0,
    )
    for rows in incarnations(trace.meta):
        idx = [index[t] for t in rows if t in index]
        for i in idx:
            prob.same_storage[i] = [j for j in idx if j != i]
    compiled = trace.meta.get("compiled") or {}
    for t, op in compiled.get("rebuilt_ends", ()):
        if int(t) in index:
            prob.rebuilt_hold[index[int(t)]] = int(op)
    for start, stop, end in compiled.get("kernel_ends", ()):
        for op in range(int(start), min(int(stop), n)):
            prob.kernel_end[op] = max(prob.kernel_end.get(op, op), int(end))
    _unpacks_as_uses(prob)
    _find_candidates(prob)
    return prob


def _unpacks_as_uses(prob: Problem) -> None:
    """Count as a use of a recorded tensor the backward op where autograd releases it when no
    backward op reads it: a ``gather``'s input, whose backward takes only its shape
    (``new_zeros(self.sizes())``, then ``scatter_add``). Its node still unpacks it, so a plan
    that drops it rebuilds it there (:meth:`Problem.unpack_point`), as any saved tensor;
    without this use it was held from forward to that node and never droppable (4 MB of a
    2-layer DeBERTa-v2's 27.9 MB peak). A tensor qualifies when it is used last in forward
    and freed by a backward op while the step's Python code no longer holds it."""
    if not prob.replayable_only:
        return
    phase = prob._phase_array
    end = prob.end.astype(np.int64)
    last = np.fromiter((int(u[-1]) if len(u) else -1 for u in prob.uses), dtype=np.int64, count=len(prob.uses))
    ok = (prob.nbytes > 0) & (end >= 0) & (end < len(phase)) & (last >= 0) & (np.asarray(prob.python_release) < end)
    ok[ok] &= (phase[end[ok]] == "backward") & (phase[last[ok]] == "forward")
    for t in np.nonzero(ok)[0].tolist():
        prob.uses[t] = np.append(prob.uses[t], end[t])


def _grouped(keys: np.ndarray, values: np.ndarray, n: int) -> list[np.ndarray]:
    """For each key 0..n-1, the sorted distinct values paired with it."""
    if len(keys) == 0:
        return [np.zeros(0, dtype=np.int64)] * n
    order = np.lexsort((values, keys))
    k, v = keys[order], values[order].astype(np.int64)
    keep = np.ones(len(k), dtype=bool)
    keep[1:] = (k[1:] != k[:-1]) | (v[1:] != v[:-1])
    k, v = k[keep], v[keep]
    return np.split(v, np.searchsorted(k, np.arange(1, n)))


def _find_candidates(prob: Problem) -> None:
    """Pick each rematerializable tensor's gaps between consecutive uses after its last
    write, keeping those whose lone rebuild is executable: the longest gap only, or, where
    ``prob.every_gap``, every gap (a tensor may be freed and rebuilt once per gap, as in
    Checkmate and Moccasin). A tensor with several gaps is listed once per gap, in gap order."""
    cands, frees, remats, early = [], [], [], []
    every_gap = prob.every_gap
    for t in np.nonzero(prob.rematerializable & (prob.nbytes > 0))[0].tolist():
        last_write = int(prob.rebuild_ops[t][-1])
        u = prob.uses[t]
        u = u[u >= last_write]
        if len(u) < 2:
            continue
        gaps = np.diff(u)
        for k in (range(len(gaps)) if every_gap else [int(np.argmax(gaps))]):
            _add_gap(prob, t, int(u[k]), int(u[k + 1]), cands, frees, remats, early)
    prob.candidates = np.asarray(cands, dtype=np.int64)
    prob.cand_early_remat = np.asarray(early, dtype=np.int64)
    prob.cand_free_after = np.asarray(frees, dtype=np.int64)
    prob.cand_remat_before = np.asarray(remats, dtype=np.int64)


def _add_gap(prob: Problem, t: int, a: int, b: int, cands, frees, remats, early) -> None:
    """List gap (a, b) of ``t`` if a lone rebuild there is allowed and executable. The gap
    starts when a drop really frees ``t``: after ``a``, or later when the step's Python code
    still holds it then (:meth:`Problem.release_after`); held until ``b - 1``, it gains nothing."""
    f = prob.release_after(t, a)
    b = prob.unpack_point(b)  # where replay rebuilds it: its node unpacks it before running
    if b - f < 2 or b > prob.end[t] or b > prob.remat_deadline[t] or not rebuildable(prob, t, b):
        return
    if not prob.gap_allowed(np.asarray([prob.producer[t]]), np.asarray([a]), np.asarray([b]))[0]:
        return
    cands.append(t)
    frees.append(f)
    remats.append(b)
    reads = rebuild_inputs(prob, t)
    r = prob.unpack_point(int(min(int(prob.end[reads].min()), b))) if reads else b
    early_ok = f + 2 <= r < b and prob.gap_allowed(np.asarray([prob.producer[t]]), np.asarray([a]),
                                                    np.asarray([r]))[0]
    early.append(r if early_ok else -1)


def rebuild_inputs(problem: Problem, t: int) -> list[int]:
    """Tensors the rebuild of ``t`` reads (inputs of its rebuild ops, ``t`` itself excluded)."""
    out: list[int] = []
    for q in problem.rebuild_ops[t].tolist():
        for u in problem.op_reads[q].tolist():
            if u != t and u not in out:
                out.append(u)
    return out


def rebuildable(problem: Problem, t: int, r: int) -> bool:
    """Can ``t`` alone be rebuilt right before op ``r``, rebuilding gone inputs as needed?"""
    return rebuild_set(problem, t, r) is not None


def rebuild_set(problem: Problem, t: int, r: int) -> set[int] | None:
    """The tensors a lone rebuild of ``t`` right before op ``r`` re-makes (``t`` and its gone
    inputs, recursively), or None when one of them cannot be rebuilt."""
    seen = {t}
    stack = [t]
    while stack:
        x = stack.pop()
        if not problem.rematerializable[x] or r > problem.remat_deadline[x]:
            return None
        for u in rebuild_inputs(problem, x):
            if u in seen or problem.held(u, r):
                continue
            seen.add(u)
            stack.append(u)
    return seen


def read_args(problem: Problem) -> dict[int, list[int]]:
    """Op -> the storages it reads, by argument index (cached)."""
    cached = getattr(problem, "_read_args", None)
    if cached is None:
        acc = problem.trace.accesses
        rd = acc[acc["role"] == "read"].sort_values(["op_id", "arg_index"], kind="stable")
        cached = {}
        for op, t in zip(rd["op_id"].tolist(), rd["tensor_id"].tolist(), strict=True):
            cached.setdefault(int(op), []).append(problem.index_of(int(t)))
        problem._read_args = cached
    return cached


def _stem(op_name: str) -> str:
    """``aten.gelu_backward.default`` -> ``gelu``: the op name without namespace, overload
    and ``_backward``."""
    parts = op_name.split(".")
    base = parts[1] if len(parts) >= 2 and parts[0] in ("aten", "prims", "prim") else parts[0]
    return base.removesuffix("_backward")


op_stem = _stem  # the public name, for other rooms


