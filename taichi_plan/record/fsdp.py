"""Record rank 0's step of an FSDP2 job (``record --fsdp N``).

The model is sharded with ``torch.distributed.fsdp.fully_shard``: each repeated block (the
blocks :func:`taichi_plan.solve.baselines.find_blocks` finds) is a unit, then the root. Under
``--fake`` the job runs on PyTorch's fake process group (``FakeStore``), so a job of any size
and any number of ranks is traced on one CPU with no memory; the device mesh is made before
``FakeTensorMode`` is entered (inside it, mesh creation fails).

What the trace then holds (docs/sharding.md):

- ``parameter``: the sharded parameters (each DTensor's local shard), ``gradient`` the gradient
  shards, ``optimizer_state`` the sharded optimizer state;
- ``unsharded_parameter``: the gathered parameters, one row per time FSDP allocates them (the
  recorder sees ``resize_``), ``unsharded_gradient`` the full gradients before their
  reduce-scatter, ``all_gather`` / ``reduce_scatter`` the communication buffers;
- the collectives as ops (``c10d._allgather_base_``, ``c10d._reduce_scatter_base_``), costed on
  the device profile's interconnect;
- ``meta.fsdp``: world size, mesh, units (module, ``reshard_after_forward``, parameters and
  their sharded and unsharded bytes), the op spans FSDP ran for each unit, the rows of each
  resized storage, and the peak ``FSDPMemTracker`` reports for the same step.

Process groups are global state: one recording per process (the CLI is one); the group is
destroyed when the recording ends, failed or not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from copy import deepcopy
from pathlib import Path

from ..base.errors import UsageError
from ..torch_common.fsdp import (
    Reshard,
    check_replicas,
    describe_layout,
    device_mesh,
    fsdp_units,
    mp_policy,
    param_group,
    patch_group_methods,
    reshard_setting,
    set_prefetch,
)
from ..torch_common.loop import Loop
from ..trace.devices import get_profile
from ..trace.format import Trace
from .api import (
    DEFAULT_FAKE_PROFILE,
    STEP_DEFINITION,
    StepRecording,
    add_python_refs,
    check_counts,
    make_step_fn,
    step_tensors,
    trace_from_records,
)
from .workloads import Workload

# FSDPMemTracker's categories -> the trace's kinds (activations and temporaries are compared
# together: the tracker files what backward makes under Temp, the trace what dies before
# backward under temporary).
TRACKER_KINDS = {
    "Sharded Param": ("parameter",),
    "Unsharded Param": ("unsharded_parameter",),
    "Buffer": ("buffer",),
    "Sharded Grad": ("gradient",),
    "Unsharded Grad": ("unsharded_gradient",),
    "All Gather": ("all_gather",),
    "Reduce Scatter": ("reduce_scatter",),
    "OptState": ("optimizer_state",),
    "Inputs": ("input",),
    # the shards an int reshard_after_forward keeps (FSDP's _sharded_post_forward_param_data):
    # the tracker knows no category for them and files them as activations
    "Activation+Temp": ("activation", "temporary", "post_forward_shard"),
}


@contextlib.contextmanager
def fake_process_group(world_size: int, replicas: int = 1):
    """Rank 0 of a ``world_size``-rank job on the fake process group, with its CPU mesh
    (:func:`device_mesh`); the group is destroyed on exit."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    check_replicas(world_size, replicas)
    if dist.is_initialized():
        raise UsageError("A torch.distributed process group is already initialized in this process; a fake "
                         "FSDP recording needs its own. Record in a fresh process.")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield device_mesh(world_size, replicas)
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _post_forward_mesh_outside_fake():
    """FSDP2 builds the smaller mesh of an int ``reshard_after_forward`` from the device
    mesh's rank tensor, in ``fully_shard``; under ``FakeTensorMode`` that tensor op comes out
    fake and the new ``DeviceMesh`` fails. Run it outside the fake mode (the mesh is real
    metadata, as the mesh made before the mode is)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.fsdp._fully_shard import _fully_shard

    orig = _fully_shard._get_post_forward_mesh_info

    def outside(*args, **kwargs):
        with unset_fake_temporarily():
            return orig(*args, **kwargs)

    _fully_shard._get_post_forward_mesh_info = outside
    try:
        yield
    finally:
        _fully_shard._get_post_forward_mesh_info = orig


def shard_model(model, mesh, reshard_after_forward: Reshard | dict[str, Reshard] = True,
                prefetch: dict[str, dict] | None = None, mixed_precision: dict | None = None) -> list[str]:
    """``fully_shard`` each repeated block of ``model``, then the root; the units' FQNs in
    order (the root is ``''``). ``reshard_after_forward``: one setting for every unit, or per
    unit FQN (units not named reshard); each True, False, or an int: the ranks to reshard to
    after forward (:func:`reshard_setting`; one int for every unit sets the blocks, the root
    reshards as usual). ``prefetch``: explicit prefetching per unit FQN
    (:func:`set_prefetch`; units not named keep FSDP's default). ``mixed_precision``: every
    unit's :func:`mp_policy` (None: FSDP's default)."""
    from torch.distributed.fsdp import fully_shard

    from ..solve.baselines import find_blocks

    shard_size = int(mesh.shape[-1])

    def setting(fqn: str) -> Reshard:
        if isinstance(reshard_after_forward, dict):
            value = reshard_after_forward.get(fqn, True)
        elif isinstance(reshard_after_forward, bool) or fqn:
            value = reshard_after_forward
        else:
            value = True  # an int for the blocks: the root, which runs first in backward, reshards in full
        return reshard_setting(value, shard_size, f"reshard_after_forward of {fqn or 'the root'}")

    blocks = find_blocks([name for name, _ in model.named_modules()])
    if isinstance(reshard_after_forward, dict):
        unknown = sorted(set(reshard_after_forward) - {*blocks, ""})
        if unknown:
            raise UsageError(f"reshard_after_forward names {unknown[0]!r}, which is not an FSDP unit of this model "
                             f"(units: {', '.join(repr(b) for b in [*blocks, ''])}).")
    policy = mp_policy(mixed_precision)
    with _post_forward_mesh_outside_fake():
        for b in blocks:
            fully_shard(model.get_submodule(b), mesh=mesh, reshard_after_forward=setting(b), mp_policy=policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=setting(""), mp_policy=policy)
    if prefetch:
        set_prefetch(model, prefetch)
    return [*blocks, ""]


def rebuild_optimizer(optimizer, model):
    """The same optimizer over the model's sharded parameters (``fully_shard`` replaced the
    parameters the workload built it with)."""
    import inspect

    accepted = inspect.signature(type(optimizer).__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return type(optimizer)(model.parameters(), **kwargs)


class FsdpInstrument:
    """Tells the recorder what FSDP does that it cannot see from ops alone: which storages are
    unsharded parameters (labelled before each step), which are unsharded gradients (at each
    unit's post-backward), and which ops FSDP ran for which unit (spans around its param
    group's unshard, wait, reshard, pre- and post-forward/backward). Patches each param
    group's methods on the instance, as ``FSDPMemTracker`` does; :meth:`close` removes them."""

    def __init__(self, recording: StepRecording, model):
        self.recorder = recording.recorder
        self.units = fsdp_units(model)
        self.spans: list[list[int]] = []
        self._patch = patch_group_methods(model, self._wrap)

    def _wrap(self, unit: int, group, name: str, orig: Callable):
        rec = self.recorder

        def inner(*args, **kwargs):
            if name == "post_backward":
                for fp in group.fsdp_params:
                    grad = getattr(fp._unsharded_param, "grad", None) if hasattr(fp, "_unsharded_param") else None
                    if grad is not None:
                        rec.relabel(grad, "unsharded_gradient")
            start = rec.op_count
            try:
                return orig(*args, **kwargs)
            finally:
                if rec.current is not None and rec.op_count > start:
                    self.spans.append([start, rec.op_count - 1, unit])
                if name == "reshard":  # an int reshard_after_forward: the shards of the smaller mesh
                    for fp in group.fsdp_params:
                        shard = getattr(fp, "_sharded_post_forward_param_data", None)
                        if shard is not None:
                            rec.relabel(shard, "post_forward_shard")

        return inner

    def begin_step(self) -> None:
        """Label the unsharded parameters' storages (they exist, at 0 bytes, between uses)."""
        self.spans = []
        labels = self.recorder.storage_labels
        labels.clear()
        for _fqn, m in self.units:
            for fp in param_group(m).fsdp_params:
                if not hasattr(fp, "_unsharded_param"):
                    continue
                up = fp._unsharded_param
                labels[up.untyped_storage()._cdata] = (
                    "unsharded_parameter", str(up.dtype).replace("torch.", ""), list(up.shape))

    def close(self) -> None:
        self._patch.remove()


def peak_tracker(model, optimizer, per_module: bool = False):
    """PyTorch's ``FSDPMemTracker`` over ``model`` and ``optimizer``. Unless ``per_module``,
    it keeps only the step's peak: after every op the tracker also walks every module it
    tracks to update that module's own peak (``MemTracker._update_peak_stats``), which is
    the ops times the modules (a 70B model's check spent most of its time there) and feeds
    only its per-module snapshots; the whole step's peak and its snapshot are updated by the
    same code as PyTorch's."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    if per_module:
        return FSDPMemTracker(model, optimizer)

    class StepPeakTracker(FSDPMemTracker):
        def _update_peak_stats(self, peak_state) -> None:  # the global half of PyTorch's
            for dev, dev_snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = deepcopy(dev_snap)

    return StepPeakTracker(model, optimizer)


def tracker_peak(model, optimizer, step_fn: Callable[[], None], inputs, set_to_none: bool = True,
                 per_module: bool = False) -> dict:
    """Run one more step under ``FSDPMemTracker`` (PyTorch's per-rank estimate, as
    :func:`peak_tracker` makes it) and return its peak: ``{"peak_bytes": int, "by_category":
    {category: bytes}}``, categories as :data:`TRACKER_KINDS` (activations and temporaries
    summed)."""
    import warnings

    from .recorder.module_tracking import HIERARCHY_WARNING

    optimizer.zero_grad(set_to_none=set_to_none)
    fmt = peak_tracker(model, optimizer, per_module)
    fmt.track_inputs(tuple(inputs))
    with warnings.catch_warnings(), fmt:
        # its ModTracker about a module outside the model (transformers' Func around the rotary
        # embedding, one object called in every layer): "Please file a bug to PyTorch"
        warnings.filterwarnings("ignore", message=HIERARCHY_WARNING)
        step_fn()
    snap = fmt.get_tracker_snapshot("peak")
    dev = next(iter(snap.values()), {})
    by = {str(getattr(k, "value", k)): int(v) for k, v in dev.items()}
    out = {cat: sum(by.get(c, 0) for c in (("Activation", "Temp") if cat == "Activation+Temp" else (cat,)))
           for cat in TRACKER_KINDS}
    return {"peak_bytes": int(by.get("Total", 0)), "by_category": out}


def record_fsdp_workload(
    workload: Workload,
    world_size: int,
    *,
    fake: bool = True,
    device_profile: str | None = None,
    steps: int = 2,
    warmup: int = 1,
    loop: Loop | None = None,
    reshard_after_forward: Reshard | dict[str, Reshard] = True,
    prefetch: dict[str, dict] | None = None,
    mixed_precision: dict | None = None,
    replicas: int = 1,
    check_tracker: bool = True,
    progress: Callable[[str], None] | None = None,
) -> Trace:
    """Record rank 0's step of ``workload`` sharded with FSDP2 over ``world_size`` ranks.

    ``fake=True``: the job runs in this process on the fake process group under
    ``FakeTensorMode`` (any size, any number of ranks, one CPU); durations are estimates on
    ``device_profile``. ``fake=False``: ``world_size`` processes here, joined with gloo on
    loopback (CPU; :func:`taichi_plan.torch_common.processes.spawn_ranks`), run the real job; rank 0
    records it (measured durations) and the others run the same steps. ``check_tracker``: run
    one more step under ``FSDPMemTracker`` and keep its peak in ``meta.fsdp.mem_tracker`` (the
    reference the trace's peak is checked against). ``prefetch``: explicit prefetching per unit
    (:func:`set_prefetch`; fake runs only). ``mixed_precision``: every unit's FSDP2
    ``MixedPrecisionPolicy`` (:func:`mixed_precision`, :func:`mp_policy`; None: FSDP's default).
    ``replicas`` > 1: HSDP, the ranks a 2-D mesh of that many replicas (:func:`device_mesh`).
    """
    check_counts(steps, warmup)
    if warmup < 1:
        raise UsageError("record --fsdp needs at least one warm-up step (FSDP initializes lazily in its first).")
    check_replicas(world_size, replicas)
    loop = loop or Loop()
    if not fake:
        if prefetch:
            raise UsageError("Explicit prefetching is recorded on the fake process group only.")
        if device_profile:
            get_profile(device_profile)  # metadata only for a real run, but checked
        return _record_real(workload, world_size, device_profile=device_profile, steps=steps, warmup=warmup,
                            loop=loop, reshard_after_forward=reshard_after_forward, check_tracker=check_tracker,
                            progress=progress, mixed_precision=mixed_precision, replicas=replicas)
    from torch._subclasses.fake_tensor import FakeTensorMode

    device_profile = device_profile or DEFAULT_FAKE_PROFILE
    profile = get_profile(device_profile)
    with fake_process_group(world_size, replicas) as mesh, FakeTensorMode():
        return record_rank(workload, mesh, world_size, backend="fake", profile=profile, steps=steps, warmup=warmup,
                           loop=loop, reshard_after_forward=reshard_after_forward, check_tracker=check_tracker,
                           progress=progress, prefetch=prefetch, mixed_precision=mixed_precision)


def record_rank(workload: Workload, mesh, world_size: int, *, backend: str, profile, steps: int, warmup: int,
                loop: Loop, reshard_after_forward: Reshard | dict[str, Reshard], check_tracker: bool, record: bool = True,
                progress: Callable[[str], None] | None = None, prefetch: dict[str, dict] | None = None,
                mixed_precision: dict | None = None) -> Trace | None:
    """This rank's part of a sharded recording, inside its process group: build (fake when
    ``backend`` is ``fake``), shard, warm up, then ``steps`` steps, recorded when ``record``
    (rank 0) and run alike otherwise (the other ranks take part in every collective), then
    the ``FSDPMemTracker`` step. Returns rank 0's trace (None on other ranks)."""
    fake = backend == "fake"
    say = progress or (lambda msg: None)
    say(f"building {workload.name}")
    model, batch, loss_fn, optimizer = workload.build(fake)
    say(f"sharding over {world_size} ranks")
    shard_model(model, mesh, reshard_after_forward, prefetch, mixed_precision)
    optimizer = rebuild_optimizer(optimizer, model)
    step = make_step_fn(model, batch, loss_fn, optimizer, where=workload.name, loop=loop)
    inputs = [batch, list(getattr(loss_fn, "inputs", ()))]
    for w in range(warmup):
        say(f"warm-up step {w + 1}/{warmup}")
        optimizer.zero_grad(set_to_none=loop.set_to_none)
        step()
    fsdp = describe_layout(model, mesh, world_size, backend)
    records = []
    with StepRecording(model, optimizer, profile if fake else None) as session:
        session.recorder.world_size = world_size
        instrument = FsdpInstrument(session, model)
        try:
            for s in range(steps):
                say(f"recording step {s + 1}/{steps}")
                optimizer.zero_grad(set_to_none=loop.set_to_none)
                if not record:
                    step()
                    continue
                instrument.begin_step()
                session.begin(inputs)
                step()
                rec = session.end()
                rec.extras["fsdp_spans"] = instrument.spans
                records.append(rec)
        finally:
            instrument.close()
    if check_tracker:
        say("checking against FSDPMemTracker")
        fsdp["mem_tracker"] = tracker_peak(model, optimizer, step, inputs, loop.set_to_none)
    # When the step's own code lets go of each storage, as a one-process recording learns it
    # (a module that leaves a tensor in the model's state, a KV cache, is then never
    # partitioned: partition.leaves_state). Every rank runs the probe (its forward gathers);
    # its backward never runs, so nothing steps after it.
    optimizer.zero_grad(set_to_none=loop.set_to_none)
    add_python_refs(records[-1] if record else None, model, optimizer, step, step_tensors(model, optimizer, inputs),
                    profile if fake else None, say)
    del model, batch, loss_fn, optimizer, step, session
    if not record:
        return None
    kept = records[-1]
    fsdp["op_spans"] = kept.extras["fsdp_spans"]
    fsdp["incarnations"] = [rows for rows in kept.incarnations.values() if len(rows) > 1]
    if profile is not None:
        fsdp["collective_link_bytes_per_s"] = profile.link_bytes_per_s(world_size)
    say("building tables")
    trace = trace_from_records(records, warmup=warmup, fake=fake, loop=loop, meta={
        "device": "cpu",
        "workload": {"name": workload.name, "kind": workload.kind, "args": workload.args},
        "device_profile": profile.name if profile is not None else None,
        "dtype": workload.dtype,
        "step_definition": STEP_DEFINITION,
    })
    trace.meta["fsdp"] = fsdp
    return trace


def _record_real(workload: Workload, world_size: int, *, device_profile, steps, warmup, loop: Loop,
                 reshard_after_forward, check_tracker, progress, mixed_precision=None, replicas=1) -> Trace:
    import tempfile

    from ..torch_common.processes import spawn_ranks
    from ..trace.format import read_trace

    if workload.kind not in ("builtin", "entry"):
        raise UsageError("A real sharded recording rebuilds the workload in each rank's process: only a built-in "
                         "model or an --entry can be recorded so.")
    say = progress or (lambda msg: None)
    say(f"running {world_size} gloo ranks")
    with tempfile.TemporaryDirectory(prefix="taichi-fsdp-") as d:
        out = Path(d) / "trace"
        spawn_ranks(world_size, "taichi_plan.record.fsdp_rank:record_rank", {
            "workload": {"name": workload.name, "kind": workload.kind, "args": workload.args},
            "device_profile": device_profile, "steps": steps, "warmup": warmup, "loop": loop.to_json(),
            "reshard_after_forward": reshard_after_forward, "check_tracker": check_tracker, "out": str(out),
            "mixed_precision": mixed_precision, "replicas": replicas})
        trace = read_trace(out)
    trace.path = None
    for key in ("name", "num_ops", "num_tensors", "content_hash", "format_version"):
        trace.meta.pop(key, None)  # written again where the caller writes the trace
    return trace


def trace_by_tracker_category(trace: Trace) -> tuple[int, int, dict[str, int]]:
    """The trace's baseline peak, its op, and the live bytes there per :data:`TRACKER_KINDS`
    category: what to hold against ``meta.fsdp.mem_tracker``."""
    from ..trace.format import baseline_live_bytes, baseline_peak

    peak, at = baseline_peak(trace)
    live = baseline_live_bytes(trace, by_kind=True)
    return peak, at, {cat: int(sum(live[k][at] for k in kinds)) for cat, kinds in TRACKER_KINDS.items()}
