"""Record, on a CPU, the kernels a GPU runs: the known CPU/GPU differences mapped at record time.

A CPU build of torch records CPU kernels even for a GPU device profile (DESIGN.md section 9), and
a plan's replay guard compares op names, so a fake GPU-profile trace must hold what the GPU
runs. :func:`gpu_kernels` maps, for as long as it is active:

- **dropout** (``F.dropout`` / ``torch.dropout``, not in place, ``0 < p < 1``, training): the
  CPU decomposes it (``empty_like``, ``bernoulli_``, ``div_``, ``mul``, a float mask); CUDA's
  ``at::dropout`` calls the fused ``native_dropout`` (output + bool mask; backward
  ``native_dropout_backward``) when ``is_fused_kernel_acceptable`` (a CUDA tensor, ``0 < p < 1``,
  not empty; ``aten/src/ATen/native/Dropout.cpp``). ``native_dropout`` has a CPU kernel, so the
  mapping calls it directly.
- **attention** (``F.scaled_dot_product_attention``): the kernel CUDA's ``select_sdp_backend``
  (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``) would pick for these shapes,
  dtypes and the profile's compute capability, in its default order flash, memory-efficient,
  math (:func:`choose_sdpa`), called the way ``scaled_dot_product_attention`` in
  ``aten/src/ATen/native/transformers/attention.cpp`` calls it (flash: head dim padded to a
  multiple of 8, output sliced back; efficient: a bool mask made additive, an unaligned mask
  padded to 8, ``compute_log_sumexp`` only when a gradient is wanted; math: the composite
  ``_scaled_dot_product_attention_math``, whose dropout is then ``native_dropout``).
  Fused kernels save output + logsumexp (flash: ``[B, H, S]`` fp32; efficient:
  ``[B, H, ceil(S/32)*32]`` fp32) + philox seed/offset, never the ``S x S`` matrix.
  Under ``FakeTensorMode`` their shapes, dtypes and strides are the meta registrations'
  (``torch/_meta_registrations.py``); on real CPU tensors :mod:`.fused_cpu` gives them kernels
  that compute the same values with the math.
- **optimizers**: ``foreach=None`` becomes ``foreach=True`` (``_default_to_fused_or_foreach``
  picks foreach when every parameter is a CUDA tensor: ``torch/optim/optimizer.py``), so the
  optimizer step is ``_foreach_*`` over all parameters, as on a GPU.

Not mapped (said in ``meta.gpu_kernels.not_mapped``): cuDNN attention (preferred on sm90/sm100
by recent torch when cuDNN > 9.15: a runtime version a profile does not know), batch norm
(``cudnn_batch_norm`` and its reserve buffer), ``clip_grad_norm_`` (foreach on CUDA), kernel
workspaces (cuBLAS, flash backward's fp32 accumulators) and NCCL buffers: no trace holds memory
an op allocates and frees inside itself.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..trace.devices import DeviceProfile
from .fused_cpu import register_cpu_kernels

_aten = torch.ops.aten
FLASH = "aten._scaled_dot_product_flash_attention.default"
EFFICIENT = "aten._scaled_dot_product_efficient_attention.default"
FUSED_ATTENTION_OPS = (FLASH, EFFICIENT, "aten._scaled_dot_product_flash_attention_backward.default",
                       "aten._scaled_dot_product_efficient_attention_backward.default")
NOT_MAPPED = [
    "cuDNN attention (_scaled_dot_product_cudnn_attention): recent torch prefers it on sm90/sm100 when the "
    "runtime cuDNN is newer than 9.15.0, which a device profile does not know",
    "batch norm: cudnn_batch_norm (and its reserve buffer) on a GPU, native_batch_norm here",
    "clip_grad_norm_: foreach over all gradients on a GPU, one norm per gradient here",
    "memory an op allocates and frees inside itself (cuBLAS/cuDNN workspaces, flash backward's fp32 "
    "accumulators), NCCL buffers, the CUDA context: in no trace",
]


@dataclass
class GpuTarget:
    """The GPU whose kernels are recorded: a profile with a compute capability."""

    profile: str
    compute_capability: tuple[int, int]
    choices: dict[str, str] = field(default_factory=dict)  # sdpa kernel -> why (first call of each distinct why)
    optimizers: int = 0  # param groups switched to foreach

    def record_choice(self, kernel: str, why: str) -> None:
        self.choices.setdefault(f"{kernel}: {why}", kernel)

    def to_meta(self, ops: list[str]) -> dict:
        """``meta.gpu_kernels``: what was mapped, and the mapped ops' counts in the kept step."""
        counted = ("aten.native_dropout.default", "aten.native_dropout_backward.default", *FUSED_ATTENTION_OPS)
        counts = {name: ops.count(name) for name in counted if name in ops}
        return {
            "profile": self.profile,
            "compute_capability": f"{self.compute_capability[0]}.{self.compute_capability[1]}",
            "mapped": ["dropout -> native_dropout", "scaled_dot_product_attention -> the CUDA backend choice",
                       "optimizer foreach=None -> foreach=True"],
            "sdpa_choices": sorted(self.choices),
            "foreach_param_groups": self.optimizers,
            "op_counts": counts,
            "not_mapped": NOT_MAPPED,
        }


