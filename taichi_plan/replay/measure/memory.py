"""Whether a replay fits this machine: the memory it may use here (free CUDA memory, or
available RAM), the refusal of a replay whose runs do not fit it unless forced
(:func:`check_memory`), and an allocation that fails while the workload runs said as
:class:`~taichi_plan.base.errors.NotEnoughMemoryError` (:func:`out_of_memory_said`)."""

from __future__ import annotations

import contextlib
import os

from ...base.errors import NotEnoughMemoryError
from ...base.units import format_bytes
from ...plan.format import Plan


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


@contextlib.contextmanager
def out_of_memory_said(memory: dict, device: str):
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
