"""The referee: replays a trace under a plan and reports the memory it really needs.

Semantics (per-tensor rematerialization, the mechanism replay executes):

* A dropped tensor ``t`` with gap ``(free_after, remat_before)`` is freed right after op
  ``free_after`` (its last use before the gap, or, when the step's Python code holds it
  longer, the last op it does: trace ``meta.python_refs``) and rebuilt by re-running its producer in the *recompute group* that runs
  just before op ``remat_before``. The rebuilt copy then lives until its original last use,
  or, when ``t`` has another gap later (imported graphs only: a recorded tensor has at most
  one), until that gap's ``free_after``: a tensor may be freed and rebuilt once per gap.
* Re-running a producer needs its inputs. An input that is live is used as is. A dropped
  input still inside its gap is rebuilt in the same, earlier group (its own rebuild moves
  up, and it then lives until its own last use). Any other input that is gone (a forward
  temporary) is rebuilt as a *transient* inside the group and freed right after its last
  reader in that group.
* A group re-runs its ops in original op order; every output of a re-run op is allocated,
  and the outputs nobody needs are freed right after that op.
* Imported graphs without a backward (``problem.every_gap``) also take *revivals*, a drop
  whose ``free_after`` is the tensor's own last op (``end``): the tensor, dead by then, is
  made available again for later rebuilds from the group before ``remat_before`` on. With
  ``remat_before == end + 1`` it is *kept* (never freed: no re-run); later, it is *rebuilt*
  there by re-running its rebuild ops (inputs resolved as above). Either way it is then held
  until the last later group that reads it and freed right after its last reader in that
  group (Moccasin's second interval of a node). At most one revival per tensor; a group
  before ``remat_before`` that needs it re-makes it as a transient.
* Partitions (see :mod:`taichi_plan.problem.partition`) are applied to the problem before this.
* An *offloaded* tensor (:mod:`taichi_plan.problem.offload`) is copied to host after its last forward
  use and back before its first backward use: its device bytes are freed after the op that runs
  when its copy-out ends and allocated again where its copy-in is issued (the prefetch point),
  then held as a rebuilt copy is. Where a copy-in ends after its op is due, the compute stream
  waits: the stall is added to the extra compute. A recompute group that reads a tensor while
  it is offloaded (a rebuild's input on the host) needs it back before that group: the first
  such group is its deadline instead.

Memory is counted per op: a tensor is live during ops ``start..end`` inclusive. During a
recompute op the live bytes are those carried into the group plus the group's outputs so
far. The peak is over run ops and recompute ops alike.
"""

from __future__ import annotations

import bisect
import heapq
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from ..base.errors import PlanError
from ..problem.core import FIXED_KINDS, Problem, rebuild_inputs
from ..problem.offload import Offload, OffloadSchedule, check_offloads, schedule_offloads
from ..trace.format import KINDS


@dataclass(frozen=True)
class Drop:
    """Free tensor (by index into ``problem.tensor_id``) after its use ``free_after``; rebuild it
    before ``remat_before`` (its next use, or earlier: then it is held until that use)."""

    tensor: int
    free_after: int
    remat_before: int


@dataclass
class Group:
    before_op: int
    ops: list[int]
    peak_bytes: int
    cost: float


@dataclass
class SimResult:
    live_bytes: np.ndarray  # during each run op
    live_by_kind: dict[str, np.ndarray]
    groups: dict[int, Group]
    peak_bytes: int
    peak_op: int
    peak_in_recompute: bool  # the peak happens in the recompute group before ``peak_op``
    extra_cost: float
    step_cost: float
    remat_at: dict[int, int] = field(default_factory=dict)  # dropped tensor -> group of its first rebuild
    # (tensor, free_after) of each drop -> the group it is rebuilt in
    remat_at_drop: dict[tuple[int, int], int] = field(default_factory=dict)
    partition_cost: float = 0.0  # included in extra_cost
    transients: dict[int, set[int]] = field(default_factory=dict)  # group -> tensors re-made and freed in it
    revived: dict[int, tuple[int, int]] = field(default_factory=dict)  # revived tensor -> ops it is held
    offload: OffloadSchedule | None = None  # the copies of offloaded tensors (None: none)

    @property
    def stall_cost(self) -> float:
        """Seconds the compute stream waits for copies-in (included in ``extra_cost``)."""
        return self.offload.stall_s if self.offload is not None else 0.0

    @property
    def host_peak_bytes(self) -> int:
        return self.offload.host_peak_bytes if self.offload is not None else 0

    @property
    def extra_pct(self) -> float:
        return 100.0 * self.extra_cost / self.step_cost if self.step_cost > 0 else 0.0

    @property
    def recompute_ops(self) -> int:
        return sum(len(g.ops) for g in self.groups.values())


