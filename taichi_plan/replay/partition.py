"""Partition replay: run a module on chunks of its batch, each chunk checkpointed.

The module's ``forward`` is replaced by one that splits every tensor argument whose first
dimension is the batch into ``chunks`` pieces (``torch.split``: in backward one node joins
the pieces' gradients, once all have arrived, with one ``cat``; ``tensor_split``'s slices
would each fill a zero tensor of the whole batch and sum them), runs the original forward on each piece under
non-reentrant ``torch.utils.checkpoint`` (so only the piece's inputs are kept for backward),
and concatenates the outputs along dim 0. One chunk is the module checkpointed whole: no
split, no join. Each checkpoint stashes the RNG state its forward ran with and restores it
for the re-run in backward (``preserve_rng_state``), so a module with dropout re-draws the
masks it used (one chunk: the unplanned module's own masks). The runtime's op counter skips the module's own ops
and resumes after its span in the trace.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from ..errors import PlanError


def install_partitions(model, partitions, rt) -> callable:
    """Wrap each planned module's forward (a head partitioned over tokens returns lazy
    logits: :func:`taichi_plan.replay.chunked_loss.install_token_heads`); returns a function
    that undoes it."""
    from .chunked_loss import install_token_heads

    undo = []
    undo_heads = install_token_heads(model, {p.module: p.chunks for p in partitions if p.over == "tokens"}, rt)
    for part in (p for p in partitions if p.over == "batch"):
        try:
            module = model.get_submodule(part.module)
        except AttributeError as e:
            raise PlanError(f"The plan partitions module {part.module!r}, which this model does not have: "
                            "the plan was made for another model.") from e
        if part.dim != 0:
            raise PlanError(f"Partition along dim {part.dim} is not supported; only dim 0 (the batch).")
        original = module.forward
        module.forward = _chunked(original, int(part.chunks), rt, part.module)
        undo.append((module, original))

    def restore():
        for module, original in undo:
            module.forward = original
        undo_heads()

    return restore


def chunk_sizes(batch: int, chunks: int) -> list[int]:
    """Rows of each chunk, as ``torch.tensor_split`` cuts them (the first ``batch % chunks`` one larger)."""
    return [batch // chunks + (c < batch % chunks) for c in range(chunks)]


def _chunked(forward, chunks: int, rt, name: str):
    def run(*args, **kwargs):
        leaves, spec = tree_flatten((args, kwargs))
        batch = next((x.shape[0] for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0), None)
        if chunks > 1 and (batch is None or batch < chunks):
            raise PlanError(f"Cannot split {name!r} into {chunks} chunks: its batch is {batch}.")
        if rt is not None:
            rt.enter_partition(name)
        try:
            if chunks == 1:  # checkpointed whole: its outputs are the module's own, nothing to join
                return checkpoint(forward, *args, use_reentrant=False, **kwargs)
            pieces = [[] for _ in range(chunks)]
            sizes = chunk_sizes(batch, chunks)
            for x in leaves:
                parts = (torch.split(x, sizes, dim=0) if isinstance(x, torch.Tensor) and x.dim() > 0
                         and x.shape[0] == batch else [x] * chunks)
                for c in range(chunks):
                    pieces[c].append(parts[c])
            outs = []
            for c in range(chunks):
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
