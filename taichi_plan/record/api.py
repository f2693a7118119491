"""Record a workload's training step into a :class:`~taichi_plan.trace.format.Trace`.

``record_workload`` builds the workload (inside a ``FakeTensorMode`` for ``fake=True``), runs
``warmup`` unrecorded steps so gradients' and optimizer state's shapes settle and the state
exists, then records ``steps`` steps, checks their op sequences match and keeps the last one.
``record`` does the same for objects already built, ``record_step`` for a step function the
caller writes; all three run :func:`run_and_record`, and the Hugging Face Trainer integration
drives the same :class:`StepRecording` from the Trainer's callbacks.
See :mod:`taichi_plan.record.recorder` for what a step is and how each column is decided.
"""

from __future__ import annotations

import contextlib
import os
import sysconfig
from collections.abc import Callable
from pathlib import Path

from ..base.errors import TaichiError, UsageError, WorkloadError
from ..torch_common.loop import AUTOCAST_DTYPES, Loop
from ..torch_common.step import call_model, optimizer_state, tensors_in
from ..trace.devices import DeviceProfile, get_profile
from ..trace.format import Trace, frame, op_signature
from .pyrefs import probe_step, release_points
from .recorder import Recorder
from .recorder.step_record import StepRecord
from .workloads import Workload, check_parts, torch_optimizer

DEFAULT_FAKE_PROFILE = "a100-40gb"
STEP_DEFINITION = (
    "zero_grad before the step (outside it); the step is forward + loss, backward (repeated per "
    "micro-batch, see meta.loop), optimizer.step(); the model output is dropped once the loss is computed"
)
CALLER_STEP_DEFINITION = (
    "zero_grad before the step (outside it); the step is the caller's step_fn() (record_step): its forwards, "
    "backwards and optimizer.step(), with the loop's shape as the caller declared it in meta.loop"
)


def make_step_fn(model, batch, loss_fn, optimizer, where: str = "workload", loop: Loop | None = None
                 ) -> Callable[[], None]:
    """One training step of ``loop`` (default: forward + loss, backward, optimizer step),
    nothing kept afterwards; ``zero_grad`` is the caller's (see :class:`Loop`)."""
    import torch

    loop = loop or Loop()
    device = next((p.device.type for p in model.parameters()), "cpu")

    def autocast():
        if loop.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device, dtype=getattr(torch, AUTOCAST_DTYPES[loop.autocast]))

    def one_loss():
        out = call_model(model, batch)
        loss = loss_fn(out, batch)
        del out
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise WorkloadError(
                f"{where}: loss_fn(output, batch) returned {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
                + "; it must return a scalar tensor."
            )
        return loss

    def step() -> None:
        try:
            run_step()
        except TaichiError:
            raise
        except Exception as e:
            raise _raised_in_step(e, where) from e

    def run_step() -> None:
        for _ in range(loop.micro_batches):
            with autocast():
                loss = one_loss()
                for _ in range(loop.forwards - 1):  # several forwards alive before one backward
                    loss = loss + one_loss()
                if loop.forwards > 1:
                    loss = loss / loop.forwards
                if loop.micro_batches > 1:
                    loss = loss / loop.micro_batches
            loss.backward()
            del loss
        if loop.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), loop.clip_grad_norm)
        optimizer.step()

    return step


