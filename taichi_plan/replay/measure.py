"""``taichi-plan replay``: run the plan's workload unplanned and planned, and measure both.

Both runs build the workload from the same seed, run one unplanned warm-up step (so the
optimizer state exists, as in the recorded trace), then ``steps`` timed steps, then one more
step under the recorder, whose live-storage accounting is the trace's own (the same numbers
MemTracker gives): that step's peak is the measured peak. Gradients and parameters after
the last step are compared: bitwise for rematerialization alone (rebuilt ops replay their RNG
state) and for modules checkpointed whole (one chunk: the same ops re-run on the same values,
the RNG state restored); when modules are split into chunks (also where a partitioned
module's dropout draws, chunk by chunk, the whole batch's masks: ``random_draws``
"as-unpartitioned"), the first planned step's gradients ``allclose`` and the parameters after
it within a relative L2 distance, the elements whose gradient is rounding noise left out
(:func:`compare_training`: Adam and Adagrad turn that noise into steps of their learning
rate; the distance after the last step is reported beside it), and
*statistically* when a partitioned module's chunks draw their own masks ("per-chunk",
``solve --partition-random``): a third, unplanned run reseeds the generator after its warm-up
step, and the planned run may differ from the unplanned one (relative L2 distance of all
gradients, and of all parameters) by at most :data:`STAT_FACTOR` times what that reseeded run
differs by: no more than other dropout masks alone make it differ.

Before building anything, the larger of the two predicted peaks (the unplanned run needs the
trace's own peak) is compared with the memory this machine has for it (free CUDA memory, or
available RAM on CPU); a replay that cannot fit is refused with both numbers unless
``force``. A fake-recorded trace costs no memory to record but replays on real tensors.

On CUDA (:func:`replay_device`: a GPU is here and the trace was recorded on one), the workload
is moved to the GPU (:func:`move_workload`), the cache the warm-up step left is emptied
(``torch.cuda.empty_cache`` after ``zero_grad``: the step starts from the tensors that outlive
it, as the allocator model assumes), every timed step is bracketed by
``torch.cuda.synchronize``, and the last timed step runs between
``torch.cuda.reset_peak_memory_stats`` and ``torch.cuda.max_memory_allocated`` /
``max_memory_reserved``: the caching allocator's own peaks, reported beside the plan's
predicted allocated and reserved peaks (docs/allocator.md).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from ..base.errors import MismatchError, NotEnoughMemoryError, PlanError
from ..base.units import format_bytes
from ..plan.format import Plan
from ..problem.optimizer.plan import plan_mode

STAT_FACTOR = 2.0  # per-chunk dropout: planned-vs-unplanned distance <= this x reseeded-vs-unplanned


def workload_of(trace):
    from ..record import get_workload

    if trace.meta.get("compiled") is not None:
        raise PlanError(
            "This plan is of a torch.compile'd step, and replay does not compile the workload it rebuilds yet: "
            "run the plan in your loop, taichi_plan.apply(torch.compile(model), plan), and measure its peak "
            "with taichi_plan.compiled.compiled_peak (README, \"Compiled training\").")
    wl = trace.meta.get("workload") or {}
    kind, name, args = wl.get("kind"), wl.get("name"), dict(wl.get("args") or {})
    if trace.meta.get("mode") == "imported" or kind not in ("builtin", "entry"):
        raise PlanError(
            f"Replay rebuilds the workload the trace was recorded from, but this trace is "
            f"{trace.meta.get('mode') or kind or 'unknown'}: only traces recorded from a built-in model or "
            "an --entry can be replayed (imported graphs and record() of live objects cannot)."
        )
    return get_workload(model=name, **args) if kind == "builtin" else get_workload(entry=name, **args)


def available_memory_bytes(device: str) -> tuple[int, str]:
    """Memory a replay on ``device`` may use here, and where that number comes from: free
    CUDA memory (``torch.cuda.mem_get_info``), or on CPU the kernel's MemAvailable
    (``/proc/meminfo``), else free physical pages (``os.sysconf``)."""
    if device == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info()
        return int(free), "free CUDA memory"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available RAM"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free RAM"
    except (ValueError, OSError, AttributeError) as e:
        raise NotEnoughMemoryError(
            "Cannot tell how much memory this machine has (no /proc/meminfo, no sysconf), so replay "
            "cannot check that the plan's workload fits. Run again with --force to try anyway."
        ) from e


def check_memory(plan: Plan, trace, device: str, force: bool = False) -> dict:
    """Refuse (:class:`NotEnoughMemoryError`) a replay whose runs do not fit the memory this
    machine has, unless ``force``; returns what was compared. The runs are one after the
    other: the unplanned one needs the trace's own peak, the planned one its predicted peak
    plus the copies of the unplanned run's parameters and gradients kept to compare them."""
    pred = plan.predicted
    base, planned = int(pred["baseline_peak_bytes"]), int(pred["planned_peak_bytes"])
    kinds = trace.tensors["kind"]
    kept = int(trace.tensors["nbytes"][kinds.isin(["parameter", "gradient"])].sum())
    needed = max(base, planned + kept)
    available, what = available_memory_bytes(device)
    out = {"needed_bytes": needed, "available_bytes": available, "available_source": what,
           "fits": needed <= available, "forced": bool(force) and needed > available}
    if needed <= available or force:
        return out
    fake_text = (" The trace was recorded fake (no memory was used to record it), but replay runs the "
                 "workload on real tensors, so it needs that memory for real."
                 if trace.meta.get("mode") == "fake" else "")
    raise NotEnoughMemoryError(
        f"Replay needs about {format_bytes(needed)} (the unplanned run peaks at {format_bytes(base)}; the "
        f"planned run at {format_bytes(planned)}, plus {format_bytes(kept)} of the unplanned run's parameters "
        f"and gradients kept to compare), but this machine has {format_bytes(available)} of {what} on "
        f"{device}.{fake_text} Replay on a machine with more memory, record and solve a smaller workload "
        "(smaller --batch, --seq or --layers), or run again with --force to try anyway.",
        needed_bytes=needed, available_bytes=available)


