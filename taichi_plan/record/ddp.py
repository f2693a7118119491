"""Record one rank's step of a DDP job (``record --ddp N``).

A DDP rank holds the whole model, its gradients and its optimizer state, like one process,
plus what ``DistributedDataParallel``'s reducer allocates: one flat gradient *bucket* per group
of parameters (``bucket_cap_mb`` each, the first one ``first_bucket_bytes_cap``; after the first
step the reducer rebuilds them in the order the gradients became ready). In backward, as each
bucket's gradients are ready, the reducer copies them into the bucket (``aten.mul.out``: scaled
by 1/world size), all-reduces it (``c10d.allreduce_``), and copies the result back into each
``.grad``; with ``gradient_as_bucket_view=True`` the ``.grad`` tensors are views of the buckets
and nothing is copied. None of this depends on the number of ranks (gloo's and NCCL's own
buffers are outside PyTorch's allocator), so one process records it for any N: the model is
wrapped in DDP over a real 1-rank gloo group on loopback (made here and destroyed when the
recording ends), and the recorder sees the reducer's real buckets and ops.

What the trace then holds (docs/sharding.md#ddp):

- ``ddp_bucket``: each bucket's storage, alive all step (with ``gradient_as_bucket_view`` the
  buckets are the gradients, kind ``gradient``);
- the all-reduces as ops (``c10d.allreduce_.default``), each costed as a ring over N ranks on
  the device profile's interconnect (``cost_source`` ``estimated``: on one rank the measured
  call moves nothing);
- ``meta.ddp``: the world size N, the bucket settings, each bucket's bytes, the profile the
  all-reduces were costed on.

DDP's reducer cannot run under ``FakeTensorMode`` (its all-reduce hook then returns no tensor:
an internal assert in c10d), so ``--ddp`` records real steps: the model must fit this machine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from ..base.errors import UsageError
from ..torch_common.loop import Loop
from ..trace.devices import get_profile
from ..trace.format import Trace
from .api import (
    DEFAULT_FAKE_PROFILE,
    STEP_DEFINITION,
    StepRecording,
    add_python_refs,
    check_counts,
    device_type,
    make_step_fn,
    step_tensors,
    trace_from_records,
)
from .workloads import Workload

BUCKET_KIND = "ddp_bucket"
ALLREDUCE_OP = "c10d.allreduce_.default"
_MiB = 1024 * 1024


@contextlib.contextmanager
def local_process_group():
    """A real 1-rank gloo process group on a free loopback port, destroyed on exit."""
    import torch.distributed as dist

    from ..torch_common.processes import free_port

    if dist.is_initialized():
        raise UsageError("A torch.distributed process group is already initialized in this process; a DDP "
                         "recording makes its own 1-rank group. Record in a fresh process.")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def wrap_ddp(model, bucket_cap_mb: float | None = None, gradient_as_bucket_view: bool = False):
    """``DistributedDataParallel(model, bucket_cap_mb=..., gradient_as_bucket_view=...)`` on the
    default process group (CPU: no device ids), everything else at DDP's defaults."""
    from torch.nn.parallel import DistributedDataParallel

    if bucket_cap_mb is not None and not bucket_cap_mb > 0:
        raise UsageError(f"--bucket-cap-mb must be a positive number of MiB, got {bucket_cap_mb}.")
    return DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=gradient_as_bucket_view)


def wrap_as_recorded(model, ddp_meta: dict):
    """Wrap ``model`` in DDP with the settings ``meta.ddp`` recorded."""
    return wrap_ddp(model, ddp_meta.get("bucket_cap_mb"), bool(ddp_meta["gradient_as_bucket_view"]))


def is_ddp(model) -> bool:
    import sys

    mod = sys.modules.get("torch.nn.parallel.distributed")
    return mod is not None and isinstance(model, mod.DistributedDataParallel)


def unwrap(model):
    """The module a DDP wrapper runs (the one a plan's FQNs name); any other model as it is."""
    return model.module if is_ddp(model) else model


def settings(ddp) -> dict:
    """What of a DDP wrapper decides a rank's memory and op sequence."""
    config = getattr(ddp, "_bucket_config", None)
    return {
        "bucket_bytes_cap": int(ddp.bucket_bytes_cap),
        "first_bucket_bytes_cap": int(config.first_bucket_bytes_cap) if config is not None else None,
        "gradient_as_bucket_view": bool(ddp.gradient_as_bucket_view),
        "find_unused_parameters": bool(ddp.find_unused_parameters),
        "static_graph": bool(ddp.static_graph),
    }


def live_layout(model) -> dict | None:
    """:func:`taichi_plan.trace.layout.layout` of a live DDP wrapper (its process group's size and
    its settings); None for any other model."""
    from ..trace.layout import layout

    if not is_ddp(model):
        return None
    return layout({"ddp": {"world_size": model.process_group.size(), **settings(model)}})


