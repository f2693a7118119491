"""taichi-plan: an offline memory planner for PyTorch training.

Record a training step once (``record``), solve a rematerialization + partition plan
under a memory budget (``solve``), judge it in a simulator (``simulate``) and look at it
(``inspect``). Planning modules never import torch; ``record`` imports it lazily.
"""

from .base.errors import TaichiError
from .base.version import __version__
from .trace.format import Trace, read_trace, write_trace


def apply(model, plan, on_mismatch: str = "raise", optimizer=None, trace=None):
    """Run ``model``'s training forwards under ``plan`` (a path or Plan); see
    :func:`taichi_plan.replay.apply`. Imports torch."""
    from .replay import apply as _apply

    return _apply(model, plan, on_mismatch, optimizer, trace)


def finish(model) -> None:
    """Remove what :func:`apply` installed; see :func:`taichi_plan.replay.finish`."""
    from .replay import finish as _finish

    _finish(model)


def reshard_settings(plan) -> dict:
    """Each FSDP unit's ``reshard_after_forward`` as ``plan`` runs the job (FQN -> True, False
    or an int), to pass to its ``fully_shard``; see :func:`taichi_plan.plan.format.reshard_settings`."""
    from .plan.format import reshard_settings as _settings

    return _settings(plan)


def chunked_cross_entropy(hidden, head, labels, chunks: int = 8, **kwargs):
    """``F.cross_entropy(head(hidden).reshape(-1, V), labels.reshape(-1))`` computed ``chunks``
    rows of tokens at a time, so the full logits and their gradient never exist; for code that
    computes its own loss. See :func:`taichi_plan.runtime.chunked_loss.chunked_cross_entropy`.
    Imports torch."""
    from .runtime.chunked_loss import chunked_cross_entropy as _chunked

    return _chunked(hidden, head, labels, chunks, **kwargs)


__all__ = ["Trace", "TaichiError", "apply", "chunked_cross_entropy", "finish", "read_trace", "reshard_settings",
           "write_trace", "__version__"]