def replay_device(trace, cuda_available: bool | None = None) -> str:
    """``cuda`` when a GPU is here and the trace was recorded on one (``meta.device``; traces
    from before it was recorded: a CUDA build of torch), else ``cpu``."""
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    recorded = trace.meta.get("device") or ("cuda" if trace.meta.get("torch_build") == "cuda" else "cpu")
    return "cuda" if cuda_available and recorded == "cuda" else "cpu"


def move_workload(model, batch, loss_fn, optimizer, device: str):
    """The workload's parts on ``device``: every parameter and buffer of the model (replaced by
    a copy on ``device``, tied ones staying tied), the optimizer's parameter groups pointed at
    the moved parameters, every tensor of the batch, and the tensors a loss function lists in
    ``inputs`` (the built-in workloads' targets). The optimizer must not have state yet. Parts
    already on ``device`` are left as they are. (Not ``Module.to``: it swaps tensors it cannot
    change in place, which fails for fake tensors the optimizer still refers to.)"""
    import torch
    from torch.utils._pytree import tree_map

    from ..base.errors import WorkloadError

    if any(optimizer.state.values()):
        raise WorkloadError("move_workload: the optimizer already has state; move the workload before its first step.")
    target = torch.device(device)

    def there(t) -> bool:
        return t.device.type == target.type and (target.index is None or t.device.index == target.index)

    def move(t):
        return t if there(t) else t.to(target)

    moved: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or there(p):
                continue
            if id(p) not in moved:
                moved[id(p)] = torch.nn.Parameter(p.detach().to(target), requires_grad=p.requires_grad)
            module._parameters[name] = moved[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = move(b)
    for group in optimizer.param_groups:
        group["params"] = [moved.get(id(p), p) for p in group["params"]]
    batch = tree_map(lambda x: move(x) if isinstance(x, torch.Tensor) else x, batch)
    inputs = getattr(loss_fn, "inputs", None)
    if isinstance(inputs, tuple):
        loss_fn.inputs = tuple(move(x) if isinstance(x, torch.Tensor) else x for x in inputs)
    stray = [p for g in optimizer.param_groups for p in g["params"] if not there(p)]
    if stray:
        raise WorkloadError(f"move_workload: {len(stray)} of the optimizer's parameters stayed on {stray[0].device} "
                            f"when the model moved to {device}; its parameters must be the model's.")
    return model, batch, loss_fn, optimizer


def _with_gpu_kernels(step: Callable[[], None], meta: dict, optimizer) -> Callable[[], None]:
    """``step`` under the GPU-kernel mapping the trace was recorded with (``meta.gpu_kernels``,
    :mod:`taichi_plan.record.gpu_ops`), so that a CPU replay runs the op stream the plan was
    solved on; ``step`` itself when the trace has none."""
    from ..record import gpu_ops

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


def seed_everything(seed: int) -> None:
    """Seed torch, Python's ``random`` and NumPy's global generator: a step that draws from
    NumPy (wav2vec2's SpecAugment masks) or ``random`` then draws the same in the planned and
    the unplanned run, which replay compares."""
    import random

    import numpy as np
    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


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

        from ..record.api import Loop, make_step_fn
        from ..runtime.calls import runtime_for
        from ..runtime.install import install
        from ..runtime.optimizer import install_optimizer
        from ..runtime.partition import install_partitions

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
        from ..record.api import late_tensors, registered_tensors, step_to_trace
        from ..record.recorder import Recorder
        from ..trace.format import baseline_peak

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


def cuda_report(predicted: dict, base: dict, planned: dict) -> dict:
    """The caching allocator's measured peaks beside the plan's predictions: allocated (the
    simulator's tensor bytes, and the allocator model's blocks) and reserved (the allocator
    model), for the planned and the unplanned run, with measured / predicted ratios. Plans
    older than format v3 predict no reserved peak (None)."""
    al = predicted.get("allocator") or {}

    def ratio(measured, pred):
        return measured / pred if measured is not None and pred else None

    out = {}
    for run, got, alloc_key, blocks_key, reserved_key in (
            ("planned", planned, "planned_peak_bytes", "planned_allocated_peak_bytes", "planned_reserved_peak_bytes"),
            ("unplanned", base, "baseline_peak_bytes", "baseline_allocated_peak_bytes", "baseline_reserved_peak_bytes")):
        m_alloc, m_res = got.get("cuda_max_allocated_bytes"), got.get("cuda_max_reserved_bytes")
        p_alloc, p_res = predicted.get(alloc_key), predicted.get(reserved_key)
        out[run] = {
            "measured_allocated_bytes": m_alloc, "measured_reserved_bytes": m_res,
            "start_allocated_bytes": got.get("cuda_start_allocated_bytes"),
            "predicted_allocated_bytes": p_alloc, "predicted_allocator_allocated_bytes": al.get(blocks_key),
            "predicted_reserved_bytes": p_res,
            "allocated_ratio": ratio(m_alloc, p_alloc), "reserved_ratio": ratio(m_res, p_res),
        }
    return out


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

    from ..record.module_tracking import HIERARCHY_WARNING, leaf_safe_module_tracking

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


@contextlib.contextmanager
def _out_of_memory_said(memory: dict, device: str):
    """An allocation that fails while the workload runs (``--force`` past the memory check, or
    memory taken by others meanwhile) is :class:`NotEnoughMemoryError`, not a traceback."""
    import torch

    try:
        yield
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
        text = str(e)
        if not isinstance(e, (torch.OutOfMemoryError, MemoryError)) and not (
                "can't allocate memory" in text or "out of memory" in text):
            raise
        need = memory.get("needed_bytes")
        what = text.splitlines()[0][:160] if text else type(e).__name__
        raise NotEnoughMemoryError(
            f"Replay ran out of memory on {device} while running the workload ({what}). "
            + (f"It needs about {format_bytes(need)}; " if need else "")
            + "replay plans of steps this machine can hold, or run the plan where its predicted peak fits.",
            needed_bytes=need, available_bytes=memory.get("available_bytes")) from None


def replay(plan: Plan | str | Path, steps: int = 3, check_grads: bool = True, seed: int = 0, *,
           force: bool = False, progress: Callable[[str], None] | None = None, trace=None) -> dict:
    """Measure ``plan`` on its workload; returns the report (what ``taichi-plan replay`` prints).
    ``trace``: the plan's trace (a directory or Trace) when it is not where the plan says.

    Raises :class:`~taichi_plan.base.errors.NotEnoughMemoryError` before building anything when the
    larger predicted peak exceeds this machine's memory, unless ``force``. ``progress(message)``
    is called as the runs go."""

    from ..runtime.calls import plan_and_trace

    if steps < 1:
        raise PlanError(f"--steps must be at least 1, got {steps}.")
    say = progress or (lambda msg: None)
    plan, trace = plan_and_trace(plan, trace)
    if plan.trace.get("layout") is not None:
        kind = "DDP" if plan.trace["layout"].get("ddp") is not None else "FSDP"
        raise PlanError(f"This plan is for rank 0 of a {plan.trace['layout']['world_size']}-rank {kind} job: replay it "
                        f"on its ranks, with --nproc {plan.trace['layout']['world_size']} (replay_sharded in Python).")
    device = replay_device(trace)
    workload = workload_of(trace)
    memory = check_memory(plan, trace, device, force)
    with _out_of_memory_said(memory, device):
        base = run_and_measure(workload, None, trace, steps, seed, device, say, "unplanned run")
        planned = run_and_measure(workload, plan, trace, steps, seed, device, say, "planned run")
    pred = plan.predicted
    # Off CUDA an offload plan's copies go host to host: the "device" and the host are one
    # memory, which the measured peak counts together; the device peak is the simulator's.
    host_on_device = int(pred.get("host_peak_bytes") or 0) if getattr(plan, "offloads", None) and device != "cuda" else 0
    report = {
        "plan": plan.trace.get("name"),
        "workload": (trace.meta.get("workload") or {}).get("name"),
        "device": device,
        "budget_bytes": plan.budget_bytes,
        "predicted_peak_bytes": pred["planned_peak_bytes"],
        "measured_peak_bytes": planned["peak_bytes"],
        "measured_peak_op": planned["peak_op"],
        "peak_ratio": planned["peak_bytes"] / pred["planned_peak_bytes"] if pred["planned_peak_bytes"] else None,
        "within_budget": plan.budget_bytes is None or planned["peak_bytes"] <= plan.budget_bytes + host_on_device,
        "baseline_predicted_peak_bytes": pred["baseline_peak_bytes"],
        "baseline_measured_peak_bytes": base["peak_bytes"],
        "memtracker_peak_bytes": planned["memtracker_peak_bytes"],
        "memtracker_note": planned.get("memtracker_note") or base.get("memtracker_note"),
        "baseline_memtracker_peak_bytes": base["memtracker_peak_bytes"],
        "step_s_unplanned": base["step_s"],
        "step_s_planned": planned["step_s"],
        "step_time_ratio": planned["step_s"] / base["step_s"] if base["step_s"] else None,
        "predicted_extra_s": pred["extra_compute"] if pred.get("cost_unit") == "s" else None,
        "predicted_runtime_overhead_s": pred.get("runtime_overhead"),
        "predicted_extra_time_s": pred.get("extra_time"),
        "measured_extra_time_s": (planned["step_s"] - base["step_s"]) if base["step_s"] and planned["step_s"]
        else None,
        "measured_recompute_s": planned["recompute_s"],
        "recompute_ops": planned["recompute_ops"],
        "skipped_calls": planned.get("skipped_calls", 0),
        "skipped_sized_ops": planned.get("skipped_sized_ops", 0),
        "partitions": len(plan.partitions),
        "optimizer": plan_mode(plan),
        "steps": steps,
        "trace_mode": trace.meta.get("mode"),
        "memory": memory,
        "cuda": cuda_report(pred, base, planned) if device == "cuda" else None,
        "offload": None if not getattr(plan, "offloads", None) else {
            "tensors": len(plan.offloads), "host_peak_bytes": pred.get("host_peak_bytes"),
            "stall_s": pred.get("stall_s"),
            "note": None if device == "cuda" else (
                "on this CPU the copies are host-to-host: the measured peak counts the planned step and the host "
                "copies together (judged against the budget plus the host peak); the device peak of an offload "
                "plan is the simulator's, computed, not measured")},
        "mechanism": "per model call: saved-tensor hooks and per-tensor rebuild from recorded op recipes; "
                     "partitions: chunked non-reentrant checkpoint",
    }
    draws = {p.module: p.random_draws for p in plan.partitions if p.random_draws}
    if draws:
        report["random_draws"] = random_draws_sentence(draws, frozenset(p.module for p in plan.partitions
                                                                         if p.chunks == 1))
    if check_grads and "per-chunk" in draws.values():
        say("reseeded unplanned run: the spread other dropout masks make")
        other = run_and_measure(workload, None, trace, steps, seed, device, say, "reseeded unplanned run",
                                rng_seed=seed + 1)
        report.update(statistical_check(base, planned, other))
    elif check_grads:
        # One chunk (checkpointed whole) re-runs the same ops on the same values: bitwise.
        exact = all(p.chunks == 1 for p in plan.partitions)
        # Stepped in backward, the planned run frees each gradient once its parameter is
        # updated: only the parameters can be compared (they carry every gradient's effect).
        in_backward = plan_mode(plan) == "in-backward"
        out = compare_training(base, planned, exact, in_backward, autocast_rounding(plan, trace))
        out.pop("matched")
        if not out["grads_match"]:
            say("second unplanned run: does the model itself train the same twice?")
            again = run_and_measure(workload, None, trace, steps, seed, device, say, "second unplanned run")
            if not compare_training(base, again, True)["grads_match"]:
                # Nondeterministic by itself (it reseeds from the clock, as transformers'
                # Reformer does; nondeterministic kernels): the plan is judged against that.
                out = statistical_check(base, planned, again, ("params",) if in_backward else ("grads", "params"),
                                        "a second unplanned run from the same seed (the model is not deterministic "
                                        "by itself: the two unplanned runs differ too)")
                out["nondeterministic_model"] = True
        report.update(out)
    return report


# Chunks sum in another order: gradients differ by rounding, compared element by element on
# the first planned step (both runs start it from the same parameters: the warm-up is
# unplanned). Parameters are compared as a whole: AdamW's update g / (sqrt(v) + eps) turns a
# rounding-sized difference in a near-zero gradient into an update difference of up to its
# learning rate, so a few elements leave any element-wise tolerance while the rest agree to
# rounding (an OPT decoder's head over tokens: 66 elements outside allclose after 5 steps, the
# parameters' relative L2 distance 1.0e-6).
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}
PARAMS_REL_TOL = 1e-5


