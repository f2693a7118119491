"""The runtime's own flattening of an op's arguments and results: what a recipe keeps of an
op's ``(args, kwargs)`` (:func:`flatten_args`, :func:`unflatten_args`) and the tensors of its
result in the trace's output order (:func:`flat_tensors`), as pytree's, without its cost per
node for the shapes aten ops take."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

_Tensor = torch.Tensor


def _out_leaves(out) -> list:
    """An op's result flattened as ``tree_leaves`` does (the trace's output order), without
    pytree's per-node bookkeeping for the usual results: a tensor, or a tuple or list of
    tensors (and Nones)."""
    if isinstance(out, _Tensor):
        return [out]
    if type(out) in (tuple, list) and all(o is None or isinstance(o, _Tensor) for o in out):
        return [o for o in out if o is not None]
    return tree_leaves(out)


def flat_tensors(out) -> list:
    """The tensors of an op's result, in flattened output order (the trace's output index)."""
    return [o for o in _out_leaves(out) if isinstance(o, _Tensor)]


class _FlatSpec(NamedTuple):
    """How an op's ``(args, kwargs)`` were flattened when nothing in them nests deeper than one
    plain list or tuple (every aten op's usual arguments): per argument, then per keyword
    argument, None for a leaf or (list or tuple, its length). :func:`flatten_args` makes it and
    :func:`unflatten_args` reverses it; anything else keeps pytree's spec."""

    args: tuple
    kwargs: tuple  # ((name, layout), ...)


class _Deep(Exception):
    """An argument :class:`_FlatSpec` does not describe."""


def flatten_args(args, kwargs) -> tuple[list, object]:
    """``(leaves, spec)`` of an op's arguments: pytree's flattening, without its cost per node
    (the largest part of a kept recipe's bookkeeping on a 4-layer BERT) where :class:`_FlatSpec`
    describes them."""
    leaves: list = []

    def layout(v):
        kind = type(v)
        if kind is list or kind is tuple:
            if any(isinstance(x, (list, tuple, dict)) for x in v):
                raise _Deep
            leaves.extend(v)
            return kind, len(v)
        if isinstance(v, (list, tuple, dict)):  # a subclass (torch.Size, a named tuple) or a dict
            raise _Deep
        leaves.append(v)
        return None

    try:
        spec = _FlatSpec(tuple(layout(a) for a in args), tuple((k, layout(v)) for k, v in kwargs.items()))
    except _Deep:
        return tree_flatten((args, kwargs))
    return leaves, spec


def unflatten_args(leaves: list, spec) -> tuple[tuple, dict]:
    """``(args, kwargs)`` back from :func:`flatten_args`'s ``leaves`` and ``spec``."""
    if not isinstance(spec, _FlatSpec):
        return tree_unflatten(leaves, spec)
    it = iter(leaves)

    def take(layout):
        if layout is None:
            return next(it)
        kind, n = layout
        items = [next(it) for _ in range(n)]
        return items if kind is list else tuple(items)

    args = tuple(take(a) for a in spec.args)
    return args, {k: take(v) for k, v in spec.kwargs}