def _raised_in_step(e: Exception, where: str) -> Exception:
    """An exception the step raised outside taichi-plan's own code (the model, its loss, the
    optimizer, a library they call) as a :class:`WorkloadError` naming where it was raised:
    the step as written does not run, with or without a plan. One raised inside taichi-plan
    is returned as it is (a bug of ours keeps its traceback)."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    if not frames or Path(frames[-1].filename).resolve().is_relative_to(_PACKAGE):
        return e
    last = frames[-1]
    fake = type(e).__module__.startswith("torch._subclasses") or "FakeTensor" in str(e)
    hint = (" Under --fake the step runs on fake tensors: it must not read tensor values (.item(), "
            "printing a tensor, a shape that depends on values)." if fake else "")
    paths = sysconfig.get_paths()
    installed = (paths["purelib"], paths["platlib"], paths["stdlib"])
    own = [f for f in frames if not f.filename.startswith(installed) and not f.filename.startswith("<")
           and not Path(f.filename).resolve().is_relative_to(_PACKAGE)]
    mine = f", called from {own[-1].name} ({own[-1].filename}, line {own[-1].lineno})" if own and own[-1] != last else ""
    return WorkloadError(
        f"{where}: the training step raised {type(e).__name__}: {e} (in {last.name}, {last.filename}, line "
        f"{last.lineno}{mine}). taichi-plan runs the step as your loop would: model(batch), loss_fn(output, batch), "
        f"backward, optimizer.step().{hint} Run that step once on its own to fix it, then record again.")


_PACKAGE = Path(__file__).resolve().parents[1]


def step_tensors(model, optimizer, inputs=()) -> list[tuple[str, list]]:
    """The tensors a step starts with, by kind, for :meth:`Recorder.begin_step`: the model's
    parameters, buffers and gradients, the optimizer's state, and every tensor in ``inputs``
    (any nesting of lists, tuples and dicts), and the gradients an input that requires grad
    has kept from earlier steps (a batch made with ``requires_grad=True``: its ``.grad``
    accumulates step after step). Unregistered, such a gradient was taken for one made at the
    op that first touched it whenever the recorder had not seen it before (replay's measured
    step), and the measured peak came out that gradient below the trace's."""
    params = list(model.parameters())
    ins = tensors_in(inputs)
    return [
        ("parameter", params),
        ("buffer", list(model.buffers())),
        ("gradient", [p.grad for p in params if p.grad is not None]
         + [t.grad for t in ins if t.requires_grad and t.grad is not None]),
        ("optimizer_state", optimizer_state(optimizer)),
        ("input", ins),
    ]


def registered_tensors(model, batch, loss_fn, optimizer) -> list[tuple[str, list]]:
    """:func:`step_tensors` of a workload: its batch and its loss function's ``inputs``."""
    return step_tensors(model, optimizer, [batch, list(getattr(loss_fn, "inputs", ()))])


def late_tensors(model, optimizer) -> list[tuple[str, list]]:
    """Tensors a step creates that outlive it (gradients, optimizer state), by kind, for
    :meth:`Recorder.end_step`."""
    return [
        ("gradient", [p.grad for p in model.parameters() if p.grad is not None]),
        ("optimizer_state", optimizer_state(optimizer)),
    ]


class StepRecording:
    """Records the steps of a live model and optimizer, however the loop around them is
    driven: :meth:`begin` before a step (after its ``zero_grad``), :meth:`end` after its
    ``optimizer.step()``; the records collect in :attr:`records`. The one path under
    :func:`record_workload`, :func:`record_step` and the Trainer integration
    (:mod:`taichi_plan.integrations.hf`), whose callbacks call :meth:`begin` and :meth:`end`.
    Close it (or use it as a context manager) to remove its hooks."""

    def __init__(self, model, optimizer, profile: DeviceProfile | None = None, recorder_cls: type = Recorder):
        self.model, self.optimizer = model, optimizer
        self.recorder = recorder_cls(profile, model)
        self.records: list[StepRecord] = []
        self.active = False
        self._hooks = self.recorder.optimizer_hooks(optimizer) + self.recorder.model_hooks(model)

    def begin(self, inputs=(), extra: list[tuple[str, list]] = ()) -> None:
        """Start recording a step; ``inputs``: the tensors the step reads that exist before it
        (the batch, or every micro-batch of the step), registered as ``input``; ``extra``:
        more ``(kind, tensors)`` that exist before it (a wrapper's own storages: DDP's gradient
        buckets), registered after the model's state (a storage registered twice keeps its
        first kind)."""
        if self.active:
            raise UsageError("StepRecording.begin() called twice without end(): a step is already being recorded.")
        self.recorder.begin_step(step_tensors(self.model, self.optimizer, inputs) + list(extra))
        self.recorder.__enter__()
        self.active = True

    def end(self) -> StepRecord:
        """Stop recording the step (call it once the step's own locals died) and keep its record."""
        if not self.active:
            raise UsageError("StepRecording.end() called without begin().")
        self.active = False
        self.recorder.__exit__(None, None, None)
        rec = self.recorder.end_step(late_tensors(self.model, self.optimizer))
        self.records.append(rec)
        return rec

    def close(self) -> None:
        """Stop a step still being recorded (an exception in it), remove the hooks, and drop
        the recorder's references."""
        if self.active:
            self.active = False
            self.recorder.__exit__(None, None, None)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.recorder.close()

    def __enter__(self) -> StepRecording:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_and_record(model, optimizer, step_fn: Callable[[], None], inputs=(), *, loop: Loop, steps: int,
                   warmup: int, profile: DeviceProfile | None = None,
                   say: Callable[[str], None] = lambda msg: None, recorder_cls: type = Recorder) -> list[StepRecord]:
    """Run ``warmup`` unrecorded steps, then record ``steps`` steps; each step is
    ``optimizer.zero_grad(set_to_none=loop.set_to_none)`` (not recorded), then ``step_fn()``.
    Then one forward-only probe (:mod:`taichi_plan.record.pyrefs`) learns when the step's own
    Python code lets go of each storage: ``extras["python_refs"]`` of the last record."""
    for w in range(warmup):
        say(f"warm-up step {w + 1}/{warmup}")
        optimizer.zero_grad(set_to_none=loop.set_to_none)
        step_fn()
    with StepRecording(model, optimizer, profile, recorder_cls) as session:
        for s in range(steps):
            say(f"recording step {s + 1}/{steps}")
            optimizer.zero_grad(set_to_none=loop.set_to_none)
            session.begin(inputs)
            step_fn()
            session.end()
    records = session.records
    if getattr(model, "_taichi_plan", None) is None:  # a planned model's step is measured, not planned
        add_python_refs(records[kept_index(records)], model, optimizer, step_fn, step_tensors(model, optimizer, inputs), profile, say)
    return records


