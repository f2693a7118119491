"""Fake recordings for a GPU profile record the GPU's kernels (taichi_plan/record/gpu_ops.py):
native_dropout, the fused attention kernel CUDA would pick (with its logsumexp, never the S x S
matrix), foreach optimizers; the CPU kernels that stand in for the fused ones compute the same
values; real CPU recordings are unchanged."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from taichi_plan.record import gpu_ops
from taichi_plan.record.fused_cpu import dropout_keep, register_cpu_kernels
from taichi_plan.record.gpu_ops import GpuTarget, choose_sdpa, gpu_kernels
from taichi_plan.trace.devices import PROFILES

pytest.importorskip("transformers")

from taichi_plan.record import builtin_workload, record_workload  # noqa: E402
from taichi_plan.trace.format import FORMAT_VERSION, baseline_peak, read_trace, write_trace  # noqa: E402

GPT2 = dict(layers=2, hidden=64, heads=2, vocab=256, seq=128, batch=4)
B, H, S = GPT2["batch"], GPT2["heads"], GPT2["seq"]


def _qkv(dtype, d=16, s=40, heads=3, batch=2):
    x = torch.randn(batch, s, 3 * heads * d, dtype=dtype, requires_grad=True)
    q, k, v = (t.view(batch, s, heads, d).transpose(1, 2) for t in x.split(heads * d, dim=2))
    return x, q, k, v


@pytest.mark.parametrize("dtype,cc,mask,causal,want", [
    (torch.float32, (8, 0), None, True, "efficient"),   # flash needs fp16/bf16
    (torch.bfloat16, (8, 0), None, True, "flash"),
    (torch.float16, (9, 0), None, False, "flash"),
    (torch.bfloat16, (8, 0), "bool", False, "efficient"),  # flash takes no mask
    (torch.float16, (7, 0), None, True, "efficient"),   # flash needs sm80+
    (torch.bfloat16, (7, 5), None, True, "math"),       # no bf16 before sm80
])
def test_backend_choice_follows_cuda_rules(dtype, cc, mask, causal, want):
    _, q, k, v = _qkv(dtype)
    m = torch.ones(40, 40, dtype=torch.bool) if mask else None
    assert choose_sdpa(q, k, v, m, 0.1, causal, False, cc)[0] == want


def test_flash_head_dim_limits():
    _, q, k, v = _qkv(torch.bfloat16, d=264)
    assert choose_sdpa(q, k, v, None, 0.0, False, False, (8, 0))[0] == "efficient"  # > 256
    _, q, k, v = _qkv(torch.bfloat16, d=200)
    assert choose_sdpa(q, k, v, None, 0.0, False, False, (8, 0))[0] == "flash"
    assert choose_sdpa(q, k, v, None, 0.0, False, False, (8, 6), grad=True)[0] == "efficient"  # sm86 backward
    _, q, k, v = _qkv(torch.float32, d=6)
    assert choose_sdpa(q, k, v, None, 0.0, False, False, (8, 0))[0] == "math"  # efficient: head dim % 4


def test_dropout_is_fused_only_where_cuda_fuses_it():
    """native_dropout for training dropout with 0 < p < 1; in-place, eval and p = 0 stay as they are
    (CUDA's at::dropout does not fuse them either)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Names(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    def ops(fn):
        x = torch.randn(64, 8)
        with gpu_kernels(GpuTarget("test", (8, 0))), Names() as seen:
            fn(x)
        return seen.names

    assert ops(lambda x: F.dropout(x, 0.1)) == ["aten.native_dropout.default"]
    assert ops(lambda x: torch.dropout(x, 0.1, True)) == ["aten.native_dropout.default"]
    assert ops(lambda x: torch.nn.Dropout(0.2)(x)) == ["aten.native_dropout.default"]
    assert ops(lambda x: F.dropout(x, 0.0)) == []
    assert ops(lambda x: F.dropout(x, 0.1, training=False)) == []
    assert "aten.bernoulli_.float" in ops(lambda x: F.dropout(x, 0.1, inplace=True))


@pytest.mark.parametrize("dtype,cc,tol", [(torch.float32, (8, 0), 1e-5), (torch.bfloat16, (8, 0), 5e-2),
                                          (torch.bfloat16, (7, 0), 5e-2)])
@pytest.mark.parametrize("mask,causal", [(None, False), (None, True), ("bool", False)])
def test_mapped_attention_computes_the_same_values(dtype, cc, tol, mask, causal):
    torch.manual_seed(0)
    x, q, k, v = _qkv(dtype)
    m = None
    if mask:
        m = torch.rand(40, 40) > 0.3
        m[:, 0] = True
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal)
    g = torch.randn_like(ref)
    (ref_grad,) = torch.autograd.grad(ref, x, g)
    target = GpuTarget("test", cc)
    with gpu_kernels(target):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal)
    (grad,) = torch.autograd.grad(out, x, g)
    assert target.choices  # a choice was made and written down
    assert torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol)
    assert torch.allclose(grad.float(), ref_grad.float(), atol=tol, rtol=tol)
    assert out.shape == ref.shape and out.dtype == ref.dtype


