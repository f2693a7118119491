"""taichi-plan: an offline memory planner for PyTorch training.

Record a training step once (``record``), solve a rematerialization + partition plan
under a memory budget (``solve``), judge it in a simulator (``simulate``) and look at it
(``inspect``). Planning modules never import torch; ``record`` imports it lazily.
"""

from .errors import TaichiError
from .trace import Trace, read_trace, write_trace

__version__ = "0.1.0"


def apply(model, plan, on_mismatch: str = "raise", optimizer=None, trace=None):
    """Run ``model``'s training forwards under ``plan`` (a path or Plan); see
    :func:`taichi_plan.replay.apply`. Imports torch."""
    from .replay import apply as _apply

    return _apply(model, plan, on_mismatch, optimizer, trace)


def finish(model) -> None:
    """Remove what :func:`apply` installed; see :func:`taichi_plan.replay.finish`."""
    from .replay import finish as _finish

    _finish(model)


__all__ = ["Trace", "TaichiError", "apply", "finish", "read_trace", "write_trace", "__version__"]
