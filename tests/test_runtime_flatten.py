"""The runtime's own flattening of an op's arguments and results (taichi_plan/runtime/mode/flatten.py:
``flatten_args``, ``unflatten_args``, ``_out_leaves``) gives back what pytree's does, for the shapes aten
ops take and for the ones it hands to pytree (nested lists, dicts, tuple subclasses)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from taichi_plan.runtime.mode.flatten import _FlatSpec, _out_leaves, flatten_args, unflatten_args

T = torch.ones(2)


@pytest.mark.parametrize("args,kwargs,fast", [
    ((T, 3, [1, 2], (T, T)), {}, True),
    ((T,), {"dim": [0, 1], "keepdim": True}, True),
    ((T, None), {"out": None}, True),
    ((), {}, True),
    ((T, []), {}, True),
    ((T, torch.Size([2])), {}, False),  # a tuple subclass: pytree's
    (([[T]],), {}, False),  # nested lists: pytree's
    (((T, 1),), {"a": {"b": T}}, False),  # a dict: pytree's
])
def test_flatten_round_trips_as_pytree_does(args, kwargs, fast):
    leaves, spec = flatten_args(args, kwargs)
    assert isinstance(spec, _FlatSpec) == fast
    want_leaves, want_spec = tree_flatten((args, kwargs))
    assert [id(x) for x in leaves] == [id(x) for x in want_leaves]  # same leaves, same order
    assert repr(unflatten_args(leaves, spec)) == repr(tree_unflatten(want_leaves, want_spec))


@pytest.mark.parametrize("out", [T, (T, T), [T, None, T], (T, [T, T]), (None,), ()])
def test_out_leaves_keep_the_traces_output_order(out):
    tensors = [id(x) for x in _out_leaves(out) if isinstance(x, torch.Tensor)]
    assert tensors == [id(x) for x in tree_leaves(out) if isinstance(x, torch.Tensor)]
