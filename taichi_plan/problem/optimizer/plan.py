"""The optimizer step and the gradients as part of the plan (no torch).

When the peak is in the optimizer step, parameters, gradients and optimizer state set the
floor and no activation plan helps. Two options change the step itself:

* ``in-backward``: each parameter is updated as soon as its gradient is complete in backward
  (replay: ``Tensor.register_post_accumulate_grad_hook``) and its gradient is freed right
  after, so the full set of gradients never exists. Only where the loop allows it: one
  backward per optimizer step (no gradient accumulation over micro-batches), no clipping over
  all gradients, gradients set to None by ``zero_grad`` (``meta.loop``).
* ``groups``: the step runs over subsets of the parameters, bounding the temporaries of a
  ``foreach`` step (one op over all parameters, PyTorch's default on GPU). A step recorded
  per parameter (what PyTorch runs on CPU) already has the smallest temporaries: there, groups
  change nothing and the option is not offered.

The simulator models an option exactly by planning on the step *as the option runs it*
(:func:`optimizer_view`): the same trace with its optimizer ops reordered (each parameter's
ops moved to right after the backward op that completes its gradient, which is then freed
after its last read). Ops keep their names, costs and tensors; only their order and the
gradients' lifetimes change. Every planner, the simulator, the reports and replay use that
view for a plan that names the option (``decisions.optimizer`` in the plan), so op ids in such
a plan are positions in the view. Forward ops keep their ids (nothing moves before the first
backward op), so a plan's drops and partitions mean the same in both.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from ...base.errors import UsageError

MODES = ("as-recorded", "groups", "in-backward")
CHOICES = ("auto", *MODES)


@dataclass(frozen=True)
class ParamStep:
    """One parameter's share of a per-parameter optimizer step."""

    param: int  # tensor id of the parameter
    grad: int  # tensor id of its gradient (``.grad`` at the step's end)
    ops: tuple[int, ...]  # its optimizer-phase op ids, in order
    ready_op: int  # the last backward op that touches the gradient: it is complete after it


def parameter_steps(trace) -> list[ParamStep] | str:
    """The optimizer step split per parameter, or a sentence saying why it cannot be.

    Optimizer-phase ops are joined when they touch a common storage; each group must hold
    exactly one parameter and its gradient (PyTorch's per-parameter loop, which it runs on
    CPU). A ``foreach`` or fused step updates many parameters in one op and is refused here.
    Ops that touch no storage stay with the op before them."""
    ops, acc, tensors = trace.ops, trace.accesses, trace.tensors
    phase = ops["phase"].to_numpy()
    opt = np.nonzero(phase == "optimizer")[0]
    if len(opt) == 0:
        return "the trace has no optimizer step"
    kind = dict(zip(tensors["tensor_id"].tolist(), tensors["kind"].tolist(), strict=True))
    a_op = acc["op_id"].to_numpy()
    a_t = acc["tensor_id"].to_numpy()
    in_opt = phase[a_op] == "optimizer"
    from .groups import Components

    sets = Components()
    find = sets.find
    touched: dict[int, list[int]] = {}
    for o, t in zip(a_op[in_opt].tolist(), a_t[in_opt].tolist(), strict=True):
        touched.setdefault(o, []).append(t)
    for ts in touched.values():
        sets.union(ts)
    members: dict[int, list[int]] = {}
    for t in {t for ts in touched.values() for t in ts}:
        members.setdefault(find(t), []).append(t)
    root_of: dict[int, int] = {}
    last = None
    for o in opt.tolist():
        root = find(touched[o][0]) if o in touched else last
        if root is not None:
            root_of[o] = last = root
    # A storage of the step that is no parameter's (AdamW's ``step`` counter: ``add_``, then
    # ``_local_scalar_dense``) belongs to the parameter whose ops come next (the loop's
    # iteration it starts), else to the one before.
    has_param = {r for r in set(root_of.values()) if any(kind[t] == "parameter" for t in members[r])}
    order = sorted(root_of)
    for r in sorted(set(root_of.values()) - has_param):
        mine = [o for o in order if root_of[o] == r]
        nxt = next((root_of[o] for o in order if o > mine[0] and root_of[o] in has_param), None)
        prv = next((root_of[o] for o in reversed(order) if o < mine[0] and root_of[o] in has_param), None)
        target = nxt if nxt is not None else prv
        if target is not None:
            for o in mine:
                root_of[o] = target
    groups: dict[int, list[int]] = {}
    for o in order:
        groups.setdefault(root_of[o], []).append(o)
    out = []
    for group_ops in groups.values():
        mine = {t for o in group_ops for t in touched.get(o, ())}
        params = [t for t in mine if kind[t] == "parameter"]
        grads = [t for t in mine if kind[t] == "gradient"]
        op = group_ops[0]
        if len(params) != 1 or len(grads) != 1:
            return (f"its optimizer step updates {len(params)} parameters together in one op (a foreach or fused "
                    f"step, PyTorch's default on GPU; op {op}, {ops['op'].iat[op]}, is part of it), so it cannot run "
                    "per parameter")
        ready = _last_backward_access(trace, grads[0])
        if ready is None:
            return (f"the gradient of the parameter op {op} updates is not made in backward (it existed before "
                    "the step: gradients kept by zero_grad(set_to_none=False), or accumulated)")
        out.append(ParamStep(params[0], grads[0], tuple(group_ops), ready))
    return out


