"""A plan read against its trace, call by call: which model calls the plan covers and where each
starts (``model_calls``, ``counted_ops``, ``call_ops``), each call's drops, rebuilds, offloads and
regions (``call_plans``), the partitions and token heads it runs, and the runtime that carries
them (``runtime_for``). What ``apply``, calibration and replay all build the runtime from."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..base.errors import PlanError
from ..plan.format import Plan, load_plan

# Ops of a caller's own code after a module call that a live forward may skip with it
# (module_calls): the residual add of ``x = x + layer(x)``, the next layer's layerdrop draw.
SKIP_GLUE = 4


def model_calls(trace) -> list[dict]:
    """The grad-enabled model calls of the trace's step (``meta.model_calls``), in order."""
    from ..problem.core import grad_model_calls

    calls = grad_model_calls(trace.meta)
    if calls is None:
        raise PlanError("The plan's trace does not say which ops ran inside the model (it was recorded by an "
                        "older taichi-plan): record it again and solve again.")
    return calls


def counted_ops(trace) -> list[bool]:
    """Per op id: whether the runtime counts it (not in ``IGNORED_OPS``, not run by FSDP's
    own machinery: :func:`taichi_plan.trace.layout.fsdp_internal_ops`)."""
    from ..torch_common.ops import IGNORED_OPS
    from ..trace.layout import fsdp_internal_ops

    names = trace.ops["op"].tolist()
    internal = fsdp_internal_ops(trace.meta, len(names))
    return [name not in IGNORED_OPS and not bool(x) for name, x in zip(names, internal, strict=True)]


def _counted_index(counted: list[bool]) -> list[int]:
    """Per op id: the number of counted ops before it."""
    out, k = [], 0
    for c in counted:
        out.append(k)
        k += c
    return out


