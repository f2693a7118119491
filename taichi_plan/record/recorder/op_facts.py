"""What the recorder knows of an op before and beside running it: its facts, once per op
(``op_info``: skipped or not, the arguments it writes, its flop formula, collective, seeded,
sized by data), whether a call's output sizes depend on tensor values (``sizes_by_data``),
the process group a collective runs over (``group_extent``, for a fake run's duration), and
whether a cast is one of autocast's cached ones (``autocast_cached``, not recomputable)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop, sdpa_flop, shape_wrapper

from ...trace.roofline import collective_kind

_aten = torch.ops.aten
# CPU SDPA kernels have the same (q, k, v, ...) / (grad_out, q, k, v, ...) layout as the CUDA ones.
_EXTRA_FLOPS = {
    _aten._scaled_dot_product_flash_attention_for_cpu: shape_wrapper(sdpa_flop),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: shape_wrapper(sdpa_backward_flop),
}
_Tensor = torch.Tensor
# Metadata queries and profiler markers: no kernel, no memory (``prim.device`` under fake mode,
# ``profiler._record_function_*`` around ``optimizer.step``).
_SKIP_NAMESPACES = ("prim", "profiler")
# Ops a rank cannot re-run alone: collectives, and FSDP's copies in and out of their buffers.
_NO_RECOMPUTE_NAMESPACES = ("c10d", "_c10d_functional", "fsdp")


@dataclass
class _OpInfo:
    name: str
    skip: bool
    mutates: bool
    write_args: list[tuple[int, str]]
    flop_fn: object
    collective: str | None = None  # ring kind (allgather, reduce_scatter, allreduce) of a collective
    no_recompute: bool = False
    seeded: bool = False  # tagged ``nondeterministic_seeded``: may draw from the RNG (see draws_random)
    sized_by_data: bool = False  # tagged ``dynamic_output_shape``: its outputs' sizes may depend on values


def op_info(func) -> _OpInfo:
    """What the recorder needs to know of an op, once per op: its name, whether it is skipped,
    the arguments it writes, its flop formula, whether it is a collective or seeded."""
    name = str(func)
    skip = func.namespace in _SKIP_NAMESPACES
    write_args = []
    schema = getattr(func, "_schema", None)
    if schema is not None:
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                write_args.append((-1 if a.kwarg_only else i, a.name))
    packet = func.overloadpacket
    flop_fn = flop_registry.get(packet) or _EXTRA_FLOPS.get(packet)
    return _OpInfo(name, skip, bool(write_args), write_args, flop_fn, collective_kind(name),
                   func.namespace in _NO_RECOMPUTE_NAMESPACES, _SEEDED is not None and _SEEDED in func.tags,
                   torch.Tag.dynamic_output_shape in func.tags)


def sizes_by_data(func, args) -> bool:
    """Does this call of an op tagged ``dynamic_output_shape`` make outputs whose sizes depend
    on tensor values (``nonzero``, ``masked_select``, ``unique``, ``x[mask]``)? Indexing is tagged
    for its boolean masks: ``x[idx]`` with integer indices is sized by ``idx``'s size alone (data
    dependent only when ``idx`` is, which the recorder follows from its inputs)."""
    if func is torch.ops.aten.index.Tensor and len(args) > 1:
        return any(isinstance(i, _Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] or ())
    return True


_SEEDED = getattr(torch.Tag, "nondeterministic_seeded", None)


def group_extent(args, world_size: int, devices_per_node: int) -> tuple[int, bool | None]:
    """(ranks, whether they span nodes) of the process group a collective runs over (its
    ``ProcessGroup`` argument: HSDP all-gathers over a shard group, a row of consecutive ranks,
    and all-reduces over a replicate group, ranks a row apart, on other nodes once a row fills
    one); (``world_size``, None) when the op names no group this process can read."""
    import torch.distributed as dist

    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                ranks = dist.get_process_group_ranks(dist.ProcessGroup.unbox(a))
            except Exception:  # noqa: BLE001  (no readable group: the whole job, as before)
                break
            if ranks:
                return len(ranks), len({r // max(devices_per_node, 1) for r in ranks}) > 1
    return world_size, None


def autocast_cached(args) -> bool:
    """Whether this may be one of autocast's cached casts (a cast of a leaf tensor that
    requires grad, with the cache enabled): the cache keeps it until the autocast region ends,
    so freeing it early frees nothing, and it is no candidate for rematerialization. (Inside a
    dispatch mode autocast reads as disabled, so every such cast counts: outside autocast these
    casts are rare in a training step, and keeping one only costs a candidate.)"""
    x = args[0] if args else None
    return isinstance(x, _Tensor) and x.is_leaf and x.requires_grad and torch.is_autocast_cache_enabled()
