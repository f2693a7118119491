"""One measured run of a workload: :class:`MeasuredRun` builds it and warms it up, installs the
plan, times its steps and measures the peak of one more step under the recorder (and one under
PyTorch's MemTracker, a cross-check); :func:`run_and_measure` is one such run from start to end,
as ``replay`` and the replay benchmark run it."""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable

from ...base.errors import MismatchError
from ...plan.format import Plan
from .workload import move_workload, seed_everything


def _with_gpu_kernels(step: Callable[[], None], meta: dict, optimizer) -> Callable[[], None]:
    """``step`` under the GPU-kernel mapping the trace was recorded with (``meta.gpu_kernels``,
    :mod:`taichi_plan.record.gpu_ops`), so that a CPU replay runs the op stream the plan was
    solved on; ``step`` itself when the trace has none."""
    from ...record import gpu_ops

    target = gpu_ops.target_of_trace(meta)
    if target is None:
        return step

    def mapped() -> None:
        with gpu_ops.gpu_kernels(target, optimizer):
            step()

    return mapped


def cuda_peaks(torch) -> dict:
    """The caching allocator's peaks since the last ``reset_peak_memory_stats``."""
    return {"cuda_max_allocated_bytes": int(torch.cuda.max_memory_allocated()),
            "cuda_max_reserved_bytes": int(torch.cuda.max_memory_reserved())}


def run_and_measure(workload, plan: Plan | None, trace, steps: int, seed: int, device: str,
                    say: Callable[[str], None] = lambda msg: None, what: str = "run",
                    rng_seed: int | None = None) -> dict:
    """Build ``workload`` from ``seed``, run an unplanned warm-up step, then ``steps`` timed
    steps under ``plan`` (None: unplanned) and one more under the recorder. Returns
    ``step_s`` (median), ``peak_bytes`` and ``peak_op`` (the recorded step's), ``ops``,
    ``recompute_s``, ``recompute_ops``, and the ``params`` and ``grads`` after the last step.
    Shared by ``replay`` and the replay benchmark (which interleaves several
    :class:`MeasuredRun` itself), so both measure the same way. On CUDA also
    ``cuda_max_allocated_bytes``/``cuda_max_reserved_bytes`` (the last timed step's peaks) and
    ``cuda_start_allocated_bytes`` (allocated when it starts: parameters, optimizer state, batch
    and anything outside the trace, such as cuBLAS workspaces). ``rng_seed``: reseed the
    generator after the warm-up step (the same model and batch, other random draws)."""
    run = MeasuredRun(workload, plan, trace, seed, device, say, what, rng_seed)
    first = {}
    try:
        for k in range(steps):
            say(f"{what}: step {k + 1}/{steps}")
            run.timed_step(read_cuda_peaks=k == steps - 1)
            if k == 0:
                first = _state(run.model, "first_")
        peak = run.measure_peak(keep_state=True)
    finally:
        run.close()
    return {**run.timings(), **peak, **run.cuda_peaks, **first}


def _state(model, prefix: str = "") -> dict:
    """Copies of ``model``'s parameters and floating-point buffers (a batch norm's running
    statistics: a rebuild must not update them again), and of its gradients (None where a
    parameter has none)."""
    return {f"{prefix}params": [p.detach().clone() for p in model.parameters()]
            + [b.detach().clone() for b in model.buffers() if b.is_floating_point()],
            f"{prefix}grads": [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]}


