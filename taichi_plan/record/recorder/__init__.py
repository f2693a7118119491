"""The recorder: a ``TorchDispatchMode`` that writes down one training step, op by op.

What one recorded step is (``record_step``)::

    optimizer.zero_grad(set_to_none=True)      # outside the recorded region: old grads die here
    -- recording starts --
    out = model(batch); loss = loss_fn(out, batch); del out      # phase "forward"
    loss.backward()                                               # phase "backward"
    optimizer.step()                                              # phase "optimizer"
    -- locals die, recording stops --

So gradients do not exist at the step start; they are allocated in backward and outlive the
step (``free_op = -1``). Parameters, buffers, optimizer state and the batch exist before the
step and are registered up front with ``alloc_op = producer_op = -1``.

How each column is decided:

- Ops: every op the mode sees, in order, except the ``prim`` and ``profiler`` namespaces (fake
  mode emits ``prim.device.default`` on every ``.device``; ``optimizer.step`` is wrapped in
  ``profiler._record_function_*`` markers; neither launches a kernel). ``aten.detach.default`` is
  kept: replay's op ordinals must skip the ops in ``torch.utils.checkpoint.SAC_IGNORED_OPS``.
- ``phase``: ``backward`` while ``torch._C._current_graph_task_id() != -1``; ``optimizer``
  between the optimizer's step pre- and post-hooks; otherwise ``forward`` (the loss included).
- ``module``: the deepest FQN in ``ModTracker.parents``, relative to the model (``''`` for the
  model itself, no module, or a module outside the model such as a loss module).
- ``flops``: ``torch.utils.flop_counter.flop_registry`` (plus CPU flash attention), else 0.
- ``duration_s``: real runs time the kernel call (``measured``): in the thread's CPU time when
  torch runs one intra-op thread (a kernel then runs on this thread alone, and time the thread
  waits for a core on a loaded machine is not the op's), else in wall time; fake runs use the
  roofline estimate of a device profile (``estimated``), 0 for ops that launch no kernel.
- ``mutates``: the schema writes an argument (in-place or ``out=``); ``recomputable`` is
  ``not mutates`` outside the optimizer phase (random ops count as recomputable: replay
  restores the RNG state), except autocast's cached casts of parameters (the cache keeps them
  until the autocast region ends, so dropping them would free nothing).
- Tensors are storages (0-byte storages are not recorded: they hold no memory): an output whose storage is already live is a view (no new tensor, no
  write) unless the op mutates that storage. ``free_op`` is the last op that started before the
  storage's weakref callback fired.
- Accesses: one ``read`` per tensor argument (``arg_index`` = position among the flattened tensor
  arguments); one ``write`` per new or mutated output storage (``arg_index`` = position among
  the flattened tensor outputs; for a mutated argument the op does not return, its position
  among the tensor arguments).
- Kinds: registered ones (parameter, buffer, optimizer_state, input), ``.grad`` storages at the
  step end are ``gradient``, storages in ``optimizer.state`` at the end ``optimizer_state``;
  the rest is ``activation`` if produced in forward and alive when backward starts (saved for
  backward), else ``temporary``. A storage an add-on labelled beforehand (``storage_labels``,
  e.g. FSDP's unsharded parameters) takes that kind; the gathered buffer of an all-gather is
  ``all_gather``, the full input of a reduce-scatter ``reduce_scatter``.
- Resized storages: ``UntypedStorage.resize_`` is no op a dispatch mode sees (FSDP2 frees and
  re-allocates unsharded parameters with it), so the recorder patches it while active. A
  storage resized to 0 bytes is freed there (``free_op`` = the last op that ran); resized to
  n > 0 bytes it becomes a new row (a new *incarnation* of the same storage) from the next op
  on. Rows of one storage are listed in ``StepRecord.incarnations``.
- Tensor subclasses that wrap others (DTensor) are let through (``NotImplemented``), so the
  mode sees the ops on their local tensors; registered DTensors count as their local tensors.
- Collectives (``c10d.*``, ``_c10d_functional.*``) and FSDP's own ops (``fsdp.*``) are never
  ``recomputable`` (a rank cannot re-run a collective alone); a fake run costs a collective
  as a ring over ``world_size`` devices on the profile's interconnect
  (:func:`~taichi_plan.trace.roofline.collective_duration_s`).
"""

from __future__ import annotations

import gc
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import arg_tree_leaves, tree_leaves