def call_plans(plan: Plan, trace, problem=None) -> list:
    """The :class:`~taichi_plan.runtime.mode.call_plan.CallPlan` of each grad-enabled model call
    (``problem``: the trace's, when the caller has it built already)."""
    from ..problem.optimizer.plan import problem_for_plan
    from .mode.call_plan import CallPlan

    problem = problem_for_plan(plan, trace, problem)
    trace = problem.trace  # the step as the plan's optimizer option runs it
    calls = model_calls(trace)
    names = trace.ops["op"].tolist()
    counted = counted_ops(trace)
    before = _counted_index(counted)

    def locate(op: int) -> tuple[int, int] | None:
        for c, call in enumerate(calls):
            if call["start"] <= op <= call["end"] and counted[op]:
                return c, before[op] - before[call["start"]]
        return None

    pos = _written_at(trace)

    drops: list[dict] = [{} for _ in calls]
    for r in plan.recompute:
        where = locate(r.op)
        if where is None:
            raise PlanError(f"The plan drops tensor {r.tensor}, made by op {r.op} ({r.op_name}) outside the model's "
                            "forward; replay only rebuilds what the model's own forward made. Solve again with "
                            "this version.")
        j = pos.get((r.op, r.tensor))
        if j is None:
            raise PlanError(f"The plan drops tensor {r.tensor} as an output of op {r.op}, but the trace has no "
                            "such output: the plan was made for another trace.")
        drops[where[0]].setdefault(where[1], []).append((j, r.tensor))
    recipes: list[set] = [set() for _ in calls]
    rerun = recipe_ops(plan, trace, problem)
    for op in rerun:
        where = locate(op)
        if where is None:
            raise PlanError(f"A rebuild in this plan re-runs op {op} ({names[op]}), which ran outside the model's "
                            "forward; replay cannot re-run it. Solve again with this version.")
        recipes[where[0]].add(where[1])
    spans: list[dict] = [{} for _ in calls]
    whole: list[set] = [set() for _ in calls]
    one_chunk = {p.module for p in _whole_partitions(plan)}
    for module, (f0, f1) in partition_spans(plan, trace, problem):
        a, b = locate(f0), locate(f1)
        if a is None or b is None or a[0] != b[0]:
            raise PlanError(f"The plan partitions {module!r}, whose ops do not all run in one call of the model.")
        spans[a[0]][module] = (a[1], b[1] + counted[f1] - 1)
        if module in one_chunk and any(f0 <= r.op <= f1 for r in plan.recompute):
            whole[a[0]].add(module)  # checkpointed whole, an output dropped (partition.whole_outputs)

    tokens: list[dict] = [{} for _ in calls]
    skip: list[set] = [set() for _ in calls]
    for module, chunks, ops in token_partitions(plan, problem):
        head = locate(ops[0])
        if head is None:
            raise PlanError(f"The plan partitions the head {module!r} over tokens, but it did not run inside a call "
                            "of the model: the plan was made for another trace.")
        tokens[head[0]][module] = chunks
        for op in ops:
            where = locate(op)
            if where is not None and where[0] == head[0]:
                skip[head[0]].add(where[1])

    simulated = _simulated(plan, problem)
    group_of, trigger_of = _groups(*simulated[1:]) if simulated is not None else ({}, {})
    triggers: list[dict] = [{} for _ in calls]
    for tid, group in trigger_of.items():
        k = problem._index.get(tid)  # a chunk's piece of a partition is no tensor of the trace
        op = int(problem.producer[k]) if k is not None else -1
        where = locate(op) if op >= 0 else None
        j = pos.get((op, tid))
        if where is not None and j is not None:
            triggers[where[0]].setdefault(where[1], []).append((j, group))
    offloads, copy_out_at, prefetch = _offload_tables(plan, problem, len(calls), locate, pos, simulated)
    tensors = trace.tensors
    kinds = tensors["kind"].tolist()
    alloc, free = tensors["alloc_op"].tolist(), tensors["free_op"].tolist()
    grads = [(a, f) for k, a, f in zip(kinds, alloc, free, strict=True) if k == "gradient"]
    out = []
    skippable, starts = module_calls(trace, calls, counted, before)
    sized: list[set] = [set() for _ in calls]
    for op in (trace.meta.get("data_sized") or {}).get("ops") or ():
        where = locate(int(op))
        if where is not None:
            sized[where[0]].add(where[1])
    regions = _call_regions(plan, trace, simulated, rerun, counted, before)
    for c, (call, ops) in enumerate(zip(calls, call_ops(trace, pos), strict=True)):
        s0 = call["start"]
        alive = any(a < s0 and (f == -1 or f >= s0) for a, f in grads)
        mine = regions.get(c, {})
        out.append(CallPlan(c, ops, drops[c], recipes[c], spans[c], call.get("inputs", []), alive,
                            bool(call.get("training", True)), group_of, tokens[c], frozenset(skip[c]),
                            triggers=triggers[c], whole=frozenset(whole[c]), module_calls=skippable[c],
                            module_starts=starts[c], sized_ops=frozenset(sized[c]),
                            trainable=_trainable(plan, call),
                            own_hooks=bool((trace.meta.get("forward_in_backward") or {}).get("ops")),
                            autocast=call.get("autocast", "unknown"),
                            regions=mine or {}, whole_call=mine is None,
                            entries=_entries(starts[c], [*spans[c], *tokens[c]]),
                            offloads=offloads[c], copy_out_at=copy_out_at[c], prefetch_triggers=prefetch[c]))
    return out