def target_of_trace(meta: dict) -> GpuTarget | None:
    """The mapping a trace was recorded with (``meta.gpu_kernels``), for a CPU replay to apply
    again so that its op stream is the trace's; None if the trace has none."""
    g = meta.get("gpu_kernels")
    if not isinstance(g, dict) or not g.get("compute_capability"):
        return None
    major, minor = (int(x) for x in str(g["compute_capability"]).split("."))
    return GpuTarget(str(g.get("profile")), (major, minor))


def target_for(profile: DeviceProfile | None, fake: bool, device: str) -> GpuTarget | None:
    """The GPU to map to: a fake recording of a CPU (or meta) model for a profile with a compute
    capability. Real recordings and models on a GPU record their own kernels."""
    if not fake or profile is None or device not in ("cpu", "meta"):
        return None
    cc = getattr(profile, "compute_capability", None)
    return GpuTarget(profile.name, tuple(cc)) if cc else None


# ---------------------------------------------------------------------------------------------
# Which attention kernel CUDA picks (sdp_utils.cpp: can_use_flash_attention,
# can_use_mem_efficient_attention, select_sdp_backend)
# ---------------------------------------------------------------------------------------------

_HALF = (torch.float16, torch.bfloat16)


def _in_sm_range(cc: tuple[int, int], lo: tuple[int, int], hi: tuple[int, int]) -> bool:
    return lo <= tuple(cc) <= hi


def _dense_common(q, k, v, enable_gqa: bool, ignore_singleton: bool) -> str | None:
    """check_nonzero_sequence_lengths_dense, check_last_dim_stride_equals_1_dense,
    check_batch_size_and_num_heads_dense (GQA only with ``enable_gqa``)."""
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return "a sequence length is 0"
    for t in (q, k, v):
        if t.stride(-1) != 1 and not (ignore_singleton and t.shape[-1] == 1):
            return "the last dimension is not contiguous"
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        return "q, k, v batch sizes differ"
    if not (q.shape[1] == k.shape[1] == v.shape[1]):
        if not enable_gqa or k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1]:
            return "q, k, v head counts differ (and enable_gqa does not allow it)"
    return None


def _flash_rejects(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, cc, grad) -> str | None:
    if not torch.backends.cuda.flash_sdp_enabled():
        return "flash disabled (torch.backends.cuda.enable_flash_sdp)"
    if attn_mask is not None:
        return "flash takes no attn_mask"
    d = q.shape[-1]
    if not (d == k.shape[-1] == v.shape[-1] and d <= 256):
        return f"flash needs equal head dims <= 256 (q {d}, k {k.shape[-1]}, v {v.shape[-1]})"
    if not _in_sm_range(cc, (8, 0), (12, 1)):
        return f"flash needs sm80..sm121, the profile is sm{cc[0]}{cc[1]}"
    if grad and (_in_sm_range(cc, (8, 6), (8, 9)) or _in_sm_range(cc, (12, 0), (12, 1))):
        if not (d <= 192 or (dropout_p == 0.0 and d > 224)):
            return f"flash backward on sm{cc[0]}{cc[1]} does not take head dim {d}"
    if is_causal and q.shape[-2] != k.shape[-2]:
        return "flash takes is_causal only with seqlen_q == seqlen_k"
    if q.dtype not in _HALF or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"flash needs fp16/bf16, got {str(q.dtype).replace('torch.', '')}"
    return _dense_common(q, k, v, enable_gqa, ignore_singleton=True)