from ...torch_common.ops import draws_random, op_clock
from ...trace.devices import DeviceProfile
from ...trace.roofline import collective_duration_s, dtype_key, estimate_duration_s
from .calls import CallsMixin
from .module_tracking import ModuleTracker, leaf_safe_module_tracking
from .op_facts import autocast_cached, group_extent, op_info, sizes_by_data
from .step_record import StepRecord
from .storages import StoragesMixin, local_tensor, storage_of, wrapper_subclasses

_Tensor = torch.Tensor


_NO_NODE = object()  # no backward op seen since the last forward or optimizer op
_current_node = getattr(torch._C, "_current_autograd_node", None)  # torch >= 2.1


class Recorder(CallsMixin, StoragesMixin, TorchDispatchMode):
    """Records ops, storages and accesses; one instance serves several steps.

    Use ``begin_step(...)`` / ``end_step(...)`` around each step, with the mode active in
    between. ``profile`` given: durations are roofline estimates; else measured by
    :func:`op_clock` (CPU time of the thread with one torch thread, else wall time).
    """

    def __init__(self, profile: DeviceProfile | None = None, model: torch.nn.Module | None = None,
                 world_size: int = 1):
        super().__init__()
        self._gc_was_enabled = False  # begin_step turned the cyclic collector off (end_step/close: on)
        self.profile = profile
        self.clock = op_clock()
        self.world_size = world_size  # devices a fake run's collectives are costed over
        # storage key -> (kind, dtype, shape) for storages an add-on knows better (FSDP's
        # unsharded parameters, which first appear through ``resize_``)
        self.storage_labels: dict[int, tuple[str, str, list]] = {}
        self._wrappers = wrapper_subclasses()
        self._orig_resize = None
        self._infos: dict = {}
        self._alive: dict[int, weakref.ref] = {}  # storage key -> weakref, every storage seen and alive
        self._tid: dict[int, int] = {}  # storage key -> tensor id in the current step
        # Rows of the current step whose storage died on another thread (a collective's worker
        # dropped the last reference after the step's own code had: see _on_free).
        self.offthread_freed: list[int] = []
        self._thread = threading.get_ident()
        self._n = 0
        self._in_opt = False
        self._rerun = (-2, False)  # (last grad-enabled backward op, whether its run is a checkpoint's)
        self._node = _NO_NODE  # the autograd node the last backward op ran in (held: its id stays unique)
        self._names = {id(m): n for n, m in model.named_modules()} if model is not None else {}
        self._call_hook = None
        self._return_hook = None
        self._call_starts: list[int] = []  # op count at each module call in progress (nested)
        self._rec: StepRecord | None = None
        self._mod_tracker = ModuleTracker()
        self._root = ""
        self._fqn_cache: dict[str, str] = {}
        if model is not None:
            get_name = getattr(self._mod_tracker, "_get_mod_name", None)
            if get_name is not None:  # name submodules relative to the model, not the first caller
                self._root = self._mod_tracker.root = get_name(model)

    @property
    def op_count(self) -> int:
        """Ops recorded so far in the current step (the id the next op gets)."""
        return self._n

    @property
    def current(self) -> StepRecord | None:
        """The record of the step being recorded, None between steps."""
        return self._rec

    def __enter__(self):
        self._mod_tracker.__enter__()
        self._patch_resize()
        self._leaf_safe = leaf_safe_module_tracking()
        self._leaf_safe.__enter__()
        self._call_hook = torch.nn.modules.module.register_module_forward_pre_hook(self._called)
        self._return_hook = torch.nn.modules.module.register_module_forward_hook(
            self._returned, with_kwargs=True, always_call=True)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._call_hook.remove()
            self._return_hook.remove()
            self._call_starts.clear()
            self._leaf_safe.__exit__(None, None, None)
            self._restore_resize()
            self._mod_tracker.__exit__(*exc)

    # -- step bookkeeping -----------------------------------------------------------------------
    def begin_step(self, registered: list[tuple[str, list[torch.Tensor]]]) -> None:
        """Start a new step; ``registered`` = [(kind, tensors)] that exist before it."""
        gc.collect()
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        self._rec = StepRecord(
            ops={k: [] for k in ("op", "module", "phase", "duration_s", "flops", "mutates", "recomputable")},
            tensors={k: [] for k in ("nbytes", "dtype", "shape", "kind", "producer_op", "alloc_op", "free_op")},
            accesses={k: [] for k in ("op_id", "tensor_id", "role", "arg_index")},
        )
        self._tid = {}
        self.offthread_freed = []
        self._thread = threading.get_ident()
        self._n = 0
        for kind, tensors in registered:
            for t in tensors:
                if isinstance(t, _Tensor):
                    t = local_tensor(t)
                    st = t.untyped_storage()
                    if st._cdata not in self._tid:
                        self._register(t, st, -1, -1, kind)

    def end_step(self, late_kinds: list[tuple[str, list[torch.Tensor]]]) -> StepRecord:
        """Stop the step (after its locals died); ``late_kinds`` re-label storages alive now.

        The cyclic garbage collector is off during the step (:meth:`begin_step` collects, then
        disables it; this turns it back on): a storage kept by a reference cycle is live until
        the step ends, in every recording and measurement alike. With the collector on, when
        it runs inside a step depends on how many Python objects came before (another rank's
        messages, a warm-up's leftovers), and two measurements of one step differed by what a
        cycle held (FSDP2 on gloo ranks: 0.4 MB). Off is also the prediction's safe side.
        """
        if self._gc_was_enabled:
            gc.enable()
            self._gc_was_enabled = False
        self._node = _NO_NODE
        rec = self._rec
        kinds = rec.tensors["kind"]
        for kind, tensors in late_kinds:
            for t in tensors:
                if isinstance(t, _Tensor):
                    tid = self._tid.get(local_tensor(t).untyped_storage()._cdata)
                    if tid is not None:
                        kinds[tid] = kind
        n_ops = rec.num_ops
        for tid, a in enumerate(rec.tensors["alloc_op"]):
            if a >= n_ops:  # grown by resize_ after the step's last op: holds no memory in the step
                rec.tensors["alloc_op"][tid] = rec.tensors["free_op"][tid] = max(n_ops - 1, 0)
                rec.tensors["nbytes"][tid] = 0
        phases = rec.ops["phase"]
        first_bw = next((i for i, p in enumerate(phases) if p == "backward"), None)
        alloc, free = rec.tensors["alloc_op"], rec.tensors["free_op"]
        for tid, k in enumerate(kinds):
            if k is None:
                alive_at_bw = (
                    first_bw is not None
                    and rec.producer_phase[tid] == "forward"
                    and (free[tid] == -1 or free[tid] >= first_bw)
                    and alloc[tid] < first_bw
                )
                kinds[tid] = "activation" if alive_at_bw else "temporary"
        self._tid = {}
        self._rec = None
        return rec

    def close(self) -> None:
        """Drop the weakrefs (and their callbacks) and the module tracker: no cycle keeps the
        model alive after recording. The cyclic collector is on again if a step left it off."""
        if self._gc_was_enabled:
            gc.enable()
            self._gc_was_enabled = False
        self._alive.clear()
        self._tid = {}
        self._rec = None
        self._mod_tracker = None

    # -- the hot path ---------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if self._wrappers and any(issubclass(t, self._wrappers) for t in types):
            return NotImplemented  # let DTensor run; the ops on its local tensors come back here
        info = self._infos.get(func)
        if info is None:
            info = self._infos[func] = op_info(func)
        rec = self._rec
        if info.skip or rec is None:
            return func(*args, **kwargs)
        op_id = self._n
        self._n = op_id + 1
        flat_in = arg_tree_leaves(*args, **kwargs)
        measure = self.profile is None
        try:
            if measure:
                t0 = self.clock()
                out = func(*args, **kwargs)
                duration_s = self.clock() - t0
            else:
                out = func(*args, **kwargs)
        except BaseException:
            self._n = op_id
            raise

        if torch._C._current_graph_task_id() != -1:
            phase = "backward"
            if torch.is_grad_enabled():
                self._note_rerun(rec, op_id)
            node = _current_node() if _current_node is not None else None
            if node is not self._node:
                rec.node_starts.append(op_id)
                self._node = node
        else:
            self._node = _NO_NODE
            phase = "optimizer" if self._in_opt else "forward"
        ops = rec.ops
        ops["op"].append(info.name)
        ops["phase"].append(phase)
        if info.seeded and draws_random(func, args, kwargs):
            rec.random_ops.append(op_id)
        ops["module"].append(self._module())

        acc = rec.accesses
        a_op, a_tid, a_role, a_idx = acc["op_id"], acc["tensor_id"], acc["role"], acc["arg_index"]
        tids = self._tid
        bytes_moved = 0
        in_keys = []
        i = 0
        sized = rec.data_sized
        by_data = info.sized_by_data and sizes_by_data(func, args)
        if by_data:
            rec.data_sized_sources.append(op_id)
        for x in flat_in:
            if isinstance(x, _Tensor):
                st = storage_of(x, info.name)
                key = st._cdata
                tid = tids.get(key)
                if tid is None:  # storage from before the step, or made outside the dispatcher
                    if st.nbytes() == 0:  # holds no memory: not recorded
                        i += 1
                        continue
                    tid = self._register(x, st, -1 if key in self._alive else op_id, -1, None)
                if sized and tid in sized:
                    by_data = True
                a_op.append(op_id)
                a_tid.append(tid)
                a_role.append("read")
                a_idx.append(i)
                in_keys.append(key)
                if not measure:
                    bytes_moved += x.nbytes
                i += 1

        written = None
        if info.mutates:
            written = {}
            for pos, name in info.write_args:
                v = args[pos] if 0 <= pos < len(args) else kwargs.get(name)
                for w in (v,) if isinstance(v, _Tensor) else tree_leaves(v):
                    if isinstance(w, _Tensor):
                        k = w.untyped_storage()._cdata
                        written.setdefault(k, in_keys.index(k) if k in in_keys else -1)

        flat_out = (out,) if isinstance(out, _Tensor) else tree_leaves(out)
        shapes = []
        launched = info.mutates
        j = 0
        for x in flat_out:
            if not isinstance(x, _Tensor):
                continue
            shapes.append(tuple(x.shape))
            st = storage_of(x, info.name)
            key = st._cdata
            tid = tids.get(key)
            if tid is None:
                launched = True
                if st.nbytes() == 0:  # holds no memory: not recorded
                    j += 1
                    continue
                tid = self._register(x, st, op_id, op_id, None)
                if by_data:
                    sized.add(tid)
            elif written is None or key not in written:
                j += 1
                continue
            else:
                del written[key]
            a_op.append(op_id)
            a_tid.append(tid)
            a_role.append("write")
            a_idx.append(j)
            if not measure:
                bytes_moved += x.nbytes
            j += 1
        if written:  # mutated arguments the op does not return (e.g. void ``_foreach_*_``)
            for key, pos in written.items():
                if key in tids:
                    a_op.append(op_id)
                    a_tid.append(tids[key])
                    a_role.append("write")
                    a_idx.append(pos)
        rec.shapes.append(tuple(shapes))
        if by_data:
            rec.data_sized_ops.add(op_id)

        flops = 0
        if info.flop_fn is not None:
            try:
                flops = int(info.flop_fn(*args, **kwargs, out_val=out))
            except Exception:  # a formula that does not know this overload: no count, not a crash
                flops = 0
        if info.collective is not None:
            self._label_collective(info.collective, flat_in, flat_out)
        if not measure:
            if info.collective is not None:
                full = max((x.nbytes for x in (*flat_in, *flat_out) if isinstance(x, _Tensor)), default=0)
                n, across = group_extent(args, self.world_size, self.profile.devices_per_node)
                duration_s = collective_duration_s(self.profile, info.name, full, n, across)
            elif launched or flops:
                dt = next((x.dtype for x in flat_in if isinstance(x, _Tensor) and x.is_floating_point()), None)
                duration_s = estimate_duration_s(self.profile, flops, bytes_moved, dtype_key(dt))
            else:
                duration_s = 0.0
        ops["duration_s"].append(duration_s)
        ops["flops"].append(flops)
        ops["mutates"].append(info.mutates)
        ops["recomputable"].append(not info.mutates and phase != "optimizer" and not info.no_recompute
                                   and not (info.name == "aten._to_copy.default" and autocast_cached(args)))
        return out

    def _label_collective(self, kind: str, flat_in, flat_out) -> None:
        """The full buffer of an all-gather (its output) is ``all_gather``, of a reduce-scatter
        (its input) ``reduce_scatter``, unless something already named its kind."""
        label = {"allgather": "all_gather", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter"}.get(kind)
        if label is None:
            return
        tensors = [x for x in (*flat_in, *flat_out) if isinstance(x, _Tensor)]
        if not tensors:
            return
        full = max(tensors, key=lambda x: x.untyped_storage().nbytes())
        tid = self._tid.get(full.untyped_storage()._cdata)
        kinds = self._rec.tensors["kind"]
        if tid is not None and kinds[tid] is None:
            kinds[tid] = label


