"""The cap on partition options (``partition.MAX_SPANS``) takes whole classes of repeated
modules: a 32-layer Llama's input norms were offered 24 of 32 (repeats tie in bytes), and a
plan of a class in part moves the repeated peak to the repeats left out."""

from __future__ import annotations

import re

import pytest

from taichi_plan.problem.core import build_problem
from taichi_plan.problem.partition import find as partition
from taichi_plan.problem.partition.find import _capped_by_class, module_class, module_spans
from taichi_plan.record import get_workload, record_workload


def test_module_class_replaces_block_indices_only():
    assert module_class("model.layers.3.mlp") == "model.layers.#.mlp"
    assert module_class("encoder.layer.11.attention.self") == "encoder.layer.#.attention.self"
    assert module_class("h.0") == "h.#"
    assert module_class("lm_head") == "lm_head" and module_class("conv2d_1") == "conv2d_1"


def bytes_only(inside: dict) -> dict:
    """One second of forward each: the spans ranked by their bytes alone."""
    return dict.fromkeys(inside, 1.0)


def test_the_cap_keeps_whole_classes_most_bytes_first():
    inside = {(f"l.{i}.norm", "batch"): 10 for i in range(4)}
    inside |= {(f"l.{i}.mlp", "batch"): 30 for i in range(4)}
    inside |= {("head", "tokens"): 20, ("l.0.attn", "batch"): 5}
    assert sorted(_capped_by_class(inside, 4, bytes_only(inside))) == sorted(k for k in inside if k[0].endswith("mlp"))
    # The norms (4) no longer fit beside the MLPs at 6: passed over for the head and the attention.
    assert sorted(_capped_by_class(inside, 6, bytes_only(inside))) == sorted(
        [k for k in inside if k[0].endswith("mlp")] + [("head", "tokens"), ("l.0.attn", "batch")])
    assert len(_capped_by_class(inside, 100, bytes_only(inside))) == len(inside)
    # A class larger than the cap is taken whole when it comes first (an 80-layer model), and
    # then nothing more.
    assert sorted(_capped_by_class(inside, 2, bytes_only(inside))) == sorted(k for k in inside if k[0].endswith("mlp"))


def test_given_their_cost_the_cap_keeps_the_most_bytes_per_second_first():
    """A 32-layer Llama's attentions hold more bytes than its norms but cost four times their
    forward per byte (fake 7B, batch 34): given the forward seconds, the norms come first."""
    inside = {(f"l.{i}.attn", "batch"): 20 for i in range(4)} | {(f"l.{i}.norm", "batch"): 15 for i in range(4)}
    cost = {k: (14.0 if k[0].endswith("attn") else 3.0) for k in inside}
    assert sorted(_capped_by_class(inside, 4, bytes_only(inside))) == sorted(k for k in inside if k[0].endswith("attn"))
    assert sorted(_capped_by_class(inside, 4, cost)) == sorted(k for k in inside if k[0].endswith("norm"))


@pytest.fixture(scope="module")
def llama():
    return build_problem(record_workload(get_workload(model="llama", layers=4, hidden=64, heads=2, seq=32, batch=4,
                                                      vocab=200), fake=True, device_profile="a100-40gb"))


@pytest.mark.parametrize("cap", [3, 5, 8])
def test_offered_spans_of_a_recorded_decoder_are_whole_classes(llama, monkeypatch, cap):
    p = llama
    p.__dict__.pop("_module_spans", None)  # the options are cached per problem
    every = {(s.module, s.over) for s in partition._batch_spans(p) + partition._sequence_spans(p)}
    monkeypatch.setattr(partition, "MAX_SPANS", cap)
    offered = {(s.module, s.over) for s in module_spans(p) if s.over != "tokens"}
    assert 0 < len(offered) < len(every)
    for m, over in offered:
        repeats = {k for k in every if k[1] == over and module_class(k[0]) == module_class(m)}
        assert repeats <= offered, (m, sorted(repeats - offered))
    assert any(re.search(r"\.\d+\.", m) for m, _ in offered)
