"""Roofline cost of one op on a device profile: what a fake recording uses for ``duration_s``.

``duration_s = max(flops / peak_flops[dtype], bytes_moved / bandwidth) + launch_overhead``,
where ``bytes_moved`` is the op's tensor inputs plus the outputs it writes (tensor bytes, not
storage bytes), and ``dtype`` is the dtype of its first floating-point input. fp32 uses the
plain fp32 peak, not TF32 (PyTorch leaves TF32 matmuls off by default). Ops that launch no
kernel (views, ``detach``, metadata) cost 0; the recorder decides which those are.
"""

from __future__ import annotations

from .devices import DeviceProfile

_TORCH_DTYPE_KEYS = {
    "torch.float32": "fp32",
    "torch.float64": "fp32",
    "torch.float16": "fp16",
    "torch.bfloat16": "bf16",
}


def dtype_key(torch_dtype) -> str:
    """``torch.bfloat16`` -> ``bf16``; anything that is not a half type -> ``fp32``."""
    return _TORCH_DTYPE_KEYS.get(str(torch_dtype), "fp32")


def estimate_duration_s(profile: DeviceProfile, flops: int, bytes_moved: int, dtype: str = "fp32") -> float:
    """Roofline estimate (seconds) of one kernel on ``profile``."""
    compute_s = flops / profile.flops_per_s(dtype) if flops else 0.0
    memory_s = bytes_moved / profile.bandwidth_bytes_per_s if bytes_moved else 0.0
    return max(compute_s, memory_s) + profile.launch_overhead_s


# Ring collectives: the fraction of the full buffer each device sends (and receives) per call.
# all-gather / reduce-scatter over n devices move (n-1)/n of the full (gathered) buffer; an
# all-reduce is a reduce-scatter then an all-gather: 2 (n-1)/n.
_RING_FACTOR = {
    "allgather": 1, "all_gather": 1, "reduce_scatter": 1, "allreduce": 2, "all_reduce": 2, "broadcast": 1,
}
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")


def collective_kind(op_name: str) -> str | None:
    """``c10d._allgather_base_.default`` -> ``allgather``; None for an op that is no collective."""
    parts = op_name.split(".")
    if len(parts) < 2 or parts[0] not in COLLECTIVE_NAMESPACES:
        return None
    stem = parts[1].strip("_").removesuffix("_base").removesuffix("_into_tensor").removesuffix("_tensor")
    stem = stem.removesuffix("_coalesced").strip("_")
    return stem if stem in _RING_FACTOR else None


def collective_duration_s(profile: DeviceProfile, op_name: str, full_nbytes: int, world_size: int,
                          across_nodes: bool | None = None) -> float:
    """Ring estimate (seconds) of one collective over ``world_size`` devices of ``profile``,
    ``full_nbytes`` being the gathered (all-gather output, reduce-scatter input, all-reduce)
    buffer: ``factor * (n-1)/n * full_nbytes / link bandwidth + launch overhead``, the link the
    slowest one the ring crosses: between nodes where ``across_nodes`` says its ranks span
    several, else within one; None: judged from the count alone
    (:meth:`DeviceProfile.link_bytes_per_s`: consecutive ranks). A collective that is not a
    ring one (a barrier, a wait) costs the launch overhead only."""
    kind = collective_kind(op_name)
    n = max(int(world_size), 1)
    if kind is None or n == 1 or not full_nbytes:
        return profile.launch_overhead_s
    moved = _RING_FACTOR[kind] * (n - 1) / n * full_nbytes
    link = (profile.link_bytes_per_s(n) if across_nodes is None
            else profile.inter_node_bytes_per_s if across_nodes else profile.intra_node_bytes_per_s)
    return moved / link + profile.launch_overhead_s
