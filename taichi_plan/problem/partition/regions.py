"""Planned regions: the module calls of a model call in which the replay runtime runs at all.

A plan's drops and rebuilds touch a few places of a forward: the ops that make a dropped
storage, the ops that read it there (autograd saves it at one of them: the runtime's pack hook
must see that), the ops a rebuild re-runs (their recipes are kept as they run), and the
*triggers* of groups rebuilt early. The runtime needs its dispatch mode and its saved-tensor
hooks at those ops only. Each such op runs inside a recorded module call (trace v10
``meta.module_args``; the innermost module running it, the trace's ``module`` column); the
calls of a model call that hold one, the outermost where they nest, are its *planned regions*.
The runtime enters its mode and hooks when a region's module is called and leaves them when it
returns, and sets its op count from the recorded start of that call; every other op of the
forward runs with nothing of the runtime in its way (issue 8: a dispatch mode over the whole
forward cost a ResNet-50 planned with 3 drops 16 ms a step, checking 1,100 ops).

An op of the model's own top-level code (module ``""``), or a trace without ``module_args``,
makes the whole call the region: the runtime then runs over the whole call, as before regions.

Torch-free: the replay runtime (``runtime.calls.call_plans``) and the overhead model
(:mod:`taichi_plan.problem.partition.overhead`) compute the same regions, so the runtime's own cost is predicted
for exactly the ops it sees.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

import numpy as np

from ..core import grad_model_calls, rebuild_inputs


class Region(NamedTuple):
    """One planned region: a recorded module call, in op ids of the trace."""

    first: int  # its first op
    last: int  # its last op
    module: str
    call: int  # which call of ``module`` in its model call (0-based), as the runtime counts them


def early_triggers(parted, sim) -> dict[int, int]:
    """Tensor index -> rebuild group (the op before which the simulator rebuilds it) of each
    *trigger*: a group whose tensors are all rebuilt earlier than backward first unpacks one of
    them (before the first of their inputs dies) runs at the last unpack of a saved tensor that
    the group's node reads for the last time, while that tensor is still alive. ``parted``,
    ``sim``: the plan's problem with its partitions applied and its simulation
    (:func:`~taichi_plan.simulate.core.simulate_plan`). A group with no such tensor is left to its
    members' unpack."""
    phase = np.asarray(parted.op_phase)
    members: dict[int, list[int]] = {}
    for t, r in sim.remat_at.items():
        members.setdefault(int(r), []).append(int(t))
    dropped = set(sim.remat_at)
    triggers: dict[int, int] = {}
    unpack = parted.unpack_at
    for r, ts in members.items():
        first_unpack = min((int(unpack[o]) for t in ts for o in parted.uses[t].tolist() if phase[o] == "backward"),
                           default=r)
        if first_unpack <= r:
            continue
        reads = {u for t in ts for u in rebuild_inputs(parted, t)}
        node = np.nonzero((unpack == r) & (phase == "backward"))[0].tolist() or [r]  # the ops of r's node
        # A tensor the node reads dies with the node (its end is the node's last op when an op
        # before that reads it: a Linear's backward reads its input at one mm, and the node
        # holds it until its apply returns, as Funnel's k_head does): the node's unpack is its last.
        in_node = set(node)
        found = [int(u) for o in node for u in parted.op_reads[o].tolist()
                 if int(parted.end[u]) in in_node and u not in dropped and int(parted.producer[u]) >= 0
                 and phase[int(parted.producer[u])] == "forward"]
        found.sort(key=lambda u: (u not in reads, u))
        if found:
            triggers[found[0]] = r
    return triggers


def needed_ops(problem, drops, rerun, triggers=()) -> set[int]:
    """The forward op ids at which the runtime must run for a plan: each dropped tensor's
    producer and its forward accesses in its model call (autograd saves it at one of them, where
    the pack hook swaps it for a handle; a view of it is an access too), each op a rebuild may
    re-run (``rerun``: their recipes), and each trigger tensor's producer and forward accesses
    (``triggers``: tensor indices whose last unpack runs a group rebuilt early). ``drops``: the
    simulator's :class:`~taichi_plan.simulate.core.Drop` s (tensor indices of ``problem``)."""
    phase, call = problem.op_phase, problem.op_call
    n = len(call)
    out = {int(i) for i in rerun if 0 <= int(i) < n}
    for t in [int(d.tensor) for d in drops] + [int(t) for t in triggers]:
        p = int(problem.producer[t])
        if not 0 <= p < n:
            continue
        out.add(p)
        out.update(int(o) for o in problem.uses[t].tolist()
                   if o < n and phase[o] == "forward" and call[o] == call[p])
    return out


def _module_calls(trace) -> dict[str, tuple[list[int], list[int | None]]]:
    """Module name -> (the first op of each recorded forward call, in order; the op after each
    one's last, None where the trace does not say: before v15)."""
    cached = getattr(trace, "_module_calls", None)
    if cached is None:
        cached = {}
        for name, entries in (trace.meta.get("module_args") or {}).items():
            if entries:
                rows = sorted((int(e[0]), int(e[2]) if len(e) > 2 else None) for e in entries)
                cached[name] = ([r[0] for r in rows], [r[1] for r in rows])
        trace._module_calls = cached
    return cached