def is_revival(problem: Problem, d: Drop) -> bool:
    """Is ``d`` a revival (module docstring): a drop, on a forward-only imported graph, whose
    ``free_after`` is the tensor's own last op?"""
    t = int(d.tensor)
    return problem.every_gap and 0 <= t < len(problem.end) and int(d.free_after) == int(problem.end[t])


def check_revivals(problem: Problem, drops: list[Drop]) -> dict[int, int]:
    """Validate the revivals among ``drops``; return tensor index -> ``remat_before``."""
    out: dict[int, int] = {}
    for d in drops:
        if not is_revival(problem, d):
            continue
        t, s = int(d.tensor), int(d.remat_before)
        tid = int(problem.tensor_id[t])
        if t in out:
            raise PlanError(f"The plan revives tensor {tid} twice; a tensor has at most one revival.")
        if problem.persists[t] or problem.kind[t] in FIXED_KINDS or problem.nbytes[t] <= 0:
            raise PlanError(f"The plan revives tensor {tid}, which is model state, an input or outlives the step.")
        if not problem.end[t] + 1 <= s < problem.num_ops:
            raise PlanError(f"The plan revives tensor {tid} before op {s}, which is not after its last op "
                            f"{int(problem.end[t])}. The plan was made for another trace.")
        if s >= problem.end[t] + 2 and not problem.rematerializable[t]:
            raise PlanError(f"The plan rebuilds tensor {tid} before op {s}, but it cannot be rebuilt (its "
                            "producer is not recomputable).")
        out[t] = s
    return out


def check_drops(problem: Problem, drops: list[Drop]) -> dict[int, list[Drop]]:
    """Validate drops against the problem; return them keyed by tensor index, each tensor's
    in gap order (revivals, checked by :func:`check_revivals`, are left out). Several gaps of
    one tensor are allowed on imported graphs only (replay rebuilds a recorded tensor once),
    and never overlapping ones."""
    out: dict[int, list[Drop]] = {}
    for d in drops:
        if is_revival(problem, d):
            continue
        t = int(d.tensor)
        tid = int(problem.tensor_id[t]) if 0 <= t < len(problem.tensor_id) else t
        if not (0 <= t < len(problem.nbytes)):
            raise PlanError(f"The plan drops tensor index {t}, which the trace does not have.")
        if t in out and problem.replayable_only:
            raise PlanError(f"The plan drops tensor {tid} twice; a recorded tensor has at most one gap.")
        if not problem.rematerializable[t]:
            raise PlanError(
                f"The plan drops tensor {tid}, but it cannot be rebuilt (its producer is not "
                "recomputable, or it is a parameter, gradient, optimizer state or input)."
            )
        u = problem.uses[t]
        a, b = int(d.free_after), int(d.remat_before)
        k = int(np.searchsorted(u, a, side="right")) - 1  # its last use at or before op a
        ok = k >= 0 and k + 1 < len(u) and a + 2 <= b <= u[k + 1]
        if not ok or u[k] < problem.rebuild_ops[t][-1] or b > problem.end[t]:
            raise PlanError(
                f"The plan drops tensor {tid} after op {a} and rebuilds it before op {b}, but op {a} "
                "is not a use of it followed by a gap of at least two ops reaching op "
                f"{b}. The plan was made for another trace."
            )
        release = problem.release_after(t, int(u[k]))
        if a != release:
            held = (f"the step's Python code holds it until op {release} (meta.python_refs), so a drop frees "
                    "it only then" if release > u[k] else f"op {a} is not a use of it")
            raise PlanError(
                f"The plan drops tensor {tid} after op {a}, but {held}. The plan was made without "
                "this trace's facts: solve it again."
            )
        out.setdefault(t, []).append(d)
    for t, ds in out.items():
        if len(ds) > 1:
            ds.sort(key=lambda d: d.free_after)
            for p, q in zip(ds, ds[1:]):
                if q.free_after < p.remat_before:
                    raise PlanError(
                        f"The plan drops tensor {int(problem.tensor_id[t])} over two overlapping gaps (after ops "
                        f"{p.free_after} and {q.free_after}); its gaps must be disjoint.")
    return out


