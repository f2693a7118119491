"""CPU kernels for CUDA's fused attention ops: the same values, by the math.

torch has no CPU kernels for ``_scaled_dot_product_{flash,efficient}_attention`` and their
backwards (they are CUDA-only). A trace recorded with a GPU's kernels (:mod:`.gpu_ops`) holds
them, so a CPU replay of its plan must run them: :func:`register_cpu_kernels` gives them CPU
kernels (``torch.library``, once per process; CPU attention itself never calls these ops) that
compute attention with the math in fp32 (fp64 for fp64) and write the outputs in the GPU
kernels' layouts and dtypes (``torch/_meta_registrations.py``). Dropout draws a seed from the
global generator (the GPU kernels consume philox offsets, and a rebuilt op with restored RNG
state draws the same), keeps it in the philox tensors, and backward regenerates the same mask
from it, as the GPU kernels do from their philox state.
"""

from __future__ import annotations

import math

import torch

_LIB = None


def register_cpu_kernels() -> None:
    """Give ``_scaled_dot_product_{flash,efficient}_attention`` and their backwards CPU kernels
    (once per process; torch has none: they are CUDA-only), so a replay on CPU of a GPU-profile
    trace runs the ops the trace holds. Fake tensors keep using the meta registrations."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    for name, kernel in (("_scaled_dot_product_flash_attention", _flash_cpu),
                         ("_scaled_dot_product_flash_attention_backward", _flash_backward_cpu),
                         ("_scaled_dot_product_efficient_attention", _efficient_cpu),
                         ("_scaled_dot_product_efficient_attention_backward", _efficient_backward_cpu)):
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "CPU"):  # a build may have one
            lib.impl(name, kernel, "CPU")
    _LIB = lib


def _new_seed() -> int:
    """A dropout seed from the global generator: the fused kernels consume RNG state (philox
    offsets) when ``dropout_p > 0``, and a rebuilt op with restored RNG state draws the same."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64))


def dropout_keep(seed: int, shape, p: float, device) -> torch.Tensor:
    """The dropout keep-mask of ``seed`` (the emulation's philox): True where kept."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return torch.rand(shape, generator=g, device=device) >= p


def _scores(q, k, bias, is_causal, scale):
    """Scaled scores ``q k^T * scale (+ bias, causal -inf)`` in fp32 (fp64 for fp64), [B,H,Sq,Sk]."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qa, ka = q.to(acc), k.to(acc)
    if ka.shape[1] != qa.shape[1]:
        ka = ka.repeat_interleave(qa.shape[1] // ka.shape[1], 1)
    s = torch.matmul(qa, ka.transpose(-2, -1)) * scale
    if bias is not None:
        s = s + bias.to(acc)
    if is_causal:
        sq, sk = s.shape[-2], s.shape[-1]
        s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool).tril(), -math.inf)
    return s


