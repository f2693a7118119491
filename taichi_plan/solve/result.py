"""Turn a planner's decisions into a :class:`~taichi_plan.plan.format.Plan`, judged by the simulator.

No planner reports its own peak or cost: :func:`make_plan` simulates the decisions and
fills ``predicted`` from the simulator, writes each decision's ``why`` and the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..base.units import format_bytes, format_cost
from ..plan.format import Offloaded, Partition, Plan, Recompute
from ..problem.core import Problem
from ..problem.offload import Offload, OffloadTiming
from ..problem.optimizer.plan import describe as describe_optimizer
from ..problem.optimizer.plan import recorded_problem, recorded_trace
from ..problem.partition.cost import partition_cost
from ..problem.partition.find import find_span
from ..problem.partition.floor import partition_savings
from ..problem.partition.overhead import runtime_overhead_s
from ..problem.partition.qualify import random_draws
from ..problem.partition.regions import checkpointed_modules, early_triggers, needed_ops, region_ops
from ..problem.sharding.decisions import describe as describe_reshard
from ..problem.sharding.prefetch import describe as describe_prefetch
from ..simulate.allocator import AllocatorConfig, AllocatorResult, replay_schedule
from ..simulate.core import Drop, SimResult, build_schedule, is_revival, rerun_ops, simulate_plan
from ..trace.layout import layout


@dataclass
class Decisions:
    """What a planner returns: drops, partitions and what it knows about optimality."""

    drops: list[Drop] = field(default_factory=list)
    partitions: list[Partition] = field(default_factory=list)
    offloads: list[Offload] = field(default_factory=list)  # only where problem.offload allows them
    status: str | None = None  # optimal|feasible; None = let the simulator decide feasible/infeasible
    objective: float | None = None  # the planner's own model objective (not the final cost)
    lower_bound: float | None = None  # a proven lower bound on extra compute, if any
    notes: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    timed_out: bool = False  # the search stopped at its time or work limit (not a proof of anything)


# A lower bound may exceed the simulated cost by float rounding only: this share of the step's
# compute (bounds come from integer costs in units of step_cost / 1e7, rounded down).
BOUND_TOLERANCE = 1e-9


def _content_hash(problem: Problem, trace) -> str:
    """The recorded trace's content hash, computed once per problem (a trace made in memory
    has none in its meta, and hashing its tables costs milliseconds per plan made)."""
    cached = getattr(problem, "_content_hash", None)
    if cached is None:
        cached = problem._content_hash = trace.content_hash()
    return cached


def make_plan(problem: Problem, budget_bytes: int | None, method: str, dec: Decisions,
              wall_s: float, seed: int, with_schedule: bool = True, *,
              allocator: AllocatorConfig | None = None) -> Plan:
    """The plan of ``dec``, with the simulator's numbers and the allocator model's reserved
    peaks (``allocator``: its settings; PyTorch's defaults when None)."""
    sim, parted = simulate_plan_of(problem, dec)
    base_peak, base_op = recorded_baseline(problem)
    fits = (budget_bytes is None or sim.peak_bytes <= budget_bytes) and host_fits(problem, sim)
    status = "infeasible" if not fits else (dec.status or "feasible")
    lb = dec.lower_bound
    if status == "optimal" and lb is None:
        lb = sim.extra_cost
    gap = None
    if lb is not None and fits:
        tol = BOUND_TOLERANCE * max(sim.step_cost, 1e-12)
        assert lb <= sim.extra_cost + tol, (
            f"{method}: lower bound {lb!r} above the simulated cost {sim.extra_cost!r} of its own plan")
        gap = 0.0 if sim.extra_cost <= 1e-12 else max(sim.extra_cost - lb, 0.0) / sim.extra_cost
    unit = problem.trace.cost_unit
    trace = recorded_trace(problem.trace)  # the plan names the trace as recorded
    schedule = build_schedule(parted, dec.drops, sim.offload)
    planned_al = replay_schedule(schedule, allocator)
    base_al = baseline_allocator(recorded_problem(problem), allocator)
    rerun = rerun_ops(parted, dec.drops) if dec.drops else set()
    seen = region_ops(problem.trace, needed_ops(parted, dec.drops, rerun, early_triggers(parted, sim)),
                      checkpointed_modules(dec.partitions)) if dec.drops else {}
    overhead = runtime_overhead_s(problem, dec.drops, dec.partitions, rerun,
                                  [op for g in sim.groups.values() for op in g.ops], seen=seen)
    compiled = problem.trace.meta.get("compiled") is not None
    notes = list(dec.notes) + (["a torch.compile'd step: drops only; partitions and the optimizer options are not "
                                "run under compile yet (docs/planner.md, \"Compiled training\")"] if compiled else [])
    return Plan(
        trace={
            "path": str(trace.path) if trace.path else None,  # made relative to the plan file on save
            "path_absolute": str(trace.path.resolve()) if trace.path else None,
            "name": trace.name,
            "content_hash": trace.meta.get("content_hash") or _content_hash(problem, trace),
            "signature": trace.signature(),
            "num_ops": trace.num_ops,
            "workload": trace.meta.get("workload"),
            "layout": layout(trace.meta),  # sharded traces: the FSDP layout the plan holds for
        },
        budget_bytes=budget_bytes,
        solver={
            "method": method,
            "status": status,
            "objective": dec.objective,
            "extra_compute": sim.extra_cost,
            "lower_bound": lb,
            "gap": gap,
            "wall_s": wall_s,
            "seed": seed,
            "notes": notes,
            "stats": dec.stats,
            "partition_random": problem.partition_random,
        },
        predicted={
            "baseline_peak_bytes": base_peak,
            "baseline_peak_op": base_op,
            "planned_peak_bytes": sim.peak_bytes,
            "planned_peak_op": sim.peak_op,
            "planned_peak_in_recompute": sim.peak_in_recompute,
            "extra_compute": sim.extra_cost,
            "extra_compute_pct": sim.extra_pct,
            "step_compute": sim.step_cost,
            "cost_unit": unit,
            "recompute_ops": sim.recompute_ops,
            "partition_compute": sim.partition_cost,
            # The allocator model's verdict (taichi_plan/simulate/allocator.py): what a CUDA step reserves.
            "baseline_reserved_peak_bytes": base_al.reserved_peak_bytes,
            "planned_reserved_peak_bytes": planned_al.reserved_peak_bytes,
            "allocator": {"model": "cuda-caching", "baseline_allocated_peak_bytes": base_al.allocated_peak_bytes,
                          "planned_allocated_peak_bytes": planned_al.allocated_peak_bytes,
                          "planned_segments": planned_al.segments, **planned_al.config.to_dict()},
            # The replay runtime's own bookkeeping (taichi_plan.problem.partition.overhead), and the two together:
            # what the step is predicted to take longer.
            "runtime_overhead": overhead,
            "extra_time": None if overhead is None else sim.extra_cost + overhead,
            # Offload (v14): host bytes the copies hold at most, seconds the compute stream waits for
            # copies-in (in extra_compute). Only where the solve allowed offloading.
            **({"host_peak_bytes": sim.host_peak_bytes, "stall_s": sim.stall_cost}
               if problem.offload is not None else {}),
        },
        recompute=[_recompute(problem, d, sim, unit) for d in sorted(dec.drops, key=lambda d: d.tensor)],
        partitions=[_partition(problem, p, unit) for p in dec.partitions],
        schedule=schedule if with_schedule else None,
        optimizer=describe_optimizer(problem),
        reshard=describe_reshard(problem),
        prefetch=describe_prefetch(problem),
        offload=problem.offload.to_dict() if problem.offload is not None else None,
        offloads=[_offloaded(problem, tm, unit) for tm in sim.offload.timings] if sim.offload is not None else [],
    )


def simulate_plan_of(problem: Problem, dec: Decisions):
    """:func:`simulate_plan` of ``dec``, its offloads on the host link ``problem.offload`` gives."""
    if dec.offloads and problem.offload is None:
        raise ValueError("decisions offload tensors, but the problem does not allow offloading")
    link = problem.offload.host_link_bytes_per_s if problem.offload is not None else None
    return simulate_plan(problem, dec.drops, dec.partitions, dec.offloads, link)


def host_fits(problem: Problem, sim: SimResult) -> bool:
    """Whether the host bytes the plan's copies hold stay within the solve's host budget."""
    cap = problem.offload.host_budget_bytes if problem.offload is not None else None
    return cap is None or sim.host_peak_bytes <= cap


def _offloaded(problem: Problem, tm: OffloadTiming, unit: str) -> Offloaded:
    t = tm.tensor
    p = int(problem.producer[t])
    if tm.leaves_device:
        what = (f"frees {format_bytes(tm.nbytes)} on the device for {tm.prefetch_at - tm.freed_after - 1} ops "
                f"(op {tm.freed_after + 1} to {tm.prefetch_at - 1}), {format_bytes(tm.nbytes)} on the host")
    else:
        what = "frees nothing on the device: its copy-in must be issued before its copy-out ends"
    copy = format_cost(tm.copy_out_end_s - tm.copy_out_start_s, unit)
    if tm.by_group:
        what += f"; a rebuild reads it, so it is needed back before the recompute group before op {tm.back_by}"
    why = (f"{what}; each copy takes {copy}, the copy-in issued before op {tm.prefetch_at}"
           + (f"; the step waits {format_cost(tm.stall_s, unit)} for it" if tm.stall_s > 0 else ", in time"))
    return Offloaded(tensor=int(problem.tensor_id[t]), op=p, op_name=problem.op_name[p], module=problem.op_module[p],
                     nbytes=tm.nbytes, after=tm.after, before=tm.before, freed_after=tm.freed_after,
                     prefetch_at=tm.prefetch_at, copy_out_s=tm.copy_out_end_s - tm.copy_out_start_s,
                     copy_in_s=tm.copy_in_end_s - tm.copy_in_start_s, stall_s=tm.stall_s, why=why)


def recorded_baseline(problem: Problem) -> tuple[int, int]:
    """The unplanned step's peak and its op: the step as recorded, even when ``problem`` is
    an optimizer option's view of it (the op then given as its position in the view)."""
    rec = recorded_problem(problem)
    peak, op = rec.baseline_peak
    position = getattr(problem.trace, "position", None)
    return peak, (int(position[op]) if position is not None and op >= 0 else op)


def baseline_allocator(problem: Problem, allocator: AllocatorConfig | None = None) -> AllocatorResult:
    """The allocator model's verdict on the unplanned step (cached on the problem per setting)."""
    config = allocator or AllocatorConfig()
    cache = problem.__dict__.setdefault("_baseline_allocator", {})
    if config not in cache:
        cache[config] = replay_schedule(build_schedule(problem, []), config)
    return cache[config]


def _recompute(problem: Problem, d: Drop, sim: SimResult, unit: str) -> Recompute:
    t = d.tensor
    p = int(problem.producer[t])
    nb = int(problem.nbytes[t])
    r = sim.remat_at_drop.get((t, d.free_after), d.remat_before)
    held = r - d.free_after - 1
    ops = problem.rebuild_ops[t].tolist()
    names = problem.op_name[p] + (f" and {len(ops) - 1} in-place op(s)" if len(ops) > 1 else "")
    cost = format_cost(float(problem.rerun_cost[ops].sum()), unit)
    if is_revival(problem, d):
        span = sim.revived.get(t)
        until = "no later rebuild reads it" if span is None else f"held until the rebuild before op {span[1] + 1}"
        how = ("kept past its last op" if d.remat_before == d.free_after + 1
               else f"rebuilt before op {d.remat_before} (re-running {names} costs {cost})")
        why = f"revived for later rebuilds that read it: {how}, {until}"
    else:
        why = (f"frees {format_bytes(nb)} for {held} ops (op {d.free_after + 1} to {r - 1}); "
               f"re-running {names} costs {cost}")
    if r != d.remat_before:
        why += f"; rebuilt early, before op {r}, because another rebuild needs it"
    return Recompute(tensor=int(problem.tensor_id[t]), op=p, op_name=problem.op_name[p],
                     module=problem.op_module[p], nbytes=nb, free_after=d.free_after,
                     remat_before=d.remat_before, why=why)


def _partition(problem: Problem, part: Partition, unit: str) -> Partition:
    span = find_span(problem, part)
    saved = partition_savings(problem, span, part.chunks)
    i = int(np.argmax(saved))
    if span.over == "tokens":
        how = (f"by computing {part.module}'s logits and the cross-entropy on them in {part.chunks} chunks of "
               f"{-(-span.rows // part.chunks)} tokens (the [{span.rows}, {span.vocab}] logits never exist); re-running the head's "
               "matmul in backward and the extra launches cost ")
    elif part.chunks == 1:
        how = (f"by checkpointing {part.module} whole (one chunk: only its inputs are kept, and its forward "
               "re-runs in its backward); re-running its forward and the extra launches cost ")
    elif span.over == "sequence":
        b, seq = span.positions
        how = (f"by running {part.module} (position-wise) on {part.chunks} runs of its {b * seq} positions "
               f"(batch {b} x sequence {seq}); re-running its forward and the extra launches cost ")
    else:
        how = (f"by running {part.module} on {part.chunks} chunks of the batch; re-running its forward and the "
               "extra launches cost ")
    why = (f"frees up to {format_bytes(int(saved[i]))} (at op {i}) {how}"
           f"{format_cost(partition_cost(problem, span, part.chunks), unit)}")
    draws = random_draws(problem, span, part.chunks)
    if draws and part.chunks == 1:
        why += "; its forward re-runs with the RNG state it first ran with: the same dropout masks"
    elif draws == "as-unpartitioned":
        why += "; its one dropout draws, chunk by chunk, the masks of the whole batch (CPU)"
    elif draws:
        why += (f"; its chunks draw their own dropout masks ({len(span.random_ops)} random op(s)): training "
                "changes statistically, not bitwise")
    return Partition(part.module, part.dim, part.chunks, why, over=span.over, random_draws=draws)


def drops_from_plan(problem: Problem, plan: Plan) -> list[Drop]:
    return [Drop(problem.index_of(r.tensor), r.free_after, r.remat_before) for r in plan.recompute]


def offloads_from_plan(problem: Problem, plan: Plan) -> list[Offload]:
    return [Offload(problem.index_of(o.tensor), o.after, o.before) for o in getattr(plan, "offloads", ())]


def plan_problem(problem: Problem, plan: Plan) -> Problem:
    """``problem`` with the plan's offload setting (v14 ``decisions.offload``), so that it
    simulates as the plan was solved."""
    from ..problem.offload import OffloadConfig, allow_offload

    off = getattr(plan, "offload", None)
    if off is None:
        return problem
    return allow_offload(problem, OffloadConfig(float(off["host_link_bytes_per_s"]), off.get("host_budget_bytes")))