@pytest.mark.parametrize("flash", [True, False])
def test_fused_dropout_backward_regenerates_the_forward_mask(flash):
    """The stand-in kernels keep the dropout seed in the philox tensors; backward rebuilds the
    same mask from it, so its gradients are those of the forward that ran."""
    torch.manual_seed(1)
    dtype = torch.float64
    _, q, k, v = _qkv(dtype, d=8, s=24, heads=2)
    p = 0.3
    aten = torch.ops.aten
    register_cpu_kernels()
    if flash:
        res = aten._scaled_dot_product_flash_attention(q, k, v, p, True, False, scale=None)
        out, seed = res[0], int(res[6].view(torch.int64)[0])
    else:
        out, lse, seed_t, _ = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, p, True)
        seed = int(seed_t)
        assert lse.shape == (2, 2, 32) and lse.dtype == torch.float32  # rows rounded up to 32
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(8)
    scores = scores.masked_fill(~torch.ones(24, 24, dtype=torch.bool).tril(), -math.inf)
    keep = dropout_keep(seed, scores.shape, p, "cpu")
    ref = (torch.softmax(scores, -1) * keep / (1 - p)) @ v
    assert torch.allclose(out, ref, atol=1e-10)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(grads, ref_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-10)


@pytest.fixture(scope="module")
def traces():
    """Tiny GPT-2, fake, a100-40gb profile: with the GPU mapping (fp32 and bf16) and without."""
    out = {}
    for key, dtype, gk in (("gpu", "fp32", True), ("cpu", "fp32", False), ("gpu_bf16", "bf16", True)):
        out[key] = record_workload(builtin_workload("gpt2", dtype=dtype, **GPT2), fake=True,
                                   device_profile="a100-40gb", gpu_kernels=gk)
    return out


def _square(trace) -> list:
    return [s for s in trace.tensors["shape"] if len(s) == 4 and s[-1] == s[-2] == S]


def _produced_by(trace, op_name):
    ops = trace.ops["op"].tolist()
    t = trace.tensors
    return t[t["producer_op"].apply(lambda i: 0 <= i and ops[i] == op_name)]


def test_gpu_profile_trace_holds_the_gpu_kernels(traces):
    gpu, cpu = traces["gpu"], traces["cpu"]
    ops = gpu.ops["op"].tolist()
    assert ops.count("aten.native_dropout.default") == ops.count("aten.native_dropout_backward.default") > 0
    assert ops.count(gpu_ops.EFFICIENT) == ops.count(
        "aten._scaled_dot_product_efficient_attention_backward.default") == GPT2["layers"]
    assert not any(o in ops for o in ("aten.bernoulli_.float", "aten._safe_softmax.default",
                                      "aten._scaled_dot_product_flash_attention_for_cpu.default"))
    assert any(o.startswith("aten._foreach_") for o in ops)  # AdamW foreach, as on CUDA
    masks = _produced_by(gpu, "aten.native_dropout.default")
    assert set(masks["dtype"]) == {"float32", "bool"}  # output + a 1-byte mask
    # the fused kernel's logsumexp: fp32 [B, H, ceil(S/32)*32], saved for backward; no S x S tensor
    lse = _produced_by(gpu, gpu_ops.EFFICIENT)
    lse = lse[lse["dtype"] == "float32"]
    assert [list(s) for s in lse["shape"] if len(s) == 3] == [[B, H, math.ceil(S / 32) * 32]] * GPT2["layers"]
    assert set(lse[lse["shape"].apply(len) == 3]["kind"]) == {"activation"}
    assert _square(gpu) == [] and len(_square(cpu)) > 0
    # FLOPs from torch's formulas for the fused ops: two S x S x D matmuls forward, four backward
    d = GPT2["hidden"] // H
    fwd = gpu.ops[gpu.ops["op"] == gpu_ops.EFFICIENT]["flops"].tolist()
    bwd = gpu.ops[gpu.ops["op"] == "aten._scaled_dot_product_efficient_attention_backward.default"]["flops"]
    assert fwd == [4 * B * H * S * S * d] * GPT2["layers"] and bwd.tolist() == [10 * B * H * S * S * d] * GPT2["layers"]
    meta = gpu.meta["gpu_kernels"]
    assert meta["profile"] == "a100-40gb" and meta["compute_capability"] == "8.0"
    assert meta["op_counts"][gpu_ops.EFFICIENT] == GPT2["layers"] and meta["not_mapped"]
    assert any("efficient" in c for c in meta["sdpa_choices"])


