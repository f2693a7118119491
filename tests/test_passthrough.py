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
from partition_replay import assert_measured_as_predicted, replay_partitions

from taichi_plan.partition import module_spans
from taichi_plan.plan import Partition
from taichi_plan.problem import build_problem
from taichi_plan.record import get_workload, record_workload
from taichi_plan.trace import write_trace


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    trace = record_workload(get_workload(entry="tiny_models:passthrough_blocks"), fake=False)
    write_trace(trace, tmp_path_factory.mktemp("pass") / "t")
    return build_problem(trace)


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