# Unit roundoff of the autocast dtypes (half an ulp at 1: 2^-8 for bfloat16's 8 significant
# bits, 2^-11 for float16's 11).
UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}


def autocast_rounding(plan: Plan, trace) -> tuple[str, int] | None:
    """(low-precision dtype, most chunks) when ``plan`` splits a module of a step recorded
    under autocast, or any span of a model whose parameters are bfloat16 or float16, else None.
    Under autocast the chunks' gradients w.r.t. a weight's cached cast are summed in the cast's
    dtype (one cast node for every chunk, docs/planner.md), so each differs from the unsplit
    gradient by up to about one rounding of that dtype per chunk, relative to the tensor's
    largest element (measured: up to 2.1 bfloat16 units at 4 chunks on a tiny GPT-2); a model
    in that dtype sums every chunk's gradient in it (a bf16 GPT-NeoX's head over 2 token
    chunks: 1.2e-4 apart, where float32's tolerance is 1e-6), and so does a sharded model whose
    FSDP2 MixedPrecisionPolicy gathers its parameters in that dtype (trace v16)."""
    if trace is None:
        return None
    from ..torch_common.fsdp import recorded_mixed_precision

    dtype = (trace.meta.get("loop") or {}).get("autocast")
    most = max((p.chunks for p in plan.partitions if p.over != "tokens"), default=1)
    sharded = {"bfloat16": "bf16", "float16": "fp16"}.get((recorded_mixed_precision(trace.meta) or {}).get("param_dtype"))
    model_dtype = trace.meta.get("dtype") if trace.meta.get("dtype") in UNIT_ROUNDOFF else sharded
    if dtype not in UNIT_ROUNDOFF and model_dtype is not None:
        dtype = model_dtype
        most = max((p.chunks for p in plan.partitions), default=1)
    return (dtype, most) if dtype in UNIT_ROUNDOFF and most > 1 else None


