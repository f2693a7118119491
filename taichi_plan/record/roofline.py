"""Roofline cost of one op on a device profile: what a fake recording uses for ``duration_s``.

``duration_s = max(flops / peak_flops[dtype], bytes_moved / bandwidth) + launch_overhead``,
where ``bytes_moved`` is the op's tensor inputs plus the outputs it writes (tensor bytes, not
storage bytes), and ``dtype`` is the dtype of its first floating-point input. fp32 uses the
plain fp32 peak, not TF32 (PyTorch leaves TF32 matmuls off by default). Ops that launch no
kernel (views, ``detach``, metadata) cost 0; the recorder decides which those are.
"""

from __future__ import annotations

from ..devices import DeviceProfile

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
