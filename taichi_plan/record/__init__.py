"""Record a training step with torch: ops, storages and accesses into a trace.

Imports torch lazily (through its submodules): ``import taichi_plan.record`` is cheap until
``record_workload`` or a workload builder is called.
"""

from __future__ import annotations

from ..torch_common.loop import Loop
from .workloads import MODELS, Workload, builtin_workload, entry_workload, get_workload, load_entry

__all__ = [
    "MODELS",
    "Loop",
    "Workload",
    "builtin_workload",
    "entry_workload",
    "get_workload",
    "load_entry",
    "record",
    "record_step",
    "record_workload",
]


def record_workload(*args, **kwargs):
    """See :func:`taichi_plan.record.api.record_workload`."""
    from .api import record_workload as _record_workload

    return _record_workload(*args, **kwargs)


def record(*args, **kwargs):
    """See :func:`taichi_plan.record.api.record`."""
    from .api import record as _record

    return _record(*args, **kwargs)


def record_step(*args, **kwargs):
    """See :func:`taichi_plan.record.api.record_step`."""
    from .api import record_step as _record_step

    return _record_step(*args, **kwargs)