def _offload_tables(plan: Plan, problem, ncalls: int, locate, pos: dict, simulated=None) -> tuple[list, list, list]:
    """Per grad-enabled model call, the runtime's offload tables (plan v14; see
    :class:`~taichi_plan.runtime.mode.call_plan.CallPlan`): the offloaded storages by producing op, the
    copies to host by the op after which they are made (in the simulator's order: its copy
    stream is first in first out), and the saved tensors whose last unpack issues copies back at
    the plan's prefetch points (a copy issued where it is needed, at its own tensor's unpack or
    by the rebuild that reads it first, is made there on demand and needs none).
    ``simulated``: :func:`_simulated` of the plan (where each copy is needed back)."""
    from ..problem.offload import trigger_tensor

    back_by = _back_by(simulated)

    made: list[dict] = [{} for _ in range(ncalls)]
    out: list[dict] = [{} for _ in range(ncalls)]
    back: list[dict] = [{} for _ in range(ncalls)]
    offs = list(getattr(plan, "offloads", ()))
    call_of: dict[int, int] = {}
    for o in sorted(offs, key=lambda o: (o.after, problem.index_of(o.tensor))):
        where, after, j = locate(o.op), locate(o.after), pos.get((o.op, o.tensor))
        if where is None or j is None or after is None or after[0] != where[0]:
            raise PlanError(f"The plan offloads tensor {o.tensor} (made by op {o.op}, {o.op_name}), which is not made "
                            "and last used in forward in one call of the model in this trace: the plan was made for "
                            "another trace. Solve it again.")
        made[where[0]].setdefault(where[1], []).append((j, o.tensor))
        out[where[0]].setdefault(after[1], []).append(o.tensor)
        call_of[o.tensor] = where[0]
    groups: dict[tuple[int, int, int], list[int]] = {}
    for o in sorted(offs, key=lambda o: (o.before, problem.index_of(o.tensor))):
        if o.prefetch_at >= back_by.get(o.tensor, o.before):
            continue
        c = call_of[o.tensor]
        u = trigger_tensor(problem, o.prefetch_at, call=c)
        p = int(problem.producer[u]) if u is not None else -1
        w = locate(p) if p >= 0 else None
        j = pos.get((p, int(problem.tensor_id[u]))) if u is not None else None
        if w is None or j is None or w[0] != c:
            raise PlanError(f"The plan copies tensor {o.tensor} back before op {o.prefetch_at}, where replay cannot "
                            "issue a copy (no tensor of its model call is unpacked there for the last time). Solve "
                            "the trace again.")
        groups.setdefault((c, w[1], j), []).append(o.tensor)
    for (c, op, j), tids in groups.items():
        back[c].setdefault(op, []).append((j, tids))
    return made, out, back


def _back_by(simulated) -> dict[int, int]:
    """Tensor id -> the op before which (or before whose recompute group, when a rebuild reads
    it) each offloaded tensor of a simulated plan must be back on the device."""
    if simulated is None or simulated[1].offload is None:
        return {}
    parted = simulated[2]
    return {int(parted.tensor_id[tm.tensor]): tm.back_by for tm in simulated[1].offload.timings}


def _entries(starts: dict, uncounted: list[str]) -> tuple:
    """The counted ops at which the call's recorded module calls start, sorted: every module's
    but the model's own and those inside ``uncounted`` (partitioned modules, heads over tokens:
    their insides run uncounted)."""
    return tuple(sorted({s for name, ss in starts.items()
                         if name and not any(name.startswith(u + ".") for u in uncounted) for s in ss}))


def _call_regions(plan: Plan, trace, simulated, rerun: set[int], counted: list[bool],
                  before: list[int]) -> dict[int, dict | None]:
    """Per grad-enabled model call: its planned regions (:mod:`taichi_plan.problem.partition.regions`) as the
    runtime enters them, module name -> {its k-th call in the model call: (first, last)
    counted op from the call's first op}; None where the runtime runs over the whole call.
    Calls with nothing to see (no drop, no rebuild) are left out: no mode runs there.
    ``simulated``: :func:`_simulated`; ``rerun``: :func:`recipe_ops`."""
    from ..problem.partition.regions import (
        checkpointed_modules,
        early_triggers,
        needed_ops,
        planned_regions,
    )

    if simulated is None:
        return {}
    drops, sim, parted = simulated
    triggers = dict(early_triggers(parted, sim))
    if sim.offload is not None:  # offloads: their storages are seen as a drop's, their copies back issued at triggers
        from ..problem.offload import trigger_tensor
        from ..simulate.core import Drop

        drops = [*drops, *(Drop(tm.tensor, tm.after, tm.before) for tm in sim.offload.timings)]
        for tm in sim.offload.timings:
            u = trigger_tensor(parted, tm.prefetch_at, call=int(parted.op_call[parted.producer[tm.tensor]]))
            if not tm.on_demand and u is not None:
                triggers.setdefault(u, -1)
    needed = needed_ops(parted, drops, rerun, triggers)
    calls = model_calls(trace)
    out: dict[int, dict | None] = {}
    for c, regions in planned_regions(trace, needed, checkpointed_modules(plan.partitions)).items():
        if regions is None:
            out[c] = None
            continue
        base = before[int(calls[c]["start"])]
        table: dict[str, dict[int, tuple[int, int]]] = {}
        for r in regions:
            first, last = before[r.first] - base, before[r.last] + counted[r.last] - 1 - base
            if last >= first:
                table.setdefault(r.module, {})[r.call] = (first, last)
        out[c] = table
    return out