def add_python_refs(record: StepRecord | None, model, optimizer, step_fn: Callable[[], None], registered: list,
                    profile: DeviceProfile | None = None, say: Callable[[str], None] = lambda msg: None) -> None:
    """Run the forward-only probe (:mod:`taichi_plan.record.pyrefs`) of ``step_fn`` and keep in
    ``record`` when the step's own Python code lets go of each storage (``extras["python_refs"]``;
    ``record`` None: the probe runs only to keep other ranks' collectives matched). Its backward
    never runs, so nothing may step the model after it."""
    say("probing when the step's Python code frees each tensor")
    probe = probe_step(model, optimizer, step_fn, registered, profile)
    if record is not None:
        record.extras["python_refs"] = release_points(record, *probe)


def _describe(rec: StepRecord, i: int) -> str:
    if i >= rec.num_ops:
        return "<end of step>"
    module = rec.ops["module"][i] or "<top level>"
    return f"{rec.ops['op'][i]} in {module} (outputs {list(map(list, rec.shapes[i]))})"


def kept_index(records: list[StepRecord]) -> int:
    """Which recorded step the trace keeps: the one that called its modules the most times
    (the last of those). Steps differ where the model skips a module call at random or by its
    data (layerdrop, a branch on a tensor's value); a plan of the step with the most calls applies
    to steps that skip some of them (the runtime skips their ops: ``runtime.calls.module_calls``), not
    to a step that calls a module the kept one did not."""
    counts = [sum(len(v) for v in r.module_args.values()) for r in records]
    best = max(counts)
    return max(i for i, c in enumerate(counts) if c == best)


def first_mismatch(records: list[StepRecord], step_indices: list[int]) -> dict | None:
    """The first op where a recorded step differs (name or output shapes) from the first one."""
    ref = records[0]
    ref_keys = list(zip(ref.ops["op"], ref.shapes, strict=True))
    for rec, step in zip(records[1:], step_indices[1:], strict=True):
        keys = list(zip(rec.ops["op"], rec.shapes, strict=True))
        if keys == ref_keys:
            continue
        by_data = ref.data_sized_ops | rec.data_sized_ops  # their sizes follow the data: compare names
        i = next((k for k, (a, b) in enumerate(zip(ref_keys, keys))
                  if a[0] != b[0] or (a != b and k not in by_data)), None)
        if i is None:
            if len(keys) == len(ref_keys):
                continue
            i = min(len(keys), len(ref_keys))
        return {"step": step, "op_index": i, "expected": _describe(ref, i), "got": _describe(rec, i)}
    return None