def _gemm_alignment(dtype, cc) -> int:
    """minimum_gemm_alignment: elements the CUTLASS kernels need the head dim aligned to."""
    half = dtype in _HALF
    use_tc = cc[0] >= 8 or (cc[0] >= 7 and half)
    mn = 4 if cc[0] >= 8 else 1
    return max(mn, 128 // (16 if half else 32)) if use_tc else mn


def _efficient_rejects(q, k, v, enable_gqa, cc) -> str | None:
    if not torch.backends.cuda.mem_efficient_sdp_enabled():
        return "memory-efficient disabled (torch.backends.cuda.enable_mem_efficient_sdp)"
    if not _in_sm_range(cc, (5, 0), (12, 1)):
        return f"memory-efficient needs sm50..sm121, the profile is sm{cc[0]}{cc[1]}"
    align = _gemm_alignment(q.dtype, cc)
    if q.shape[-1] != k.shape[-1] or q.shape[-1] % align or v.shape[-1] % align or q.shape[-1] == 0:
        return f"memory-efficient needs head dims divisible by {align}"
    if cc[0] >= 8:
        nbytes = align * q.element_size()
        if any(t.storage_offset() * t.element_size() % nbytes for t in (q, k, v) if t.numel()):
            return f"memory-efficient on sm80+ needs q, k, v storage offsets aligned to {nbytes} bytes"
    why = _dense_common(q, k, v, enable_gqa, ignore_singleton=False)
    if why:
        return why
    ok = (torch.float16, torch.float32, torch.bfloat16) if cc[0] >= 8 else (torch.float16, torch.float32)
    if q.dtype not in ok or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"memory-efficient on sm{cc[0]}{cc[1]} does not take {str(q.dtype).replace('torch.', '')}"
    return None


def choose_sdpa(q, k, v, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                enable_gqa: bool = False, cc: tuple[int, int] = (8, 0), grad: bool = True) -> tuple[str, str]:
    """``("flash" | "efficient" | "math", why)``: the backend CUDA's ``select_sdp_backend`` picks
    in its default order (flash, memory-efficient, math), cuDNN attention left out (module doc)."""
    if any(t.dim() != 4 for t in (q, k, v)) or any(t.is_nested for t in (q, k, v)):
        return "math", "not 4-D dense q, k, v"
    no_flash = _flash_rejects(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa, cc, grad)
    if no_flash is None:
        return "flash", f"{str(q.dtype).replace('torch.', '')}, head dim {q.shape[-1]}, no mask"
    no_eff = _efficient_rejects(q, k, v, enable_gqa, cc)
    if no_eff is None:
        return "efficient", no_flash
    if not torch.backends.cuda.math_sdp_enabled():
        raise RuntimeError(f"No available SDPA kernel for this GPU profile: {no_flash}; {no_eff}; math disabled.")
    return "math", f"{no_flash}; {no_eff}"


# ---------------------------------------------------------------------------------------------
# The mapping itself
# ---------------------------------------------------------------------------------------------


def _bind(args, kwargs, names_defaults) -> list:
    out = []
    for i, (name, default) in enumerate(names_defaults):
        out.append(args[i] if i < len(args) else kwargs.get(name, default))
    return out


def fused_dropout(x, p: float, training: bool = True):
    """CUDA's ``at::dropout``: ``native_dropout`` when its fused kernel is acceptable, else what
    the CPU does too (identity, or ``mul`` by zero for ``p == 1``)."""
    if training and 0.0 < p < 1.0 and x.numel() > 0:
        return _aten.native_dropout(x, p, True)[0]
    return torch.dropout(x, p, training)


def _convert_bool_mask(mask, dtype):
    """convert_boolean_attn_mask: a bool mask becomes additive (0 where kept, -inf elsewhere)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask.logical_not(), -math.inf, torch.scalar_tensor(0.0, dtype=dtype, device=mask.device))


def _sdpa_math(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa):
    """``_scaled_dot_product_attention_math`` (attention.cpp), with CUDA's dropout."""
    neg = scale is not None and scale < 0
    factor = math.sqrt(abs(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    q = q * (-factor if neg else factor)
    if is_causal:
        mask = _convert_bool_mask(torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril(),
                                  q.dtype)
    if enable_gqa and q.shape[-3] != k.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    attn = torch.matmul(q, k.transpose(-2, -1) * factor)
    if mask is not None:
        attn.add_(mask)
    attn = _aten._safe_softmax(attn, -1)
    if dropout_p > 0.0:
        attn = fused_dropout(attn, dropout_p, True)
    return torch.matmul(attn, v)


def _pad_last_dim(t, to: int):
    d = t.shape[-1]
    return t if d % to == 0 else F.pad(t, (0, to - d % to))


def _aligned(t, alignment: int) -> bool:
    return all(t.stride(i) % alignment == 0 for i in range(t.dim() - 1)) and t.stride(-1) == 1


def _preprocess_mask(mask, q, k):
    """preprocess_mask (attention.cpp): pad an unaligned bias to a multiple of 8, expand to 4-D."""
    if not _aligned(mask, 8):
        d = mask.shape[-1]
        mask = F.pad(mask, (0, 8 - d % 8))[..., :d]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def gpu_sdpa(target: GpuTarget, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
    """``scaled_dot_product_attention`` as CUDA runs it on ``target``."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    backend, why = choose_sdpa(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa,
                               target.compute_capability, grad)
    target.record_choice(backend, why)
    mask = _convert_bool_mask(attn_mask, query.dtype)
    if backend == "flash":
        d = query.shape[-1]
        og_scale = scale if scale is not None else 1.0 / math.sqrt(d)
        out = _aten._scaled_dot_product_flash_attention(
            _pad_last_dim(query, 8), _pad_last_dim(key, 8), _pad_last_dim(value, 8), dropout_p, is_causal, False,
            scale=og_scale)[0]
        return out if out.shape[-1] == d else out[..., :d]
    if backend == "efficient":
        if mask is not None:
            mask = _preprocess_mask(mask, query, key)
        return _aten._scaled_dot_product_efficient_attention(query, key, value, mask, grad, dropout_p, is_causal,
                                                             scale=scale)[0]
    return _sdpa_math(query, key, value, mask, dropout_p, is_causal, scale, enable_gqa)


_DROPOUT_ARGS = (("input", None), ("p", 0.5), ("training", True), ("inplace", False))
_TORCH_DROPOUT_ARGS = (("input", None), ("p", 0.5), ("train", True))
_SDPA_ARGS = (("query", None), ("key", None), ("value", None), ("attn_mask", None), ("dropout_p", 0.0),
              ("is_causal", False), ("scale", None), ("enable_gqa", False))


class GpuKernelMode(TorchFunctionMode):
    """Above autograd: sends dropout and attention to the kernels ``target`` runs, so autograd
    records their GPU backward ops too."""

    def __init__(self, target: GpuTarget):
        super().__init__()
        self.target = target

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout or func is torch.dropout:
            x, p, training, *inplace = _bind(args, kwargs, _DROPOUT_ARGS if func is F.dropout else _TORCH_DROPOUT_ARGS)
            inplace = bool(inplace and inplace[0])
            if not inplace and isinstance(x, torch.Tensor) and 0.0 <= p <= 1.0:  # in-place: CUDA decomposes too
                return fused_dropout(x, p, training)
        elif func is F.scaled_dot_product_attention:
            bound = _bind(args, kwargs, _SDPA_ARGS)
            if all(isinstance(t, torch.Tensor) for t in bound[:3]):
                return gpu_sdpa(self.target, *bound)
        return func(*args, **kwargs)


def prepare_optimizer(optimizer) -> int:
    """Set ``foreach=True`` where the optimizer would choose (``foreach=None``, not fused, not
    differentiable): on CUDA parameters it chooses foreach. Returns the groups changed."""
    changed = 0
    for group in getattr(optimizer, "param_groups", []):
        if "foreach" in group and group["foreach"] is None and not group.get("fused") \
                and not group.get("differentiable"):
            group["foreach"] = True
            changed += 1
    return changed


@contextlib.contextmanager
def gpu_kernels(target: GpuTarget, optimizer=None):
    """Map dropout, attention and the optimizer to ``target``'s kernels while active (see the
    module doc); real CPU tensors get the fused attention kernels' CPU stand-ins."""
    register_cpu_kernels()
    if optimizer is not None:
        target.optimizers += prepare_optimizer(optimizer)
    with GpuKernelMode(target):
        yield target