@dataclass
class _Resolved:
    """A plan resolved against the problem: when every rebuild runs and what each group holds."""

    D: dict[int, list[Drop]]  # gap drops per tensor, in gap order
    R: dict[int, int]  # revivals: tensor -> remat_before
    remat_at: dict[tuple[int, int], int]  # (tensor, gap) -> group of its rebuild
    transients: dict[int, set[int]]  # group -> tensors re-made there and freed in it
    revived: dict[int, tuple[int, int]]  # revived tensor -> (first op held, last op held) in the timeline
    expiring: dict[int, set[int]]  # group -> revived tensors carried in and freed after their last reader
    rebuilt: dict[int, set[int]]  # group -> revived tensors rebuilt there and held after it

    def groups(self) -> dict[int, tuple[set[int], set[int], set[int]]]:
        """Group time -> (tensors rebuilt there and held, transients, carried tensors it frees)."""
        out: dict[int, tuple[set[int], set[int], set[int]]] = {}
        for (t, _j), r in self.remat_at.items():
            out.setdefault(r, (set(), set(), set()))[0].add(t)
        for r, ts in self.rebuilt.items():
            out.setdefault(r, (set(), set(), set()))[0].update(ts)
        for r, ts in self.transients.items():
            out.setdefault(r, (set(), set(), set()))[1].update(ts)
        for r, ts in self.expiring.items():
            out.setdefault(r, (set(), set(), set()))[2].update(ts)
        return out


def _resolve(problem: Problem, drops: list[Drop], failures: set[int] | None = None) -> _Resolved:
    D = check_drops(problem, drops)
    R = check_revivals(problem, drops)
    remat_at, found, read_at = _closure(problem, D, R, failures)
    transients: dict[int, set[int]] = defaultdict(set, found)
    revived: dict[int, tuple[int, int]] = {}
    expiring: dict[int, set[int]] = defaultdict(set)
    rebuilt: dict[int, set[int]] = defaultdict(set)
    for t, s in R.items():
        e = read_at.get(t)
        keep = s == problem.end[t] + 1
        if keep and e is None:
            continue  # kept for nothing: freed at its last op as before
        if not keep and (e is None or e == s):
            transients[s].add(t)  # rebuilt for its own group only (or for nobody)
            continue
        if not keep:
            rebuilt[s].add(t)
        revived[t] = (s, e - 1)
        expiring[e].add(t)
    return _Resolved(D, R, remat_at, {r: v for r, v in transients.items() if v}, revived, dict(expiring),
                     dict(rebuilt))