def _trainable(plan: Plan, call: dict) -> tuple | None:
    """A recorded call's ``trainable`` signature (trace v12), None where it is not checked: older
    traces, and sharded or DDP ones (their parameters are shards or wrapped)."""
    t = call.get("trainable")
    return None if t is None or plan.trace.get("layout") is not None else tuple(t)


def module_calls(trace, calls: list[dict], counted: list[bool], before: list[int]) -> tuple[list[dict], list[dict]]:
    """Per grad-enabled model call, two tables of its recorded submodule calls (trace v10
    ``meta.module_args``), in counted ops from the call's first op:

    * skippable: the op at which a module call starts -> [(first, last, module name)],
      outermost first: where the call may go on when a live forward skipped that module call,
      from the op right after its last one to at most ``SKIP_GLUE`` ops of its caller's own
      code after it (``x = x + layer(x)``: the residual add is skipped with the layer);
    * starts: module name -> the ops at which its calls start, in order.

    The runtime lets a live call skip such a call (layerdrop skips a layer, a branch on a
    tensor's value skips a block: :meth:`~taichi_plan.runtime.mode.guards.GuardsMixin._resync` and
    ``_entered``). A module call's ops: from its start, the contiguous ops whose module is it or
    one inside it, up to its next call."""
    modules = trace.ops["module"].tolist()
    n = len(modules)
    total = [*before, before[-1] + counted[-1]] if n else [0]  # counted ops before op i, for i <= n
    skippable: list[dict] = [{} for _ in calls]
    starts: list[dict] = [{} for _ in calls]
    for name, entries in (trace.meta.get("module_args") or {}).items():
        ss = sorted(int(e[0]) for e in entries)
        inside = name + "."
        for k, s in enumerate(ss):
            c = next((c for c, call in enumerate(calls) if call["start"] <= s <= call["end"]), None)
            if c is None:
                continue
            c0, end = calls[c]["start"], calls[c]["end"]
            starts[c].setdefault(name, []).append(total[s] - total[c0])
            stop = min(ss[k + 1] if k + 1 < len(ss) else n, end + 1)
            e = s
            while e < stop and (modules[e] == name or (modules[e] or "").startswith(inside)):
                e += 1
            g = e  # the caller's own ops right after the call (an ancestor's, or top level)
            while g <= end and total[g] - total[e] < SKIP_GLUE and (not modules[g] or name.startswith(modules[g] + ".")):
                g += 1
            if total[e] > total[s]:  # (an identity runs no op of its own: nothing to skip)
                skippable[c].setdefault(total[s] - total[c0], []).append((total[e] - total[c0], total[g] - total[c0], name))
    for table in skippable:
        for ends in table.values():
            ends.sort(key=lambda x: (-x[0], x[2]))
    return skippable, starts


def _written_at(trace) -> dict[tuple[int, int], int]:
    """(op id, tensor id) -> the flattened output index at which the op writes the tensor."""
    acc = trace.accesses
    writes = acc[acc["role"] == "write"]
    return {(int(o), int(t)): int(a) for o, t, a in zip(writes["op_id"], writes["tensor_id"], writes["arg_index"],
                                                        strict=True)}


