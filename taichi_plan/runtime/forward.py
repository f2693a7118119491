"""A module's ``forward`` replaced by a planned one (partitioned chunks, lazy token-head logits),
and put back; a copy of the model gets the original."""

from __future__ import annotations


class PlannedForward:
    """A planned module's ``forward`` (an instance attribute that calls ``run``). A copy of the
    model (``copy.deepcopy``: an EMA model, a second run) gets the copied module's own forward
    instead: the copy is not planned, and never runs the original module's weights."""

    __slots__ = ("original", "run")

    def __init__(self, run, original):
        self.run, self.original = run, original

    def __call__(self, *args, **kwargs):
        return self.run(*args, **kwargs)

    def __deepcopy__(self, memo):
        import copy

        return copy.deepcopy(self.original, memo)  # a bound method: bound to the module's copy


def wrap_forward(module, make) -> callable:
    """Set ``module.forward`` to :class:`PlannedForward` of ``make(original forward)``; returns
    a function that restores what was there (the class's forward, or an instance's own)."""
    own = "forward" in module.__dict__
    original = module.forward
    module.forward = PlannedForward(make(original), original)

    def restore():
        if own:
            module.forward = original
        else:
            del module.forward

    return restore