def record_workload(
    workload: Workload,
    *,
    fake: bool = False,
    device_profile: str | None = None,
    steps: int = 2,
    warmup: int = 1,
    loop: Loop | None = None,
    progress: Callable[[str], None] | None = None,
    gpu_kernels: bool = True,
    calibrate: bool = True,
) -> Trace:
    """Record ``workload`` and return a trace of one steady-state step.

    ``fake``: trace under ``FakeTensorMode`` (no memory, any size); durations are then roofline
    estimates on ``device_profile`` (default ``a100-40gb``). Real runs measure durations and
    keep ``device_profile`` as metadata only.

    ``gpu_kernels``: a fake recording of a CPU model for a GPU profile records the kernels that
    GPU runs where this torch's differ (dropout, attention, foreach optimizers:
    :mod:`taichi_plan.record.gpu_ops`), said in ``meta.gpu_kernels``; False records this
    torch's own kernels.

    ``calibrate``: a real recording then measures the replay runtime's cost per op on the
    model's own forward (:func:`taichi_plan.runtime.calibrate.measure_on_model`, a few seconds
    at most), into ``meta.runtime_overhead``; False keeps the microbenchmark's.
    """
    check_counts(steps, warmup)
    if fake:
        device_profile = device_profile or DEFAULT_FAKE_PROFILE
    profile = get_profile(device_profile) if device_profile else None
    say = progress or (lambda msg: None)

    from torch._subclasses.fake_tensor import FakeTensorMode

    from . import gpu_ops

    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    with mode:
        say(f"building {workload.name}")
        model, batch, loss_fn, optimizer = workload.build(fake)
        device = device_type(model)
        loop = loop or Loop()
        step = make_step_fn(model, batch, loss_fn, optimizer, where=workload.name, loop=loop)
        target = gpu_ops.target_for(profile, fake, device) if gpu_kernels else None
        with gpu_ops.gpu_kernels(target, optimizer) if target else contextlib.nullcontext():
            records = run_and_record(model, optimizer, step, [batch, list(getattr(loss_fn, "inputs", ()))],
                                     loop=loop, steps=steps, warmup=warmup, profile=profile if fake else None,
                                     say=say)
        say("building tables")
        trace = trace_from_records(records, warmup=warmup, fake=fake, loop=loop, meta={
            "gpu_kernels": target.to_meta(records[-1].ops["op"]) if target else None,
            "device": device,
            "workload": {"name": workload.name, "kind": workload.kind, "args": workload.args},
            "device_profile": device_profile,
            "dtype": workload.dtype,
            "step_definition": STEP_DEFINITION,
        })
        # The runtime's per-op cost on this model's own ops (runtime/calibrate/), on a model this
        # recording built (record() of a user's live objects leaves them alone).
        if not fake and calibrate and workload.kind != "python":
            from ..runtime.calibrate import measure_on_model

            say("measuring the replay runtime's cost per op")
            measured = measure_on_model(model, batch, loss_fn, trace)
            if measured is not None:
                trace.meta["runtime_overhead"] = {**trace.meta["runtime_overhead"], **measured}
        del model, batch, loss_fn, optimizer, step
    return trace


def trace_from_records(records: list[StepRecord], *, warmup: int, fake: bool, loop: Loop, meta: dict) -> Trace:
    """The trace of one of ``records`` (steps ``warmup`` .. ``warmup + len(records) - 1``): the
    last, or where the steps differ the one with the most module calls (:func:`kept_index`),
    with the recording's own facts in ``meta`` (signatures, whether the steps matched, the
    model's calls, ``loop``) added to the caller's (``device``, ``workload``, ``device_profile``,
    ``dtype``, ``step_definition``), and what the replay runtime costs per op here (``runtime_overhead``)."""
    import torch

    from ..runtime.mode import calibrate_overhead

    step_indices = list(range(warmup, warmup + len(records)))
    signatures = [op_signature(r.ops["op"], r.shapes) for r in records]
    mismatch = first_mismatch(records, step_indices)
    k = kept_index(records)
    kept = records[k]
    full = {
        "torch_version": torch.__version__,
        "torch_build": "cuda" if torch.version.cuda else "cpu",
        "device": meta["device"],
        "workload": meta["workload"],
        "mode": "fake" if fake else "real",
        "device_profile": meta.get("device_profile"),
        "dtype": meta["dtype"],
        "warmup_steps": warmup,
        "steps_recorded": len(records),
        "kept_step": step_indices[k],
        "signatures": signatures,
        "signature": signatures[k],
        "steps_match": mismatch is None,
        "first_mismatch": mismatch,
        "cost_unit": "s",
        "step_definition": meta["step_definition"],
        "filtered_ops": ["prim.*", "profiler.*"],
        "model_calls": kept.calls,
        "random_ops": kept.random_ops,
        "backward_nodes": kept.node_starts,
        "forward_in_backward": forward_in_backward(kept),
        "called_modules": sorted(kept.called_modules),
        "module_args": dict(sorted(kept.module_args.items())),
        "data_sized": data_sized(kept),
        "loop": loop.to_json(),
        "gpu_kernels": meta.get("gpu_kernels"),
        "runtime_overhead": dict(calibrate_overhead()),
    }
    if "python_refs" in kept.extras:
        full["python_refs"] = kept.extras["python_refs"]
    return step_to_trace(kept, step_indices[k], "estimated" if fake else "measured", full)


