"""What a planner can decide, built from a trace (no torch).

A *candidate* is a tensor whose memory can be given back between two consecutive uses:
it is freed after use ``free_after`` and rematerialized (its producer op re-run) before
use ``remat_before``. For a recorded step the natural gap is forward -> backward; for a
public graph it is the longest gap between two uses. A candidate qualifies when its
producer is recomputable, nobody else writes it, and none of the producer's inputs is
written between the producer and ``remat_before`` (the recomputed value would differ).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .trace import Trace, baseline_live_bytes, live_intervals

FIXED_KINDS = ("parameter", "buffer", "gradient", "optimizer_state", "input")


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
    rematerializable: np.ndarray  # bool per tensor: producer may be re-run to rebuild it
    baseline_live: np.ndarray  # live bytes during each op, unplanned
    candidates: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    cand_free_after: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    cand_remat_before: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

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
        return self._index[int(tensor_id)]

    def __post_init__(self):
        self._index = {int(t): i for i, t in enumerate(self.tensor_id.tolist())}


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
    order = np.argsort(a_op, kind="stable")
    op_reads: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * n
    op_outputs: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * n
    if len(order):
        so, st, sout = a_op[order], a_t[order], is_output[order]
        bounds = np.searchsorted(so, np.arange(n + 1))
        for i in range(n):
            lo, hi = bounds[i], bounds[i + 1]
            if lo == hi:
                continue
            ts, outs = st[lo:hi], sout[lo:hi]
            op_reads[i] = np.unique(ts[~outs])
            op_outputs[i] = np.unique(ts[outs])
    # Tensors produced by an op but with no write access recorded still count as outputs.
    for t in np.nonzero(producer >= 0)[0]:
        p = producer[t]
        if t not in op_outputs[p]:
            op_outputs[p] = np.union1d(op_outputs[p], [t])

    # Uses per tensor (any access) and writers other than the producer.
    order_t = np.lexsort((a_op, a_t))
    uses: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * m
    foreign_write = np.zeros(m, dtype=bool)
    if len(order_t):
        st, so, sw = a_t[order_t], a_op[order_t], a_write[order_t]
        bounds = np.searchsorted(st, np.arange(m + 1))
        for t in range(m):
            lo, hi = bounds[t], bounds[t + 1]
            if lo == hi:
                continue
            uses[t] = np.unique(so[lo:hi])
            w = so[lo:hi][sw[lo:hi]]
            foreign_write[t] = bool(np.any(w != producer[t]))
    writes: dict[int, np.ndarray] = {}
    if len(a_op):
        wt, wo = a_t[a_write], a_op[a_write]
        multi = np.nonzero(foreign_write)[0]
        for t in multi.tolist():
            writes[t] = np.unique(wo[wt == t])

    recomputable = ops["recomputable"].to_numpy().astype(bool)
    mutates = ops["mutates"].to_numpy().astype(bool)
    remat = np.zeros(m, dtype=bool)
    ok_kind = ~np.isin(kind, FIXED_KINDS)
    has_prod = producer >= 0
    remat[has_prod] = recomputable[producer[has_prod]] & ~mutates[producer[has_prod]]
    remat &= ok_kind & ~foreign_write

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
        baseline_live=baseline_live_bytes(trace),
    )
    _find_candidates(prob, writes)
    return prob


def _find_candidates(prob: Problem, writes: dict[int, np.ndarray]) -> None:
    """Pick each rematerializable tensor's longest gap between consecutive uses."""
    cands, frees, remats = [], [], []
    for t in np.nonzero(prob.rematerializable & (prob.nbytes > 0))[0]:
        u = prob.uses[t]
        p = prob.producer[t]
        u = u[u >= p]
        if len(u) < 2:
            continue
        gaps = np.diff(u)
        k = int(np.argmax(gaps))
        if gaps[k] < 2:
            continue
        a, b = int(u[k]), int(u[k + 1])
        if b > prob.end[t]:
            continue
        # The producer's inputs must hold the same values at b as at p.
        if any(_written_between(writes.get(int(r)), p, b) for r in prob.op_reads[p]):
            continue
        cands.append(t)
        frees.append(a)
        remats.append(b)
    prob.candidates = np.asarray(cands, dtype=np.int64)
    prob.cand_free_after = np.asarray(frees, dtype=np.int64)
    prob.cand_remat_before = np.asarray(remats, dtype=np.int64)


def _written_between(write_ops: np.ndarray | None, lo: int, hi: int) -> bool:
    """True if any op in (lo, hi) writes the tensor (``write_ops`` sorted, or None)."""
    if write_ops is None:
        return False
    k = np.searchsorted(write_ops, lo, side="right")
    return bool(k < len(write_ops) and write_ops[k] < hi)


def coverage_delta(problem: Problem, chosen: np.ndarray | None = None) -> np.ndarray:
    """Bytes freed at each op by dropping the candidates (all, or those where ``chosen``).

    A candidate frees its bytes during ops ``free_after+1 .. remat_before-1``: an upper
    bound on what it saves (rebuilding early or transients only add memory back).
    """
    n = problem.num_ops
    sel = np.ones(len(problem.candidates), dtype=bool) if chosen is None else chosen.astype(bool)
    delta = np.zeros(n + 1, dtype=np.int64)
    np.add.at(delta, problem.cand_free_after[sel] + 1, problem.nbytes[problem.candidates[sel]])
    np.add.at(delta, problem.cand_remat_before[sel], -problem.nbytes[problem.candidates[sel]])
    return np.cumsum(delta)[:n]


def min_live_bytes(problem: Problem) -> np.ndarray:
    """Bytes that must be live during each op under any plan (everything droppable dropped,
    nothing rebuilt): no budget below ``max(min_live_bytes)`` can be met."""
    return problem.baseline_live - coverage_delta(problem)