def _last_backward_access(trace, tensor_id: int) -> int | None:
    acc = trace.accesses
    ops = acc["op_id"].to_numpy()[acc["tensor_id"].to_numpy() == tensor_id]
    phase = trace.ops["phase"].to_numpy()
    bw = ops[phase[ops] == "backward"] if len(ops) else ops
    return int(bw.max()) if len(bw) else None


def in_backward_refusal(trace) -> str | None:
    """Why this trace's loop does not allow stepping in backward (None: it does)."""
    loop = trace.meta.get("loop")
    if trace.meta.get("mode") == "imported" or loop is None:
        return "the trace does not say what its training loop was (meta.loop): record it with taichi-plan record"
    if int(loop.get("micro_batches", 1)) != 1:
        return (f"the loop accumulates gradients over {loop['micro_batches']} micro-batches: a parameter may only "
                "be updated once its gradient is complete, after the last micro-batch")
    if loop.get("clip_grad_norm") is not None:
        return "the loop clips the norm over all gradients, which needs every gradient before any update"
    if not loop.get("set_to_none", True):
        return "the loop keeps its gradients between steps (zero_grad(set_to_none=False))"
    phase = trace.ops["phase"].to_numpy()
    bw = np.nonzero(phase == "backward")[0]
    if len(bw) and (bw[-1] - bw[0] + 1 != len(bw)):
        return "the step runs more than one backward pass"
    found = _per_parameter(trace)
    return None if isinstance(found, list) else found


def _per_parameter(trace):
    """(trace, its per-parameter steps) where the step runs one parameter at a time: the
    trace itself, or for a ``foreach`` step its view in groups of one parameter (each
    parameter's own foreach ops, as a hook stepping that parameter alone runs them); or a
    sentence saying why neither is possible."""
    steps = parameter_steps(trace)
    if not isinstance(steps, str):
        return [trace, steps]
    from .groups import foreach_step, groups_view

    step = foreach_step(trace)
    if isinstance(step, str):
        return steps
    single = groups_view(trace, step, [[i] for i in range(len(step.params))])
    one = parameter_steps(single) if single is not None else steps
    return steps if isinstance(one, str) else [single, one]


def groups_refusal(trace) -> str | None:
    """Why stepping in groups cannot help this trace (None: it can)."""
    from .groups import foreach_step

    if not isinstance(parameter_steps(trace), str):
        return ("its optimizer step already runs one parameter at a time (the per-parameter loop PyTorch runs on "
                "CPU), so its temporaries are already the smallest any grouping gives")
    step = foreach_step(trace)
    if isinstance(step, str):
        return step
    if len(step.params) < 2:
        return "its optimizer step updates a single parameter"
    return None


def refusal(trace, mode: str) -> str | None:
    """Why ``mode`` cannot be used on ``trace`` (None: it can)."""
    if mode == "as-recorded":
        return None
    if mode in ("in-backward", "groups") and trace.meta.get("compiled") is not None:
        return ("the trace is of a torch.compile'd step, and stepping the optimizer in backward hooks or in groups "
                "beside a compiled backward is not built yet")
    if mode in ("in-backward", "groups") and trace.meta.get("fsdp") is not None:
        return ("the trace is rank 0 of an FSDP2 job (record --fsdp): FSDP writes the gradient shards after its "
                "reduce-scatter, not through autograd, and stepping its DTensor parameters in hooks or groups is not "
                "built yet")
    if mode in ("in-backward", "groups") and trace.meta.get("ddp") is not None:
        return ("the trace is a rank of a DDP job (record --ddp): DDP all-reduces the gradients in buckets during "
                "backward, so a parameter's gradient is final only when backward ends, and stepping the optimizer "
                "in hooks or groups under DDP is not built yet")
    if mode == "in-backward":
        return in_backward_refusal(trace)
    if mode == "groups":
        return groups_refusal(trace)
    raise UsageError(f"--optimizer must be one of {', '.join(CHOICES)}, not {mode!r}.")


