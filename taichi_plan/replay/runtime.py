"""The replay runtime: per-tensor rematerialization in live PyTorch training.

It executes what the simulator models (docs/planner.md):

* A ``TorchDispatchMode`` counts the step's ops exactly as the recorder does (``prim.*`` and
  ``profiler.*`` skipped) and checks each forward op's name against the trace the plan was made
  for (the guard). For every forward op it keeps a *recipe* for each storage the op creates or
  writes in place: the op, its non-tensor arguments, and for each tensor argument the storage
  it views (a weak reference and a recipe id) with its dtype, size, stride and offset. Random
  ops also keep the RNG state they ran with.
* Saved-tensor hooks: when autograd saves a tensor whose storage the plan drops, the pack hook
  keeps a handle instead of the tensor, so the storage is freed as soon as the forward's own
  references die (after the op ``free_after``).
* When backward unpacks a handle the storage is rebuilt from its recipe: each input is used
  if it is still alive, else rebuilt too (recursively). A rebuilt storage that the plan drops
  is kept until all its handles are unpacked (the simulator's "rebuilt early, held until its
  last use"); any other rebuilt input is a transient, freed when the rebuild is done.

Rebuilt ops run under ``no_grad`` with the recorded RNG state, so values, and gradients, are
bitwise those of the unplanned run.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from ..errors import MismatchError

_Tensor = torch.Tensor
_SKIP_NAMESPACES = ("prim", "profiler")
# Ops whose presence depends on how autograd saves tensors (saved-tensor hooks remove the
# ``detach`` of saved outputs), or that only query metadata: not counted, here or in the trace.
IGNORED_OPS = frozenset(str(op) for op in torch.utils.checkpoint.SAC_IGNORED_OPS) | {"aten.detach.default"}


@dataclass(frozen=True)
class TRef:
    """A tensor argument in a recipe: which storage it views, and how."""

    sid: int
    dtype: torch.dtype
    device: torch.device
    size: tuple
    stride: tuple
    offset: int


@dataclass
class Step:
    func: object
    spec: object  # pytree spec of (args, kwargs)
    leaves: list  # leaves with tensors replaced by TRef
    out_pos: int | None  # flattened output index that is this storage (None: in-place write)
    rng: tuple | None  # (cpu state, {device: cuda state}) for random ops


@dataclass
class _Info:
    name: str
    skip: bool
    mutates: bool
    write_args: list
    random: bool


def _info(func) -> _Info:
    schema = getattr(func, "_schema", None)
    write_args, random = [], False
    if schema is not None:
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                write_args.append((-1 if a.kwarg_only else i, a.name))
            if "Generator" in str(a.type):
                random = True
    name = str(func)
    skip = func.namespace in _SKIP_NAMESPACES or name in IGNORED_OPS
    return _Info(name, skip, bool(write_args), write_args, random)


class PlanRuntime(TorchDispatchMode):
    """One instance per planned model; ``begin_step()`` / ``end_step()`` around each step,
    with the mode entered and :meth:`hooks` active in between.

    ``drops``: counted forward op -> [(flattened output index, tensor id)] to drop.
    ``forward_ops``: the trace's counted forward ops (name, module), in order (the guard).
    Counted ops exclude ``IGNORED_OPS``, in the trace and live alike.
    """

    def __init__(self, drops: dict[int, list[tuple[int, int]]], forward_ops: list[tuple[str, str]],
                 on_mismatch: str = "raise", spans: dict[str, tuple[int, int]] | None = None,
                 recipe_ops: set[int] | None = None):
        super().__init__()
        self.recipe_ops = recipe_ops  # counted forward ops to keep recipes for (None: all)
        self.spans = spans or {}  # partitioned module -> its forward op span in the trace
        self._partition_depth = 0
        self.drops = drops
        self.forward_ops = forward_ops
        self.on_mismatch = on_mismatch
        self.enabled = True
        self._infos: dict = {}
        self._next_sid = 0
        self._sid_of: dict[int, int] = {}  # live storage cdata -> sid
        self._alive: dict[int, weakref.ref] = {}  # sid -> weakref to the storage
        self._recipes: dict[int, list[Step]] = {}
        self._dropped: dict[int, int] = {}  # sid -> tensor id
        self._pending: dict[int, int] = {}  # sid -> handles not unpacked yet
        self._cache: dict[int, torch.UntypedStorage] = {}
        self._building: dict[int, torch.UntypedStorage] = {}
        self._n = 0
        self._in_forward = False
        self._recomputing = 0
        self.mismatch: str | None = None
        # Measurements of the last step.
        self.recompute_s = 0.0
        self.recompute_ops = 0
        self.dropped_storages = 0

    # -- steps ------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        self._n = 0
        self._in_forward = True
        self._recipes.clear()
        self._dropped.clear()
        self._pending.clear()
        self._cache.clear()
        self.recompute_s = 0.0
        self.recompute_ops = 0
        self.dropped_storages = 0

    def end_step(self) -> None:
        self._in_forward = False
        self._recipes.clear()
        self._cache.clear()
        self._dropped.clear()
        self._pending.clear()

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    # -- identity -----------------------------------------------------------------------------------
    def _sid(self, st: torch.UntypedStorage) -> int:
        key = st._cdata
        sid = self._sid_of.get(key)
        if sid is None:
            sid = self._next_sid
            self._next_sid += 1
            self._sid_of[key] = sid
            self._alive[sid] = weakref.ref(st, lambda _r, key=key, sid=sid: self._forget(key, sid))
        return sid

    def _forget(self, key: int, sid: int) -> None:
        if self._sid_of.get(key) == sid:
            del self._sid_of[key]
        self._alive.pop(sid, None)

    def _ref(self, t: _Tensor) -> TRef:
        return TRef(self._sid(t.untyped_storage()), t.dtype, t.device, tuple(t.size()), tuple(t.stride()),
                    t.storage_offset())

    # -- the guard ----------------------------------------------------------------------------------
    def _check(self, i: int, name: str) -> None:
        if not self.enabled:
            return
        expected = self.forward_ops[i] if i < len(self.forward_ops) else None
        if expected is not None and expected[0] == name:
            return
        where = (f"forward op {i}: the plan expects {expected[0]} in {expected[1] or '<top level>'}"
                 if expected else f"forward op {i}: the plan's forward has only {len(self.forward_ops)} ops")
        msg = (f"The live op sequence differs from the one the plan was made for, at {where}, but the "
               f"model ran {name}. The model, its input shapes or its code changed since the trace was "
               "recorded: record and solve again, or apply the plan with on_mismatch='warn'.")
        self._mismatch(msg)

    def _mismatch(self, msg: str) -> None:
        self.mismatch = msg
        if self.on_mismatch == "warn":
            import warnings

            warnings.warn(msg + " Running unplanned from here on.", stacklevel=2)
            self.enabled = False
            return
        raise MismatchError(msg)

    def _size_mismatch(self, i: int, name: str, j: int, got: int, want: int) -> None:
        self._mismatch(
            f"The live op sequence differs from the one the plan was made for, at forward op {i} "
            f"({name} in {self.forward_ops[i][1] or '<top level>'}): its output {j} has {got} bytes, the "
            f"plan's trace has {want}. The input shapes (batch, sequence length) or the model changed "
            "since the trace was recorded: record and solve again, or apply the plan with on_mismatch='warn'.")

    def finish_forward(self) -> None:
        """Called when backward starts: the forward must have had exactly the trace's ops."""
        if self._in_forward:
            self._in_forward = False
            if self.enabled and self._n != len(self.forward_ops):
                self._mismatch(
                    f"The live forward ran {self._n} ops but the plan's trace has {len(self.forward_ops)}. "
                    "The model or its inputs changed since the trace was recorded: record and solve again, "
                    "or apply the plan with on_mismatch='warn'.")

    # -- dispatch -----------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        info = self._infos.get(func)
        if info is None:
            info = self._infos[func] = _info(func)
        if info.skip or self._recomputing or not self._in_forward or self._partition_depth:
            return func(*args, **kwargs)
        if torch._C._current_graph_task_id() != -1:
            self.finish_forward()
            return func(*args, **kwargs)
        i = self._n
        self._n += 1
        self._check(i, info.name)
        keep = self.recipe_ops is None or i in self.recipe_ops
        rng = _rng_state(args, kwargs) if info.random and keep else None
        out = func(*args, **kwargs)
        if not self.enabled:
            return out
        if not keep:
            sizes = self.forward_ops[i][2] if i < len(self.forward_ops) else {}
            if sizes:
                flat = [o for o in ([out] if isinstance(out, _Tensor) else tree_leaves(out)) if isinstance(o, _Tensor)]
                for j, want in sizes.items():
                    if j < len(flat) and flat[j].untyped_storage().nbytes() != want:
                        self._size_mismatch(i, info.name, j, flat[j].untyped_storage().nbytes(), want)
                        return out
            return out
        leaves, spec = tree_flatten((args, kwargs))
        in_sids = set()
        refs = []
        for x in leaves:
            if isinstance(x, _Tensor):
                r = self._ref(x)
                in_sids.add(r.sid)
                refs.append(r)
            else:
                refs.append(x)
        flat_out = [out] if isinstance(out, _Tensor) else tree_leaves(out)
        outs = []
        sizes = self.forward_ops[i][2] if i < len(self.forward_ops) else {}
        for j, x in enumerate(o for o in flat_out if isinstance(o, _Tensor)):
            st = x.untyped_storage()
            fresh = st._cdata not in self._sid_of
            sid = self._sid(st)
            outs.append(sid)
            if fresh and sid not in in_sids:
                self._recipes[sid] = [Step(func, spec, refs, j, rng)]
                want = sizes.get(j)
                if want is not None and want != st.nbytes():
                    self._size_mismatch(i, info.name, j, st.nbytes(), want)
                    if not self.enabled:
                        return out
        if info.mutates:
            for pos, name in info.write_args:
                v = args[pos] if 0 <= pos < len(args) else kwargs.get(name)
                for w in tree_leaves(v):
                    if isinstance(w, _Tensor):
                        sid = self._sid(w.untyped_storage())
                        if sid in self._recipes:
                            self._recipes[sid].append(Step(func, spec, refs, None, rng))
        for j, tid in self.drops.get(i, ()):
            if j < len(outs) and outs[j] in self._recipes:
                self._dropped[outs[j]] = tid
                self.dropped_storages += 1
        return out

    # -- partitions -------------------------------------------------------------------------------
    def enter_partition(self, span: tuple[int, int] | None, name: str) -> None:
        """A partitioned module starts: its ops are not the trace's, so they are not counted."""
        if self._partition_depth == 0 and self._in_forward and self.enabled and span is not None \
                and torch._C._current_graph_task_id() == -1 and self._n != span[0]:
            self._mismatch(f"The partitioned module {name!r} started at forward op {self._n}, but the plan "
                           f"expects it at op {span[0]}. Record and solve again.")
        self._partition_depth += 1

    def leave_partition(self, span: tuple[int, int] | None) -> None:
        self._partition_depth -= 1
        if self._partition_depth == 0 and span is not None and self._in_forward \
                and torch._C._current_graph_task_id() == -1:
            self._n = span[1] + 1

    # -- saved tensors ------------------------------------------------------------------------------
    def _pack(self, t: _Tensor):
        if not self.enabled or self._recomputing or not isinstance(t, _Tensor):
            return t
        sid = self._sid_of.get(t.untyped_storage()._cdata)
        if sid is None or sid not in self._dropped:
            return t
        self._pending[sid] = self._pending.get(sid, 0) + 1
        return ("taichi_plan.dropped", self._ref(t))

    def _unpack(self, packed):
        if not (isinstance(packed, tuple) and len(packed) == 2 and packed[0] == "taichi_plan.dropped"):
            return packed
        ref = packed[1]
        t = self._tensor(ref)
        left = self._pending.get(ref.sid, 1) - 1
        if left <= 0:
            self._pending.pop(ref.sid, None)
            self._cache.pop(ref.sid, None)
        else:
            self._pending[ref.sid] = left
        return t

    # -- rebuilding ---------------------------------------------------------------------------------
    def _tensor(self, ref: TRef) -> _Tensor:
        if 0 in ref.size:  # an empty tensor (e.g. a cache's torch.tensor([])): nothing to rebuild
            return torch.empty(ref.size, dtype=ref.dtype, device=ref.device)
        st = self._storage(ref.sid)
        return torch.empty(0, dtype=ref.dtype, device=ref.device).set_(st, ref.offset, ref.size, ref.stride)

    def _storage(self, sid: int) -> torch.UntypedStorage:
        if sid in self._building:
            return self._building[sid]
        if sid in self._cache:
            return self._cache[sid]
        w = self._alive.get(sid)
        st = w() if w is not None else None
        if st is not None:  # still alive (its value cannot have changed: see remat_deadline)
            return st
        steps = self._recipes.get(sid)
        if not steps:
            raise MismatchError(f"A storage the plan needs back (id {sid}) has no recipe; the plan does not "
                                "match this model. Record and solve again.")
        t0 = time.perf_counter()
        self._recomputing += 1
        try:
            with torch.no_grad():
                st = None
                for step in steps:
                    args, kwargs = tree_unflatten(
                        [self._tensor(x) if isinstance(x, TRef) else x for x in step.leaves], step.spec)
                    out = _run(step, args, kwargs)
                    self.recompute_ops += 1
                    if step.out_pos is not None:
                        flat = [o for o in ([out] if isinstance(out, _Tensor) else tree_leaves(out))
                                if isinstance(o, _Tensor)]
                        st = flat[step.out_pos].untyped_storage()
                        self._building[sid] = st
        finally:
            self._recomputing -= 1
            self._building.pop(sid, None)
        if self._recomputing == 0:
            self.recompute_s += time.perf_counter() - t0
        if sid in self._dropped and self._pending.get(sid, 0) > 0:
            self._cache[sid] = st
        return st


def _rng_state(args, kwargs):
    devices = {x.device for x in tree_leaves((args, kwargs)) if isinstance(x, _Tensor) and x.device.type == "cuda"}
    cuda = {d: torch.cuda.get_rng_state(d) for d in devices}
    return torch.get_rng_state(), cuda


def _run(step: Step, args, kwargs):
    if step.rng is None:
        return step.func(*args, **kwargs)
    cpu, cuda = step.rng
    with torch.random.fork_rng(devices=list(cuda), enabled=True):
        torch.set_rng_state(cpu)
        for d, s in cuda.items():
            torch.cuda.set_rng_state(s, d)
        return step.func(*args, **kwargs)
