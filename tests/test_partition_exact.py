"""Modules split into chunks of their batch: the simulator models the chunked run event by
event (taichi_plan/partition.py, ``_chunked_peaks``), so a replayed plan measures its
predicted peak to the byte, with the peak inside a partitioned span (where the old model,
which shrank every tensor to 1/k and joined input gradients by hand, was 65 KB over)."""

from __future__ import annotations

import pytest

from taichi_plan.partition import find_span, module_spans
from taichi_plan.plan import Partition
from taichi_plan.problem import build_problem
from taichi_plan.record import get_workload, record_workload
from taichi_plan.simulate import simulate_plan
from taichi_plan.trace import write_trace
from tests.partition_replay import assert_measured_as_predicted, replay_partitions

# transformers' default dropout is on: the blocks, attn and mlp draw random numbers and cannot be
# split without the opt-in, their linear layers and the activation can.
SIZES = dict(model="gpt2", layers=2, hidden=64, heads=2, vocab=64, seq=16, batch=4)


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    d = tmp_path_factory.mktemp("exact") / "tiny-gpt2"
    trace = record_workload(get_workload(**SIZES), fake=False)
    write_trace(trace, d)
    return d, build_problem(trace)


def _in_span(problem, parts, op: int) -> bool:
    spans = [find_span(problem, q) for q in parts]
    return any(s.fwd[0] <= op <= s.fwd[1] or s.bwd[0] <= op <= s.bwd[1] for s in spans)


@pytest.mark.parametrize("parts", [
    # weights and biases: every later chunk's gradient added to the first's; the peak is there
    [("transformer.h.1.mlp.c_proj", 4)],
    # an activation (no parameters, 8 ops re-run per chunk) and a linear layer in two chunks
    [("transformer.h.1.mlp.act", 4), ("transformer.h.0.attn.c_attn", 2)],
], ids=["c_proj-4", "act-4+c_attn-2"])
def test_batch_partitions_measure_as_predicted(traced, tmp_path, parts):
    d, p = traced
    _plan, r = replay_partitions(p, [Partition(m, 0, k) for m, k in parts], tmp_path)
    assert_measured_as_predicted(r)


def test_peak_of_a_split_linear_is_inside_it(traced):
    """The first case above is a real check of the partition's own model: its predicted peak
    is at an op of the partitioned module's backward (the gradient accumulation)."""
    _d, p = traced
    parts = [Partition("transformer.h.1.mlp.c_proj", 0, 4)]
    sim, _ = simulate_plan(p, [], parts)
    assert not sim.peak_in_recompute and _in_span(p, parts, sim.peak_op)


def test_chunk_counts_divide_the_batch(traced):
    _d, p = traced
    for s in module_spans(p):
        assert all(s.batch % k == 0 for k in s.chunk_choices if s.over == "batch")