def compare_training(base: dict, planned: dict, exact: bool, in_backward: bool = False,
                     rounding: tuple[str, int] | None = None) -> dict:
    """``grads_match``, ``grads_check`` (what was compared, in words) and ``grads_max_abs_diff``
    of two :func:`run_and_measure` results (or any two dicts of ``grads``, ``first_grads`` and
    ``params`` lists): every gradient and parameter after the last step bitwise (``exact``),
    else the first planned step's gradients within :data:`GRAD_TOL` and the parameters after
    the last step within :data:`PARAMS_REL_TOL` relative L2 distance. ``in_backward``: the
    planned run kept no gradients (the optimizer stepped in backward). ``matched`` holds the
    verdict for the gradients and the parameters apart. ``rounding`` (:func:`autocast_rounding`):
    each first-step gradient within ``chunks`` roundings of the autocast dtype of its largest
    element instead, and the parameters within that over their whole instead of
    :data:`PARAMS_REL_TOL`."""
    import torch

    worst = 0.0
    ok = {"grads": True, "params": True}

    def each(key: str, part: str):
        nonlocal worst
        for a, b in zip(base[key], planned[key], strict=True):
            if a is None or b is None:
                ok[part] &= a is None and b is None
                continue
            worst = max(worst, float(_diff(a, b).abs().max()) if a.numel() else 0.0)
            yield a, b

    if exact:
        for key in ("params",) if in_backward else ("grads", "params"):
            for a, b in each(key, key):
                ok[key] &= bool(torch.equal(a, b))
        check = "bitwise (torch.equal)"
    else:
        parts = []
        rel = None if rounding is None else rounding[1] * UNIT_ROUNDOFF[rounding[0]]
        if not in_backward and rel is None:
            for a, b in each("first_grads", "grads"):
                ok["grads"] &= bool(torch.allclose(a, b, **GRAD_TOL))
            parts.append(f"allclose(rtol={_sci(GRAD_TOL['rtol'])}, atol={_sci(GRAD_TOL['atol'])}) on the first "
                         "planned step's gradients")
        elif not in_backward:
            for a, b in each("first_grads", "grads"):
                if a.numel():
                    ok["grads"] &= float((a - b).abs().max()) <= rel * float(a.abs().max()) + GRAD_TOL["atol"]
            parts.append(f"the first planned step's gradients within {rounding[1]} {rounding[0]} roundings of each "
                         f"tensor's largest element (the chunks' gradients are summed in {rounding[0]})")
        list(each("params", "params"))
        params_tol = PARAMS_REL_TOL if rel is None else max(PARAMS_REL_TOL, rel)
        noise = None if in_backward else _rounding_level(base, planned, rel)
        # Judged after the first planned step (both runs start it from the same parameters):
        # later steps compound each difference through the model, whatever made it.
        first = "first_params" if base.get("first_params") and planned.get("first_params") else "params"
        dist = _rel_distance(base[first], planned[first], noise)
        ok["params"] &= dist <= params_tol
        shown = _sci(params_tol) if rel is None else f"{params_tol:.3g}"
        left_out = sum(int(m.sum()) for m in noise or () if m is not None)
        last = _rel_distance(base["params"], planned["params"])
        parts.append(f"parameters after the {'first planned' if first == 'first_params' else 'last'} step within "
                     f"{shown} relative L2 distance ({dist:.2g}"
                     + (f"; {left_out} elements whose gradient is rounding noise left out: an optimizer that "
                        "normalizes its step, such as Adam or Adagrad, turns that noise into steps of its learning "
                        "rate" if left_out else "") + f"; after the last step {last:.2g})")
        check = ", ".join(parts)
    if in_backward:
        check += ", parameters only (gradients are freed in backward)"
    return {"grads_match": ok["grads"] and ok["params"], "grads_check": check, "grads_max_abs_diff": worst,
            "matched": ok}


