"""An FSDP2 model as both record and replay see it: its device mesh, its units and their param
groups, their live resharding, prefetch and mixed-precision settings (and setting them), the
layout a trace records of them, and patching the groups' methods."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from ..base.errors import UsageError


def check_replicas(world_size: int, replicas: int) -> None:
    """HSDP's replica count must divide the ranks (each replica a shard group of the same size)."""
    if world_size < 1:
        raise UsageError(f"--fsdp must be at least 1 rank, got {world_size}.")
    if replicas < 1 or world_size % replicas:
        raise UsageError(f"--hsdp {replicas}: the {world_size} ranks must split into that many replicas of equal "
                         f"shard groups; give a divisor of {world_size}.")


def device_mesh(world_size: int, replicas: int = 1, device: str = "cpu"):
    """The job's device mesh: 1-D over every rank (FSDP), or, with ``replicas`` > 1, 2-D
    ``(replicas, world_size // replicas)`` with dims ``("replicate", "shard")`` (HSDP:
    ``fully_shard`` shards each unit within a row and all-reduces its gradients across rows)."""
    from torch.distributed.device_mesh import init_device_mesh

    check_replicas(world_size, replicas)
    if replicas == 1:
        return init_device_mesh(device, (world_size,))
    return init_device_mesh(device, (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard"))


def mesh_replicas(meta: dict) -> int:
    """The replica count of a sharded trace's mesh (``meta.fsdp.mesh_shape``: 2-D for HSDP)."""
    shape = (meta.get("fsdp") or {}).get("mesh_shape") or []
    return int(shape[0]) if len(shape) == 2 else 1


# Names the CLI and meta.fsdp use for FSDP2's MixedPrecisionPolicy dtypes.
MP_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def mixed_precision(param_dtype: str | None = None, reduce_dtype: str | None = None) -> dict | None:
    """The ``mixed_precision`` setting of a recording (``meta.fsdp``, trace v16) from the CLI's
    names (``bf16``, ``fp16``, ``fp32``; None: FSDP's default): None when neither is given."""
    for name in (param_dtype, reduce_dtype):
        if name is not None and name not in MP_DTYPES:
            raise UsageError(f"An FSDP mixed-precision dtype must be one of {', '.join(MP_DTYPES)}, not {name!r}.")
    if param_dtype is None and reduce_dtype is None:
        return None
    return {"param_dtype": MP_DTYPES.get(param_dtype), "reduce_dtype": MP_DTYPES.get(reduce_dtype)}


def mp_policy(setting: dict | None):
    """FSDP2's ``MixedPrecisionPolicy`` for a ``mixed_precision`` setting (None: its default,
    parameters gathered and gradients reduced in their own dtype)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    setting = setting or {}

    def dtype(key: str):
        name = setting.get(key)
        return getattr(torch, name) if name else None

    return MixedPrecisionPolicy(param_dtype=dtype("param_dtype"), reduce_dtype=dtype("reduce_dtype"))


def reshard_setting(value, shard_size: int, what: str = "reshard_after_forward") -> Reshard:
    """A unit's ``reshard_after_forward`` as FSDP2 runs it: a bool, or an int that is a factor
    of the shard group's size (FSDP2 reads 1 as False and the group's size as True; so does
    this). Anything else is a :class:`UsageError` that names the factors."""
    if isinstance(value, bool):
        return value
    factors = [k for k in range(2, shard_size) if shard_size % k == 0]
    if not isinstance(value, int) or value < 1 or shard_size % value:
        raise UsageError(
            f"{what} is {value!r}: give True, False, or the number of ranks to reshard to after forward, a "
            f"factor of the {shard_size}-rank shard group (" + (", ".join(map(str, factors)) if factors else
                                                               "this group has none between 1 and itself") + ").")
    return False if value == 1 else True if value == shard_size else value


def fsdp_units(model) -> list[tuple[str, object]]:
    """(FQN, module) of each FSDP unit (a module ``fully_shard`` made an ``FSDPModule`` with
    parameters of its own), in module order."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for name, m in model.named_modules():
        if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None:
            out.append((name, m))
    return out


def set_reshard(model, settings: dict[str, bool]) -> Callable[[], None]:
    """Set each FSDP unit named in ``settings`` (FQN -> ``reshard_after_forward``) with
    ``FSDPModule.set_reshard_after_forward(value, recurse=False)``, also where it already has
    that value: that pins it (FSDP2's default, ``reshard_after_forward=None``, would otherwise
    turn the root's off at its lazy init, after ``apply``). Returns a function that restores
    the previous values."""
    from ..base.errors import PlanError

    changed = []
    for fqn, m in fsdp_units(model):
        value = settings.get(fqn)
        if value is None:
            continue
        g = param_group(m)
        if not isinstance(value, bool):  # an int: set only by fully_shard (FSDP2's setter takes a bool)
            if reshard_of(g) != value:
                raise PlanError(
                    f"The plan reshards FSDP unit {fqn or '<root>'} to {value} ranks after forward, but the model "
                    f"has reshard_after_forward={reshard_of(g)} there. FSDP2 sets an int only when it shards: pass "
                    f"reshard_after_forward={value} to that unit's fully_shard.")
            continue
        changed.append((m, g, g.post_forward_mesh_info))
        m.set_reshard_after_forward(value, recurse=False)

    def undo() -> None:
        for m, g, was in changed:
            m.set_reshard_after_forward(was is not None, recurse=False)
            g.post_forward_mesh_info = was  # as it was, an int's smaller mesh included

    return undo


def set_prefetch(model, settings: dict[str, dict]) -> Callable[[], None]:
    """Set FSDP2's explicit prefetching of the units named in ``settings`` (FQN ->
    ``{"forward": [FQN, ...], "backward": [FQN, ...] | None}``): ``forward`` with
    ``set_modules_to_forward_prefetch`` (``[]``: none, FSDP's default), ``backward`` with
    ``set_modules_to_backward_prefetch`` (None: FSDP's default, the unit that ran forward just
    before; ``[]``: none, set as the unit itself, which is gathered by then: a no-op target that
    turns the default off, since an empty list means the default). Returns a function that
    restores the previous lists."""
    units = dict(fsdp_units(model))
    saved = []
    for fqn, s in settings.items():
        if fqn not in units:
            raise UsageError(f"prefetch names {fqn!r}, which is not an FSDP unit of this model "
                             f"(units: {', '.join(repr(u) for u in units)}).")
        m = units[fqn]
        state = m._get_fsdp_state()
        saved.append((state, list(state._states_to_forward_prefetch), list(state._states_to_backward_prefetch)))
        targets = [units[t] for t in s.get("forward") or []]
        m.set_modules_to_forward_prefetch(targets)
        back = s.get("backward")
        m.set_modules_to_backward_prefetch([] if back is None else [units[t] for t in back] or [m])

    def undo() -> None:
        for state, fwd, bwd in saved:
            state._states_to_forward_prefetch = fwd
            state._states_to_backward_prefetch = bwd

    return undo


def live_prefetch(model) -> dict[str, dict]:
    """Each FSDP unit's explicit prefetching, as :func:`set_prefetch` takes it (units at FSDP's
    default left out; a backward list naming only the unit itself reads as ``[]``)."""
    units = fsdp_units(model)
    name = {id(m._get_fsdp_state()): fqn for fqn, m in units}
    out = {}
    for fqn, m in units:
        state = m._get_fsdp_state()
        fwd = [name.get(id(s), "?") for s in state._states_to_forward_prefetch]
        bwd = [name.get(id(s), "?") for s in state._states_to_backward_prefetch]
        back = None if not bwd else [t for t in bwd if t != fqn]
        if fwd or back is not None:
            out[fqn] = {"forward": fwd, "backward": back}
    return out


def param_group(module):
    return module._get_fsdp_state()._fsdp_param_group


def reshard_of(group) -> Reshard:
    """A param group's ``reshard_after_forward`` as FSDP2 holds it: False (no post-forward
    mesh), True (its own mesh), or the size of the smaller mesh it reshards to."""
    post = group.post_forward_mesh_info
    if post is None:
        return False
    if post == group.mesh_info:
        return True
    return int(post.shard_mesh_size)


def live_layout(model) -> dict | None:
    """:func:`taichi_plan.trace.layout.layout` of a live model: None when it is not sharded with
    FSDP2, else its world size, mesh and units."""
    from ..trace.layout import layout

    units = fsdp_units(model)
    if not units:
        return None
    mesh = param_group(units[0][1]).mesh_info.mesh
    return layout({"fsdp": describe_layout(model, mesh, mesh.size(), "live")})


def _cast_dtypes(policy, own) -> tuple:
    """(param_dtype, reduce_dtype) FSDP runs a parameter of dtype ``own`` with under ``policy``:
    ``FSDPParam.init_dtype_attrs``' rule (no reduce cast where it equals the param dtype, no
    param cast where that is the parameter's own or the parameter is not floating point), here
    because FSDP applies it only at its lazy init, in the first forward, after which apply()
    may come."""
    p, r = getattr(policy, "param_dtype", None), getattr(policy, "reduce_dtype", None)
    if r == p:
        r = None
    if p == own or not own.is_floating_point:
        p = None
    return p, r


def param_dtype_of(fsdp_param, policy=None):
    """The dtype FSDP gathers a parameter in: its mixed-precision ``param_dtype``, else its own."""
    own = fsdp_param.sharded_param.dtype
    return _cast_dtypes(policy, own)[0] or own


def group_mixed_precision(group) -> dict:
    """A unit's mixed precision as FSDP runs it (``param_dtype``, ``reduce_dtype``: dtype names;
    FSDP normalizes a policy dtype equal to the parameters' own to no cast): {} when it casts
    nothing (trace v16; older traces had no key, and no policy)."""
    params = group.fsdp_params
    if not params:
        return {}
    p, r = _cast_dtypes(getattr(group, "mp_policy", None), params[0].sharded_param.dtype)
    if p is None and r is None:
        return {}
    return {"param_dtype": str(p).replace("torch.", "") if p is not None else None,
            "reduce_dtype": str(r).replace("torch.", "") if r is not None else None}


def recorded_mixed_precision(meta: dict) -> dict | None:
    """The ``mixed_precision`` setting a sharded trace was recorded with (its units'; trace
    v16), None for FSDP's default (and older traces)."""
    for u in (meta.get("fsdp") or {}).get("units", []):
        if u.get("param_dtype") or u.get("reduce_dtype"):
            return {"param_dtype": u.get("param_dtype"), "reduce_dtype": u.get("reduce_dtype")}
    return None


# The param-group methods in which FSDP runs its own ops (gathering, copying, freeing).
GROUP_METHODS = ("pre_forward", "post_forward", "pre_backward", "post_backward", "unshard", "wait_for_unshard",
                 "reshard")


def patch_group_methods(model, wrap: Callable) -> _Undo:
    """Replace each FSDP unit's param-group methods in :data:`GROUP_METHODS` by
    ``wrap(unit_index, group, name, original)`` on the instance (as ``FSDPMemTracker`` does);
    the returned handle's ``remove()`` restores them."""
    patched = []
    for k, (_fqn, m) in enumerate(fsdp_units(model)):
        g = param_group(m)
        for name in GROUP_METHODS:
            setattr(g, name, wrap(k, g, name, getattr(g, name)))
            patched.append((g, name))

    def undo() -> None:
        for g, name in patched:
            with contextlib.suppress(AttributeError):
                delattr(g, name)
        patched.clear()

    return _Undo(undo)


Reshard = bool | int  # a unit's reshard_after_forward: True, False, or the group size to reshard to


def describe_layout(model, mesh, world_size: int, backend: str) -> dict:
    """``meta.fsdp`` without the per-step parts: the layout of the sharded model."""
    units = []
    for fqn, m in fsdp_units(model):
        g = param_group(m)
        unit = {
            "module": fqn,
            # FSDP2 never reshards the root after forward (backward would gather it at once);
            # an int: the ranks of the smaller mesh it reshards to (trace v17)
            "reshard_after_forward": reshard_of(g),
            "params": [fp._param_fqn or "" for fp in g.fsdp_params],
            "sharded_nbytes": int(sum(fp.sharded_param._local_tensor.untyped_storage().nbytes()
                                      for fp in g.fsdp_params)),
            # gathered in the policy's param_dtype, where it casts (mixed precision)
            "unsharded_nbytes": int(sum(fp._orig_size.numel() * param_dtype_of(fp, getattr(g, "mp_policy", None)).itemsize
                                        for fp in g.fsdp_params)),
        }
        unit.update(group_mixed_precision(g))
        units.append(unit)
    return {"world_size": world_size, "rank": 0, "backend": backend, "mesh_shape": list(mesh.shape),
            "mesh_device": mesh.device_type, "units": units}


class _Undo:
    def __init__(self, fn: Callable[[], None]):
        self.remove = fn
