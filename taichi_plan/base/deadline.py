"""The command's wall-clock deadline, checked by the phases that run long (no torch).

``solve --time-limit`` covers the whole command: besides the search, phases that do not take
a time limit of their own (building an optimizer option's view of the step and its problem,
its floor, the screens run before any search) must stop when the time is up. They call
:func:`check` in their loops; inside :func:`until` (the solve entry point sets it), a check
past the deadline raises :class:`OutOfTime`, which the caller turns into "stopped at the time
limit" (never into "no plan exists"). Outside :func:`until` a check does nothing, so library
calls without a limit behave as before.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_DEADLINE: ContextVar[float | None] = ContextVar("taichi_plan_deadline", default=None)
checks = 0  # checks made so far in this process (tests count them)


class OutOfTime(Exception):
    """The deadline passed during ``phase`` (a few words)."""

    def __init__(self, phase: str):
        super().__init__(phase)
        self.phase = phase


@contextmanager
def until(deadline: float | None) -> Iterator[None]:
    """Checks inside this block raise once ``time.perf_counter()`` passes ``deadline`` (None:
    no deadline; an enclosing earlier one stays in force)."""
    outer = _DEADLINE.get()
    if deadline is None or (outer is not None and outer <= deadline):
        yield
        return
    token = _DEADLINE.set(deadline)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


@contextmanager
def lifted() -> Iterator[None]:
    """No deadline inside this block (a phase bounded by its own limit, whose result must not
    be lost to a check: the search once it may hold a plan)."""
    token = _DEADLINE.set(None)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def current() -> float | None:
    """The deadline in force (perf_counter), or None."""
    return _DEADLINE.get()


def past() -> bool:
    """Whether the deadline in force has passed (False without one)."""
    d = _DEADLINE.get()
    return d is not None and time.perf_counter() > d


def check(phase: str) -> None:
    """Raise :class:`OutOfTime` naming ``phase`` if the deadline in force has passed."""
    global checks
    checks += 1
    if past():
        raise OutOfTime(phase)