def call_ops(trace, pos: dict | None = None) -> list[list]:
    """Per grad-enabled model call, its counted ops as the runtime checks them: (op name,
    module, {output index: bytes of the storage it creates}). A storage whose size depends on
    tensor values (trace v11 ``meta.data_sized``: the tokens a mixture of experts routes to an
    expert) is not held to its recorded size: its recipe is the live op's, whatever the size."""
    pos = _written_at(trace) if pos is None else pos
    sized = set((trace.meta.get("data_sized") or {}).get("tensors") or ())
    names = trace.ops["op"].tolist()
    modules = trace.ops["module"].tolist()
    counted = counted_ops(trace)
    tensors = trace.tensors
    nbytes = dict(zip(tensors["tensor_id"].tolist(), tensors["nbytes"].tolist(), strict=True))
    producer = dict(zip(tensors["tensor_id"].tolist(), tensors["producer_op"].tolist(), strict=True))
    made: dict[int, dict[int, int]] = {}
    for (o, t), j in pos.items():
        if producer.get(t) == o and t not in sized:
            made.setdefault(o, {})[j] = int(nbytes[t])
    return [[(names[o], modules[o], made.get(o, {})) for o in range(call["start"], call["end"] + 1) if counted[o]]
            for call in model_calls(trace)]


def token_partitions(plan: Plan, problem) -> list[tuple[str, int, tuple[int, ...]]]:
    """(head module, chunks, forward op ids of its span) of each partition over tokens."""
    from ..problem.partition.find import find_span

    out = []
    for p in plan.partitions:
        if p.over != "tokens":
            continue
        span = find_span(problem, p)
        if span is None:
            raise PlanError(f"The plan partitions the head {p.module!r} over tokens, but its trace has no such head "
                            "and loss: the plan was made for another trace.")
        out.append((p.module, int(p.chunks), span.fwd_ops))
    return out


def rebuild_groups(plan: Plan, trace, problem=None) -> tuple[dict[int, int], dict[int, int]]:
    """(dropped tensor id -> the op before which the simulator rebuilds it (its group),
    trigger tensor id -> group).

    The runtime rebuilds a group when backward first unpacks one of its tensors (at the start
    of the autograd node that reads it: ``Problem.unpack_at``). A group the simulator runs
    earlier than that (every member rebuilt *early*, before the first of its inputs dies:
    docs/planner.md) needs another moment: the last unpack of a saved tensor that the group's
    node reads for the last time (its *trigger*), while that tensor is still alive. A group with no such tensor is left to its members' unpack (then its gone inputs
    are re-made from recipes where they have them)."""
    from ..problem.optimizer.plan import problem_for_plan

    simulated = _simulated(plan, problem_for_plan(plan, trace, problem))
    return _groups(*simulated[1:]) if simulated is not None else ({}, {})


def _simulated(plan: Plan, problem) -> tuple | None:
    """(drops, simulation, problem with the partitions applied) of ``plan``'s drops on
    ``problem`` (the plan's view of its trace); None when it drops nothing."""
    from ..simulate.core import simulate_plan
    from ..solve.result import drops_from_plan, offloads_from_plan, plan_problem

    drops = drops_from_plan(problem, plan)
    offloads = offloads_from_plan(problem, plan)
    if not drops and not offloads:
        return None
    problem = plan_problem(problem, plan)
    link = problem.offload.host_link_bytes_per_s if problem.offload is not None else None
    sim, parted = simulate_plan(problem, drops, plan.partitions, offloads, link)
    return drops, sim, parted


def _groups(sim, parted) -> tuple[dict[int, int], dict[int, int]]:
    """:func:`rebuild_groups` of a simulated plan."""
    from ..problem.partition.regions import early_triggers

    triggers = {int(parted.tensor_id[u]): r for u, r in early_triggers(parted, sim).items()}
    return {int(parted.tensor_id[t]): int(r) for t, r in sim.remat_at.items()}, triggers


def _whole_partitions(plan: Plan) -> list:
    """The plan's partitions that checkpoint a module whole (one chunk, along the batch)."""
    return [p for p in plan.partitions if p.chunks == 1 and p.over in ("batch", "sequence")]


