"""Offload, the third choice beside keeping and dropping a saved activation (no torch).

An offloaded tensor is copied to host memory after its last forward use and copied back
before its first backward use, on copy streams, while the compute stream goes on. The
simulator (:func:`taichi_plan.simulate.core.simulate`) asks :func:`schedule_offloads` when each
copy runs and where the compute stream waits for one. The model:

* **Compute stream.** The step's ops run in order, each for its cost (``Problem.op_cost``),
  a recompute group before its op for the group's cost; nothing else is on it. Op ``i`` starts
  at ``op_start_s[i]``.
* **Copy-out** (device to host, one stream, FIFO in issue order). Issued right after op
  ``after`` ends (the tensor's last forward use, as a drop frees it); it starts when that
  stream is free and takes ``nbytes / host_link_bytes_per_s``. Its host buffer is held from
  its start. The device bytes are freed after the op that runs when the copy ends (``freed_after``:
  ``after`` itself when the copy ends before the next op starts; the runtime frees a tensor
  between ops).
* **Copy-in** (host to device, one stream, FIFO). Issued before op ``prefetch_at``, at the
  boundary before that op's recompute group; the device bytes are allocated there. It starts
  when that stream is free and the tensor's copy-out has ended, and its host buffer is freed
  when it ends.
* **Prefetch point.** On the stall-free timeline, the latest issue point from which the
  copy-in ends before op ``before`` (the first backward use's unpack point) starts, copies-in
  taken latest deadline first so that their FIFO order is their deadline order (each must end
  before the next one's latest start). Only points at or after the copy-out's end count (one
  issued earlier holds the device bytes from there: the tensor never leaves); a copy-in that
  cannot make it from any of them is issued at the first of them (or at ``before`` when there
  is none), and the compute stream stalls.
  Issue points are the ops the runtime can act at (:func:`issue_points`).
* **Read by a rebuild.** A recompute group that re-runs an op reading the tensor while it is
  away (the tensor is a rebuild's input, a checkpoint on the host) needs it back before the
  group: the first such group, before op ``r`` (``after < r <= before``), moves the deadline to
  the boundary before that group (``back_by = r``, ``by_group``), the prefetch point is chosen
  among the issue points before it, and the runtime copies it back on demand there if no
  earlier point was chosen (the group reads it, :mod:`taichi_plan.runtime.mode.rebuilds`).
* **Stall.** Before op ``before`` (or before the group that reads it first) the compute stream
  waits until the copy-in has ended; the wait is added to the step (``stall_s``, counted in the
  plan's extra compute). Later ops start later by the waits before them.

Host bytes in use are the host buffers of copies between their copy-out's start and their
copy-in's end (``host_peak_bytes``). Not modelled: compute slowed by a concurrent copy (memory
bandwidth), the per-drop runtime cost and partition costs on the timeline (they are added to
the step's cost, not placed in time), copies in both directions sharing a link (PCIe and
NVLink-C2C are full duplex).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..base.errors import PlanError

__all__ = ["Offload", "OffloadConfig", "OffloadSchedule", "allow_offload", "host_link_of", "OffloadTiming", "check_offloads", "issue_points", "offload_candidates",
           "schedule_offloads"]


@dataclass(frozen=True)
class OffloadConfig:
    """A solve that may offload: the host link its copies run on and the host bytes they may hold."""

    host_link_bytes_per_s: float
    host_budget_bytes: int | None = None  # None: no bound

    def to_dict(self) -> dict:
        return {"host_link_bytes_per_s": float(self.host_link_bytes_per_s), "host_budget_bytes": self.host_budget_bytes}


def host_link_of(trace, given: float | None = None) -> float:
    """The host link an offload of ``trace`` is costed on: ``given`` (bytes/s), else the trace's
    device profile's (``meta.device_profile``); a :class:`~taichi_plan.base.errors.UsageError`
    when neither is known."""
    from ..base.errors import UsageError
    from ..trace.devices import get_profile

    if given is not None:
        if not given > 0:
            raise UsageError(f"The host link bandwidth must be above 0 bytes/s, not {given!r}.")
        return float(given)
    name = trace.meta.get("device_profile")
    if name:
        bw = get_profile(name).host_link_bytes_per_s
        if bw > 0:
            return float(bw)
    raise UsageError("Offload needs the host link bandwidth its copies run at, and this trace names no device "
                     "profile (record it with --device-profile, or give --host-link GB/s).")


def allow_offload(problem, config: OffloadConfig | None):
    """``problem`` with offload among the planners' options (``config``) or not
    (:meth:`~taichi_plan.problem.core.Problem.with_options`)."""
    return problem.with_options(offload=config)


@dataclass(frozen=True)
class Offload:
    """Copy ``tensor`` (index into ``problem.tensor_id``) to host after op ``after`` (its last
    forward use); have it back on the device before op ``before`` (its first backward use's
    unpack point)."""

    tensor: int
    after: int
    before: int


@dataclass
class OffloadTiming:
    """When one offload's copies run (seconds from the step's start) and what they do."""

    tensor: int
    after: int
    before: int
    nbytes: int
    copy_out_start_s: float
    copy_out_end_s: float
    freed_after: int  # device bytes freed after this op
    prefetch_at: int  # copy-in issued (device bytes allocated again) before this op
    copy_in_start_s: float
    copy_in_end_s: float
    stall_s: float  # the compute stream waited this long before op ``before`` (or the group at ``back_by``)
    back_by: int = -1  # the tensor is needed back before op ``back_by`` (``before``, or a rebuild's group)
    by_group: bool = False  # ``back_by`` is the recompute group before that op (which reads it), not the op

    @property
    def leaves_device(self) -> bool:
        """Whether the device bytes are ever given back (the copy-out ends before the copy-in is issued)."""
        return self.prefetch_at > self.freed_after + 1

    @property
    def on_demand(self) -> bool:
        """Whether the copy back is issued where the tensor is needed (its unpack, or the rebuild
        that reads it first), which replay does on demand, rather than earlier at a trigger."""
        return self.prefetch_at >= self.back_by


@dataclass
class OffloadSchedule:
    timings: list[OffloadTiming] = field(default_factory=list)
    stall_s: float = 0.0
    host_peak_bytes: int = 0
    host_link_bytes_per_s: float = 0.0
    step_time_s: float = 0.0  # the compute stream's end, stalls included
    op_start_s: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def by_tensor(self) -> dict[int, OffloadTiming]:
        return {t.tensor: t for t in self.timings}


def offload_candidates(problem) -> list[Offload]:
    """The offloads a plan may make: the forward -> backward gaps of saved activations that a
    drop could free (``problem.candidates``), one per tensor (imported graphs have no backward
    to copy back for, and offload needs seconds, not cost units)."""
    if not problem.replayable_only or problem.trace.cost_unit != "s":
        return []
    out, seen = [], set()
    for t, a, b in zip(problem.candidates.tolist(), problem.cand_free_after.tolist(),
                       problem.cand_remat_before.tolist()):
        if t not in seen and problem.op_phase[b] == "backward":
            seen.add(t)
            out.append(Offload(int(t), int(a), int(b)))
    return out


def check_offloads(problem, offloads, dropped=()) -> None:
    """Refuse an offload that is not one of :func:`offload_candidates`, a tensor offloaded
    twice or also dropped (``dropped``: tensor indices)."""
    allowed = {(o.tensor, o.after, o.before) for o in offload_candidates(problem)}
    seen: set[int] = set()
    dropped = set(dropped)
    for o in offloads:
        t = int(o.tensor)
        tid = int(problem.tensor_id[t]) if 0 <= t < len(problem.tensor_id) else t
        if t in seen:
            raise PlanError(f"The plan offloads tensor {tid} twice; a tensor is offloaded at most once.")
        if t in dropped:
            raise PlanError(f"The plan both drops and offloads tensor {tid}; choose one.")
        if (t, int(o.after), int(o.before)) not in allowed:
            why = ("offload needs a recorded step whose costs are seconds" if not allowed else
                   f"after op {o.after} and back before op {o.before} is not a forward -> backward gap of a saved "
                   "activation of this trace")
            raise PlanError(f"The plan offloads tensor {tid}, but {why}. The plan was made for another trace: "
                            "solve it again.")
        seen.add(t)


def issue_points(problem) -> np.ndarray:
    """Sorted op ids before which a copy-in may be issued: on a recorded step, the unpack
    points of backward nodes that unpack a saved forward tensor of a model call for the last
    time (the runtime issues the copy when autograd unpacks it: a *trigger*, as an early
    rebuild group's), and every forward op; elsewhere every op. A copy-in issued at its own
    tensor's unpack point (``before``) needs no trigger: it is always allowed."""
    cached = problem.__dict__.get("_issue_points")
    if cached is not None:
        return cached
    n = problem.num_ops
    if not problem.replayable_only:
        out = np.arange(n, dtype=np.int64)
    else:
        phase = np.asarray(problem.op_phase)
        unpack = problem.unpack_at
        ok = phase != "backward"
        for u in range(len(problem.nbytes)):
            p, e = int(problem.producer[u]), int(problem.end[u])
            if p < 0 or not 0 <= e < n or phase[p] != "forward" or phase[e] != "backward" or problem.op_call[p] < 0:
                continue
            r = int(unpack[e])
            if r < n and any(int(unpack[o]) == r for o in problem.uses[u].tolist() if o <= e and phase[o] == "backward"):
                ok[r] = True
        out = np.nonzero(ok)[0].astype(np.int64)
    problem.__dict__["_issue_points"] = out
    return out


def trigger_tensor(problem, r: int, call: int | None = None) -> int | None:
    """A saved forward tensor (index) whose last unpack is node ``r``'s (made in model call
    ``call``, if given), the smallest index; None if there is none. The runtime issues a copy
    back there when autograd unpacks it (:func:`issue_points`)."""
    phase = problem.op_phase
    unpack = problem.unpack_at
    best = None
    for o in np.nonzero(unpack == r)[0].tolist():
        if phase[o] != "backward":
            continue
        for u in problem.op_reads[o].tolist():
            p, e = int(problem.producer[u]), int(problem.end[u])
            if (p < 0 or phase[p] != "forward" or not 0 <= e < problem.num_ops or int(unpack[e]) != r
                    or problem.op_call[p] < 0 or (call is not None and int(problem.op_call[p]) != call)):
                continue
            best = u if best is None else min(best, u)
    return best


def schedule_offloads(problem, offloads, group_cost: dict[int, float], host_link_bytes_per_s: float,
                      group_reads: dict[int, int] | None = None) -> OffloadSchedule:
    """When each offload's copies run, where the compute stream stalls, and the host bytes
    (see the module docstring). ``group_cost``: op -> cost of the recompute group before it;
    ``group_reads``: offloaded tensor -> the first op (``after < r <= before``) whose recompute
    group reads it (it must be back before that group)."""
    if not offloads:
        return OffloadSchedule(host_link_bytes_per_s=host_link_bytes_per_s)
    if not host_link_bytes_per_s or host_link_bytes_per_s <= 0:
        raise PlanError("The plan offloads tensors, but no host link bandwidth is known for it (a device "
                        "profile's host_link_bytes_per_s, or --host-link). Give one.")
    n = problem.num_ops
    cost = np.asarray(problem.op_cost, dtype=np.float64)
    pre = np.zeros(n, dtype=np.float64)
    for r, c in group_cost.items():
        if 0 <= r < n:
            pre[r] += c
    # Stall-free timeline: boundary[i] = before op i's group; start[i] = op i itself.
    boundary = np.concatenate([[0.0], np.cumsum(pre + cost)])[:n]
    nominal_start = boundary + pre
    points = issue_points(problem)
    dur = {o.tensor: float(problem.nbytes[o.tensor]) / host_link_bytes_per_s for o in offloads}
    # The prefetch point is chosen on the stall-free timeline; the event pass below gives the
    # real times (a stall delays what comes after it).
    out_end: dict[int, float] = {}  # copy-outs on the stall-free timeline (FIFO)
    free = 0.0
    for o in sorted(offloads, key=lambda o: (o.after, o.tensor)):
        free = max(float(nominal_start[o.after] + cost[o.after]), free) + dur[o.tensor]
        out_end[o.tensor] = free
    reads = group_reads or {}
    # Needed back before op back_by (after its group), or before the group there that reads it.
    back_by = {o.tensor: int(reads.get(o.tensor, o.before)) for o in offloads}
    need_s = {o.tensor: float(boundary[back_by[o.tensor]] if o.tensor in reads else nominal_start[o.before])
              for o in offloads}
    prefetch: dict[int, int] = {}
    latest_end = np.inf
    for o in sorted(offloads, key=lambda o: (-back_by[o.tensor], o.tensor in reads, -o.tensor)):
        deadline = min(need_s[o.tensor], latest_end)
        start_by = deadline - dur[o.tensor]
        # Issued before its copy-out ends, a copy-in would hold the device bytes from there on:
        # the tensor would never leave. Its own unpack point (or the group that reads it) is
        # always allowed.
        mid = points[(points > o.after) & (points < back_by[o.tensor])]
        mid = mid[boundary[mid] >= out_end[o.tensor] - 1e-12 * max(1.0, out_end[o.tensor])]
        allowed = np.append(mid, back_by[o.tensor])
        fit = allowed[boundary[allowed] <= start_by + 1e-12 * max(1.0, abs(start_by))]
        p = int(fit[-1]) if len(fit) else int(allowed[0])
        prefetch[o.tensor] = p
        latest_end = max(start_by, float(boundary[p]))
    issue_at: dict[int, list] = {}
    out_at: dict[int, list] = {}
    need_at: dict[int, list] = {}
    need_group_at: dict[int, list] = {}
    for o in sorted(offloads, key=lambda o: (o.before, o.tensor)):
        issue_at.setdefault(prefetch[o.tensor], []).append(o)
        (need_group_at if o.tensor in reads else need_at).setdefault(back_by[o.tensor], []).append(o)
    for o in sorted(offloads, key=lambda o: (o.after, o.tensor)):
        out_at.setdefault(o.after, []).append(o)
    clock = 0.0
    d2h_free = h2d_free = 0.0
    out_times: dict[int, tuple[float, float]] = {}
    in_times: dict[int, tuple[float, float]] = {}
    stall: dict[int, float] = {}
    op_start = np.zeros(n, dtype=np.float64)
    for i in range(n):
        for o in issue_at.get(i, ()):
            s = max(clock, h2d_free, out_times[o.tensor][1])
            in_times[o.tensor] = (s, s + dur[o.tensor])
            h2d_free = s + dur[o.tensor]
        for o in need_group_at.get(i, ()):
            wait = max(0.0, in_times[o.tensor][1] - clock)
            stall[o.tensor] = wait
            clock += wait
        clock += pre[i]
        for o in need_at.get(i, ()):
            wait = max(0.0, in_times[o.tensor][1] - clock)
            stall[o.tensor] = wait
            clock += wait
        op_start[i] = clock
        clock += cost[i]
        for o in out_at.get(i, ()):
            s = max(clock, d2h_free)
            out_times[o.tensor] = (s, s + dur[o.tensor])
            d2h_free = s + dur[o.tensor]
    timings = []
    for o in sorted(offloads, key=lambda o: (o.after, o.tensor)):
        oe = out_times[o.tensor][1]
        # the last op that starts before the copy-out ends holds the bytes
        freed = max(int(o.after), int(np.searchsorted(op_start, oe, side="left")) - 1)
        timings.append(OffloadTiming(
            tensor=int(o.tensor), after=int(o.after), before=int(o.before), nbytes=int(problem.nbytes[o.tensor]),
            copy_out_start_s=out_times[o.tensor][0], copy_out_end_s=oe, freed_after=freed,
            prefetch_at=prefetch[o.tensor], copy_in_start_s=in_times[o.tensor][0],
            copy_in_end_s=in_times[o.tensor][1], stall_s=stall[o.tensor], back_by=back_by[o.tensor],
            by_group=o.tensor in reads))
    # Host bytes: +nbytes at a copy-out's start, -nbytes at its copy-in's end (at one instant,
    # buffers taken before buffers given back: the larger count).
    events = sorted([(t.copy_out_start_s, 0, t.nbytes) for t in timings]
                    + [(t.copy_in_end_s, 1, -t.nbytes) for t in timings])
    host = peak = 0
    for _s, _k, nb in events:
        host += nb
        peak = max(peak, host)
    return OffloadSchedule(timings=timings, stall_s=float(sum(stall.values())), host_peak_bytes=int(peak),
                           host_link_bytes_per_s=float(host_link_bytes_per_s), step_time_s=float(clock),
                           op_start_s=op_start)
