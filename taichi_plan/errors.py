"""The public home of the errors (``taichi_plan.errors.TaichiError``, as the README says): they
live in :mod:`taichi_plan.base.errors`; nothing inside the package imports this module."""

from .base.errors import (
    BudgetError,
    InfeasibleBudgetError,
    MismatchError,
    NotEnoughMemoryError,
    OutputError,
    OutputExistsError,
    PlanError,
    TaichiError,
    TraceError,
    UsageError,
    WorkloadError,
)

__all__ = ["BudgetError", "InfeasibleBudgetError", "MismatchError", "NotEnoughMemoryError", "OutputError",
           "OutputExistsError", "PlanError", "TaichiError", "TraceError", "UsageError", "WorkloadError"]