def _sci(v: float) -> str:
    """1e-4, not 0.0001."""
    return f"{v:.0e}".replace("e-0", "e-")


def random_draws_sentence(draws: dict[str, str], whole: frozenset[str] = frozenset()) -> str:
    """What the partitioned modules that draw random numbers do to training, for people
    (``whole``: the modules checkpointed whole, one chunk)."""
    own = sorted(m for m, d in draws.items() if d == "per-chunk")
    same = sorted(m for m, d in draws.items() if d == "as-unpartitioned" and m not in whole)
    kept = sorted(m for m, d in draws.items() if d == "as-unpartitioned" and m in whole)
    parts = []
    if own:
        parts.append(f"partitioned chunks of {', '.join(own)} draw their own dropout masks: training changes "
                     "statistically, not bitwise")
    if same:
        parts.append(f"the chunks of {', '.join(same)} draw the whole batch's dropout masks (one dropout, CPU)")
    if kept:
        parts.append(f"{', '.join(kept)}, checkpointed whole, re-run(s) with the RNG state of its forward: the "
                     "same dropout masks")
    return "; ".join(parts)


# A first-step gradient element whose two runs disagree by more than this share of its value
# is rounding noise (the gradient check has bounded the disagreement absolutely).
NOISE_SHARE = 1e-2