def check_choice(trace, choice: str) -> None:
    """Refuse an option the user named that this trace cannot use, saying why."""
    if choice not in CHOICES:
        raise UsageError(f"--optimizer must be one of {', '.join(CHOICES)}, not {choice!r}.")
    why = None if choice == "auto" else refusal(trace, choice)
    if why is not None:
        raise UsageError(f"--optimizer {choice} cannot be used on this trace: {why}. Use --optimizer as-recorded "
                         "(or auto, which uses what the trace allows).")


def optimizer_view(trace, mode: str | None, groups: list[list[int]] | None = None):
    """The trace of the step as ``mode`` runs it (the trace itself for ``as-recorded``/None);
    ``groups``: for ``groups``, the parameters of each group (indices in the step's order).

    The view is a :class:`~taichi_plan.trace.format.Trace` with the same tensors, accesses and op
    rows, reordered (and, for groups, split); ``view.recorded`` is the trace it was made from,
    ``view.position`` maps a recorded op id to its position in the view, and
    ``meta.optimizer_view`` names the mode. Cached on the trace."""
    if mode in (None, "as-recorded"):
        return recorded_trace(trace)
    key = (mode, None if groups is None else tuple(tuple(g) for g in groups))
    if _view_key(trace) == key:
        return trace
    trace = recorded_trace(trace)
    cache = trace.__dict__.setdefault("_optimizer_views", {})
    if key not in cache:
        why = refusal(trace, mode)
        if why is not None:
            raise UsageError(f"The plan steps the optimizer {mode}, but its trace cannot: {why}.")
        if mode == "groups":
            from .groups import foreach_step, groups_view

            step = foreach_step(trace)
            if groups is None or sorted(u for g in groups for u in g) != list(range(len(step.params))):
                raise UsageError(f"Stepping the optimizer in groups needs every one of its {len(step.params)} "
                                 f"parameters in exactly one group; got {groups!r}.")
            view = groups_view(trace, step, groups)
            if view is None:
                raise UsageError("The optimizer step cannot be split in these groups: an op that is not a foreach "
                                 "op updates parameters of two groups.")
            view.meta = {**view.meta, "optimizer_view": {"mode": "groups", "groups": [list(g) for g in groups],
                                                         "parameters": len(step.params)}}
        else:
            base, steps = _per_parameter(trace)
            view = _in_backward_view(base, steps)
            if base is not trace:  # a foreach step, split per parameter first
                view.position = view.position[base.position]
        view.recorded = trace
        cache[key] = view
    return cache[key]


def _view_key(trace) -> tuple | None:
    info = trace.meta.get("optimizer_view")
    if info is None:
        return None
    groups = info.get("groups")
    return info["mode"], None if groups is None else tuple(tuple(g) for g in groups)


def recorded_trace(trace):
    """The trace as recorded, for a view made by :func:`optimizer_view` (else ``trace``)."""
    return getattr(trace, "recorded", None) or trace


