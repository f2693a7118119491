"""The plan: a data type and its file format (``*.plan.json``), depending on nothing above the
trace. ``from taichi_plan.plan import save_plan, load_plan`` is public (the README shows it)."""

from .format import (
    FORMAT_VERSION,
    READABLE_VERSIONS,
    STATUSES,
    Offloaded,
    Partition,
    Plan,
    Recompute,
    load_plan,
    peak_from_schedule,
    save_plan,
)

__all__ = ["FORMAT_VERSION", "READABLE_VERSIONS", "STATUSES", "Offloaded", "Partition", "Plan", "Recompute",
           "load_plan", "peak_from_schedule", "save_plan"]