def _rounding_level(base: dict, planned: dict, rel: float | None) -> list | None:
    """Per parameter, the elements whose first planned step's gradient is rounding noise: the
    two runs disagree on it by more than :data:`NOISE_SHARE` of its value (the gradient check
    already bounds their disagreement by its tolerance, so these are the elements near zero),
    or None without first-step gradients. A gradient that is mathematically zero (a key
    projection's bias under softmax) comes out as rounding noise that the runs round
    differently; Adam's and Adagrad's normalized steps turn it into parameter differences of
    up to their learning rate per step (an OPT decoder with Adagrad: 8e-4 relative distance
    after 2 steps, from gradients 1.5e-8 apart)."""
    a_all, b_all = base.get("first_grads"), planned.get("first_grads")
    if not a_all or not b_all:
        return None
    out = []
    for a, b in zip(a_all, b_all, strict=True):
        if a is None or b is None or not a.numel():
            out.append(None)
            continue
        out.append((a.double() - b.double()).abs() > NOISE_SHARE * a.double().abs())
    return out


def _diff(a, b):
    """``a - b`` in float64, 0 where the two are equal: a buffer holding -inf (a causal mask)
    in both runs differs by nothing, not by nan."""
    import torch

    x, y = a.double(), b.double()
    return torch.where(x == y, torch.zeros_like(x), x - y)