def recipe_ops(plan: Plan, trace, problem=None) -> set[int]:
    """Op ids whose recipes a rebuild may need: every op the simulator re-runs for this plan,
    and the rebuild ops of every dropped tensor."""
    from ..problem.optimizer.plan import problem_for_plan
    from ..problem.partition.apply import apply_partitions
    from ..simulate.core import rerun_ops
    from ..solve.result import drops_from_plan

    problem = problem_for_plan(plan, trace, problem)
    drops = drops_from_plan(problem, plan)
    # With the modules checkpointed whole applied: a dropped output of one is rebuilt through
    # the module's insides (partition.whole_outputs), gone there. (Split modules' tensors are
    # never dropped nor re-made.)
    whole = _whole_partitions(plan)
    if drops and whole:
        problem = apply_partitions(problem, whole, drops)[0]
    return {int(i) for i in rerun_ops(problem, drops)}


def recorded_state(trace) -> tuple[int, int]:
    """(bytes, tensors) of the optimizer state the recorded step held (trace kind
    ``optimizer_state``)."""
    t = trace.tensors
    state = t[t["kind"] == "optimizer_state"]
    return int(state["nbytes"].sum()), len(state)


def runtime_for(plan: Plan, trace, on_mismatch: str = "raise"):
    """The :class:`~taichi_plan.runtime.mode.PlanRuntime` that executes ``plan``."""
    from .mode import PlanRuntime

    return PlanRuntime(call_plans(plan, trace), on_mismatch, (trace.meta.get("loop") or {}),
                       None if trace.meta.get("steps_match", True) else trace.meta.get("first_mismatch"),
                       step_at=calls_before_step(trace), warmup=int(trace.meta.get("warmup_steps") or 0))


def calls_before_step(trace) -> int | None:
    """How many grad-enabled model calls of the recorded step start before its optimizer step
    (its first op of phase ``optimizer``); None when the step has no optimizer op. Fewer than
    all calls when the step calls the model again after ``optimizer.step()``."""
    phase = trace.ops["phase"].to_numpy()
    at = np.flatnonzero(phase == "optimizer")
    if not len(at):
        return None
    first = int(trace.ops["op_id"].to_numpy()[at[0]])
    return sum(1 for c in model_calls(trace) if c["start"] < first)


def partition_spans(plan: Plan, trace, problem=None) -> list[tuple[str, tuple[int, int]]]:
    """(module, forward op span) of each partitioned module in the trace, once per
    micro-batch it runs in."""
    parts = [p for p in plan.partitions if p.over in ("batch", "sequence")]
    if not parts:
        return []
    from ..problem.optimizer.plan import problem_for_plan
    from ..problem.partition.find import partitionable_spans
    from ..problem.partition.span import occurrence_spans

    spans = {s.module: [o.fwd for o in occurrence_spans(s)]
             for s in partitionable_spans(problem_for_plan(plan, trace, problem)) if s.over in ("batch", "sequence")}
    missing = [p.module for p in parts if p.module not in spans]
    if missing:
        raise PlanError(f"The plan partitions {missing[0]!r}, which its trace cannot partition: the plan "
                        "was made for another trace.")
    return [(p.module, fwd) for p in parts for fwd in spans[p.module]]


def plan_and_trace(plan: Plan | str | Path, trace=None):
    """Load a plan (path or Plan) and the trace it was solved for, checked by content hash
    and against the plan. ``trace`` (a trace directory or a ``Trace``) overrides where the
    plan says its trace is; by default it is looked for relative to the plan file, then at
    the absolute path the plan records (:func:`taichi_plan.report.plan_text.locate_trace`)."""
    from ..report.plan_text import locate_trace

    plan_path = None
    if not isinstance(plan, Plan):
        plan_path = Path(plan)
        plan = load_plan(plan_path)
    found, status = locate_trace(plan, plan_path, trace=trace)
    if found is None:
        raise PlanError(
            f"Replay needs the trace the plan was solved for, but {status['reason']}. Put that trace "
            "directory back, or name it explicitly (--trace DIR on the command line, trace=DIR in "
            "Python), or record and solve again."
        )
    return plan, found
