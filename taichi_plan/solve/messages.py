"""What a solve says when it cannot give a plan: the budget it could not meet and why (the floor
of the step, what would help, a transformers KV cache), or that it ran out of time; each a
:class:`~taichi_plan.base.errors.InfeasibleBudgetError` with the least peak it reached."""

from __future__ import annotations

import math

import numpy as np

from ..base.deadline import OutOfTime, until
from ..base.errors import InfeasibleBudgetError
from ..base.units import format_bytes
from ..plan.format import Plan
from ..problem.core import Problem
from ..problem.describe import describe_op
from ..problem.optimizer.plan import (
    OPTION_ORDER,
    WORDS,
    choose_groups,
    floor_parts,
    recorded_problem,
    refusal,
    view_problem,
)
from ..problem.partition.find import state_keepers
from ..problem.partition.floor import floor_bytes
from ..trace.format import own_checkpointing
from .config import SolverConfig
from .reach import lowest_reachable


def timed_out_error(problem: Problem, budget_bytes: int, method: str, peak: int, op: int, time_limit: float,
                    work_limit: float | None, stopped_in: str | None = None) -> InfeasibleBudgetError:
    """No plan yet when the limit ran out (not a proof that none exists): say so (and in which
    phase it stopped, ``stopped_in``), and the lowest peak a plan found reaches: ``peak``, at
    ``op`` (the best plan for this budget's, or the heuristic's when asked for less)."""
    limit = f"the time limit of {time_limit:g} s" + ("" if work_limit is None else f" or the work limit of {work_limit:g}")
    at = f", during {describe_op(problem, op)}" if op >= 0 else ""
    view = (problem.trace.meta.get("optimizer_view") or {}).get("mode")
    if view is not None:  # reached with that optimizer option: asked for it by name, it gets the whole limit
        at += f", with the optimizer {WORDS.get(view, view).split(' (')[0]}"
    where = "the search" if stopped_in is None else f"it stopped while {stopped_in}: the search"
    msg = (f"No {method} plan found for a budget of {format_bytes(budget_bytes)} ({budget_bytes} bytes) within "
           f"{limit}: {where} stopped before any plan fit, which does not prove that none exists. The lowest "
           f"peak a plan found so far reaches (the heuristic's and the baselines' included, also when asked "
           f"for less) is {format_bytes(peak)}{at}. "
           f"Give it more time (--time-limit), or ask for at least that (--budget {_suggest(peak)}"
           f"{'' if view is None else f' --optimizer {view}'}). "
           "No plan file was written.")
    err = InfeasibleBudgetError(msg, min_budget_bytes=peak, op_id=op)
    err.planned_peak_bytes = peak
    err.timed_out = True
    return err


def stopped_error(problem: Problem, budget_bytes: int, method: str, phase: str, time_limit: float,
                  work_limit: float | None, failed: list[InfeasibleBudgetError], deadline: float,
                  config: SolverConfig = SolverConfig()) -> InfeasibleBudgetError:
    """The time ran out during ``phase``, with no plan found (``failed``: the errors of the
    options tried): :func:`timed_out_error` with the lowest peak known, the options' or the
    heuristic's on the step as recorded (``problem``), bisected until ``deadline``."""
    known = [(e.min_budget_bytes, e.op_id) for e in failed if e.min_budget_bytes]
    # An option's best plan may peak above the step unplanned, which meets its own peak.
    peak, op = (min([*known, tuple(problem.baseline_peak)]) if known
                else lowest_reachable(problem, deadline=deadline, config=config)[:2])
    return timed_out_error(problem, budget_bytes, method, peak, -1 if op is None else op, time_limit, work_limit,
                           stopped_in=phase)


def infeasible_error(problem: Problem, budget_bytes: int, method: str, plan: Plan | None = None,
                     deadline: float | None = None, config: SolverConfig = SolverConfig()):
    floor = floor_bytes(problem)
    i = int(np.argmax(floor))
    reach, reach_op, _asked = lowest_reachable(problem, deadline=deadline, config=config)
    peak = plan.predicted["planned_peak_bytes"] if plan is not None else None
    if peak is not None and peak <= budget_bytes:
        reach = min(reach, peak)
    head = f"No {method} plan fits a budget of {format_bytes(budget_bytes)} ({budget_bytes} bytes)."
    if plan is not None:
        at = describe_op(problem, plan.predicted["planned_peak_op"]) if plan.predicted["planned_peak_op"] >= 0 else ""
        head += f" The best {method} plan peaks at {format_bytes(peak)}" + (f", during {at}." if at else ".")
    if reach <= budget_bytes:
        msg = (f"{head} taichi-plan's heuristic reaches {format_bytes(reach)} on this trace: "
               "use --method auto. No plan file was written.")
    else:
        if method in OURS:
            meet = (f"The lowest budget taichi-plan is known to meet is {format_bytes(reach)}" +
                    ("" if method in ("auto", "ilp") else " (--method auto may reach a little lower)"))
        else:
            meet = f"taichi-plan's own planner (--method auto) meets {format_bytes(reach)}"
        msg = (f"{head} No plan of this trace can go below {format_bytes(int(floor[i]))}: {describe_op(problem, i)} "
               "needs that much live at once even with every droppable tensor dropped and every module "
               f"partitioned. {meet}: ask for at least that (--budget {_suggest(reach)})"
               f"{_what_helps(problem, i, int(floor[i]), deadline)} No plan file was written.")
    err = InfeasibleBudgetError(msg, min_budget_bytes=reach, op_id=reach_op)
    err.planned_peak_bytes = peak
    return err


