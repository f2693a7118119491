"""What each FSDP resharding setting costs and saves, and a plan's
``decisions.reshard_after_forward`` (no torch).

A unit that does not reshard saves its backward gathering's time (:func:`regather_cost`) and
holds its unsharded parameters from the end of its forward to its backward
(:func:`held_bytes`); :func:`describe` writes, per unit, its setting and why, for the plan.
"""

from __future__ import annotations

from ...trace.layout import fsdp_meta
from .reshard import units_off, units_to
from .smaller_mesh import smaller_mesh_saving
from .units import gathered_rows, regather_ops, shard_group_size


def regather_cost(problem, unit: int) -> float:
    """Seconds the recorded step spends gathering ``unit`` again in backward (its all-gather
    on the interconnect, copy-in and copy-out): what not resharding it saves."""
    rec = getattr(problem, "recorded_problem", None) or problem
    return float(rec.op_cost[regather_ops(rec.trace, [unit])].sum())


def held_bytes(problem, unit: int) -> tuple[int, int, int]:
    """(bytes, first op, last op) a unit that does not reshard holds longer: its unsharded
    parameters from the end of its forward to its backward gathering (recorded op ids)."""
    rec = getattr(problem, "recorded_problem", None) or problem
    gone = regather_ops(rec.trace, [unit])
    if not len(gone):
        return 0, -1, -1
    first = int(gone[0])
    rows = [rec._index[t] for t in gathered_rows(rec.trace, unit)]
    size = int(sum(int(rec.nbytes[r]) for r in rows))
    lo = min([first, *(int(rec.end[r]) + 1 for r in rows)])
    return size, lo, first


def describe(problem) -> dict | None:
    """``decisions.reshard_after_forward`` of a plan on ``problem`` (plan v5): per FSDP unit,
    its setting and, for each one changed, why; None for a trace that is not sharded."""
    f = fsdp_meta(problem.trace.meta)
    if f is None:
        return None
    from ...base.units import format_bytes, format_cost

    rec = getattr(problem, "recorded_problem", None) or problem
    recorded = fsdp_meta(rec.trace.meta)["units"]
    off = set(units_off(problem))
    to = units_to(problem)
    unit = problem.trace.cost_unit
    units = []
    for k, u in enumerate(f["units"]):
        entry = {"module": u["module"], "reshard_after_forward": u["reshard_after_forward"],
                 "recorded": recorded[k]["reshard_after_forward"]}
        if k in off:
            size, lo, hi = held_bytes(rec, k)
            entry["why"] = (f"keeps {format_bytes(size)} of gathered parameters from op {lo} to op {hi} "
                            f"(recorded op ids), which saves its backward all-gather and copy-out: "
                            f"{format_cost(regather_cost(rec, k), unit)}")
        elif k in to:
            _size, lo, hi = held_bytes(rec, k)
            kept, saved = smaller_mesh_saving(rec, k, to[k])
            entry["why"] = (f"keeps {format_bytes(kept)} of post-forward shards (1/{to[k]} of its gathered "
                            f"parameters) from op {lo} to op {hi} (recorded op ids), and gathers them in backward "
                            f"over {to[k]} ranks instead of {shard_group_size(rec.trace.meta)}: "
                            f"{format_cost(saved, unit)} saved, its post-forward copies included")
        units.append(entry)
    saved = rec.step_cost - problem.step_cost
    out = {"units": units, "step_compute_saved": saved, "chosen_by": None}
    if to:  # v13: the ops of the step the plan's ids refer to (FSDP's post-forward ops added)
        out["num_ops"] = int(problem.num_ops)
    return out
