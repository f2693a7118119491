"""The recorder's storage bookkeeping: the storage holding a tensor's memory on this rank
(``local_tensor``, a DTensor's local shard; ``storage_of``, which refuses tensors with no single
storage), the tensor subclasses let through to their local tensors, and ``StoragesMixin``
(composed by :class:`~taichi_plan.record.recorder.Recorder`): a row per storage and incarnation,
its free at the weakref callback, ``UntypedStorage.resize_`` followed while recording."""

from __future__ import annotations

import threading
import weakref
from functools import partial

import torch

_Tensor = torch.Tensor


def wrapper_subclasses() -> tuple:
    """Tensor subclasses whose ops the recorder lets through to their local tensors (DTensor)."""
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # a torch built without distributed
        return ()
    return (DTensor,)


def local_tensor(t):
    """The tensor holding ``t``'s memory on this rank: a DTensor's local shard, else ``t``."""
    return getattr(t, "_local_tensor", t) if isinstance(t, _Tensor) else t


def storage_of(x, op: str):
    """``x``'s untyped storage; a tensor without one (sparse, nested) is refused by name."""
    try:
        return x.untyped_storage()
    except (NotImplementedError, RuntimeError) as e:
        from ...base.errors import WorkloadError

        raise WorkloadError(
            f"The step uses a {str(x.layout).replace('torch.', '')} tensor (in {op}), which has no single storage "
            "to count: taichi-plan records dense (strided) tensors only. Sparse gradients come from "
            "nn.Embedding(sparse=True) or F.embedding(sparse=True): use sparse=False (dense gradients) to record "
            "and plan this step.") from e


class StoragesMixin:
    """The recorder's rows of storages: registering them, their frees and resizes, their kinds
    relabelled by add-ons (state set up by ``Recorder``)."""

    def _patch_resize(self) -> None:
        """``UntypedStorage.resize_`` reaches no dispatch mode (MemTracker patches it too)."""
        if self._orig_resize is not None:
            return
        orig = self._orig_resize = torch.UntypedStorage.resize_
        on_resize = self._on_resize

        def resize_(st, size):
            out = orig(st, size)
            on_resize(st)
            return out

        torch.UntypedStorage.resize_ = resize_

    def _restore_resize(self) -> None:
        if self._orig_resize is not None:
            torch.UntypedStorage.resize_ = self._orig_resize
            self._orig_resize = None

    def _on_resize(self, st) -> None:
        rec = self._rec
        if rec is None:
            return
        key = st._cdata
        nbytes = st.nbytes()
        tid = self._tid.get(key)
        tens = rec.tensors
        if tid is not None:
            if tens["nbytes"][tid] == nbytes:
                return
            self._end_incarnation(tid, key)
        if nbytes == 0:
            return
        kind, dtype, shape = self.storage_labels.get(key, (None, "uint8", [nbytes]))
        tid = self._register_storage(st, dtype, shape, self._n, -1, kind)
        rec.incarnations.setdefault(key, []).append(tid)

    def _end_incarnation(self, tid: int, key: int) -> None:
        """A storage shrank or grew: its current row ends with the last op that ran."""
        tens = self._rec.tensors
        self._tid.pop(key, None)
        rows = self._rec.incarnations.setdefault(key, [])
        if tid not in rows:  # its first row, registered before it was ever resized
            rows.append(tid)
        if self._n == 0:  # resized before the step's first op: the row never held memory in it
            tens["nbytes"][tid] = 0
            tens["free_op"][tid] = 0
            if tens["alloc_op"][tid] < 0:
                tens["alloc_op"][tid] = 0
        else:
            tens["free_op"][tid] = self._n - 1

    def relabel(self, t: torch.Tensor, kind: str) -> None:
        """Give the current row of ``t``'s storage the kind ``kind`` (an add-on that knows
        what a storage is: FSDP's unsharded gradients)."""
        if self._rec is not None:
            tid = self._tid.get(local_tensor(t).untyped_storage()._cdata)
            if tid is not None:
                self._rec.tensors["kind"][tid] = kind

    def tensor_id(self, t: torch.Tensor) -> int | None:
        """The current step's row of ``t``'s storage, None if the step has not seen it."""
        return self._tid.get(local_tensor(t).untyped_storage()._cdata) if self._rec is not None else None

    def _register(self, t, st, op_id: int, producer: int, kind: str | None) -> int:
        label = self.storage_labels.get(st._cdata) if kind is None else None
        return self._register_storage(st, str(t.dtype).replace("torch.", ""), list(t.shape), op_id, producer,
                                      label[0] if label else kind)

    def _register_storage(self, st, dtype: str, shape: list, op_id: int, producer: int, kind: str | None) -> int:
        key = st._cdata
        rec = self._rec
        tens = rec.tensors
        tid = len(tens["nbytes"])
        self._tid[key] = tid
        if key not in self._alive:
            self._alive[key] = weakref.ref(st, partial(self._on_free, key))
        tens["nbytes"].append(st.nbytes())
        tens["dtype"].append(dtype)
        tens["shape"].append(shape)
        tens["kind"].append(kind)
        tens["producer_op"].append(producer)
        tens["alloc_op"].append(op_id)
        tens["free_op"].append(-1)
        rec.producer_phase.append(rec.ops["phase"][producer] if producer >= 0 else None)
        return tid

    def _on_free(self, key: int, _ref) -> None:
        """A storage died: its row is freed after the last op that started. When the callback
        runs on another thread than the step's, a collective's worker (gloo's) held the last
        reference: it lets go just after it marks the collective done, so whether that is
        before or after the step's own code drops the tensor, and so at which op the storage
        dies, is a race between the threads. The row is kept in ``offthread_freed``."""
        self._alive.pop(key, None)
        tid = self._tid.pop(key, None)
        if tid is not None:
            self._rec.tensors["free_op"][tid] = max(self._n - 1, 0)
            if threading.get_ident() != self._thread:
                self.offthread_freed.append(tid)
