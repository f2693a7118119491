"""The recorder, checked by counting: against MemTracker's peak, real vs fake, invariants."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from taichi_plan.record import get_workload, record_workload  # noqa: E402
from taichi_plan.record.api import make_step_fn  # noqa: E402
from taichi_plan.trace.format import baseline_peak, read_trace, write_trace  # noqa: E402

TINY_GPT2 = {"layers": 2, "hidden": 128, "heads": 4, "vocab": 1000, "seq": 64, "batch": 4}
MLP = {"hidden": 256, "layers": 3, "batch": 32}


@pytest.fixture(scope="module")
def gpt2_real():
    return record_workload(get_workload(model="gpt2", **TINY_GPT2), fake=False)


@pytest.fixture(scope="module")
def gpt2_fake():
    # this torch's own kernels (no GPU mapping, tests/test_gpu_ops.py): fake must record what real runs
    return record_workload(get_workload(model="gpt2", **TINY_GPT2), fake=True, device_profile="a100-40gb",
                           gpu_kernels=False)


@pytest.fixture(scope="module")
def mlp_real():
    return record_workload(get_workload(model="mlp", **MLP), fake=False)


def memtracker_peak(workload) -> int:
    """MemTracker's peak over the same step: warm-up first, grads set to None, then the
    model, optimizer state and batch registered as external (they exist before the step)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils._pytree import tree_leaves

    model, batch, loss_fn, optimizer = workload.build(False)
    step = make_step_fn(model, batch, loss_fn, optimizer)
    optimizer.zero_grad(set_to_none=True)
    step()
    optimizer.zero_grad(set_to_none=True)
    tracker = MemTracker()
    inputs = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
    tracker.track_external(model, optimizer, *inputs, *getattr(loss_fn, "inputs", ()))
    with tracker:
        step()
    return sum(dev["Total"] for dev in tracker.get_tracker_snapshot("peak").values())


@pytest.mark.slow
@pytest.mark.parametrize("name,sizes,fixture", [("mlp", MLP, "mlp_real"), ("gpt2", TINY_GPT2, "gpt2_real")])
def test_peak_agrees_with_memtracker(name, sizes, fixture, request):
    trace = request.getfixturevalue(fixture)
    peak, _ = baseline_peak(trace)
    expected = memtracker_peak(get_workload(model=name, **sizes))
    assert 0.95 <= peak / expected <= 1.05, (peak, expected)


@pytest.mark.slow
def test_fake_and_real_record_the_same_ops(gpt2_real, gpt2_fake):
    assert gpt2_real.ops["op"].tolist() == gpt2_fake.ops["op"].tolist()
    assert gpt2_real.ops["module"].tolist() == gpt2_fake.ops["module"].tolist()
    assert gpt2_real.meta["signature"] == gpt2_fake.meta["signature"]
    assert baseline_peak(gpt2_real) == baseline_peak(gpt2_fake)
    assert gpt2_real.meta["mode"] == "real" and gpt2_fake.meta["mode"] == "fake"
    assert set(gpt2_real.ops["cost_source"]) == {"measured"}
    assert set(gpt2_fake.ops["cost_source"]) == {"estimated"}


@pytest.mark.slow
def test_gpt2_small_fake_has_all_phases():
    trace = record_workload(get_workload(model="gpt2", batch=2, seq=128), fake=True)
    phases = trace.ops["phase"].tolist()
    assert {"forward", "backward", "optimizer"} <= set(phases)
    # forward, then backward, then optimizer: each phase is one contiguous run
    order = [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p]
    assert order == ["forward", "backward", "optimizer"]
    assert trace.meta["steps_match"] is True and trace.meta["first_mismatch"] is None
    assert len(trace.meta["signatures"]) == trace.meta["steps_recorded"] == 2
    assert trace.meta["device_profile"] == "a100-40gb"
    params = trace.tensors[trace.tensors["kind"] == "parameter"]
    assert params["nbytes"].sum() == 124_439_808 * 4  # GPT-2 small, tied embedding counted once
    assert (trace.ops["duration_s"] >= 0).all() and trace.ops["duration_s"].sum() > 0


def test_meta_fields(mlp_real):
    meta = mlp_real.meta
    for key in ("torch_version", "torch_build", "workload", "mode", "device_profile", "dtype",
                "steps_recorded", "signatures", "signature", "steps_match", "first_mismatch"):
        assert key in meta
    assert meta["cost_unit"] == "s"
    assert meta["torch_build"] in ("cpu", "cuda")
    assert meta["workload"]["name"] == "mlp" and meta["workload"]["args"]["batch"] == 32
    assert meta["signature"] == meta["signatures"][-1]
    assert (mlp_real.ops["step"] == meta["kept_step"]).all()