def data_sized(rec: StepRecord) -> dict:
    """``meta.data_sized`` (trace v11): the tensors whose size depends on tensor values
    (``StepRecord.data_sized``), the ops that made or read them, and, per op and module, how many calls made outputs sized by
    values (``nonzero``, ``x[mask]``): a mixture of experts routes another number of tokens to each
    expert every step. The runtime does not hold such a tensor to its recorded size; the plan's
    peak is predicted at the recorded sizes."""
    count: dict[tuple[str, str], int] = {}
    for o in rec.data_sized_sources:
        key = (rec.ops["op"][o], rec.ops["module"][o] or "")
        count[key] = count.get(key, 0) + 1
    return {"tensors": sorted(int(t) for t in rec.data_sized), "ops": sorted(int(o) for o in rec.data_sized_ops),
            "sources": [[op, module, n] for (op, module), n in sorted(count.items())]}


def forward_in_backward(rec: StepRecord) -> dict:
    """``meta.forward_in_backward`` (trace v8): the ops of forward code that
    ``torch.utils.checkpoint`` re-ran inside the recorded backward (the model's own activation
    checkpointing), and per run of them the modules they ran in (their names' common prefix)."""
    runs: list[list[int]] = []  # the re-run ops in runs of consecutive op ids
    for i in rec.rerun_ops:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    names = rec.ops["module"]
    modules: list[str] = []
    for run in runs:
        parts = [names[i].split(".") for i in run if names[i]]
        prefix = ".".join(os.path.commonprefix(parts)) if parts else ""
        if prefix and prefix not in modules:
            modules.append(prefix)
    outer = [m for m in modules if not any(m.startswith(o + ".") for o in modules)]
    return {"ops": len(rec.rerun_ops), "modules": outer}


def check_counts(steps: int, warmup: int) -> None:
    if steps < 1:
        raise UsageError(f"--steps must be at least 1, got {steps}.")
    if warmup < 0:
        raise UsageError(f"warmup must be >= 0, got {warmup}.")


def step_to_trace(rec: StepRecord, step: int, cost_source: str, meta: dict) -> Trace:
    """A recorded step as a :class:`Trace` (op ids from 0, every op tagged ``cost_source``)."""
    n, m = rec.num_ops, len(rec.tensors["nbytes"])
    ops = frame("ops", {"op_id": list(range(n)), "step": [step] * n, "cost_source": [cost_source] * n, **rec.ops})
    tensors = frame("tensors", {"tensor_id": list(range(m)), **rec.tensors})
    accesses = frame("accesses", rec.accesses)
    return Trace(ops, tensors, accesses, meta)


def record(model, batch, loss_fn, optimizer, *, name: str = "python", steps: int = 2, warmup: int = 1,
           device_profile: str | None = None, loop: Loop | None = None,
           progress: Callable[[str], None] | None = None) -> Trace:
    """Record a real step of objects you already built (same contract as ``--entry``).

    Runs ``warmup`` + ``steps`` real training steps on them (the model's weights change).
    For a fake (no-memory) recording, build inside the fake mode: pass a
    :class:`~taichi_plan.record.workloads.Workload` or an ``--entry`` to :func:`record_workload`.
    """
    parts = check_parts((model, batch, loss_fn, optimizer), f"record({name!r})")

    def build(fake: bool):
        return parts

    workload = Workload(name, {}, build, dtype_name(parts[0]), "python", {})
    return record_workload(workload, fake=False, device_profile=device_profile, steps=steps,
                           warmup=warmup, loop=loop, progress=progress)


