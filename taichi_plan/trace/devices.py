"""Device profiles: the public spec-sheet numbers a fake recording's roofline estimate uses.

A profile gives the memory capacity, the peak *dense* FLOP/s per dtype (no structured-sparsity
numbers), the memory bandwidth and a per-kernel launch overhead. Each number carries a
``source`` note. Memory sizes are the nominal capacity in binary units (a "40GB" A100 reports
40,960 MiB), since that is what the allocator can hand out at most.

This module never imports torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ..base.errors import UsageError

GIB = 2**30
TERA = 10**12
GIGA = 10**9
DTYPES = ("fp32", "tf32", "fp16", "bf16")


@dataclass(frozen=True)
class DeviceProfile:
    """One accelerator's public numbers.

    ``peak_flops`` maps a dtype (``fp32``, ``tf32``, ``fp16``, ``bf16``) to dense FLOP/s; a
    dtype the chip has no fast path for is absent (``flops_per_s`` falls back to fp32).
    ``sources`` maps each field name (and ``peak_flops.<dtype>``) to where the number is from.
    ``compute_capability`` (``(8, 0)`` for sm80) decides which kernels a fake recording maps to
    (``taichi_plan.record.gpu_ops``: flash attention needs sm80+, for instance).
    """

    name: str
    title: str
    memory_bytes: int
    peak_flops: dict[str, float]
    bandwidth_bytes_per_s: float
    launch_overhead_s: float
    sources: dict[str, str] = field(default_factory=dict)
    # Collective bandwidth per device and direction (bytes/s): within a node (NVLink, or PCIe
    # where the card has no NVLink) and between nodes (the InfiniBand NICs of the vendor's
    # reference system, per device). ``devices_per_node``: devices one node of that system holds.
    intra_node_bytes_per_s: float = 0.0
    inter_node_bytes_per_s: float = 0.0
    devices_per_node: int = 8

    def link_bytes_per_s(self, world_size: int) -> float:
        """The bandwidth a ring collective over ``world_size`` devices runs at: the slowest
        link it crosses (within one node up to ``devices_per_node`` devices, else between nodes)."""
        return self.intra_node_bytes_per_s if world_size <= self.devices_per_node else self.inter_node_bytes_per_s
    compute_capability: tuple[int, int] | None = None  # CUDA sm version; None: not a CUDA GPU
    # Host link bandwidth per direction (bytes/s) an offload's copies run at: the *effective*
    # rate of pinned-memory copies over the card's PCIe link, or NVLink-C2C on a Grace Hopper.
    host_link_bytes_per_s: float = 0.0

    def flops_per_s(self, dtype: str) -> float:
        """Peak dense FLOP/s for ``dtype`` (``fp32``/``bf16``/``fp16``/``tf32``; torch names too)."""
        key = _DTYPE_ALIASES.get(dtype, dtype)
        return self.peak_flops.get(key) or self.peak_flops["fp32"]

    def to_dict(self) -> dict:
        return asdict(self)


_DTYPE_ALIASES = {
    "float32": "fp32",
    "torch.float32": "fp32",
    "float": "fp32",
    "float16": "fp16",
    "torch.float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
}

_LAUNCH_NOTE = "typical CUDA kernel launch latency (~5 us); an estimate, not a datasheet number"


_CC_SOURCE = "NVIDIA CUDA GPUs compute capability table (developer.nvidia.com/cuda-gpus)"

# Collective bandwidth (GB/s per device, each way) within a node and between nodes, with sources.
_NVLINK = "NVLink {both} GB/s (both directions), {each} GB/s each way"
_NO_SYSTEM = "no reference system: one 100 Gb/s (12.5 GB/s) network link per GPU assumed"
_DGX_A100 = ("NVIDIA DGX A100 datasheet: 8x single-port ConnectX-6 200 Gb/s HDR InfiniBand, one per GPU "
             "(25 GB/s)")
_LINKS = {
    "v100-16gb": (150, "NVIDIA Tesla V100 datasheet (SXM2): " + _NVLINK.format(both=300, each=150),
                  12.5, "NVIDIA DGX-1 with V100 datasheet: 4x 100 Gb/s EDR InfiniBand per 8 GPUs; taken as "
                        "one 100 Gb/s (12.5 GB/s) link per GPU, an upper estimate"),
    "t4-16gb": (16, "NVIDIA T4 Tensor Core GPU datasheet: PCIe Gen3 x16, 32 GB/s (both directions), 16 GB/s "
                    "each way (no NVLink)", 12.5, _NO_SYSTEM),
    "a100-40gb": (300, "NVIDIA A100 Tensor Core GPU datasheet (SXM4): " + _NVLINK.format(both=600, each=300),
                  25, _DGX_A100),
    "a100-80gb": (300, "NVIDIA A100 Tensor Core GPU datasheet (SXM4): " + _NVLINK.format(both=600, each=300),
                  25, _DGX_A100),
    "h100-80gb": (450, "NVIDIA H100 Tensor Core GPU datasheet (SXM): " + _NVLINK.format(both=900, each=450),
                  50, "NVIDIA DGX H100 datasheet: 8x ConnectX-7 400 Gb/s NDR InfiniBand, one per GPU (50 GB/s)"),
    "h200-141gb": (450, "NVIDIA H200 Tensor Core GPU datasheet (SXM): " + _NVLINK.format(both=900, each=450),
                   50, "NVIDIA DGX H200 datasheet: 8x ConnectX-7 400 Gb/s NDR InfiniBand, one per GPU (50 GB/s)"),
    "gh200-96gb": (450, "NVIDIA GH200 Grace Hopper Superchip datasheet: NVLink 900 GB/s (both directions), 450 GB/s "
                        "each way between GPUs", 12.5, _NO_SYSTEM),
    "rtx-4090-24gb": (32, "NVIDIA Ada Lovelace GPU architecture whitepaper (RTX 4090): PCIe Gen4 x16, 64 GB/s "
                          "(both directions), 32 GB/s each way (no NVLink)", 12.5, _NO_SYSTEM),
}


# Host link per direction (GB/s effective, pinned memory) and where it is from. PCIe figures are the
# link's raw rate per direction less the ~20% that packet headers and flow control take in measured
# pinned copies (CUDA's bandwidthTest reaches 12-13 GB/s on PCIe 3 x16, ~25 on Gen4, ~50 on Gen5).
_PCIE = "PCIe Gen{gen} x16: {raw} GB/s raw per direction, ~{eff} GB/s effective for pinned copies (about 80%)"
_HOST_LINKS = {
    "v100-16gb": (12, "NVIDIA Tesla V100 datasheet: host interface " + _PCIE.format(gen=3, raw="15.75", eff=12)),
    "t4-16gb": (12, "NVIDIA T4 Tensor Core GPU datasheet: " + _PCIE.format(gen=3, raw="15.75", eff=12)),
    "a100-40gb": (25, "NVIDIA A100 Tensor Core GPU datasheet: " + _PCIE.format(gen=4, raw="31.5", eff=25)),
    "a100-80gb": (25, "NVIDIA A100 Tensor Core GPU datasheet: " + _PCIE.format(gen=4, raw="31.5", eff=25)),
    "h100-80gb": (50, "NVIDIA H100 Tensor Core GPU datasheet: PCIe Gen5 128 GB/s (both directions); "
                      + _PCIE.format(gen=5, raw=63, eff=50)),
    "h200-141gb": (50, "NVIDIA H200 Tensor Core GPU datasheet: PCIe Gen5 128 GB/s (both directions); "
                       + _PCIE.format(gen=5, raw=63, eff=50)),
    "rtx-4090-24gb": (25, "NVIDIA Ada Lovelace GPU architecture whitepaper (RTX 4090): "
                          + _PCIE.format(gen=4, raw="31.5", eff=25)),
    "gh200-96gb": (450, "NVIDIA GH200 Grace Hopper Superchip datasheet: NVLink-C2C 900 GB/s (both directions), "
                        "450 GB/s each way between the Grace CPU's memory and the H100"),
}


def _profile(name, title, mem_gib, flops_tf, bw_gbs, sheet, mem_note, extra=None, cc=None):
    intra_gbs, intra_note, inter_gbs, inter_note = _LINKS[name]
    host_gbs, host_note = _HOST_LINKS[name]
    sources = {
        "host_link_bytes_per_s": host_note,
        "intra_node_bytes_per_s": intra_note,
        "inter_node_bytes_per_s": inter_note,
        "memory_bytes": f"{sheet}: {mem_note}",
        "bandwidth_bytes_per_s": f"{sheet}: {bw_gbs:,} GB/s memory bandwidth",
        "launch_overhead_s": _LAUNCH_NOTE,
    }
    for dt, tf in flops_tf.items():
        sources[f"peak_flops.{dt}"] = f"{sheet}: {tf} TFLOPS {_FLOP_NOTE[dt]}"
    if cc is not None:
        sources["compute_capability"] = f"{_CC_SOURCE}: {cc[0]}.{cc[1]}"
    sources.update(extra or {})
    return DeviceProfile(
        name=name,
        title=title,
        memory_bytes=int(mem_gib * GIB),
        peak_flops={dt: tf * TERA for dt, tf in flops_tf.items()},
        bandwidth_bytes_per_s=bw_gbs * GIGA,
        launch_overhead_s=5e-6,
        sources=sources,
        intra_node_bytes_per_s=intra_gbs * GIGA,
        inter_node_bytes_per_s=inter_gbs * GIGA,
        compute_capability=cc,
        host_link_bytes_per_s=host_gbs * GIGA,
    )


_FLOP_NOTE = {
    "fp32": "FP32 (non-tensor-core)",
    "tf32": "TF32 tensor core, dense",
    "fp16": "FP16 tensor core with FP32 accumulate, dense",
    "bf16": "BF16 tensor core with FP32 accumulate, dense",
}

PROFILES: dict[str, DeviceProfile] = {
    p.name: p
    for p in [
        _profile(
            "v100-16gb", "NVIDIA V100 SXM2 16GB", 16,
            {"fp32": 15.7, "fp16": 125.0}, 900,
            "NVIDIA Tesla V100 datasheet (SXM2)", "16 GB HBM2",
            {"peak_flops.bf16": "V100 has no BF16 tensor cores: bf16 uses the fp32 number"},
            cc=(7, 0),
        ),
        _profile(
            "t4-16gb", "NVIDIA T4 16GB", 16,
            {"fp32": 8.1, "fp16": 65.0}, 320,
            "NVIDIA T4 Tensor Core GPU datasheet", "16 GB GDDR6",
            {"peak_flops.bf16": "T4 has no BF16 tensor cores: bf16 uses the fp32 number"},
            cc=(7, 5),
        ),
        _profile(
            "a100-40gb", "NVIDIA A100 SXM4 40GB", 40,
            {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0}, 1555,
            "NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB)", "40 GB HBM2",
            cc=(8, 0),
        ),
        _profile(
            "a100-80gb", "NVIDIA A100 SXM4 80GB", 80,
            {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0}, 2039,
            "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB)", "80 GB HBM2e",
            cc=(8, 0),
        ),
        _profile(
            "h100-80gb", "NVIDIA H100 SXM5 80GB", 80,
            {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4}, 3350,
            "NVIDIA H100 Tensor Core GPU datasheet (SXM)", "80 GB HBM3",
            cc=(9, 0),
        ),
        _profile(
            "h200-141gb", "NVIDIA H200 SXM 141GB", 141,
            {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4}, 4800,
            "NVIDIA H200 Tensor Core GPU datasheet (SXM)",
            "141 GB HBM3e, taken as 141 GiB like the other profiles' nominal capacities (the device "
            "itself reports a little less to the allocator)",
            {"peak_flops.tf32": "NVIDIA H200 Tensor Core GPU datasheet (SXM): 989 TFLOPS TF32 tensor core "
                                "with sparsity, halved to the dense 494.7",
             "peak_flops.fp16": "NVIDIA H200 Tensor Core GPU datasheet (SXM): 1,979 TFLOPS FP16 tensor core "
                                "with sparsity, halved to the dense 989.4",
             "peak_flops.bf16": "NVIDIA H200 Tensor Core GPU datasheet (SXM): 1,979 TFLOPS BF16 tensor core "
                                "with sparsity, halved to the dense 989.4",
             "interconnect": "NVIDIA H200 Tensor Core GPU datasheet (SXM): NVLink 900 GB/s, PCIe Gen5 128 GB/s "
                             "(collectives use intra_node_bytes_per_s / inter_node_bytes_per_s)"},
            cc=(9, 0),
        ),
        _profile(
            "gh200-96gb", "NVIDIA GH200 Grace Hopper Superchip (H100 96GB)", 96,
            {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4}, 4000,
            "NVIDIA GH200 Grace Hopper Superchip datasheet", "96 GB HBM3 on the GPU",
            {"peak_flops.tf32": "NVIDIA GH200 Grace Hopper Superchip datasheet: 989 TFLOPS TF32 tensor core with "
                                "sparsity, halved to the dense 494.7",
             "peak_flops.fp16": "NVIDIA GH200 Grace Hopper Superchip datasheet: 1,979 TFLOPS FP16 tensor core with "
                                "sparsity, halved to the dense 989.4",
             "peak_flops.bf16": "NVIDIA GH200 Grace Hopper Superchip datasheet: 1,979 TFLOPS BF16 tensor core with "
                                "sparsity, halved to the dense 989.4"},
            cc=(9, 0),
        ),
        _profile(
            "rtx-4090-24gb", "NVIDIA GeForce RTX 4090 24GB", 24,
            {"fp32": 82.6, "tf32": 82.6, "fp16": 165.2, "bf16": 165.2}, 1008,
            "NVIDIA Ada Lovelace GPU architecture whitepaper (RTX 4090)", "24 GB GDDR6X",
            cc=(8, 9),
        ),
    ]
}


def known_profiles() -> list[str]:
    return list(PROFILES)


def get_profile(name: str) -> DeviceProfile:
    """The profile called ``name`` (case-insensitive); :class:`UsageError` lists the known ones."""
    key = str(name).strip().lower()
    if key in PROFILES:
        return PROFILES[key]
    raise UsageError(
        f"Unknown device profile {name!r}. Known profiles: {', '.join(PROFILES)}. "
        "Run `taichi-plan devices` to see their numbers."
    )


def profiles_table() -> list[dict]:
    """One row per profile, numbers in display units (GiB, TFLOP/s, GB/s, us)."""
    rows = []
    for p in PROFILES.values():
        rows.append(
            {
                "name": p.name,
                "memory_gib": p.memory_bytes / GIB,
                **{f"{dt}_tflops": (p.peak_flops[dt] / TERA if dt in p.peak_flops else None) for dt in DTYPES},
                "bandwidth_gbs": p.bandwidth_bytes_per_s / GIGA,
                "host_link_gbs": p.host_link_bytes_per_s / GIGA,
                "launch_us": p.launch_overhead_s * 1e6,
            }
        )
    return rows


def profiles_json() -> str:
    return json.dumps({name: p.to_dict() for name, p in PROFILES.items()}, indent=1)
