"""When the step's own Python code lets go of each storage (trace v4, ``meta.python_refs``).

The replay runtime drops a storage by having autograd's pack hook keep a handle instead of
the tensor: the memory is given back only once every *other* reference to the storage is
gone. A model that keeps a tensor in a local until it returns (HF ``GPT2Attention`` keeps its
attention weights until the block returns), in a list, in the tuple it returns, or on
``self``, holds it after its last use, and dropping it frees nothing until then.

:func:`probe_step` learns those points. After the recorded steps it runs the step function
once more, forward only, under the recorder and under saved-tensor hooks whose pack keeps
nothing: autograd holds no tensor, so each storage dies exactly when the step's own
references die, and the recorder writes that down as it writes every free. The probe stops
when backward starts (``torch.autograd._engine_run_backward`` raises at its first call, before
any gradient is touched); a storage still alive then is held into backward. The generator
states are restored afterwards (``fork_rng``) and so are the model's buffers (batch-norm
statistics), so the probe changes nothing the user trains with; it costs one forward.

:func:`release_points` maps the probe's frees onto the recorded step: op by op, leaving out
the ops PyTorch's selective checkpointing ignores (saved-tensor hooks remove the ``detach``
of saved outputs), and storage by storage through (producer op, output position). Each
forward segment of the recorded step (the ops before a backward: one per micro-batch) whose
op sequence equals the probe's, or ends with it, is mapped; another one is listed as not
known. A segment may begin with ops of the loop's own that the probe does not run: the
Trainer adds the last micro-batch's loss to its running total after that backward, so its
second micro-batch's segment starts with that ``add``; those leading ops are not mapped.
"""

from __future__ import annotations

from collections.abc import Callable

from .recorder import Recorder
from .recorder.step_record import StepRecord


class _BackwardStarted(BaseException):
    """Raised by the probe's stand-in for the autograd engine: the forward is over.
    A ``BaseException`` so that a step function's ``except Exception`` does not swallow it."""


def _keep_nothing(_t):
    return None


def _refuse(_packed):
    raise RuntimeError("taichi-plan's Python-reference probe keeps no saved tensor; backward cannot run in it")


def probe_step(model, optimizer, step_fn: Callable[[], None], registered: list, profile=None
               ) -> tuple[StepRecord, list[int], int]:
    """Run ``step_fn`` forward only, with autograd keeping no tensor; returns the probe's record,
    each of its storages' last op alive (``-1``: still alive when backward started) and the
    number of ops it ran before backward. ``registered``: :meth:`Recorder.begin_step`'s list."""
    import torch

    recorder = Recorder(profile, model)
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    engine = torch.autograd._engine_run_backward
    seen: dict = {}

    def stop(*_args, **_kwargs):
        rec = recorder.current
        seen["free_op"] = list(rec.tensors["free_op"])
        seen["ops"] = recorder.op_count
        raise _BackwardStarted

    try:
        with torch.random.fork_rng(devices=devices):
            recorder.begin_step(registered)
            torch.autograd._engine_run_backward = stop
            try:
                with recorder, torch.autograd.graph.saved_tensors_hooks(_keep_nothing, _refuse):
                    step_fn()
            except _BackwardStarted:
                pass
            finally:
                torch.autograd._engine_run_backward = engine
            if not seen:  # a step without backward: everything the probe saw is known
                seen["free_op"] = list(recorder.current.tensors["free_op"])
                seen["ops"] = recorder.op_count
            rec = recorder.end_step([])
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        recorder.close()
    return rec, seen["free_op"], seen["ops"]


def _segments(phases: list[str]) -> list[tuple[int, int]]:
    """The forward segments of a recorded step: each run of ops before a backward op
    (``[start, end)``), one per micro-batch."""
    out, start = [], 0
    for i, p in enumerate(phases):
        if p == "backward":
            if start is not None and i > start:
                out.append((start, i))
            start = None
        elif start is None:
            start = i
    return out


def _outputs(rec: StepRecord) -> dict[tuple[int, int], int]:
    """(producer op, output position) -> tensor id, for every storage an op made."""
    producer = rec.tensors["producer_op"]
    acc = rec.accesses
    out = {}
    for op, tid, role, j in zip(acc["op_id"], acc["tensor_id"], acc["role"], acc["arg_index"], strict=True):
        if role == "write" and producer[tid] == op:
            out.setdefault((op, j), tid)
    return out


def release_points(main: StepRecord, probe: StepRecord, probe_free: list[int], probe_ops: int) -> dict:
    """``meta.python_refs`` of the recorded step ``main`` from the probe (:func:`probe_step`):
    ``release``, ``[tensor id, op]`` for each storage made in a mapped forward segment that its
    step's Python code holds after its last forward use: the last op it is alive when autograd
    keeps nothing, ``-1`` when it is still held when backward starts; ``segments`` and
    ``segments_known``, forward segments in the step and mapped; ``unknown_segments``, the first
    op of each segment that was not (its ops differ from the probe's)."""
    from ..torch_common.ops import IGNORED_OPS

    names, phases = main.ops["op"], main.ops["phase"]
    p_names = probe.ops["op"][:probe_ops]
    p_idx = [i for i, name in enumerate(p_names) if name not in IGNORED_OPS]
    p_key = [p_names[i] for i in p_idx]
    p_pos = []  # probe op -> index in p_idx of the last counted op at or before it
    k = -1
    for name in p_names:
        if name not in IGNORED_OPS:
            k += 1
        p_pos.append(k)
    p_made = _outputs(probe)
    m_made = _outputs(main)
    m_made_by: dict[int, list[tuple[int, int]]] = {}
    for (op, j), tid in m_made.items():
        m_made_by.setdefault(op, []).append((j, tid))
    last_fwd_use: dict[int, int] = {}
    acc = main.accesses
    for op, tid in zip(acc["op_id"], acc["tensor_id"], strict=True):
        if phases[op] == "forward" and op > last_fwd_use.get(tid, -1):
            last_fwd_use[tid] = op
    segments = _segments(phases)
    release: list[list[int]] = []
    unknown: list[int] = []
    for start, end in segments:
        m_idx = [i for i in range(start, end) if names[i] not in IGNORED_OPS]
        lead = len(m_idx) - len(p_key)  # ops of the loop's own before this forward (see above)
        if lead < 0 or [names[i] for i in m_idx[lead:]] != p_key:
            unknown.append(start)
            continue
        m_idx = m_idx[lead:]
        for k, op in enumerate(m_idx):
            for j, tid in m_made_by.get(op, ()):
                ptid = p_made.get((p_idx[k], j))
                if ptid is None:
                    continue
                f = probe_free[ptid]
                if f < 0 or f >= probe_ops:
                    rel = -1  # held when backward starts
                else:
                    q = p_pos[f]
                    rel = m_idx[q + 1] - 1 if q + 1 < len(m_idx) else end - 1
                if rel < 0 or rel > last_fwd_use.get(tid, op):
                    release.append([int(tid), int(rel)])
    return {"release": release, "segments": len(segments), "segments_known": len(segments) - len(unknown),
            "unknown_segments": unknown}