def record_step(model, optimizer, step_fn: Callable[[], None], *, inputs=(), loop: Loop | None = None,
                name: str = "step", args: dict | None = None, steps: int = 2, warmup: int = 1,
                device_profile: str | None = None, progress: Callable[[str], None] | None = None) -> Trace:
    """Record a step you write yourself: ``step_fn()`` runs one whole optimizer step (every
    micro-batch's forward and backward, clipping, ``optimizer.step()``) on ``model`` and
    ``optimizer``, keeping nothing afterwards; ``optimizer.zero_grad(set_to_none=loop.set_to_none)``
    runs before each step, outside it. ``warmup`` unrecorded steps, then ``steps`` recorded
    ones (the model's weights change), whose op sequences must match; the last one is kept.

    ``inputs``: the tensors the step reads that exist before it (its batches), recorded as
    ``input``. ``loop``: what you know of the loop's shape (micro-batches per step, forwards
    per backward, autocast, clipping, ``zero_grad``), stored as ``meta.loop``; the step must
    call the model with grad ``loop.micro_batches * loop.forwards`` times. ``args``: the
    workload's arguments for ``meta.workload.args`` (``batch`` lets the planner partition).
    """
    import torch

    check_counts(steps, warmup)
    loop = loop or Loop()
    where = f"record_step({name!r})"
    problems = []
    if not isinstance(model, torch.nn.Module):
        problems.append(f"model is a {type(model).__name__}, not an nn.Module")
    if not isinstance(torch_optimizer(optimizer), torch.optim.Optimizer):
        problems.append(f"optimizer is a {type(optimizer).__name__}, not a torch.optim.Optimizer")
    optimizer = torch_optimizer(optimizer)  # accelerate's AcceleratedOptimizer: the one it steps
    if not callable(step_fn):
        problems.append(f"step_fn is a {type(step_fn).__name__}, not a function that runs one optimizer step")
    if problems:
        raise WorkloadError(f"{where}: {'; '.join(problems)}.")
    if device_profile:
        get_profile(device_profile)  # a real run measures durations: the profile is metadata, checked
    records = run_and_record(model, optimizer, step_fn, inputs, loop=loop, steps=steps, warmup=warmup,
                             say=progress or (lambda msg: None))
    check_calls(records[-1], loop, where)
    return trace_from_records(records, warmup=warmup, fake=False, loop=loop,
                              meta=caller_meta(model, name, args, device_profile))


def caller_meta(model, name: str, args: dict | None, device_profile: str | None) -> dict:
    """The meta of a trace of a step the caller wrote (:func:`record_step`, a compiled step)."""
    return {
        "device": device_type(model),
        "workload": {"name": name, "kind": "python", "args": dict(args or {})},
        "device_profile": device_profile,
        "dtype": dtype_name(model),
        "step_definition": CALLER_STEP_DEFINITION,
    }


def check_calls(rec: StepRecord, loop: Loop, where: str) -> None:
    """Refuse a recorded step whose grad-enabled model calls do not number
    ``loop.micro_batches * loop.forwards``: the trace would describe another loop than ran."""
    grad_calls = sum(1 for c in rec.calls if c.get("grad"))
    want = loop.micro_batches * loop.forwards
    if grad_calls != want:
        raise UsageError(
            f"{where}: the step called the model {grad_calls} time(s) with grad, but the loop given says "
            f"{loop.micro_batches} micro-batch(es) x {loop.forwards} forward(s) = {want}. Pass the Loop your "
            "step runs (Loop(micro_batches=..., forwards=...)), so that the trace says what the step does.")


def device_type(model) -> str:
    """Where the model's kernels run (``meta.device``): its parameters' device type."""
    return next((p.device.type for p in model.parameters()), "cpu")


def dtype_name(model) -> str:
    p = next(iter(model.parameters()), None)
    return {"torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(str(getattr(p, "dtype", "")), "fp32")