def _call_last(modules: list[str], name: str, first: int, stop: int) -> int | None:
    """The last op of the call of ``name`` that starts at ``first``, for traces that do not
    record where module calls end (before v15): the last op, before
    ``stop``, whose module is ``name`` or one inside it, until the first op of its callers'
    own code (a module whose name ``name`` is inside, or the top level). Ops of another
    module that the call runs (one registered elsewhere) stay inside it."""
    inside = name + "."
    last = None
    for o in range(first, stop):
        m = modules[o]
        if m == name or m.startswith(inside):
            last = o
        elif not m or inside.startswith(m + "."):
            break
    return last


def planned_regions(trace, needed, checkpointed=()) -> dict[int, list[Region] | None]:
    """Per grad-enabled model call (its index in ``meta.model_calls``' grad-enabled calls)
    holding an op of ``needed``: its planned regions in op order, or None when the runtime must
    run over the whole call (an op of the model's own top-level code, a trace without
    ``module_args``, module calls that do not nest). Calls without a needed op are left out.

    ``checkpointed``: the modules the plan partitions along the batch or the sequence (each
    chunk, or the whole module, under ``torch.utils.checkpoint``). A needed op inside one makes
    that module's call the region: entered inside it, the runtime's saved-tensor hooks would be
    innermost there and keep what the checkpoint discards (a block checkpointed whole, its
    output dropped and rebuilt through its insides: 9.5% over the prediction). For the same
    reason a step recorded with the model's own activation checkpointing (trace v8
    ``meta.forward_in_backward``) keeps the runtime over the whole call: its hooks stay outside
    every checkpoint the model runs."""
    calls = grad_model_calls(trace.meta) or []
    if not calls:
        return {}
    call_starts = [int(c["start"]) for c in calls]
    if (trace.meta.get("forward_in_backward") or {}).get("ops"):
        whole: dict[int, list[Region] | None] = {}
        for i in needed:
            c = bisect.bisect_right(call_starts, int(i)) - 1
            if c >= 0 and int(i) <= int(calls[c]["end"]):
                whole[c] = None
        return whole
    modules = trace.ops["module"].tolist()
    known = _module_calls(trace)
    found: dict[int, dict[tuple[str, int], tuple[int, int]] | None] = {}
    for i in sorted(int(i) for i in needed):
        c = bisect.bisect_right(call_starts, i) - 1
        if c < 0 or i > int(calls[c]["end"]):
            continue
        if c in found and found[c] is None:
            continue
        name = modules[i]
        name = next((m for m in checkpointed if name == m or name.startswith(m + ".")), name)
        ss, ends = known.get(name, (None, None)) if name else (None, None)
        j = bisect.bisect_right(ss, i) - 1 if ss else -1
        if j < 0 or ss[j] < call_starts[c]:
            found[c] = None  # the model's top-level code, or a module call the trace does not list
            continue
        mine = found.setdefault(c, {})
        if (name, j) not in mine:
            if ends[j] is not None:  # recorded (v15)
                last = ends[j] - 1 if ends[j] > ss[j] else None
            else:
                stop = min(ss[j + 1] if j + 1 < len(ss) else len(modules), int(calls[c]["end"]) + 1)
                last = _call_last(modules, name, ss[j], stop)
            if last is None or last < i or last > int(calls[c]["end"]):
                found[c] = None
                continue
            mine[(name, j)] = (ss[j], last)
    out: dict[int, list[Region] | None] = {}
    for c, mine in found.items():
        if mine is None:
            out[c] = None
            continue
        kept: list[Region] = []
        for (name, j), (first, last) in sorted(mine.items(), key=lambda kv: (kv[1][0], -kv[1][1])):
            if kept and first <= kept[-1].last:
                if last <= kept[-1].last:
                    continue  # inside the region before it
                kept = None  # calls that overlap without nesting: run over the whole call
                break
            k = j - bisect.bisect_left(known[name][0], call_starts[c])  # its call within this model call
            kept.append(Region(first, last, name, k))
        out[c] = kept
    return out


def module_calls_per_call(trace) -> dict[int, int]:
    """Per grad-enabled model call: how many forward calls of the model's modules it made (its
    own call left out): where the runtime's module hooks run while it is planned."""
    calls = grad_model_calls(trace.meta) or []
    starts = [int(c["start"]) for c in calls]
    out: dict[int, int] = {}
    for name, (ss, _ends) in _module_calls(trace).items():
        if not name:
            continue
        for s in ss:
            c = bisect.bisect_right(starts, s) - 1
            if c >= 0 and s <= int(calls[c]["end"]):
                out[c] = out.get(c, 0) + 1
    return out


class RegionOps(NamedTuple):
    """What the runtime runs in a model call's planned regions: their ops, and how many regions
    it enters (each entry turns its mode and hooks on and off: ``region_s``)."""

    ops: int
    regions: int


def region_ops(trace, needed, checkpointed=()) -> dict[int, RegionOps | None]:
    """Per model call holding a needed op: its planned regions' ops and count (None: the whole
    call)."""
    return {c: None if rs is None else RegionOps(sum(r.last - r.first + 1 for r in rs), len(rs))
            for c, rs in planned_regions(trace, needed, checkpointed).items()}


def checkpointed_modules(partitions) -> list[str]:
    """The modules a plan's ``partitions`` run under ``torch.utils.checkpoint`` (along the
    batch or the sequence: whole, or in chunks), outermost first."""
    return sorted({p.module for p in partitions if p.over in ("batch", "sequence")}, key=lambda m: (m.count("."), m))
