"""A module that returns its input as it got it (``nn.Identity``: a drop path at rate 0, as
in ConvNeXt, Swin, BEiT) has no backward of its own. PyTorch's ``ModTracker`` hooks every
output's gradient to open a module in backward; for a passed-through input that hook runs right
after the one that closes it (the same tensor), so the module stayed open to the end of the
backward and every later backward op was filed under it: a tiny ConvNeXt's last layer had the
downsampling before it in its backward, and split in chunks it was predicted 16-21 KB above
its measured peak. The recorder opens a module only on the gradients of outputs it made."""

from __future__ import annotations

import numpy as np
import pytest
from partition_replay import assert_measured_as_predicted, recorded, replay_partitions

from taichi_plan.plan.format import Partition
from taichi_plan.problem.partition.find import module_spans


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    return recorded(tmp_path_factory.mktemp("pass") / "t", entry="tiny_models:passthrough_blocks")[1]


def test_a_passthrough_module_has_no_backward_ops(blocks):
    p = blocks
    backward = np.asarray(p.op_phase) == "backward"
    labels = {m for m, b in zip(p.op_module, backward, strict=True) if b}
    assert not any(m.endswith("drop_path") for m in labels), sorted(labels)
    # the downsampling's backward is its own, after the blocks' (not inside the first block's)
    spans = {s.module: s for s in module_spans(p)}
    first, down = spans["blocks.0"], spans["downsample"]
    assert first.bwd[1] < down.bwd[0], (first.bwd, down.bwd)


def test_a_block_around_a_passthrough_splits_as_predicted(blocks, tmp_path):
    _plan, r = replay_partitions(blocks, [Partition("blocks.0", 0, 2), Partition("blocks.1", 0, 4)], tmp_path)
    assert_measured_as_predicted(r)


@pytest.fixture(scope="module")
def gptj(tmp_path_factory):
    return recorded(tmp_path_factory.mktemp("gptj") / "t", entry="tiny_models:gptj")[1]


def test_parallel_branches_keep_their_own_backward(gptj):
    """GPT-J's attention and MLP both read the block's norm: the MLP's first linear layer closes
    in backward only when the attention's backward is done too (its input's gradient is then
    complete). The recorder files each backward op under the module opened last (the deepest
    of those opened together), so the attention's own ops are the attention's, not that layer's
    (it had taken all of them: the deepest open module), and the linear layers whose output is
    their parent's (the MLP's last, the attention's projection) keep their backward."""
    p = gptj
    spans = {s.module: s for s in module_spans(p) if s.over == "batch"}
    for b in ("transformer.h.0", "transformer.h.1"):
        fc_in, attn = spans[f"{b}.mlp.fc_in"], spans[f"{b}.attn"]
        assert fc_in.bwd[1] - fc_in.bwd[0] < 16, fc_in.bwd  # its own few ops, not the attention's
        assert attn.bwd[0] > fc_in.bwd[1], (attn.bwd, fc_in.bwd)
        assert f"{b}.mlp.fc_out" in spans and f"{b}.attn.out_proj" in spans
    backward = np.asarray(p.op_phase) == "backward"
    sdpa = [m for m, name, b in zip(p.op_module, p.op_name, backward, strict=True)
            if b and "scaled_dot_product" in name]
    assert len(sdpa) == 2 and all(m.endswith(".attn") for m in sdpa), sdpa


def test_parallel_branches_split_as_predicted(gptj, tmp_path):
    parts = [Partition("transformer.h.0.mlp.fc_in", 0, 2), Partition("transformer.h.1.attn", 0, 1),
             Partition("transformer.h.1.mlp", 0, 4)]
    _plan, r = replay_partitions(gptj, parts, tmp_path)
    assert_measured_as_predicted(r)


@pytest.fixture(scope="module")
def helper_blocks(tmp_path_factory):
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        problem = recorded(tmp_path_factory.mktemp("helper") / "t", entry="tiny_models:helper_module_blocks")[1]
    problem.recording_warnings = [str(w.message) for w in seen]
    return problem


def test_a_module_outside_the_model_called_twice_is_no_warning(helper_blocks):
    """ModTracker names a module outside the model by its class, so its second call (the
    next block's) finds the name still open and warns "The module hierarchy tracking maybe be
    messed up. Please file a bug to PyTorch": every record of a Llama-family model printed it
    under transformers 5.25. The recorder files such a module's ops itself, and says nothing."""
    assert not [m for m in helper_blocks.recording_warnings if "hierarchy tracking" in m]


def test_a_module_outside_the_model_belongs_to_the_block_that_calls_it(helper_blocks):
    """A module object the model never registered (transformers 5.25's ``Func`` around
    ``apply_rotary_pos_emb``, called inside each attention) opens last in backward: its ops
    were filed under no module, every block's backward was cut in two, and no block was
    partitionable. They are the calling block's, forward and backward."""
    p = helper_blocks
    mul_sigmoid = [i for i, name in enumerate(p.op_name) if name in ("aten.sigmoid.default", "aten.sigmoid_backward.default")]
    assert mul_sigmoid and all(p.op_module[i].startswith("blocks.") for i in mul_sigmoid), \
        [(p.op_name[i], p.op_module[i]) for i in mul_sigmoid]
    spans = {s.module: s for s in module_spans(p) if s.over == "batch"}
    assert {"blocks.0", "blocks.1"} <= set(spans), sorted(spans)


def test_a_block_calling_a_module_outside_the_model_splits_as_predicted(helper_blocks, tmp_path):
    _plan, r = replay_partitions(helper_blocks, [Partition("blocks.0", 0, 2), Partition("blocks.1", 0, 4)], tmp_path)
    assert_measured_as_predicted(r)