class MeasuredRun:
    """One workload built from ``seed`` (moved to the GPU when ``device`` is ``cuda``) and
    warmed up with one unplanned step, then with ``plan`` installed (None: unplanned).
    :meth:`timed_step` runs and times one step; :meth:`measure_peak` runs one step under the
    recorder (the measured peak) and one under MemTracker; :meth:`close` removes what was
    installed. Several runs may be alive at once and stepped in turn: a plan is installed on its
    own model's calls only."""

    def __init__(self, workload, plan: Plan | None, trace, seed: int, device: str,
                 say: Callable[[str], None] = lambda msg: None, what: str = "run", rng_seed: int | None = None):
        import torch

        from ...record.api import Loop, make_step_fn
        from ...runtime.calls import runtime_for
        from ...runtime.install import install
        from ...runtime.optimizer import install_optimizer
        from ...runtime.partition import install_partitions

        self.device, self.say, self.what = device, say, what
        seed_everything(seed)
        say(f"{what}: building {workload.name}")
        self.model, self.batch, self.loss_fn, self.optimizer = workload.build(False)
        if device == "cuda":
            self.model, self.batch, self.loss_fn, self.optimizer = move_workload(
                self.model, self.batch, self.loss_fn, self.optimizer, "cuda")
        self.loop = Loop.from_meta(trace.meta) if trace is not None else Loop()
        self._step = make_step_fn(self.model, self.batch, self.loss_fn, self.optimizer, where=workload.name,
                                  loop=self.loop)
        if device == "cpu" and trace is not None:  # a GPU's kernels mapped at record time: map them again
            self._step = _with_gpu_kernels(self._step, trace.meta, self.optimizer)
        self.optimizer.zero_grad(set_to_none=self.loop.set_to_none)
        self._step()  # warm-up, unplanned
        if device == "cuda":  # start from what outlives a step, not from the unplanned step's cache
            self.optimizer.zero_grad(set_to_none=self.loop.set_to_none)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        if rng_seed is not None:
            seed_everything(rng_seed)
        self.rt, self._handles, self._undo = None, [], (lambda: None)
        self.step_s: list[float] = []
        self.recompute_s: list[float] = []
        self.cuda_peaks: dict = {}
        if plan is not None:
            self.rt = runtime_for(plan, trace)
            self._handles = install(self.model, self.rt, self.optimizer) + install_optimizer(plan, self.optimizer)
            self._undo = install_partitions(self.model, plan.partitions, self.rt)

    def one_step(self) -> None:
        """One step of the loop (zero_grad first), planned when a plan is installed."""
        self.optimizer.zero_grad(set_to_none=self.loop.set_to_none)
        if self.rt is not None:
            self.rt.reset_counters()
        self._step()

    def timed_step(self, read_cuda_peaks: bool = False) -> float:
        """Run and time one step; its seconds are kept in ``step_s`` (and the runtime's
        recompute seconds in ``recompute_s``). On CUDA with ``read_cuda_peaks``: the caching
        allocator's peaks of this step go to ``cuda_peaks`` (the cache of earlier steps is
        there, as in training)."""
        import torch

        cuda = self.device == "cuda"
        if cuda:
            torch.cuda.synchronize()
            if read_cuda_peaks:
                torch.cuda.reset_peak_memory_stats()
                self.cuda_peaks = {"cuda_start_allocated_bytes": int(torch.cuda.memory_allocated())}
        t0 = time.perf_counter()
        self.one_step()
        if cuda:
            torch.cuda.synchronize()
            if read_cuda_peaks:
                self.cuda_peaks.update(cuda_peaks(torch))
        self.step_s.append(time.perf_counter() - t0)
        if self.rt is not None:
            self.recompute_s.append(self.rt.recompute_s)
        return self.step_s[-1]

    def timings(self) -> dict:
        """``step_s`` and ``recompute_s`` (medians of the timed steps so far), ``recompute_ops``."""
        return {"step_s": statistics.median(self.step_s) if self.step_s else None,
                "recompute_s": statistics.median(self.recompute_s) if self.recompute_s else 0.0,
                "recompute_ops": self.rt.recompute_ops if self.rt is not None else 0,
                "skipped_calls": self.rt.skipped_calls if self.rt is not None else 0,
                "skipped_sized_ops": self.rt.skipped_sized_ops if self.rt is not None else 0}

    def measure_peak(self, keep_state: bool = False) -> dict:
        """One step under the recorder, then one under MemTracker: ``peak_bytes``, ``peak_op``,
        ``ops`` (the recorded step's) and ``memtracker_peak_bytes``; with ``keep_state``, also
        the parameters and gradients after the recorded step (what replay compares)."""
        from ...record.api import late_tensors, registered_tensors, step_to_trace
        from ...record.recorder import Recorder
        from ...trace.format import baseline_peak

        model, optimizer = self.model, self.optimizer
        self.say(f"{self.what}: measuring a step")
        recorder = Recorder(None, model)
        hooks = recorder.optimizer_hooks(optimizer)
        try:
            optimizer.zero_grad(set_to_none=self.loop.set_to_none)
            recorder.begin_step(registered_tensors(model, self.batch, self.loss_fn, optimizer))
            with recorder:
                self.one_step()
            rec = recorder.end_step(late_tensors(model, optimizer))
            for h in hooks:
                h.remove()
            hooks = []
            # What replay compares: the parameters and gradients after the recorded step. The
            # MemTracker step after it is a cross-check that may stop half way (its own failure,
            # or the plan stopping in a step the plan cannot run): the two runs' states after it
            # need not be comparable.
            state = _state(model) if keep_state else {}
            self.say(f"{self.what}: measuring a step with MemTracker")
            memtracker, memtracker_note = _memtracker_peak(model, optimizer, self.one_step, self.loop)
        finally:
            for h in hooks:
                h.remove()
            recorder.close()
        measured = step_to_trace(rec, 0, "measured", {})
        peak, peak_op = baseline_peak(measured)
        return {"peak_bytes": peak, "peak_op": peak_op, "ops": measured.num_ops,
                "memtracker_peak_bytes": memtracker, "memtracker_note": memtracker_note, **state}

    def close(self) -> None:
        """Remove the plan's hooks and partitions (the model stays usable, unplanned)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._undo()
        self._undo = lambda: None


class _NoHook:
    def remove(self) -> None:
        pass


def _memtracker_peak(model, optimizer, one_step, loop) -> tuple[int | None, str | None]:
    """One more step under PyTorch's own ``MemTracker`` (an accounting independent of the
    recorder's): (its peak, None), or (None, why) where it cannot follow the step: MemTracker
    refuses a model called more than once per step, and a failure of its own (a cross-check)
    is reported, not raised. Two of its limits are worked around: it registers a gradient hook
    on every parameter, which PyTorch refuses for a frozen one ("cannot register a hook on a
    tensor that doesn't require gradient"), so frozen ones are marked as hooked already; and
    its module tracking runs leaf-safe (record.recorder.leaf_safe_module_tracking)."""
    if loop.micro_batches * loop.forwards != 1:
        return None, "MemTracker follows one model call per step"
    from torch.distributed._tools.mem_tracker import MemTracker

    from ...record.recorder.module_tracking import HIERARCHY_WARNING, leaf_safe_module_tracking

    tracker = MemTracker()
    hooked = getattr(tracker, "_param_to_grad_hook_handles", None)  # a WeakIdKeyDictionary
    if hooked is not None and hasattr(hooked, "__setitem__"):
        for p in model.parameters():
            if not p.requires_grad:
                hooked[p] = (_NoHook(), _NoHook())
    try:
        with warnings.catch_warnings(), leaf_safe_module_tracking():
            # it warns about each parameter without a gradient (None)
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
            # and its ModTracker about a module outside the model ("Please file a bug to PyTorch")
            warnings.filterwarnings("ignore", message=HIERARCHY_WARNING)
            tracker.track_external(model, optimizer)
            with tracker:
                one_step()
    except MismatchError as e:  # the plan stopped in this step (a step whose ops it cannot run)
        return None, f"not measured: the plan stopped in that step: {str(e).splitlines()[0] if str(e) else ''}"
    except Exception as e:  # noqa: BLE001  (a cross-check of PyTorch's: its failure is reported, not ours)
        root = e
        while root.__cause__ is not None:  # the step's own error, not the wrapper that blames the step
            root = root.__cause__
        first = str(root).splitlines()[0] if str(root) else ""
        return None, (f"MemTracker failed: the step raised under PyTorch's MemTracker, which wraps every module "
                      f"call, and ran without it: {type(root).__name__}: {first}")
    snap = tracker.get_tracker_snapshot("peak")
    return int(sum(v["Total"] for v in snap.values())), None
