"""A step's time with its collectives overlapping compute (no torch).

``Problem.step_cost`` adds every op's cost, collectives included, as if each ran alone. On a
GPU, FSDP2 issues its all-gathers and reduce-scatters on streams of their own: a collective
runs while the compute stream goes on, and the compute stream waits only where an op reads what
the collective wrote (an all-gather's copy-out reads its buffer). Prefetching
(:mod:`taichi_plan.problem.sharding.prefetch`) issues an all-gather earlier, so more compute lies between its
issue and that read.

:func:`overlapped_step_time` replays the recorded op order on two timelines:

- every op that is not a collective runs on the compute timeline, in order, each starting when
  the previous one ended and every tensor it reads is ready;
- a collective (``c10d.*``, ``_c10d_functional.*``) is issued when the compute timeline reaches
  it and runs on one communication timeline, in issue order, for its cost; every tensor it
  touches (the trace marks its output as read, not written) is ready when it ends;
- the step ends when both timelines are done.

Modelled: overlap of a collective with the compute issued after it and before its result is
read, collectives serialised among themselves. Not modelled: the CPU running ahead of the
device (on a GPU, FSDP's implicit prefetching overlaps forward all-gathers even without an
explicit prefetch when the CPU is ahead: this model is pessimistic there), compute slowed by a
concurrent collective (memory bandwidth, the SMs NCCL uses), NCCL's own buffers, and copy-in on
its own stream (it is counted on the compute timeline). Recomputation a plan adds is counted on
the compute timeline as a whole (an upper bound: it could hide more of a collective).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Overlap", "is_collective", "overlapped_step_time"]

COLLECTIVE_PREFIXES = ("c10d.", "_c10d_functional.")


def is_collective(op_name: str) -> bool:
    return op_name.startswith(COLLECTIVE_PREFIXES)


@dataclass(frozen=True)
class Overlap:
    step_time: float        # the step's end: both timelines done
    compute_time: float     # sum of the costs of the ops that are not collectives
    collective_time: float  # sum of the collectives' costs
    exposed_time: float     # step_time - compute_time: collective time the compute timeline waited for

    def to_json(self) -> dict:
        return {"step_time": self.step_time, "compute_time": self.compute_time,
                "collective_time": self.collective_time, "exposed_collective_time": self.exposed_time}


def overlapped_step_time(problem) -> Overlap:
    """The step's time in the two-timeline model above (cached on the problem)."""
    cached = problem.__dict__.get("_overlap")
    if cached is not None:
        return cached
    trace = problem.trace
    n = problem.num_ops
    cost = np.asarray(problem.op_cost, dtype=float)
    coll = np.asarray([is_collective(x) for x in problem.op_name], dtype=bool)
    acc = trace.accesses
    a_op = acc["op_id"].to_numpy().astype(np.int64)
    a_t = acc["tensor_id"].to_numpy().astype(np.int64)
    order = np.argsort(a_op, kind="stable")
    bounds = np.searchsorted(a_op[order], np.arange(n + 1))
    ready: dict[int, float] = {}  # tensor id -> when the last collective writing it ends
    compute = comm = 0.0
    for i in range(n):
        rows = order[bounds[i]:bounds[i + 1]]
        if coll[i]:
            comm = max(comm, compute) + cost[i]
            for r in rows:  # the trace marks no write on a collective's buffers: all of them wait
                ready[int(a_t[r])] = comm
            continue
        begin = compute
        for r in rows:
            at = ready.get(int(a_t[r]))
            if at is not None and at > begin:
                begin = at
        compute = begin + cost[i]
    total_compute = float(cost[~coll].sum())
    end = max(compute, comm)
    out = Overlap(step_time=float(end), compute_time=total_compute, collective_time=float(cost[coll].sum()),
                  exposed_time=float(end - total_compute))
    problem._overlap = out
    return out