def _what_helps(problem: Problem, op: int, floor: int, deadline: float | None = None) -> str:
    """The floor's parts at ``op`` (parameters, optimizer state, gradients, activations) and
    the advice that fits them: the optimizer options with the floor each would reach (or why
    the loop rules one out; not past ``deadline``); when parameters, gradients and optimizer
    state make most of the floor, what would shrink them, not a smaller batch, which cannot help."""
    parts = floor_parts(problem, op, floor).by_kind
    state = parts["parameter"] + parts["gradient"] + parts["optimizer_state"]
    names = {"parameter": "parameters", "optimizer_state": "optimizer state", "gradient": "gradients",
             "activations": "activations and other tensors"}
    where = " (in the optimizer step)" if problem.op_phase[op] == "optimizer" else ""
    text = (f". At op {op}{where} the floor is " +
            ", ".join(f"{names[k]} {format_bytes(v)}" for k, v in parts.items()) + ".")
    used = (problem.trace.meta.get("optimizer_view") or {}).get("mode")
    if used is not None:
        text += f" That is with the optimizer {WORDS[used]}."
    try:
        with until(deadline):
            text += _options_floor(recorded_problem(problem), used, floor)
    except OutOfTime:  # the step's views under the other options can take long to build
        text += " What the other optimizer options would reach was not weighed within the time limit."
    own = own_checkpointing(problem.trace.meta)
    if own is not None:
        text += " " + own
    kv = kv_cache_note(recorded_problem(problem))
    if kv is not None:
        text += " " + kv
    if floor <= 0 or state < floor / 2:
        return text + (" Otherwise, reduce the batch size." if own is None else "")
    return (text + f" Parameters, gradients and optimizer state are {100 * state / floor:.0f}% of it: no "
            "activation plan and no smaller batch frees them; sharding them across devices (FSDP), an optimizer "
            "with less state, or lower-precision parameters and state would.")


def kv_cache_note(problem: Problem) -> str | None:
    """A sentence on the modules no plan partitions because they keep tensors in the model's
    state (a KV cache), or None."""
    keeps = state_keepers(problem)
    if not keeps:
        return None
    more = f" and {len(keeps) - 3} more" if len(keeps) > 3 else ""
    return (f"{len(keeps)} module(s) ({', '.join(keeps[:3])}{more}) make tensors that the step's code still "
            "holds after their forward although no later forward op reads them (a transformers model's KV cache, "
            "or outputs the model returns and the loss does not use), so no plan partitions or checkpoints them: "
            "re-run in backward, such a module would make them a second time while the first copies are held. "
            "Where that is a transformers model's KV cache, training needs none: recorded with "
            "model.config.use_cache = False (as gradient_checkpointing_enable() sets it), its modules are all options"
            + (" (this built-in model: record it with --no-kv-cache)." if _builtin_decoder(problem) else "."))


def _builtin_decoder(problem: Problem) -> bool:
    """Was the trace recorded from a built-in decoder, which ``--no-kv-cache`` builds without its cache?"""
    from ..trace.format import KV_CACHE_MODELS

    wl = problem.trace.meta.get("workload") or {}
    return wl.get("kind") == "builtin" and wl.get("name") in KV_CACHE_MODELS


def _options_floor(rec: Problem, used: str | None, floor: int) -> str:
    """Sentences on what each optimizer option other than ``used`` does to ``floor`` (or why
    the loop rules it out); checks the deadline in force."""
    text = ""
    for mode in OPTION_ORDER:
        if mode == used:
            continue
        why = refusal(rec.trace, mode)
        if why is not None:
            if mode == "in-backward":  # (groups are refused only where they cannot help)
                text += f" The optimizer cannot be stepped in backward here (--optimizer in-backward): {why}."
            continue
        other = int(floor_bytes(view_problem(rec, mode, choose_groups(rec, 0) if mode == "groups" else None)).max())
        if other < floor:
            text += (f" With the optimizer {WORDS[mode]} (--optimizer {mode}, or auto), no plan can go below "
                     f"{format_bytes(other)} instead: {format_bytes(floor - other)} less.")
    return text


def _suggest(nbytes: int) -> str:
    """A budget flag at or just above ``nbytes``, in a readable unit."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= 10 * scale:
            return f"{math.ceil(nbytes / scale * 100) / 100:g}{unit}"
    return str(nbytes)


OURS = ("auto", "ilp", "heuristic")
