"""Partition replay: run a module on chunks of its batch, each chunk checkpointed.

The module's ``forward`` is replaced by one that splits every tensor argument whose first
dimension is the batch into ``chunks`` pieces (``torch.split``: in backward one node joins
the pieces' gradients, once all have arrived, with one ``cat``; ``tensor_split``'s slices
would each fill a zero tensor of the whole batch and sum them), runs the original forward on each piece under
non-reentrant ``torch.utils.checkpoint`` (so only the piece's inputs are kept for backward),
and concatenates the outputs along dim 0 (a position-wise module split over its positions,
``over="sequence"``: :func:`_over_positions`). One chunk is the module checkpointed whole: no
split, no join. Each checkpoint stashes the RNG state its forward ran with and restores it
for the re-run in backward (``preserve_rng_state``), so a module with dropout re-draws the
masks it used (one chunk: the unplanned module's own masks). The runtime's op counter skips the module's own ops
and resumes after its span in the trace.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from ..base.errors import PlanError
from .forward import wrap_forward


def install_partitions(model, partitions, rt) -> callable:
    """Wrap each planned module's forward (a head partitioned over tokens returns lazy
    logits: :func:`taichi_plan.runtime.chunked_loss.install_token_heads`); returns a function
    that undoes it."""
    from .chunked_loss import install_token_heads

    undo = []
    undo_heads = install_token_heads(model, {p.module: p.chunks for p in partitions if p.over == "tokens"}, rt)
    for part in (p for p in partitions if p.over in ("batch", "sequence")):
        try:
            module = model.get_submodule(part.module)
        except AttributeError as e:
            raise PlanError(f"The plan partitions module {part.module!r}, which this model does not have: "
                            "the plan was made for another model.") from e
        if type(module).forward is torch.nn.Module.forward:
            raise PlanError(f"The plan partitions module {part.module!r}, a {type(module).__name__} that has no forward "
                            "of its own (its children run, it is never called), so it cannot run on chunks: the plan "
                            "was made from a trace without the modules each call ran (before trace v8). Record and "
                            "solve again.")
        if part.dim != (1 if part.over == "sequence" else 0):
            raise PlanError(f"Partition {part.over!r} along dim {part.dim} is not supported; the batch is split "
                            "along dim 0, the sequence along dim 1.")
        wrap = _over_positions if part.over == "sequence" else _chunked
        undo.append(wrap_forward(module, lambda f, w=wrap, p=part: w(f, int(p.chunks), rt, p.module)))

    def restore():
        for fn in undo:
            fn()
        undo_heads()

    return restore


def chunk_sizes(batch: int, chunks: int) -> list[int]:
    """Rows of each chunk, as ``torch.tensor_split`` cuts them (the first ``batch % chunks`` one larger)."""
    return [batch // chunks + (c < batch % chunks) for c in range(chunks)]


def _chunked(forward, chunks: int, rt, name: str):
    def run(*args, **kwargs):
        leaves, spec = tree_flatten((args, kwargs))
        batch = next((x.shape[0] for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0), None)
        k = chunks
        if rt is not None and rt.smaller_call() and batch is not None and 0 < batch < chunks:
            k = batch  # a smaller batch: one row per chunk, no larger than the recorded chunks
        if k > 1 and (batch is None or batch < k):
            raise PlanError(f"Cannot split {name!r} into {chunks} chunks: its batch is {batch}.")
        if rt is not None:
            rt.enter_partition(name)
        try:
            if k == 1:  # checkpointed whole: its outputs are the module's own, nothing to join
                return checkpoint(forward, *args, use_reentrant=False, **kwargs)
            pieces = [[] for _ in range(k)]
            sizes = chunk_sizes(batch, k)
            for x in leaves:
                parts = (torch.split(x, sizes, dim=0) if isinstance(x, torch.Tensor) and x.dim() > 0
                         and x.shape[0] == batch else [x] * k)
                for c in range(k):
                    pieces[c].append(parts[c])
            outs = []
            for c in range(k):
                a, kw = tree_unflatten(pieces[c], spec)
                outs.append(checkpoint(forward, *a, use_reentrant=False, **kw))
            flat = [tree_flatten(o) for o in outs]
            spec_out = flat[0][1]
            merged = []
            for j, first in enumerate(flat[0][0]):
                if isinstance(first, torch.Tensor) and first.dim() > 0:
                    merged.append(torch.cat([f[0][j] for f in flat], dim=0))
                else:
                    merged.append(first)
            return tree_unflatten(merged, spec_out)
        finally:
            if rt is not None:
                rt.leave_partition(name)

    return run


def _over_positions(forward, chunks: int, rt, name: str):
    """A position-wise module (taichi_plan/problem/partition/position_span.py) on ``chunks`` runs of its
    positions: each tensor argument that starts with the first one's ``(batch, seq)`` is
    viewed as ``[1, batch * seq, ...]`` and ``split`` along dim 1; each run goes through the
    module checkpointed; the outputs' runs are joined by one ``cat`` and viewed back as
    ``[batch, seq, ...]``. With batch 1 the runs are runs of the sequence."""

    def run(*args, **kwargs):
        leaves, spec = tree_flatten((args, kwargs))
        first = next((x for x in leaves if isinstance(x, torch.Tensor) and x.dim() >= 2), None)
        if first is None:
            raise PlanError(f"Cannot split {name!r} over its positions: it got no tensor of shape [batch, seq, ...].")
        pos = tuple(first.shape[:2])
        n = pos[0] * pos[1]
        if n % chunks and rt is not None and rt.smaller_call():
            # Smaller inputs: uneven runs, each no longer than the recorded ones (n < N, N = k x run).
            sizes = chunk_sizes(n, min(chunks, n))
        elif n % chunks:
            raise PlanError(f"Cannot split {name!r} into {chunks} runs of its {n} positions: {chunks} does not divide "
                            f"them (its input is {list(first.shape)}; the plan was made for another sequence length).")
        else:
            sizes = [n // chunks] * chunks
        size = sizes[0]
        if rt is not None:
            rt.enter_partition(name)
        try:
            pieces = [[] for _ in sizes]
            for x in leaves:
                if isinstance(x, torch.Tensor) and x.dim() >= 2 and tuple(x.shape[:2]) == pos:
                    parts = torch.split(x.reshape(1, n, *x.shape[2:]), sizes, dim=1)
                else:
                    parts = [x] * len(sizes)
                for c in range(len(sizes)):
                    pieces[c].append(parts[c])
            flat = []
            for c in range(len(sizes)):
                a, kw = tree_unflatten(pieces[c], spec)
                flat.append(tree_flatten(checkpoint(forward, *a, use_reentrant=False, **kw)))
            merged = []
            for j, y in enumerate(flat[0][0]):
                if not isinstance(y, torch.Tensor) or y.dim() == 0:
                    merged.append(y)
                elif y.dim() >= 2 and tuple(y.shape[:2]) == (1, size):
                    whole = torch.cat([f[0][j] for f in flat], dim=1)
                    merged.append(whole.view(*pos, *whole.shape[2:]))
                elif y.shape[0] == size:
                    merged.append(torch.cat([f[0][j] for f in flat], dim=0))
                else:
                    raise PlanError(f"{name!r} returned a tensor of shape {list(y.shape)} for a run of {size} positions: "
                                    "not one row per position, so its runs cannot be joined. The plan was made for "
                                    "another model.")
            return tree_unflatten(merged, flat[0][1])
        finally:
            if rt is not None:
                rt.leave_partition(name)

    return run
