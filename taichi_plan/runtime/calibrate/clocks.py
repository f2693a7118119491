"""The clocks calibration times the runtime with: :class:`SpanClock` (the seconds a step
spends in one head + loss span), :func:`own_clocked_runtime` (the runtime summing its own
seconds in its dispatch handler, its saved-tensor hooks and its module hooks) and
:func:`kernel_stopwatch` (a dispatch mode beneath it that times the kernels its handler calls,
so that they can be taken out)."""

from __future__ import annotations

import functools
import time


class SpanClock:
    """The seconds one step spends in a head + loss span (a span over tokens): from the head's
    call to the end of the loss, and from the start of the backward to the moment the head's
    input gets its gradient (the span's backward is the first of the step's, the head and its
    loss being the last of its forward). Split or not, the span's work is in these two
    stretches, and the rest of the step is not: the span probes' extras are their differences
    (:func:`~taichi_plan.runtime.calibrate.measure_on_model`). Measured as differences of whole forward and backward passes,
    two recordings of one 4-layer Llama gave its head split in 2 an extra of 10.7 and 19.7 ms
    on an idle CPU, the step's own noise; trained with that split alone the step measured
    +12.5 and +20.1 ms (docs/benchmarks.md). A span whose input carries no gradient, or
    whose head is not called, counts its forward stretch only."""

    def __init__(self, model, head: str, clock):
        self.clock, self.start, self.fwd_s, self.bw0, self.bw1 = clock, None, 0.0, None, None
        try:
            module = model.get_submodule(head)
        except AttributeError:
            module = None
        self.handles = [module.register_forward_pre_hook(self._called)] if module is not None else []

    def _called(self, _module, args):
        self.start = self.clock()
        x = next((a for a in args if hasattr(a, "requires_grad")), None)
        if x is not None and x.requires_grad:
            self.handles.append(x.register_hook(self._grad))

    def _grad(self, _grad):
        if self.bw1 is None:
            self.bw1 = self.clock()

    def forward_done(self) -> None:
        now = self.clock()
        if self.start is not None:
            self.fwd_s = now - self.start
        self.bw0 = now

    def seconds(self) -> float:
        bw = self.bw1 - self.bw0 if self.bw1 is not None and self.bw0 is not None else 0.0
        return self.fwd_s + bw

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


@functools.cache
def own_clocked_runtime():
    """:class:`~taichi_plan.runtime.mode.PlanRuntime` with the seconds it spends in its
    dispatch handler and its pack hook summed in ``own_s`` (kernels included: a
    :func:`kernel_stopwatch` beneath it times those), in its unpack hook in ``unpack_s`` (the
    rebuilds it runs included), and in its module hooks in ``hook_s`` (regions entered and
    left included; ``hook_n``: the module calls), for calibration only."""
    from ..mode import PlanRuntime

    class OwnClocked(PlanRuntime):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.own_s, self.unpack_s, self.inside = 0.0, 0.0, False
            self.hook_s, self.hook_n = 0.0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            t0 = time.perf_counter()
            self.inside = True
            try:
                return super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self.inside = False
                self.own_s += time.perf_counter() - t0

        _pack = _clocked(PlanRuntime._pack, "own_s")
        _unpack = _clocked(PlanRuntime._unpack, "unpack_s")
        _left = _clocked(PlanRuntime._left, "hook_s")

        def _entered(self, module, args):
            self.hook_n += 1
            t0 = time.perf_counter()
            try:
                return PlanRuntime._entered(self, module, args)
            finally:
                self.hook_s += time.perf_counter() - t0

    return OwnClocked


def _clocked(method, total: str):
    """``method`` with its seconds added to the attribute ``total`` of its object."""

    def clocked(self, *args):
        t0 = time.perf_counter()
        try:
            return method(self, *args)
        finally:
            setattr(self, total, getattr(self, total) + time.perf_counter() - t0)

    return clocked


def kernel_stopwatch(rt):
    """A dispatch mode to enter beneath the own-clocked runtime ``rt``: it sums in ``kernel_s``
    the seconds of the ops ``rt``'s handler calls (other ops pass through untimed). Its entry
    from C++ into Python is in the runtime's seconds, where it stands in for the runtime's own
    entry."""
    mode = _stopwatch_class()()
    mode.rt, mode.kernel_s = rt, 0.0
    return mode


@functools.cache
def _stopwatch_class():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Stopwatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not self.rt.inside:
                return func(*args, **(kwargs or {}))
            t0 = time.perf_counter()
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.kernel_s += time.perf_counter() - t0

    return Stopwatch
