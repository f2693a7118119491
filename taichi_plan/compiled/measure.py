"""A step's peak as PyTorch's profiler sees the allocator, compiled code included.

Inductor allocates its buffers in generated code, below the dispatcher, so no dispatch mode
(the recorder, ``MemTracker``) sees them, and either would make dynamo fall back to eager. The
profiler's memory events (``profile_memory=True``) come from the allocator itself: every
allocation and free of the step, whoever made it. The peak is the bytes of the step's own
storages alive when it starts (parameters, gradients, optimizer state, the batch) plus the
highest running sum of the events. On CUDA the caching allocator's ``max_memory_allocated``
says the same directly.
"""

from __future__ import annotations

from collections.abc import Callable


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st._cdata not in seen:
            seen.add(st._cdata)
            total += st.nbytes()
    return total


def compiled_peak(step: Callable[[], None], model, optimizer, inputs=()) -> dict:
    """Run ``step()`` once under the profiler's memory events: ``peak_bytes`` (the step's
    storages alive at its start plus the events' highest running sum), ``start_bytes``,
    ``events``. ``model``/``optimizer``/``inputs``: what the step holds when it starts."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ..record.api import step_tensors

    start = _storage_bytes([t for _kind, ts in step_tensors(model, optimizer, inputs) for t in ts
                            if isinstance(t, torch.Tensor) and t.device.type == "cpu"])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    sizes = [size for _t, size in sorted(allocations(prof))]
    live = high = 0
    for size in sizes:
        live += size
        high = max(high, live)
    return {"peak_bytes": start + high, "start_bytes": start, "events": len(sizes), "end_delta_bytes": live}


def allocations(prof) -> list[tuple[int, int]]:
    """(time ns, bytes: negative for a free) of every allocator event the profiler recorded,
    from its event tree (``FunctionEvent`` lists keep only those under a recorded op)."""
    from torch._C._profiler import _EventType

    out, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            out.append((node.start_time_ns, int(node.extra_fields.alloc_size)))
        stack.extend(node.children)
    return out