def _in_backward_view(trace, steps: list[ParamStep]):
    from ...trace.format import Trace, remap_backward_nodes

    n = len(trace.ops)
    after: dict[int, list[int]] = {}
    moved: set[int] = set()
    for s in sorted(steps, key=lambda s: (s.ready_op, s.ops[0])):
        after.setdefault(s.ready_op, []).extend(s.ops)
        moved.update(s.ops)
    order: list[int] = []
    for i in range(n):
        if i not in moved:
            order.append(i)
            order.extend(after.get(i, ()))
    new = np.empty(n, dtype=np.int64)
    new[np.asarray(order, dtype=np.int64)] = np.arange(n)

    ops = trace.ops.iloc[order].reset_index(drop=True)
    ops["op_id"] = np.arange(n, dtype=np.int32)
    acc = trace.accesses.copy()
    acc["op_id"] = new[acc["op_id"].to_numpy()].astype(np.int32)
    acc = acc.sort_values(["op_id"], kind="stable").reset_index(drop=True)
    tensors = trace.tensors.copy()

    def remap(col: str) -> np.ndarray:
        v = tensors[col].to_numpy().astype(np.int64)
        return np.where(v >= 0, new[np.maximum(v, 0)], -1)

    producer, alloc, free = remap("producer_op"), remap("alloc_op"), remap("free_op")
    first = acc.groupby("tensor_id")["op_id"].min()
    last = acc.groupby("tensor_id")["op_id"].max()
    tid = tensors["tensor_id"].to_numpy()
    lo = first.reindex(tid).to_numpy()
    hi = last.reindex(tid).to_numpy()
    has = ~np.isnan(hi)
    alloc = np.where((alloc >= 0) & has, np.minimum(alloc, np.nan_to_num(lo, nan=0).astype(np.int64)), alloc)
    free = np.where((free >= 0) & has, np.maximum(free, np.nan_to_num(hi, nan=0).astype(np.int64)), free)
    # A gradient is freed when its parameter's step is done (the hook sets ``.grad = None``).
    done = {s.grad: int(new[s.ops[-1]]) for s in steps}
    # So is what the step made and only it used (Adam's ``denom``): the hook's step call
    # returns there, where the recorded loop freed it only when its next parameter's
    # iteration made another (in the view, after backward ops in between).
    step_of = {o: k for k, s in enumerate(steps) for o in s.ops}
    a_op, a_t = trace.accesses["op_id"].to_numpy(), trace.accesses["tensor_id"].to_numpy()
    used_in: dict[int, set] = {}
    for o, t in zip(a_op.tolist(), a_t.tolist(), strict=True):
        used_in.setdefault(t, set()).add(step_of.get(o, -1))
    ends = {}
    for t, p in zip(tid.tolist(), tensors["producer_op"].tolist(), strict=True):
        k = step_of.get(int(p), -1)
        if k >= 0 and used_in.get(int(t)) == {k} and int(t) not in done:
            ends[int(t)] = int(new[steps[k].ops[-1]])
    free = np.asarray([done.get(t, min(f, ends[t]) if t in ends and f >= 0 else f)
                       for t, f in zip(tid.tolist(), free.tolist(), strict=True)], dtype=np.int64)
    tensors["producer_op"] = producer.astype(np.int32)
    tensors["alloc_op"] = alloc.astype(np.int32)
    tensors["free_op"] = free.astype(np.int32)

    meta = copy.deepcopy(trace.meta)
    for call in meta.get("model_calls") or []:
        for key in ("start", "end"):
            if call.get(key) is not None:
                call[key] = int(new[int(call[key])])
    meta["optimizer_view"] = {"mode": "in-backward", "parameters": len(steps)}
    remap_backward_nodes(meta, trace.ops["phase"].to_numpy(), order)
    view = Trace(ops=ops, tensors=tensors, accesses=acc, meta=meta, path=trace.path)
    view.position = new  # recorded op id -> its position in the view
    return view


@dataclass(frozen=True)
class FloorParts:
    """What is live at the op that sets a floor: the fixed training state and the rest."""

    op: int
    total: int
    by_kind: dict  # parameter, gradient, optimizer_state, activations (everything else)


def floor_parts(problem, op: int, floor: int) -> FloorParts:
    """The floor at ``op`` split into parameters, gradients, optimizer state and activations
    (the rest: activations, inputs and temporaries that no plan frees there)."""
    live = (problem.start <= op) & (problem.end >= op)
    parts = {k: int(problem.nbytes[live & (problem.kind == k)].sum())
             for k in ("parameter", "optimizer_state", "gradient")}
    parts["activations"] = max(int(floor) - sum(parts.values()), 0)
    return FloorParts(op, int(floor), parts)


OPTION_ORDER = ("groups", "in-backward")  # what ``auto`` tries after the recorded step, least change first
WORDS = {"in-backward": "stepped in backward (each parameter updated as soon as its gradient is complete, the "
                        "gradient freed right after)",
         "groups": "stepped in groups of parameters"}