def simulate(problem: Problem, drops: list[Drop], offloads: list[Offload] = (),
             host_link_bytes_per_s: float | None = None) -> SimResult:
    """Simulate the step with ``drops`` and ``offloads`` applied (copies on a host link of
    ``host_link_bytes_per_s``); see the module docstring for semantics."""
    res = _resolve(problem, drops)
    D, remat_at = res.D, res.remat_at
    n = problem.num_ops
    nbytes = problem.nbytes
    sched = _offload_schedule(problem, res, list(offloads), host_link_bytes_per_s) if offloads else None

    # Pieces (tensor, first op, last op) under the plan, then the per-op live timeline.
    starts = problem.start.copy()
    ends = problem.end.copy()
    extra_t, extra_s, extra_e, made = [], [], [], []
    for t, ds in D.items():
        ends[t] = ds[0].free_after
        for j in range(len(ds)):
            extra_t.append(t)
            extra_s.append(remat_at[(t, j)])
            extra_e.append(_piece_end(problem, ds, j, t))
            made.append(True)
    for t, (first, last) in res.revived.items():
        extra_t.append(t)
        extra_s.append(first)
        extra_e.append(last)
        made.append(res.R[t] >= problem.end[t] + 2)  # a kept tensor is not allocated again
    for tm in sched.timings if sched is not None else ():
        if tm.leaves_device:
            ends[tm.tensor] = tm.freed_after
            extra_t.append(tm.tensor)
            extra_s.append(tm.prefetch_at)
            extra_e.append(rebuilt_end(problem, tm.tensor))
            made.append(False)  # copied in before the group at its op: carried into it
    pt = np.concatenate([np.arange(len(nbytes)), np.asarray(extra_t, dtype=np.int64)])
    ps = np.concatenate([starts, np.asarray(extra_s, dtype=np.int64)])
    pe = np.concatenate([ends, np.asarray(extra_e, dtype=np.int64)])
    live_by_kind = {}
    kinds = problem.kind[pt]
    present = set(kinds.tolist())
    for k in KINDS:
        if k not in present:  # (a kind no tensor has: zeros, without the sweep)
            live_by_kind[k] = np.zeros(n, dtype=np.int64)
            continue
        mask = kinds == k
        delta = np.zeros(n + 1, dtype=np.int64)
        np.add.at(delta, ps[mask], nbytes[pt[mask]])
        np.add.at(delta, pe[mask] + 1, -nbytes[pt[mask]])
        live_by_kind[k] = np.cumsum(delta)[:n]
    live = sum(live_by_kind.values()) if n else np.zeros(0, dtype=np.int64)
    start_bytes = np.zeros(n + 1, dtype=np.int64)
    alloc = np.concatenate([np.ones(len(nbytes), dtype=bool), np.asarray(made, dtype=bool)])
    np.add.at(start_bytes, ps[alloc], nbytes[pt[alloc]])

    groups = {}
    for r, members in res.groups().items():
        carried = int(live[r] - start_bytes[r]) + int(sum(int(nbytes[t]) for t in members[2]))
        groups[r] = _run_group(problem, r, members, carried)

    peak_op, peak_bytes, in_group = -1, 0, False
    if n:
        peak_op = int(np.argmax(live))
        peak_bytes = int(live[peak_op])
    for r in sorted(groups):
        if groups[r].peak_bytes > peak_bytes:
            peak_bytes, peak_op, in_group = groups[r].peak_bytes, r, True
    # Each drop's own cost beyond its re-run ops (Problem.drop_cost: the runtime's measured
    # drop_s; 0 without one).
    extra = float(sum(g.cost for g in groups.values())) + problem.drop_cost * len(drops)
    extra += sched.stall_s if sched is not None else 0.0
    remat_at_drop = {(t, ds[j].free_after): remat_at[(t, j)] for t, ds in D.items() for j in range(len(ds))}
    remat_at_drop.update({(t, int(problem.end[t])): s for t, s in res.R.items()})
    return SimResult(
        live_bytes=live,
        live_by_kind=live_by_kind,
        groups=groups,
        peak_bytes=peak_bytes,
        peak_op=peak_op,
        peak_in_recompute=in_group,
        extra_cost=extra,
        step_cost=problem.step_cost,
        remat_at={t: remat_at[(t, 0)] for t in D},
        remat_at_drop=remat_at_drop,
        transients=res.transients,
        revived=res.revived,
        offload=sched,
    )


def _offload_schedule(problem: Problem, res: _Resolved, offloads: list[Offload],
                      host_link_bytes_per_s: float | None) -> OffloadSchedule:
    """The offloads' copies (:func:`taichi_plan.problem.offload.schedule_offloads`) on the timeline of
    the plan's recompute groups; a group that reads an offloaded tensor while it is away (a
    rebuild's input on the host) needs it back before the group: the first such group is the
    tensor's deadline."""
    check_offloads(problem, offloads, res.D)
    away = {int(o.tensor): o for o in offloads}
    group_cost = {}
    reads: dict[int, int] = {}
    for r, members in sorted(res.groups().items()):
        ops = [p for p, _a, _f in group_events(problem, members)]
        group_cost[r] = float(problem.rerun_cost[ops].sum()) if ops else 0.0
        for p in ops:
            for u in problem.op_reads[p].tolist():
                o = away.get(int(u))
                if o is not None and o.after < r <= o.before and int(u) not in reads:
                    reads[int(u)] = r
    return schedule_offloads(problem, offloads, group_cost, host_link_bytes_per_s or 0.0, group_reads=reads)