def test_bf16_records_flash_with_its_logsumexp(traces):
    t = traces["gpu_bf16"]
    assert t.ops["op"].tolist().count(gpu_ops.FLASH) == GPT2["layers"]
    lse = _produced_by(t, gpu_ops.FLASH)
    assert [list(s) for s in lse[lse["dtype"] == "float32"]["shape"]] == [[B, H, S]] * GPT2["layers"]
    assert _square(t) == []


def test_attention_memory_drops_by_the_s_squared_term(traces):
    """Saved activations of the attention modules: the CPU recording keeps S x S matrices (the
    softmax, the dropout mask and its output); the GPU kernels keep output + logsumexp."""

    def attn_saved(trace):
        mods = trace.ops["module"].tolist()
        t = trace.tensors
        in_attn = t["producer_op"].apply(lambda i: i >= 0 and mods[i].endswith(".attn"))
        return int(t[in_attn & (t["kind"] == "activation")]["nbytes"].sum())

    s2_fp32 = GPT2["layers"] * B * H * S * S * 4  # one fp32 S x S matrix per layer
    gpu, cpu = attn_saved(traces["gpu"]), attn_saved(traces["cpu"])
    assert cpu - gpu >= 2 * s2_fp32, (cpu, gpu)
    assert gpu < s2_fp32  # what is left is O(S), not O(S^2)
    assert baseline_peak(traces["gpu"])[0] < baseline_peak(traces["cpu"])[0] - s2_fp32


def test_cpu_recordings_are_unchanged(traces):
    register_cpu_kernels()  # the CPU stand-ins are registered: CPU dispatch must not use them
    assert traces["cpu"].meta["gpu_kernels"] is None
    assert "aten.bernoulli_.float" in traces["cpu"].ops["op"].tolist()
    real = record_workload(builtin_workload("gpt2", **dict(GPT2, batch=1, seq=16)), fake=False,
                           device_profile="a100-40gb", steps=1)
    ops = real.ops["op"].tolist()
    assert real.meta["gpu_kernels"] is None and real.meta["mode"] == "real"
    assert not any("native_dropout" in o or "efficient_attention" in o or "_foreach_" in o for o in ops)


def test_trace_round_trip_keeps_the_mapping_and_inspect_shows_it(traces, tmp_path):
    from taichi_plan.report.trace_text import render_trace_summary, trace_summary

    write_trace(traces["gpu"], tmp_path / "t")
    back = read_trace(tmp_path / "t")
    assert back.meta["format_version"] == FORMAT_VERSION and back.meta["gpu_kernels"] == traces["gpu"].meta["gpu_kernels"]
    s = trace_summary(back)
    assert s["kernels"] == "a100-40gb sm80 (mapped): native_dropout, efficient SDPA, foreach"
    assert "kernels" in render_trace_summary(s, width=200)
    assert trace_summary(traces["cpu"])["kernels"] == "as run on cpu by a cpu build of torch"


def test_plan_on_a_gpu_profile_trace_is_valid_and_replays_on_cpu(traces):
    """Solved on the mapped trace, the plan is feasible in the simulator, and a CPU replay (which
    maps the same kernels again) passes the op guard, measures the predicted peak and gives
    bitwise-equal gradients."""
    from taichi_plan.problem.core import build_problem
    from taichi_plan.replay.measure import replay
    from taichi_plan.solve import solve

    trace = traces["gpu"]
    problem = build_problem(trace)
    budget = int(problem.baseline_peak[0] * 0.7)
    plan = solve(trace, budget, "heuristic", time_limit=5, problem=problem)
    assert plan.recompute and plan.predicted["planned_peak_bytes"] <= budget
    report = replay(plan, steps=1, trace=trace, force=True)
    assert report["device"] == "cpu" and report["grads_match"] is True
    assert report["measured_peak_bytes"] == report["predicted_peak_bytes"]
    assert report["baseline_measured_peak_bytes"] == report["baseline_predicted_peak_bytes"]


def test_every_profile_has_a_sourced_compute_capability():
    for p in PROFILES.values():
        assert p.compute_capability and p.sources["compute_capability"].endswith(
            f"{p.compute_capability[0]}.{p.compute_capability[1]}")
