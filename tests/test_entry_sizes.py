"""An ``--entry`` (or ``record_step``) that builds its own batch names no batch size or sequence
length: the planner reads them from the model call's inputs as the step made them
(``problem.batch_and_seq``). Before, such a trace offered no partition along the batch or
the sequence at all (a tiny ConvNeXt from ``transformers``, recorded with its entry's own
batch of 8: nothing split, no plan at 50% of its peak)."""

from __future__ import annotations

import pytest
from partition_replay import assert_measured_as_predicted, replay_partitions

from taichi_plan.plan.format import Partition
from taichi_plan.problem.core import batch_and_seq, build_problem
from taichi_plan.problem.partition.find import module_spans
from taichi_plan.record import get_workload, record_workload
from taichi_plan.trace.format import write_trace


def _meta(args: dict, inputs: list) -> dict:
    return {"workload": {"args": args}, "model_calls": [{"start": 0, "end": 9, "grad": True, "inputs": inputs}]}


def test_sizes_are_read_from_the_model_calls_inputs():
    ids, mask = ["input_ids", [4, 64], "int64"], ["attention_mask", [4, 64], "int64"]
    pixels, labels = ["pixel_values", [8, 3, 32, 32], "float32"], ["labels", [8], "int64"]
    assert batch_and_seq(_meta({}, [ids, mask])) == (4, 64)
    assert batch_and_seq(_meta({}, [pixels, labels])) == (8, None)  # no integer input with positions
    assert batch_and_seq(_meta({"batch": 2, "seq": 16}, [ids])) == (2, 16)  # named: as named
    # inputs that disagree say nothing
    assert batch_and_seq(_meta({}, [ids, pixels])) == (None, 64)
    assert batch_and_seq(_meta({}, [ids, ["labels", [4, 32], "int64"]])) == (4, None)
    assert batch_and_seq({"workload": {"args": {}}}) == (None, None)  # no model calls listed


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    trace = record_workload(get_workload(entry="tiny_models:stacked_blocks"), fake=False)
    assert "batch" not in trace.meta["workload"]["args"]
    write_trace(trace, tmp_path_factory.mktemp("blocks") / "t")
    return build_problem(trace)


def test_an_entrys_own_batch_is_split_and_replays_as_predicted(blocks, tmp_path):
    spans = {s.module: s for s in module_spans(blocks)}
    assert spans["blocks.0"].chunk_choices == (1, 2, 4, 8)
    _plan, r = replay_partitions(blocks, [Partition("blocks.0", 0, 4), Partition("blocks.2.up", 0, 2)], tmp_path)
    assert_measured_as_predicted(r)


def test_an_entrys_own_sequence_is_split_over_positions(tmp_path):
    """A batch of one and the sequence from the token ids: the position-wise modules are
    offered over their positions (the entry's own seq, 64)."""
    trace = record_workload(get_workload(entry="tiny_models:opt_decoder", batch=1), fake=False, calibrate=False)
    assert "seq" not in trace.meta["workload"]["args"]
    assert batch_and_seq(trace.meta) == (1, 64)
    seq = [s for s in module_spans(build_problem(trace)) if s.over == "sequence"]
    assert seq and all(s.batch == 64 for s in seq), seq
