"""Whether a plan fits the trace it names: its tensor ids, op ids and modules exist in the trace and
agree with it, seen through the plan's own resharding and prefetch choices (which renumber the step).
``load_plan`` checks the file alone (:mod:`taichi_plan.plan.check`); this check runs wherever the
trace is at hand, before anything is drawn, simulated or replayed from the plan."""

from __future__ import annotations

from ..base.errors import PlanError
from ..plan.check import COPY_ID_BASE, PARTITION_TRANSIENT_IDS_FROM
from ..trace.layout import check_layout, layout
from .sharding.prefetch import view_of_prefetch
from .sharding.reshard import view_of_choice


def check_plan_against_trace(plan, trace, where: str = "The plan") -> None:
    """The plan's tensor ids, op ids and modules exist in ``trace`` and agree with it
    (``plan`` is a :class:`~taichi_plan.plan.format.Plan`, ``trace`` a :class:`~taichi_plan.trace.format.Trace`)."""
    at = f" {trace.path}" if trace.path is not None else ""
    other = (f"The plan does not fit the trace at{at or ' hand'}: solve that trace again, or give the trace "
             "the plan was solved for.")
    n = len(trace.ops)
    if plan.trace.get("num_ops") != n:
        raise PlanError(f"{where}: field `trace.num_ops` is {plan.trace.get('num_ops')!r}, but the trace{at} "
                        f"has {n} ops. {other}")
    recorded = trace
    if getattr(plan, "reshard", None):  # v5: ids are the step's with those units not resharding
        trace = view_of_choice(trace, {u["module"]: u["reshard_after_forward"] for u in plan.reshard["units"]})
    if getattr(plan, "prefetch", None):  # v6: ids are the step's with those all-gathers issued so
        trace = view_of_prefetch(trace, {ph: plan.prefetch[ph] for ph in ("forward", "backward")})
    tids = trace.tensors["tensor_id"].tolist()
    producer = dict(zip(tids, trace.tensors["producer_op"].tolist(), strict=True))
    names = trace.ops["op"].tolist()
    for i, r in enumerate(plan.recompute):
        f = f"decisions.recompute[{i}]"
        if r.tensor not in producer:
            raise PlanError(f"{where}: {f} drops tensor {r.tensor}, which the trace{at} does not have. {other}")
        if producer[r.tensor] != r.op:
            raise PlanError(f"{where}: {f} says tensor {r.tensor} is made by op {r.op}, but in the trace{at} "
                            f"op {producer[r.tensor]} makes it. {other}")
        if names[r.op] != r.op_name:
            raise PlanError(f"{where}: {f} names op {r.op} {r.op_name!r}, but in the trace{at} it is "
                            f"{names[r.op]!r}. {other}")
    for i, o in enumerate(getattr(plan, "offloads", ())):
        f = f"decisions.offload.tensors[{i}]"
        if o.tensor not in producer:
            raise PlanError(f"{where}: {f} offloads tensor {o.tensor}, which the trace{at} does not have. {other}")
        if producer[o.tensor] != o.op or names[o.op] != o.op_name:
            raise PlanError(f"{where}: {f} says tensor {o.tensor} is made by op {o.op} {o.op_name!r}, but in the "
                            f"trace{at} op {producer[o.tensor]} {names[producer[o.tensor]]!r} makes it. {other}")
    check_layout(plan.trace.get("layout"), layout(recorded.meta), where)
    modules = set(trace.ops["module"].tolist())
    for i, q in enumerate(plan.partitions):
        if not any(m == q.module or m.startswith(q.module + ".") for m in modules):
            raise PlanError(f"{where}: decisions.partitions[{i}] partitions module {q.module!r}, which no op "
                            f"of the trace{at} runs in. {other}")
    if plan.schedule:
        known = set(tids)
        for k in plan.schedule["nbytes"]:
            tid = int(k)
            if plan.partitions and tid <= PARTITION_TRANSIENT_IDS_FROM:
                continue
            if getattr(plan, "optimizer", None) and tid <= COPY_ID_BASE:
                continue  # a group's own copy of a tensor the optimizer step makes once per group
            base = tid if tid >= 0 else -1 - tid
            if base not in known:
                raise PlanError(f"{where}: schedule.nbytes lists tensor {tid}, which the trace{at} does not "
                                f"have{' (a partitioned copy of ' + str(base) + ')' if tid < 0 else ''}. {other}")