def _piece_end(problem: Problem, ds: list[Drop], j: int, t: int) -> int:
    """Last op the copy rebuilt for gap ``j`` of ``t`` is held: the next gap's free_after, or
    the end of its last copy (:func:`rebuilt_end`)."""
    return ds[j + 1].free_after if j + 1 < len(ds) else rebuilt_end(problem, t)


def rebuilt_end(problem: Problem, t: int) -> int:
    """Last op a rebuilt copy of ``t`` is held. On a recorded step, replay holds it until its
    last handle is unpacked, then autograd's node holds what it unpacked while its apply runs:
    it dies before the engine's sums of a broadcast input's gradient to its shape that follow
    (``partition.apply_end``), where the unplanned step's saved variable lives until the node
    is released, after them (a linear layer's bias gradient, 512 B, allocated beside the
    rebuilt input in the prediction, not in the run: a DistilBERT measured 512 B below its
    predicted peak). Elsewhere: the tensor's own end, or past it where a compiled step's kernel
    reads the rebuilt copy to its end (``Problem.rebuilt_hold``)."""
    end = int(problem.end[t])
    if t in problem.rebuilt_hold:
        return max(end, problem.rebuilt_hold[t])
    if not problem.replayable_only:
        return end
    from ..problem.partition.peaks import apply_end

    u = problem.uses[t]
    u = u[u <= end]
    return apply_end(problem, int(u[-1]), end) if len(u) else end


def _available(problem: Problem, D: dict[int, list[Drop]], remat_at: dict[tuple[int, int], int], u: int,
               r: int) -> bool:
    """Is tensor ``u`` in memory when the group before op ``r`` runs (or rebuilt in it)?"""
    s = problem.start[u]
    if u in D:
        ds = D[u]
        if s <= r - 1 and ds[0].free_after >= r:
            return True
        return any(remat_at[(u, j)] <= r <= _piece_end(problem, ds, j, u) for j in range(len(ds)))
    return problem.held(u, r)


def _gap_holding(D: dict[int, list[Drop]], remat_at: dict[tuple[int, int], int], u: int, r: int) -> int | None:
    """The gap of ``u`` during which the group before op ``r`` runs (u freed, not yet back)."""
    for j, d in enumerate(D.get(u, ())):
        if d.free_after < r < remat_at[(u, j)]:
            return j
    return None


REVIVE = -2  # heap entry of a revival's rebuild (j = -1: a transient)


def _closure(problem: Problem, D: dict[int, list[Drop]], R: dict[int, int] | None = None,
             failures: set[int] | None = None
             ) -> tuple[dict[tuple[int, int], int], dict[int, set[int]], dict[int, int]]:
    """When each dropped tensor is rebuilt, which transients each group needs, and the last
    group that reads each revived tensor.

    Groups are resolved earliest first, so a rebuild that moves up (because an earlier
    group needs the tensor) is settled before any later group looks at it. A rebuild that
    needs a tensor that is gone and cannot be rebuilt raises :class:`PlanError`, or, with
    ``failures``, adds the dropped tensor whose rebuild started the chain to it.
    """
    R = R or {}
    remat_at = {(t, j): d.remat_before for t, ds in D.items() for j, d in enumerate(ds)}
    transients: dict[int, set[int]] = defaultdict(set)
    read_at: dict[int, int] = {}
    heap = [(d.remat_before, t, j, t) for t, ds in D.items() for j, d in enumerate(ds)]
    heap += [(s, t, REVIVE, t) for t, s in R.items() if s >= problem.end[t] + 2]
    heapq.heapify(heap)
    while heap:
        r, t, j, root = heapq.heappop(heap)
        if j >= 0 and remat_at[(t, j)] != r:
            continue  # superseded: rebuilt in an earlier group
        if r > problem.remat_deadline[t]:
            _fail(problem, failures, root, t, r, f"an input of its rebuild is overwritten at op {int(problem.remat_deadline[t])}")
            continue
        for u in rebuild_inputs(problem, t):
            if _available(problem, D, remat_at, u, r):
                continue
            if u in R and R[u] <= r:  # revived by then: held until its last reader
                read_at[u] = max(read_at.get(u, r), r)
                continue
            gap = _gap_holding(D, remat_at, u, r)
            if gap is not None:
                remat_at[(u, gap)] = r
                heapq.heappush(heap, (r, u, gap, root))
            elif u not in transients[r]:
                if not problem.rematerializable[u]:
                    _fail(problem, failures, root, t, r, f"it needs tensor {int(problem.tensor_id[u])}, "
                          "which is gone by then and cannot be rebuilt")
                    continue
                transients[r].add(u)
                heapq.heappush(heap, (r, u, -1, root))
    return remat_at, {r: s for r, s in transients.items() if s}, read_at


