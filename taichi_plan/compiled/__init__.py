"""Plans for ``torch.compile``'d training (docs/planner.md, "Compiled training").

A compiled step is planned from the graphs compile itself runs: AOTAutograd's joint forward and
backward graph of each compiled region, after decompositions (and, under inductor, after its
joint-graph passes), split by PyTorch's own min-cut partitioner. The one thing taichi-plan
changes in that pipeline is the partitioner's choice of saved values
(``choose_saved_values_set``): :mod:`.graphs` records with every value the backward reads saved,
and applies a plan by leaving its dropped tensors out of that set, so the partitioner's own
extraction recomputes them in the backward graph. Imports torch lazily.
"""

from __future__ import annotations

__all__ = ["record_compiled", "apply_compiled", "is_compiled", "compiled_peak"]


def record_compiled(*args, **kwargs):
    """Record a compiled model's step: :func:`taichi_plan.compiled.record.record_compiled`."""
    from .record import record_compiled as _record_compiled

    return _record_compiled(*args, **kwargs)


def apply_compiled(*args, **kwargs):
    """Apply a plan of a compiled step: :func:`taichi_plan.compiled.apply.apply_compiled`."""
    from .apply import apply_compiled as _apply_compiled

    return _apply_compiled(*args, **kwargs)


def is_compiled(model) -> bool:
    """Is ``model`` a ``torch.compile``'d module (``torch.compile(m)`` or ``m.compile()``)?"""
    from .graphs import compiled_kind

    return compiled_kind(model) is not None


def compiled_peak(*args, **kwargs):
    """A step's peak as the profiler's memory events see it: :func:`taichi_plan.compiled.measure.compiled_peak`."""
    from .measure import compiled_peak as _compiled_peak

    return _compiled_peak(*args, **kwargs)