def test_tensor_kinds_and_lifetimes(mlp_real):
    t = mlp_real.tensors
    ops = mlp_real.ops
    kinds = set(t["kind"])
    assert {"parameter", "gradient", "optimizer_state", "input", "activation", "temporary"} <= kinds
    pre = t[t["kind"].isin(["parameter", "optimizer_state", "input"])]
    assert (pre["alloc_op"] == -1).all() and (pre["producer_op"] == -1).all() and (pre["free_op"] == -1).all()
    grads = t[t["kind"] == "gradient"]
    assert (grads["alloc_op"] >= 0).all() and (grads["free_op"] == -1).all()
    assert set(ops["phase"].iloc[grads["alloc_op"]]) == {"backward"}
    first_bw = int(ops.index[ops["phase"] == "backward"][0])
    acts = t[t["kind"] == "activation"]
    assert (acts["alloc_op"] < first_bw).all()
    assert ((acts["free_op"] == -1) | (acts["free_op"] >= first_bw)).all()
    # 4 Linear layers of 256x256 / 256x10 with biases
    assert t.loc[t["kind"] == "parameter", "nbytes"].sum() == 4 * (3 * (256 * 256 + 256) + 256 * 10 + 10)


def test_views_mutations_and_flops(mlp_real):
    ops, acc = mlp_real.ops, mlp_real.accesses
    writes = acc[acc["role"] == "write"]
    views = ops[ops["op"].isin(["aten.t.default", "aten.view.default", "aten.detach.default"])]
    assert len(views) and not writes["op_id"].isin(views["op_id"]).any()
    inplace = ops[ops["mutates"]]
    assert len(inplace) and set(inplace["phase"]) <= {"optimizer", "forward", "backward"}
    assert not inplace["recomputable"].any()
    assert not ops.loc[ops["phase"] == "optimizer", "recomputable"].any()
    # every in-place optimizer op writes a parameter or optimizer-state storage, not a new one
    t = mlp_real.tensors.set_index("tensor_id")
    opt_writes = writes[writes["op_id"].isin(inplace.loc[inplace["phase"] == "optimizer", "op_id"])]
    assert len(opt_writes)
    # addmm(bias, x[32,256], W^T[256,256]) = 2*32*256*256 FLOPs
    first = ops[ops["op"] == "aten.addmm.default"].iloc[0]
    assert first["flops"] == 2 * 32 * 256 * 256
    assert first["module"] == "0"
    # each storage written by a fresh output is a new tensor produced by that op
    produced = t[t["producer_op"] >= 0]
    assert (produced["producer_op"] == produced["alloc_op"]).all()


def test_modules_are_model_fqns(gpt2_real):
    modules = set(gpt2_real.ops["module"])
    assert "transformer.h.0.attn" in modules and "transformer.h.1.mlp.c_fc" in modules
    assert not any(m.startswith("GPT2LMHeadModel") for m in modules)
    bw = gpt2_real.ops[gpt2_real.ops["phase"] == "backward"]
    assert any(m.startswith("transformer.h.") for m in bw["module"])


def test_written_trace_reads_back(mlp_real, tmp_path):
    path = write_trace(mlp_real, tmp_path / "mlp")
    back = read_trace(path)
    assert back.ops["op"].tolist() == mlp_real.ops["op"].tolist()
    assert back.tensors["nbytes"].tolist() == mlp_real.tensors["nbytes"].tolist()
    assert len(back.accesses) == len(mlp_real.accesses)
    assert baseline_peak(back) == baseline_peak(mlp_real)
    assert back.meta["signature"] == mlp_real.meta["signature"]


@pytest.mark.parametrize("model,sizes", [
    ("bert", {"layers": 1, "hidden": 64, "heads": 2, "vocab": 500, "seq": 32, "batch": 2}),
    ("llama", {"layers": 1, "hidden": 64, "heads": 2, "vocab": 500, "seq": 32, "batch": 2}),
    ("vit", {"layers": 1, "hidden": 64, "heads": 2, "image_size": 32, "batch": 2}),
])
def test_other_models_record_fake(model, sizes):
    trace = record_workload(get_workload(model=model, optimizer="sgd", **sizes), fake=True)
    assert trace.meta["steps_match"]
    assert {"forward", "backward", "optimizer"} <= set(trace.ops["phase"])
    assert "optimizer_state" in set(trace.tensors["kind"])  # SGD momentum buffers


def test_record_objects_from_python():
    from taichi_plan.record import record

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trace = record(model, x, lambda out, batch: torch.nn.functional.cross_entropy(out, y), opt, name="toy")
    assert trace.meta["workload"] == {"name": "toy", "kind": "python", "args": {}}
    assert trace.meta["steps_match"]
    # the loss is computed outside the model: no module name for it
    assert trace.ops.loc[trace.ops["op"].str.startswith("aten.nll_loss"), "module"].eq("").all()


def test_a_sparse_gradient_is_refused_by_name():
    # nn.Embedding(sparse=True) makes a sparse COO gradient, which has no storage to count.
    import torch.nn.functional as F

    from taichi_plan.base.errors import WorkloadError
    from taichi_plan.record import record

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 16, sparse=True), torch.nn.Linear(16, 64))
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(WorkloadError, match=r"sparse_coo tensor .*sparse=False"):
        record(model, ids, lambda out, b: F.cross_entropy(out.reshape(-1, 64), b.reshape(-1)),
               torch.optim.SGD(model.parameters(), lr=0.1))
