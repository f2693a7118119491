"""One rank of a real sharded recording, as :func:`taichi_plan.torch_common.processes.spawn_ranks`
starts it (:func:`taichi_plan.record.fsdp.record_fsdp_workload` with ``fake=False``)."""

from __future__ import annotations

import json
from pathlib import Path

from ..base.errors import TaichiError
from ..torch_common.processes import init_gloo


def record_rank(rank: int, nproc: int, port: int, out_dir: str, workload: dict, device_profile, steps: int,
                warmup: int, loop: dict, reshard_after_forward, check_tracker: bool, out: str,
                mixed_precision: dict | None = None, replicas: int = 1) -> None:
    """One rank of a real sharded recording (:func:`taichi_plan.record.fsdp.record_fsdp_workload`
    with ``fake=False``): rank 0 records and writes the trace to ``out``."""
    import torch
    import torch.distributed as dist

    from ..trace.devices import get_profile
    from ..trace.format import write_trace
    from . import Loop, get_workload
    from . import fsdp as fsdp_record

    result: dict = {"rank": rank}
    try:
        mesh = init_gloo(rank, nproc, port, replicas)
        try:
            kw = dict(workload["args"])
            wl = (get_workload(model=workload["name"], **kw) if workload["kind"] == "builtin"
                  else get_workload(entry=workload["name"], **kw))
            torch.manual_seed(0)
            trace = fsdp_record.record_rank(
                wl, mesh, nproc, backend="gloo", profile=None, steps=steps, warmup=warmup, loop=Loop(**loop),
                reshard_after_forward=reshard_after_forward, check_tracker=check_tracker, record=rank == 0,
                mixed_precision=mixed_precision)
            if trace is not None:
                trace.meta["device_profile"] = get_profile(device_profile).name if device_profile else None
                write_trace(trace, out)
        finally:
            dist.destroy_process_group()
    except TaichiError as e:
        result["error"] = f"rank {rank}: {e}"
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