def _rel_distance(a: list, b: list, skip: list | None = None) -> float:
    """||a - b|| / ||a|| over every tensor of the two lists (None entries skipped; ``skip``:
    per tensor, a mask of elements left out of the difference; elements equal in both, -inf
    included, differ by 0, and the norm of ``a`` is over its finite elements)."""
    import torch

    num = den = 0.0
    for k, (x, y) in enumerate(zip(a, b, strict=True)):
        if x is None or y is None:
            continue
        diff = _diff(x, y)
        mask = skip[k] if skip is not None and k < len(skip) else None
        if mask is not None and mask.shape == diff.shape:
            diff = torch.where(mask, torch.zeros_like(diff), diff)
        num += float(torch.sum(diff ** 2))
        xd = x.double()
        den += float(torch.sum(torch.where(torch.isfinite(xd), xd, torch.zeros_like(xd)) ** 2))
    return (num / den) ** 0.5 if den > 0 else 0.0


def statistical_check(base: dict, planned: dict, other: dict, keys=("grads", "params"),
                      other_what: str = "an unplanned run with other dropout masks") -> dict:
    """Planned vs unplanned against ``other`` (a reseeded unplanned run, see the module
    docstring, or a second one where the model is not deterministic by itself) vs unplanned."""
    out = {"grads_match": True, "grads_distance": {}, "grads_max_abs_diff": 0.0}
    for key in keys:
        d_plan, d_seed = _rel_distance(base[key], planned[key]), _rel_distance(base[key], other[key])
        out["grads_distance"][key] = {"planned": d_plan, "reseeded": d_seed}
        out["grads_match"] &= d_plan <= STAT_FACTOR * d_seed
        for a, b in zip(base[key], planned[key], strict=True):
            if a is not None and b is not None and a.numel():
                out["grads_max_abs_diff"] = max(out["grads_max_abs_diff"], float(_diff(a, b).abs().max()))
    g = out["grads_distance"]
    names = {"grads": "gradients", "params": "parameters"}
    planned_d = ", ".join(f"{names[k]} {g[k]['planned']:.3g}" for k in keys)
    other_d = ", ".join(f"{g[k]['reseeded']:.3g}" for k in keys)
    out["grads_check"] = (f"statistical: planned vs unplanned relative L2 distance ({planned_d}) at most "
                          f"{STAT_FACTOR:g}x that of {other_what} ({other_d})")
    return out