def _fail(problem, failures, root, t, r, why) -> None:
    if failures is None:
        raise PlanError(f"Rebuilding tensor {int(problem.tensor_id[t])} before op {r} is impossible: "
                        f"{why}. The plan is not executable on this trace.")
    failures.add(root)


def unexecutable(problem: Problem, drops: list[Drop]) -> set[int]:
    """Dropped tensors whose rebuild chain cannot run (the simulator would refuse them)."""
    failures: set[int] = set()
    _resolve(problem, drops, failures)
    return failures


def group_events(problem: Problem, members: tuple[set[int], ...]):
    """The recompute events of one group (tensors rebuilt there and held, transients, and
    revived tensors carried in and freed after their last reader there): (op, allocs, frees)
    in order."""
    kept, trans = members[0], members[1]
    expiring = members[2] if len(members) > 2 else set()
    ops = sorted({int(q) for t in kept | trans for q in problem.rebuild_ops[t].tolist()})
    last_use: dict[int, int] = {}  # transient or expiring -> last group op that reads or writes it
    for p in ops:
        # (a compiled kernel holds what it reads to its end: the last group op up to there)
        held = ops[bisect.bisect_right(ops, problem.kernel_end[p]) - 1] if p in problem.kernel_end else p
        for u in (*problem.op_reads[p].tolist(), *problem.op_outputs[p].tolist()):
            if u in trans or u in expiring:
                last_use[u] = max(last_use.get(u, p), held)
    last_of: dict[int, list[int]] = defaultdict(list)  # group op -> the transients and expiring it frees
    for u in trans | expiring:
        last_of[last_use.get(u, ops[0])].append(u)
    events = []
    for p in ops:
        outs = problem.op_outputs[p].tolist()
        frees = [u for u in outs if u not in kept and u not in trans]
        events.append((p, outs, sorted(set(frees + last_of.get(p, [])))))
    return events


def _run_group(problem, r: int, members, carried: int) -> Group:
    live = carried
    peak = carried
    cost = 0.0
    rerun_cost = problem.rerun_cost  # an op's cost re-run by the runtime (Problem.rerun_cost)
    events = group_events(problem, members)
    for p, allocs, frees in events:
        live += int(problem.nbytes[allocs].sum()) if allocs else 0
        peak = max(peak, live)
        live -= int(problem.nbytes[frees].sum()) if frees else 0
        cost += float(rerun_cost[p])
    return Group(before_op=r, ops=[e[0] for e in events], peak_bytes=peak, cost=cost)


