"""Partitions under gradient accumulation: a module runs once per micro-batch, and is
partitioned in each. In the second micro-batch its parameters' gradients already exist:
autograd sums the chunks' new gradients in the parameter's input buffer (the first chunk's,
then each later one added out of place) and adds the sum into the old gradient in place at
the end. The simulator models that (partition._added_to_grads); a 2-micro-batch loop
replays with measured peak == predicted, the peak inside the second micro-batch's
partitioned backward (where the model without old gradients is 114,944 B under)."""

from __future__ import annotations

import pytest

from taichi_plan.plan.format import Partition
from taichi_plan.problem.core import build_problem
from taichi_plan.problem.partition.find import find_span
from taichi_plan.record import get_workload, record_workload
from taichi_plan.simulate.core import simulate_plan
from taichi_plan.torch_common.loop import Loop
from taichi_plan.trace.format import write_trace
from tests.partition_replay import assert_measured_as_predicted, replay_partitions

# SGD: the step's peak is in the backward, not in the optimizer's state.
SIZES = dict(model="gpt2", layers=2, hidden=64, heads=2, vocab=64, seq=16, batch=4, optimizer="sgd")


@pytest.fixture(scope="module")
def accum(tmp_path_factory):
    d = tmp_path_factory.mktemp("accum") / "tiny-gpt2-accum"
    trace = record_workload(get_workload(**SIZES), fake=False, loop=Loop(micro_batches=2), calibrate=False)
    write_trace(trace, d)
    return build_problem(trace)


def test_a_module_of_each_micro_batch_is_one_span(accum):
    s = find_span(accum, Partition("transformer.h.1.mlp.c_proj", 0, 4))
    assert s is not None and len(s.more) == 1
    (f, b), = s.more
    assert s.bwd[1] < f[0] and f[1] < b[0]  # the second micro-batch's forward and backward


@pytest.mark.parametrize("parts", [
    [("transformer.h.1.mlp.c_proj", 4)],  # weight and bias: old gradients from micro-batch 1
    [("transformer.h.1.mlp.act", 4), ("transformer.h.0.attn.c_attn", 2)],
], ids=["c_proj-4", "act-4+c_attn-2"])
def test_two_micro_batches_measure_as_predicted(accum, tmp_path, parts):
    _plan, r = replay_partitions(accum, [Partition(m, 0, k) for m, k in parts], tmp_path)
    assert_measured_as_predicted(r)


def test_peak_is_where_old_gradients_are_added(accum):
    """The first case's predicted peak is in the second micro-batch's c_proj backward: a real
    check of the accumulation model."""
    parts = [Partition("transformer.h.1.mlp.c_proj", 0, 4)]
    sim, _ = simulate_plan(accum, [], parts)
    (_f, (b0, b1)), = find_span(accum, parts[0]).more
    assert b0 <= sim.peak_op <= b1 and sim.peak_bytes > accum.baseline_peak[0]