def _forward(q, k, v, bias, dropout_p, is_causal, scale, seed):
    s = _scores(q, k, bias, is_causal, scale)
    lse = torch.logsumexp(s, -1)
    prob = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    if dropout_p > 0.0:
        prob = prob * dropout_keep(seed, prob.shape, dropout_p, q.device) / (1.0 - dropout_p)
    va = v.to(prob.dtype)
    if va.shape[1] != prob.shape[1]:
        va = va.repeat_interleave(prob.shape[1] // va.shape[1], 1)
    return torch.matmul(prob, va), lse


def _backward(grad_out, q, k, v, bias, out, dropout_p, is_causal, scale, seed):
    s = _scores(q, k, bias, is_causal, scale)
    acc = s.dtype
    prob = torch.exp(s - torch.logsumexp(s, -1, keepdim=True)).nan_to_num(0.0)
    keep = dropout_keep(seed, prob.shape, dropout_p, q.device).to(acc) / (1.0 - dropout_p) if dropout_p > 0 else 1.0
    heads, kv_heads = q.shape[1], k.shape[1]
    va = v.to(acc).repeat_interleave(heads // kv_heads, 1) if kv_heads != heads else v.to(acc)
    ka = k.to(acc).repeat_interleave(heads // kv_heads, 1) if kv_heads != heads else k.to(acc)
    go = grad_out.to(acc)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    grad_v = torch.matmul((prob * keep).transpose(-2, -1), go)
    grad_p = torch.matmul(go, va.transpose(-2, -1)) * keep
    grad_s = prob * (grad_p - (go * out.to(acc)).sum(-1, keepdim=True))
    grad_q = torch.matmul(grad_s, ka) * scale
    grad_k = torch.matmul(grad_s.transpose(-2, -1), q.to(acc)) * scale
    if kv_heads != heads:
        grad_k = grad_k.unflatten(1, (kv_heads, heads // kv_heads)).sum(2)
        grad_v = grad_v.unflatten(1, (kv_heads, heads // kv_heads)).sum(2)
    return grad_q, grad_k, grad_v, grad_s


def _like(ref, value):
    """``value`` copied into a tensor with ``ref``'s shape, dtype and strides (the GPU kernels'
    layout: what later ops see, e.g. whether ``.contiguous()`` copies)."""
    out = torch.empty_strided(ref.shape, ref.stride(), dtype=ref.dtype, device=ref.device)
    out.copy_(value)
    return out


def _seed_tensors(seed: int, flash: bool):
    if flash:  # meta__scaled_dot_product_flash_attention: rng_state uint64[2], unused uint64[]
        return (torch.tensor([seed, 0], dtype=torch.int64).view(torch.uint64),
                torch.zeros((), dtype=torch.int64).view(torch.uint64))
    return torch.tensor(seed, dtype=torch.int64), torch.zeros((), dtype=torch.int64)


def _seed_of(t) -> int:
    return int(t.view(torch.int64).reshape(-1)[0])


def _flash_cpu(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    seed = _new_seed() if dropout_p > 0.0 else 0
    out, lse = _forward(query, key, value, None, dropout_p, is_causal, scale, seed)
    out = _like(torch.empty_like(query), out)
    rng_state, unused = _seed_tensors(seed, True)
    debug = torch.empty(0, dtype=query.dtype)
    return out, lse.float(), None, None, query.shape[2], key.shape[2], rng_state, unused, debug


def _flash_backward_cpu(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                        dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    seed = _seed_of(philox_seed) if dropout_p > 0.0 else 0
    gq, gk, gv, _ = _backward(grad_out, query, key, value, None, out, dropout_p, is_causal, scale, seed)
    return _like(torch.empty_like(query), gq), _like(torch.empty_like(key), gk), _like(torch.empty_like(value), gv)


def _efficient_cpu(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *,
                   scale=None):
    seed = _new_seed() if dropout_p > 0.0 else 0
    out, lse = _forward(query, key, value, attn_bias, dropout_p, is_causal, scale, seed)
    b, h, m, kv = query.shape[0], query.shape[1], query.shape[2], value.shape[-1]
    layout = torch.empty(b, m, h, kv, dtype=query.dtype).transpose(1, 2)  # [B, M, H, K] transposed
    rows = math.ceil(m / 32) * 32 if compute_log_sumexp else 0
    logsumexp = torch.zeros((b, h, rows), dtype=torch.float32)  # rows past m: padding, never read
    if rows:
        logsumexp[..., :m] = lse
    seed_t, offset_t = _seed_tensors(seed, False)
    return _like(layout, out), logsumexp, seed_t, offset_t


def _efficient_backward_cpu(grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset,
                            dropout_p, grad_input_mask, is_causal=False, *, scale=None):
    seed = _seed_of(philox_seed) if dropout_p > 0.0 else 0
    bias = attn_bias if attn_bias is not None and attn_bias.numel() else None
    gq, gk, gv, gs = _backward(grad_out, query, key, value, bias, out, dropout_p, is_causal, scale, seed)

    def permuted(t):
        return torch.empty_permuted(t.shape, (0, 2, 1, 3), dtype=t.dtype)

    grad_bias = None
    if bias is not None and grad_input_mask[3]:
        grad_bias = gs.to(bias.dtype)
        while grad_bias.dim() > bias.dim():
            grad_bias = grad_bias.sum(0)
        grad_bias = grad_bias.sum_to_size(bias.shape).contiguous()
    return _like(permuted(query), gq), _like(permuted(key), gk), _like(permuted(value), gv), grad_bias