def view_problem(problem, mode: str | None, groups: list[list[int]] | None = None):
    """The problem of the step as ``mode`` runs it, from the recorded trace's ``problem``
    (cached on the view; the view keeps the recorded problem for the unplanned baseline)."""
    from ..core import build_problem

    view = optimizer_view(problem.trace, mode, groups)
    if view is problem.trace:
        return problem
    problem = recorded_problem(problem)
    if view is problem.trace:
        return problem
    cached = view.__dict__.get("_problem")
    if cached is None:
        cached = view._problem = build_problem(view)
        cached.recorded_problem = problem
    return cached


def choose_groups(problem, budget_bytes: int) -> list[list[int]]:
    """The fewest groups (2, 4, 8, 16, or one per parameter) whose step's floor is within
    ``budget_bytes``; else those with the lowest floor."""
    from ...base.deadline import check
    from ..partition.floor import floor_bytes
    from .groups import balanced_groups, foreach_step

    rec = recorded_problem(problem)
    step = foreach_step(rec.trace)
    best = None
    for k in sorted({k for k in (2, 4, 8, 16) if k < len(step.params)} | {len(step.params)}):
        check(f"weighing the optimizer step in {k} groups")
        groups = balanced_groups(rec.trace, step, k)
        floor = int(floor_bytes(view_problem(rec, "groups", groups)).max())
        if floor <= budget_bytes:
            return groups
        if best is None or floor < best[0]:
            best = (floor, groups)
    return best[1]


def problem_for_plan(plan, trace, problem=None):
    """The problem a plan's op ids refer to: the step as its optimizer option runs it, with its
    FSDP units resharding as it says."""
    from ..core import build_problem
    from ..sharding.prefetch import problem_for_prefetch
    from ..sharding.reshard import problem_for_choice

    opt = getattr(plan, "optimizer", None) or {}
    problem = view_problem(problem or build_problem(trace), plan_mode(plan), opt.get("groups"))
    # v5: the step with the plan's FSDP units not resharding after forward (sharded traces,
    # on which the optimizer options are refused: the two never combine)
    problem = problem_for_choice(problem, getattr(plan, "reshard", None))
    return problem_for_prefetch(problem, getattr(plan, "prefetch", None))  # v6: its prefetching


def plan_mode(plan) -> str:
    """The plan's optimizer option (``as-recorded`` for plans without one)."""
    return (getattr(plan, "optimizer", None) or {}).get("mode", "as-recorded")


def recorded_problem(problem):
    """The recorded step's problem of a view's ``problem`` (``problem`` itself otherwise)."""
    return getattr(problem, "recorded_problem", None) or problem


def describe(problem) -> dict | None:
    """``decisions.optimizer`` of a plan on ``problem``: its mode and what it changes, or None
    for the step as recorded."""
    info = problem.trace.meta.get("optimizer_view")
    if info is None:
        return None
    from ...base.units import format_bytes

    rec = recorded_problem(problem)
    before, _ = rec.baseline_peak
    after, after_op = problem.baseline_peak
    peaks = f"the unplanned step peaks at {format_bytes(after)} (op {after_op}) instead of {format_bytes(before)}"
    if format_bytes(after) == format_bytes(before):  # "5.52 MB instead of 5.52 MB" says nothing
        diff = int(before) - int(after)
        peaks = (f"the unplanned step peaks at {format_bytes(after)} (op {after_op}), "
                 + (f"{diff:,} bytes below the recorded step's peak" if diff > 0 else
                    f"{-diff:,} bytes above the recorded step's peak" if diff < 0 else "as the recorded step does"))
    if info["mode"] == "groups":
        groups = info["groups"]
        why = (f"the foreach step over {info['parameters']} parameters runs in {len(groups)} groups, one after the "
               f"other, so only one group's temporaries are live at once; {peaks}")
        return {"mode": "groups", "groups": groups, "parameters": info["parameters"], "num_ops": problem.num_ops,
                "why": why}
    grads = int(problem.nbytes[problem.kind == "gradient"].sum())
    why = (f"{info['parameters']} parameters each updated right after the backward op that completes its gradient, "
           f"which is then freed (the {format_bytes(grads)} of gradients are never all live at once); {peaks}")
    return {"mode": info["mode"], "parameters": info["parameters"], "num_ops": problem.num_ops, "why": why}


def optimizer_note(optimizer: dict, auto: bool) -> str:
    how = "--optimizer auto chose" if auto else "as asked,"
    return f"{how} the optimizer {WORDS[optimizer['mode']]}: {optimizer['why']}"