def bucket_tensors(step: Callable[[], None]) -> list:
    """Run ``step`` (one DDP training step) and return the buckets it all-reduced, one tensor
    per storage, in the order the reducer launched them: DDP's own gradient buffers, which no
    Python API exposes. Run it after DDP's first step (which buckets everything at once and
    rebuilds the buckets in the next forward)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    reduced: list = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.c10d.allreduce_.default:
                reduced.extend(args[0])
            return func(*args, **(kwargs or {}))

    with Watch():
        step()
    seen, out = set(), []
    for t in reduced:
        key = t.untyped_storage()._cdata
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def cost_allreduces(trace: Trace, profile, world_size: int) -> None:
    """Cost each all-reduce of ``trace`` as a ring over ``world_size`` ranks on ``profile``'s
    interconnect (in place; ``cost_source`` ``estimated``): a 1-rank recording's own call moves
    nothing."""
    from ..trace.roofline import collective_duration_s

    ops, acc = trace.ops, trace.accesses
    nbytes = dict(zip(trace.tensors["tensor_id"].tolist(), trace.tensors["nbytes"].tolist(), strict=True))
    for i in ops.index[ops["op"] == ALLREDUCE_OP]:
        op_id = int(ops.at[i, "op_id"])
        full = max((nbytes[int(t)] for t in acc["tensor_id"][acc["op_id"] == op_id]), default=0)
        ops.at[i, "duration_s"] = collective_duration_s(profile, ALLREDUCE_OP, full, world_size)
        ops.at[i, "cost_source"] = "estimated"


def record_ddp_workload(
    workload: Workload,
    world_size: int,
    *,
    bucket_cap_mb: float | None = None,
    gradient_as_bucket_view: bool = False,
    fake: bool = False,
    device_profile: str | None = None,
    steps: int = 2,
    warmup: int = 2,
    loop: Loop | None = None,
    progress: Callable[[str], None] | None = None,
) -> Trace:
    """Record one rank's step of ``workload`` trained with DDP over ``world_size`` ranks (a
    real step in this process, on a 1-rank gloo group: see the module's docstring).
    ``device_profile`` (default ``a100-40gb``) costs the all-reduces; the other ops' durations
    are measured."""
    if fake:
        raise UsageError(
            "record --ddp cannot run under --fake: DDP's reducer fails under FakeTensorMode (its all-reduce "
            "hook returns no tensor, an internal assert in c10d), on the fake process group as on a real one. "
            "Record the DDP step for real (drop --fake: each DDP rank holds the whole model, so it must fit this "
            "machine), or record a sharded job with `--fsdp N --fake`.")
    check_counts(steps, warmup)
    if warmup < 2:
        raise UsageError("record --ddp needs at least two warm-up steps: DDP's first step reduces every gradient in "
                         "one bucket and rebuilds its buckets in the next forward.")
    if world_size < 1:
        raise UsageError(f"--ddp must be at least 1 rank, got {world_size}.")
    loop = loop or Loop()
    profile = get_profile(device_profile or DEFAULT_FAKE_PROFILE)
    say = progress or (lambda msg: None)
    with local_process_group():
        say(f"building {workload.name}")
        model, batch, loss_fn, optimizer = workload.build(False)
        device = device_type(model)
        ddp = wrap_ddp(model, bucket_cap_mb, gradient_as_bucket_view)
        step = make_step_fn(ddp, batch, loss_fn, optimizer, where=workload.name, loop=loop)
        inputs = [batch, list(getattr(loss_fn, "inputs", ()))]
        for w in range(warmup):
            say(f"warm-up step {w + 1}/{warmup}")
            optimizer.zero_grad(set_to_none=loop.set_to_none)
            if w < warmup - 1:
                step()
            else:
                buckets = bucket_tensors(step)
        meta_ddp = {"world_size": world_size, "recorded_ranks": 1, "backend": "gloo", "bucket_cap_mb": bucket_cap_mb,
                    **settings(ddp),
                    "buckets": [{"nbytes": int(b.untyped_storage().nbytes()), "dtype": str(b.dtype).replace(
                        "torch.", ""), "numel": int(b.numel())} for b in buckets],
                    "collective_profile": profile.name,
                    "collective_link_bytes_per_s": profile.link_bytes_per_s(world_size)}
        with StepRecording(model, optimizer) as session:
            for s in range(steps):
                say(f"recording step {s + 1}/{steps}")
                optimizer.zero_grad(set_to_none=loop.set_to_none)
                session.begin(inputs, [(BUCKET_KIND, buckets)])
                step()
                session.end()
        records = session.records
        # When the step's own code (the model's, through DDP's wrapper) lets go of each storage,
        # as a one-process recording learns it: a module that leaves a tensor in the model's
        # state (a KV cache) is then never partitioned (partition.leaves_state). The probe's
        # backward never runs, so DDP's reducer is left waiting: nothing steps after it.
        add_python_refs(records[-1], ddp, optimizer, step, step_tensors(model, optimizer, inputs)
                        + [(BUCKET_KIND, buckets)], say=say)
        del model, ddp, batch, loss_fn, optimizer, step, session, buckets
    say("building tables")
    trace = trace_from_records(records, warmup=warmup, fake=False, loop=loop, meta={
        "device": device,
        "workload": {"name": workload.name, "kind": workload.kind, "args": workload.args},
        "device_profile": device_profile,
        "dtype": workload.dtype,
        "step_definition": STEP_DEFINITION + "; the model wrapped in DistributedDataParallel (meta.ddp)",
    })
    cost_allreduces(trace, profile, world_size)
    trace.meta["ddp"] = meta_ddp
    return trace
