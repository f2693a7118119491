"""The CUDA replay path, tested as far as a CPU allows: which device a replay picks, moving a
workload, and the caching allocator's counters read around the measured step (torch.cuda is
faked here: no GPU in CI). Nothing here is a GPU measurement."""

from __future__ import annotations

import pytest

from taichi_plan.base.errors import WorkloadError
from taichi_plan.plan.format import save_plan
from taichi_plan.record import get_workload, record_workload
from taichi_plan.replay import measure
from taichi_plan.replay.measure import memory, run, workload
from taichi_plan.solve import solve
from taichi_plan.trace.devices import get_profile
from taichi_plan.trace.format import read_trace, write_trace


class _Meta:
    def __init__(self, **meta):
        self.meta = meta


def test_replay_runs_on_cuda_only_for_traces_recorded_there():
    assert workload.replay_device(_Meta(device="cuda", torch_build="cuda"), cuda_available=True) == "cuda"
    assert workload.replay_device(_Meta(device="cuda", torch_build="cuda"), cuda_available=False) == "cpu"
    assert workload.replay_device(_Meta(device="cpu", torch_build="cuda"), cuda_available=True) == "cpu"
    assert workload.replay_device(_Meta(torch_build="cuda"), cuda_available=True) == "cuda"  # older traces
    assert workload.replay_device(_Meta(torch_build="cpu"), cuda_available=True) == "cpu"


def test_recordings_say_where_they_ran():
    trace = record_workload(get_workload(model="mlp", batch=4, hidden=16, layers=1))
    assert trace.meta["device"] == "cpu"


def test_move_workload_moves_every_part_and_the_optimizer_follows():
    model, batch, loss_fn, optimizer = get_workload(model="mlp", batch=4, hidden=16, layers=1).build(False)
    model, batch, loss_fn, optimizer = workload.move_workload(model, batch, loss_fn, optimizer, "meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert batch.device.type == "meta" and loss_fn.inputs[0].device.type == "meta"
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    assert len(opt_params) == len(list(model.parameters()))
    assert all(a is b for a, b in zip(opt_params, model.parameters()))  # the model's own parameters


def test_move_workload_refuses_an_optimizer_with_state():
    import torch

    model, batch, loss_fn, optimizer = get_workload(model="mlp", batch=4, hidden=16, layers=1).build(False)
    loss_fn(model(batch), batch).backward()
    optimizer.step()
    with pytest.raises(WorkloadError, match="already has state"):
        workload.move_workload(model, batch, loss_fn, optimizer, "meta")
    assert isinstance(optimizer.state[next(model.parameters())]["exp_avg"], torch.Tensor)


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's counters and barriers, logged; the workload stays on the CPU."""
    import torch

    calls: list[str] = []
    state = {"peak": 0}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))

    def reset(*a):
        calls.append("reset")
        state["peak"] = 1000 * (calls.count("reset"))

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 7)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: state["peak"] + 1)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: state["peak"] + 2)
    monkeypatch.setattr(run, "move_workload", lambda *parts, device=None: parts[:4])
    return calls


def test_run_and_measure_on_cuda_resets_and_reads_the_peaks_around_the_last_step(fake_cuda):
    wl = get_workload(model="mlp", batch=4, hidden=16, layers=1)
    out = run.run_and_measure(wl, None, None, steps=3, seed=0, device="cuda")
    assert out["cuda_max_allocated_bytes"] == 1001 and out["cuda_max_reserved_bytes"] == 1002
    assert out["cuda_start_allocated_bytes"] == 7
    assert fake_cuda.count("reset") == 1 and fake_cuda.count("empty_cache") == 1
    # warm-up, then the cache is emptied; each of the 3 timed steps is synchronized before and
    # after, and the peaks are reset just before the last one
    assert fake_cuda[:2] == ["sync", "empty_cache"]
    assert fake_cuda[2:] == ["sync", "sync", "sync", "sync", "sync", "reset", "sync"]


def test_run_and_measure_on_cpu_touches_no_cuda_counter(fake_cuda):
    wl = get_workload(model="mlp", batch=4, hidden=16, layers=1)
    out = run.run_and_measure(wl, None, None, steps=2, seed=0, device="cpu")
    assert fake_cuda == [] and "cuda_max_allocated_bytes" not in out


def test_replay_report_puts_cuda_peaks_beside_the_predicted_ones(tmp_path, fake_cuda, monkeypatch):
    trace = read_trace(write_trace(record_workload(get_workload(model="mlp", batch=4, hidden=16, layers=1)),
                                   tmp_path / "t"))
    plan = solve(trace, 10**15, "none")
    path = save_plan(plan, tmp_path / "p.plan.json")
    monkeypatch.setattr(measure, "replay_device", lambda trace: "cuda")
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: (10**12, "free CUDA memory"))
    report = measure.replay(path, steps=1)
    assert report["device"] == "cuda"
    cuda = report["cuda"]
    p = plan.predicted
    assert cuda["unplanned"]["measured_allocated_bytes"] == 1001  # first run's reset
    assert cuda["planned"]["measured_allocated_bytes"] == 2001 and cuda["planned"]["measured_reserved_bytes"] == 2002
    assert cuda["planned"]["predicted_allocated_bytes"] == p["planned_peak_bytes"]
    assert cuda["planned"]["predicted_reserved_bytes"] == p["planned_reserved_peak_bytes"]
    assert cuda["planned"]["predicted_allocator_allocated_bytes"] == p["allocator"]["planned_allocated_peak_bytes"]
    assert cuda["planned"]["reserved_ratio"] == pytest.approx(2002 / p["planned_reserved_peak_bytes"])
    assert cuda["unplanned"]["predicted_reserved_bytes"] == p["baseline_reserved_peak_bytes"]


def test_h200_profile_has_its_datasheet_numbers():
    h = get_profile("H200-141GB")
    assert h.memory_bytes == 141 * 2**30
    assert h.bandwidth_bytes_per_s == 4.8e12
    assert h.flops_per_s("bf16") == pytest.approx(989.4e12)
    assert h.flops_per_s("fp32") == pytest.approx(67e12)
    assert "H200" in h.sources["memory_bytes"] and "141 GB HBM3e" in h.sources["memory_bytes"]
    assert "NVLink 900 GB/s" in h.sources["interconnect"]
