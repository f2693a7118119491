"""The replay runtime's offload copies (plan v14): a storage to host memory and back.

On CUDA (``torch.cuda.is_available()`` and a CUDA storage): the copy to host runs on a side
stream of its own into pinned host memory, after the compute stream's work so far
(``wait_stream``); the device block is kept from reuse until the copy ends
(``record_stream``). The copy back allocates its device block on the compute stream (where
the plan's prefetch point issues it) and fills it on a second side stream, after the copy out
has ended (its event); the compute stream waits for its event only where the storage is used
(:func:`wait_ready`). **This path is not tested**: the machines the test suite runs on have no
CUDA device.

Elsewhere (a CPU run) both copies are plain host-to-host copies (``torch.empty_like`` +
``copy_``), made where the plan says, so that an offload plan's schedule, guards and gradients
are tested on a CPU; the device peak of such a plan is the simulator's, not measured.
"""

from __future__ import annotations

import torch

_STREAMS: dict = {}


def _side_stream(device: torch.device, way: str):
    key = (str(device), way)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device)
    return _STREAMS[key]


def _cuda(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


def to_host(st: torch.UntypedStorage) -> tuple[torch.Tensor, object]:
    """A host copy of the bytes of ``st`` and the event its copy ends with (None off CUDA)."""
    src = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)
    if not _cuda(src.device):
        return torch.empty_like(src).copy_(src), None
    stream = _side_stream(src.device, "out")
    stream.wait_stream(torch.cuda.current_stream(src.device))
    host = torch.empty(src.shape, dtype=torch.uint8, pin_memory=True)
    with torch.cuda.stream(stream):
        host.copy_(src, non_blocking=True)
    src.record_stream(stream)
    return host, stream.record_event()


def to_device(host: torch.Tensor, ready, device: torch.device) -> tuple[torch.UntypedStorage, object]:
    """``host`` copied back to ``device`` (after the event ``ready`` of its copy out), and the
    event the copy ends with (None off CUDA)."""
    if not _cuda(device):
        return torch.empty_like(host).copy_(host).untyped_storage(), None
    stream = _side_stream(device, "in")
    dev = torch.empty(host.shape, dtype=torch.uint8, device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    if ready is not None:
        stream.wait_event(ready)
    with torch.cuda.stream(stream):
        dev.copy_(host, non_blocking=True)
    dev.record_stream(stream)
    return dev.untyped_storage(), stream.record_event()


def wait_ready(st: torch.UntypedStorage, ready) -> None:
    """The compute stream waits for the copy that filled ``st`` (nothing off CUDA)."""
    if ready is not None and _cuda(st.device):
        torch.cuda.current_stream(st.device).wait_event(ready)
