"""Record a workload's training step into a :class:`~taichi_plan.trace.Trace`.

``record_workload`` builds the workload (inside a ``FakeTensorMode`` for ``fake=True``), runs
``warmup`` unrecorded steps so gradients' and optimizer state's shapes settle and the state
exists, then records ``steps`` steps, checks their op sequences match and keeps the last one.
See :mod:`taichi_plan.record.recorder` for what a step is and how each column is decided.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from ..devices import get_profile
from ..errors import UsageError, WorkloadError
from ..trace import Trace, frame, op_signature
from .loop import AUTOCAST_DTYPES, Loop
from .recorder import Recorder, StepRecord
from .workloads import Workload, check_parts

DEFAULT_FAKE_PROFILE = "a100-40gb"
STEP_DEFINITION = (
    "zero_grad before the step (outside it); the step is forward + loss, backward (repeated per "
    "micro-batch, see meta.loop), optimizer.step(); the model output is dropped once the loss is computed"
)


def _call_model(model, batch):
    import torch

    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, dict):
        return model(**batch)
    return model(*batch)


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
        out = _call_model(model, batch)
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


def _tensors(obj) -> list:
    import torch
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _optimizer_state(optimizer) -> list:
    return [v for state in optimizer.state.values() for v in _tensors(list(state.values()))]


def registered_tensors(model, batch, loss_fn, optimizer) -> list[tuple[str, list]]:
    """The tensors a step starts with, by kind, for :meth:`Recorder.begin_step`."""
    params = list(model.parameters())
    return [
        ("parameter", params),
        ("buffer", list(model.buffers())),
        ("gradient", [p.grad for p in params if p.grad is not None]),
        ("optimizer_state", _optimizer_state(optimizer)),
        ("input", _tensors(batch) + _tensors(list(getattr(loss_fn, "inputs", ())))),
    ]


def late_tensors(model, optimizer) -> list[tuple[str, list]]:
    """Tensors a step creates that outlive it (gradients, optimizer state), by kind, for
    :meth:`Recorder.end_step`."""
    return [
        ("gradient", [p.grad for p in model.parameters() if p.grad is not None]),
        ("optimizer_state", _optimizer_state(optimizer)),
    ]


def _describe(rec: StepRecord, i: int) -> str:
    if i >= rec.num_ops:
        return "<end of step>"
    module = rec.ops["module"][i] or "<top level>"
    return f"{rec.ops['op'][i]} in {module} (outputs {list(map(list, rec.shapes[i]))})"


def first_mismatch(records: list[StepRecord], step_indices: list[int]) -> dict | None:
    """The first op where a recorded step differs (name or output shapes) from the first one."""
    ref = records[0]
    ref_keys = list(zip(ref.ops["op"], ref.shapes, strict=True))
    for rec, step in zip(records[1:], step_indices[1:], strict=True):
        keys = list(zip(rec.ops["op"], rec.shapes, strict=True))
        if keys == ref_keys:
            continue
        i = next((k for k, (a, b) in enumerate(zip(ref_keys, keys)) if a != b), min(len(keys), len(ref_keys)))
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
) -> Trace:
    """Record ``workload`` and return a trace of one steady-state step.

    ``fake``: trace under ``FakeTensorMode`` (no memory, any size); durations are then roofline
    estimates on ``device_profile`` (default ``a100-40gb``). Real runs measure durations and
    keep ``device_profile`` as metadata only.
    """
    if steps < 1:
        raise UsageError(f"--steps must be at least 1, got {steps}.")
    if warmup < 0:
        raise UsageError(f"warmup must be >= 0, got {warmup}.")
    if fake:
        device_profile = device_profile or DEFAULT_FAKE_PROFILE
    profile = get_profile(device_profile) if device_profile else None
    say = progress or (lambda msg: None)

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    with mode:
        say(f"building {workload.name}")
        model, batch, loss_fn, optimizer = workload.build(fake)
        device = next((p.device.type for p in model.parameters()), "cpu")  # where the kernels ran
        loop = loop or Loop()
        step = make_step_fn(model, batch, loss_fn, optimizer, where=workload.name, loop=loop)
        for w in range(warmup):
            say(f"warm-up step {w + 1}/{warmup}")
            optimizer.zero_grad(set_to_none=loop.set_to_none)
            step()
        recorder = Recorder(profile if fake else None, model)
        hooks = recorder.optimizer_hooks(optimizer) + recorder.model_hooks(model)
        records: list[StepRecord] = []
        try:
            for s in range(steps):
                say(f"recording step {s + 1}/{steps}")
                optimizer.zero_grad(set_to_none=loop.set_to_none)
                recorder.begin_step(registered_tensors(model, batch, loss_fn, optimizer))
                with recorder:
                    step()
                records.append(recorder.end_step(late_tensors(model, optimizer)))
        finally:
            for h in hooks:
                h.remove()
            recorder.close()
        del model, batch, loss_fn, optimizer, step, recorder
    say("building tables")
    from ..replay.runtime import calibrate_overhead

    step_indices = list(range(warmup, warmup + steps))
    signatures = [op_signature(r.ops["op"], r.shapes) for r in records]
    mismatch = first_mismatch(records, step_indices)
    kept = records[-1]
    meta = {
        "torch_version": torch.__version__,
        "torch_build": "cuda" if torch.version.cuda else "cpu",
        "device": device,
        "workload": {"name": workload.name, "kind": workload.kind, "args": workload.args},
        "mode": "fake" if fake else "real",
        "device_profile": device_profile,
        "dtype": workload.dtype,
        "warmup_steps": warmup,
        "steps_recorded": steps,
        "kept_step": step_indices[-1],
        "signatures": signatures,
        "signature": signatures[-1],
        "steps_match": mismatch is None,
        "first_mismatch": mismatch,
        "cost_unit": "s",
        "step_definition": STEP_DEFINITION,
        "filtered_ops": ["prim.*", "profiler.*"],
        "model_calls": kept.calls,
        "loop": loop.to_json(),
        "runtime_overhead": calibrate_overhead(),
    }
    return step_to_trace(kept, step_indices[-1], "estimated" if fake else "measured", meta)


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

    workload = Workload(name, {}, build, _dtype_name(parts[0]), "python", {})
    return record_workload(workload, fake=False, device_profile=device_profile, steps=steps,
                           warmup=warmup, loop=loop, progress=progress)


def _dtype_name(model) -> str:
    p = next(iter(model.parameters()), None)
    return {"torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(str(getattr(p, "dtype", "")), "fp32")