def build_schedule(problem: Problem, drops: list[Drop], offload: OffloadSchedule | None = None) -> dict:
    """The explicit event list of the planned step, self-contained.

    ``{"initial": [tensor ids live at step start], "nbytes": {tensor id: bytes},
    "events": [[kind, op, [allocated tensor ids], [freed tensor ids]], ...]}`` where kind
    is ``run`` or ``recompute``, or, with ``offload`` (the simulation's copies), ``copy_out``
    (its copy to host has ended: the device copy freed, right after the run of the op that held
    it last) and ``copy_in`` (issued before the op's recompute group: allocated again). Peak = max over events of (live + allocated), then the
    freed ones leave. :func:`taichi_plan.plan.format.peak_from_schedule` does exactly that.
    """
    res = _resolve(problem, drops)
    D = res.D
    kept = {t for t in res.revived if res.R[t] == problem.end[t] + 1}  # held past their last op
    n = problem.num_ops
    tid = problem.tensor_id
    allocs: list[list[int]] = [[] for _ in range(n)]
    frees: list[list[int]] = [[] for _ in range(n)]
    initial = []
    away = {tm.tensor: tm for tm in offload.timings if tm.leaves_device} if offload is not None else {}
    copy_in: dict[int, list[int]] = defaultdict(list)
    copy_out: dict[int, list[int]] = defaultdict(list)
    for tm in sorted(away.values(), key=lambda x: (x.before, x.tensor)):
        copy_out[tm.freed_after].append(int(tid[tm.tensor]))
        copy_in[tm.prefetch_at].append(int(tid[tm.tensor]))
    for t in range(len(tid)):
        if problem.initial[t]:
            initial.append(int(tid[t]))
        else:
            allocs[problem.start[t]].append(int(tid[t]))
        for d in D.get(t, ()):
            frees[d.free_after].append(int(tid[t]))
        if not problem.persists[t] and t not in kept:
            frees[rebuilt_end(problem, t) if t in D or t in away else problem.end[t]].append(int(tid[t]))
    grouped = res.groups()
    events = []
    for i in range(n):
        for x in copy_in.get(i, ()):
            events.append(["copy_in", i, [x], []])
        if i in grouped:
            for p, a, f in group_events(problem, grouped[i]):
                events.append(["recompute", p, [int(tid[x]) for x in a], [int(tid[x]) for x in f]])
        events.append(["run", i, allocs[i], frees[i]])
        for x in copy_out.get(i, ()):
            events.append(["copy_out", i, [], [x]])
    used = {x for e in events for x in e[2]} | set(initial)
    nb = {int(tid[t]): int(problem.nbytes[t]) for t in range(len(tid)) if int(tid[t]) in used}
    return {"initial": initial, "nbytes": nb, "events": events}


def rebuild_overhead(problem: Problem, drop: Drop) -> int:
    """Bytes a lone rebuild of ``drop`` adds on top of what is carried into its group:
    its rebuilt tensor plus every transient its rebuild chain holds at the worst moment."""
    res = _resolve(problem, [drop])
    r = res.remat_at[(drop.tensor, 0)] if drop.tensor in res.D else drop.remat_before
    members = res.groups().get(r)
    live = peak = 0
    for _p, allocs, frees in group_events(problem, members) if members else ():
        live += int(problem.nbytes[allocs].sum()) if allocs else 0
        peak = max(peak, live)
        live -= int(problem.nbytes[frees].sum()) if frees else 0
    return peak


def simulate_plan(problem: Problem, drops: list[Drop], partitions=(), offloads=(),
                  host_link_bytes_per_s: float | None = None) -> tuple[SimResult, Problem]:
    """Simulate drops, partitions and offloads together; returns the result and the partitioned
    problem (the one whose tensors the timeline and schedule describe)."""
    from ..problem.partition.apply import apply_partitions

    parted, cost = apply_partitions(problem, partitions, [*drops, *(Drop(o.tensor, o.after, o.before) for o in offloads)]
                                    if offloads and partitions else drops)
    sim = simulate(parted, drops, offloads, host_link_bytes_per_s)
    sim.partition_cost = cost
    sim.extra_cost += cost
    return sim, parted


def rerun_ops(problem: Problem, drops: list[Drop]) -> set[int]:
    """Every op the planned step re-runs: the ops of all recompute groups, and the rebuild
    ops of every dropped tensor (what a replay must be able to run again)."""
    res = _resolve(problem, drops)
    ops: set[int] = set()
    for members in res.groups().values():
        ops.update(op for op, _a, _f in group_events(problem, members))
    for t in [*res.D, *(t for t, s in res.R.items() if s >= problem.end[t] + 2)]:
        ops.update(problem.rebuild_ops[t].tolist())
    return ops
