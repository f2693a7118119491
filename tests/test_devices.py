"""Device profiles: lookup, units, and the roofline estimate built on them."""

from __future__ import annotations

import pytest

from taichi_plan.base.errors import UsageError
from taichi_plan.trace.devices import PROFILES, get_profile, profiles_table
from taichi_plan.trace.roofline import estimate_duration_s


def test_get_profile_is_case_insensitive():
    assert get_profile("A100-40GB") is PROFILES["a100-40gb"]


def test_unknown_profile_lists_known_ones():
    with pytest.raises(UsageError) as e:
        get_profile("tpu-v4")
    for name in PROFILES:
        assert name in str(e.value)


@pytest.mark.parametrize("name", list(PROFILES))
def test_profiles_are_complete(name):
    p = get_profile(name)
    assert p.memory_bytes >= 16 * 2**30
    assert p.peak_flops["fp32"] > 1e12 and p.bandwidth_bytes_per_s > 1e11
    assert 0 < p.launch_overhead_s < 1e-4
    for key in ("memory_bytes", "bandwidth_bytes_per_s", "launch_overhead_s", "peak_flops.fp32"):
        assert p.sources.get(key)
    assert all(f"peak_flops.{dt}" in p.sources for dt in p.peak_flops)
    # half precision is never slower than fp32; bf16 falls back to fp32 where there is none
    assert p.flops_per_s("bf16") >= p.flops_per_s("fp32")
    assert p.flops_per_s("torch.float16") == p.peak_flops["fp16"]


def test_known_numbers():
    assert get_profile("a100-80gb").bandwidth_bytes_per_s == 2039e9
    assert get_profile("h100-80gb").peak_flops["bf16"] == pytest.approx(989.4e12)
    assert get_profile("v100-16gb").flops_per_s("bf16") == 15.7e12
    assert len(profiles_table()) == len(PROFILES)


def test_roofline():
    p = get_profile("a100-40gb")
    # compute bound: 2*4096^3 FLOPs in bf16
    flops = 2 * 4096**3
    assert estimate_duration_s(p, flops, 3 * 4096 * 4096 * 2, "bf16") == pytest.approx(flops / 312e12 + 5e-6)
    # memory bound: 1 GB moved, no FLOPs
    assert estimate_duration_s(p, 0, 10**9, "fp32") == pytest.approx(1e9 / 1555e9 + 5e-6)


@pytest.mark.parametrize("name", list(PROFILES))
def test_host_links_have_sources(name):
    p = get_profile(name)
    assert 5e9 <= p.host_link_bytes_per_s <= 1e12 and p.sources.get("host_link_bytes_per_s")


def test_host_link_numbers():
    # PCIe 3 x16 ~12 GB/s effective (V100), PCIe 5 x16 ~50 (H100), NVLink-C2C 450 each way (GH200)
    assert get_profile("v100-16gb").host_link_bytes_per_s == 12e9
    assert get_profile("h100-80gb").host_link_bytes_per_s == 50e9
    assert get_profile("gh200-96gb").host_link_bytes_per_s == 450e9
