"""FSDP2's ``reshard_after_forward`` per unit, derived from a recorded trace (no torch).

A sharded trace (``record --fsdp N``) is recorded with every unit's ``reshard_after_forward``
fixed. A unit that reshards frees its gathered parameters when its forward ends and gathers
them again in backward (an all-gather, a copy-out into the same storages: a second row of each
storage, ``meta.fsdp.incarnations``). A unit that does not reshard keeps the forward's
gathering until its backward is done, and runs no backward all-gather at all.

A setting (module -> ``reshard_after_forward``) sets some of the units recorded resharding
apart: to ``False`` (:func:`~taichi_plan.problem.sharding.no_reshard.reshard_view`: the unit
keeps its gathered parameters to its backward) or to an int K
(:func:`~taichi_plan.problem.sharding.smaller_mesh.smaller_mesh_view`: it reshards to a K-rank
mesh after forward), possibly both, on different units. This module turns a setting into the
changes it makes (:func:`choice_changes`), the step's trace (:func:`setting_view`) and its
problem (:func:`reshard_problem`, cached on the recorded problem), and reads back which units a
problem's view sets apart (:func:`units_off`, :func:`units_to`). The units and their backward
gathering are in :mod:`taichi_plan.problem.sharding.units`, what each setting costs and the
plan's decisions in :mod:`taichi_plan.problem.sharding.decisions`.

Not derived: a unit recorded *without* resharding (or to a smaller mesh) cannot be turned into
one that reshards (its backward gathering was never recorded); a smaller mesh on a trace whose op times
were measured rather than estimated (the inserted ops' times would be guesses).
"""

from __future__ import annotations

from ...base.errors import PlanError
from ...trace.layout import fsdp_meta
from .no_reshard import reshard_view
from .smaller_mesh import smaller_mesh_view
from .units import unit_index

__all__ = ["choice_changes", "problem_for_choice", "reshard_problem", "setting_view", "units_off", "units_to",
           "view_of_choice"]


Change = bool | int  # a unit's reshard_after_forward set apart from the recording: False, or K ranks


def choice_changes(meta: dict, choice: dict | None) -> dict[int, Change]:
    """The units a setting (module -> ``reshard_after_forward``) sets apart from the trace,
    among those it recorded resharding (unit index -> False, or K: a smaller mesh); a unit set
    as recorded is no change."""
    f = fsdp_meta(meta) or {}
    recorded = {u["module"]: u["reshard_after_forward"] for u in f.get("units", [])}
    out: dict[int, Change] = {}
    for module, value in (choice or {}).items():
        k = unit_index(meta, module)
        if value == recorded.get(module) and type(value) is type(recorded.get(module)):
            continue
        if value is True or recorded.get(module) is not True:
            raise PlanError(f"The plan sets reshard_after_forward={value!r} for FSDP unit {module or '<root>'!r}, "
                            f"recorded with {recorded.get(module)!r}: only a unit recorded resharding in full can be "
                            "set not to, or to a smaller mesh. Record with resharding and solve again.")
        out[k] = value
    return out


def setting_view(trace, changes: dict[int, Change] | list[int]):
    """The trace of the step with ``changes`` (unit index -> False or K; a list: those units
    False): the units set to K first (:func:`smaller_mesh_view`), then those set to False
    (:func:`reshard_view`), ``view.position`` through both."""
    changes = _as_changes(changes)
    to = {u: v for u, v in changes.items() if v is not False}
    off = sorted(u for u, v in changes.items() if v is False)
    view = smaller_mesh_view(trace, to) if to else trace
    return reshard_view(view, off) if off else view


def _as_changes(changes) -> dict[int, Change]:
    if isinstance(changes, dict):
        return {int(u): (v if v is False else int(v)) for u, v in changes.items()}
    return dict.fromkeys((int(u) for u in changes), False)


def view_of_choice(trace, choice: dict | None):
    """The trace for a setting (module -> ``reshard_after_forward``): the recorded trace with
    the units it sets apart (:func:`choice_changes`) so."""
    return setting_view(trace, choice_changes(trace.meta, choice))


def reshard_problem(problem, changes: dict[int, Change] | list[int]):
    """The problem of the step with ``changes`` (:func:`setting_view`; a list of units: those
    not resharding), from the recorded step's ``problem``; cached on the recorded trace. The
    view's problem keeps the recorded one (``recorded_problem``) for the unplanned baseline, as
    optimizer views do."""
    from ..core import build_problem

    rec = getattr(problem, "recorded_problem", None) or problem
    changes = _as_changes(changes)
    key = tuple(sorted(changes.items()))
    if not key:
        return rec
    cache = rec.__dict__.setdefault("_reshard_problems", {})
    if key not in cache:
        view = setting_view(rec.trace, changes)
        prob = build_problem(view)
        prob.partition_random = rec.partition_random
        prob.recorded_problem = rec
        cache[key] = prob
    return cache[key]


def units_off(problem) -> list[int]:
    """Indices of the units a problem's view sets not to reshard (none for a recorded step)."""
    info = problem.trace.meta.get("reshard_view")
    if info is None:
        return []
    return [unit_index(problem.trace.meta, m) for m in info.get("units", [])]


def units_to(problem) -> dict[int, int]:
    """The units a problem's view reshards to a smaller mesh (unit index -> K)."""
    info = problem.trace.meta.get("reshard_view") or {}
    return {unit_index(problem.trace.meta, m): int(k) for m, k in (info.get("to") or {}).items()}


def problem_for_choice(problem, choice: dict | None):
    """The problem a plan's ``decisions.reshard_after_forward`` describes, from the recorded
    step's ``problem`` (the recorded one when the plan changes no unit)."""
    if not choice:
        return problem
    rec = getattr(problem, "recorded_problem", None) or problem
    return reshard_problem(rec, choice_changes(rec.trace.meta,
                                               {u["module"]: u["reshard_after_forward"] for u in choice["units"]}))


