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

import contextlib
import gc
import os
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from functools import partial

import torch
from torch.distributed._tools import mod_tracker as _mod_tracker_module
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import arg_tree_leaves, tree_leaves
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop, sdpa_flop, shape_wrapper

from ..torch_common.ops import draws_random, op_clock
from ..torch_common.step import autocast_of, input_signature
from ..trace.devices import DeviceProfile
from ..trace.roofline import collective_duration_s, collective_kind, dtype_key, estimate_duration_s

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


def _wrapper_subclasses() -> tuple:
    """Tensor subclasses whose ops the recorder lets through to their local tensors (DTensor)."""
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # a torch built without distributed
        return ()
    return (DTensor,)


def local_tensor(t):
    """The tensor holding ``t``'s memory on this rank: a DTensor's local shard, else ``t``."""
    return getattr(t, "_local_tensor", t) if isinstance(t, _Tensor) else t


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


def _storage(x, op: str):
    """``x``'s untyped storage; a tensor without one (sparse, nested) is refused by name."""
    try:
        return x.untyped_storage()
    except (NotImplementedError, RuntimeError) as e:
        from ..base.errors import WorkloadError

        raise WorkloadError(
            f"The step uses a {str(x.layout).replace('torch.', '')} tensor (in {op}), which has no single storage "
            "to count: taichi-plan records dense (strided) tensors only. Sparse gradients come from "
            "nn.Embedding(sparse=True) or F.embedding(sparse=True): use sparse=False (dense gradients) to record "
            "and plan this step.") from e


def trainable_signature(model) -> list[int]:
    """``[count, bytes]`` of the model's parameters that require grad (trace v12
    ``model_calls[].trainable``): which tensors autograd saves for backward, and which
    gradients and optimizer state the step holds, follow from it."""
    n = b = 0
    for p in model.parameters():
        if p.requires_grad:
            n += 1
            b += p.numel() * p.element_size()
    return [n, b]


def _op_info(func) -> _OpInfo:
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


@dataclass
class StepRecord:
    """Column lists of one recorded step (plain Python lists, turned into frames later)."""

    ops: dict[str, list] = field(default_factory=dict)
    tensors: dict[str, list] = field(default_factory=dict)
    accesses: dict[str, list] = field(default_factory=dict)
    shapes: list = field(default_factory=list)
    producer_phase: list = field(default_factory=list)
    calls: list = field(default_factory=list)  # the model's forward calls (see Recorder.model_hooks)
    incarnations: dict = field(default_factory=dict)  # storage key -> its rows (tensor ids), when resized
    extras: dict = field(default_factory=dict)  # what add-ons (record.fsdp) note about the step
    random_ops: list = field(default_factory=list)  # op ids that drew random numbers (draws_random)
    # Tensor ids whose size depends on tensor values (trace v11 meta.data_sized): made by an op
    # whose output size does (``nonzero``, ``x[mask]``: sizes_by_data), or by any op reading such a
    # tensor (a mixture of experts' ``hidden[token_idx]`` and everything its expert computes);
    # an in-place write keeps its storage's size. ``data_sized_ops``: the ops that made or read
    # them; ``data_sized_sources``: the ops whose own outputs are sized by values.
    data_sized: set = field(default_factory=set)
    data_sized_ops: set = field(default_factory=set)
    data_sized_sources: list = field(default_factory=list)
    # Op ids of forward code re-run inside backward by torch.utils.checkpoint: the model's own
    # activation checkpointing (Recorder._note_rerun).
    rerun_ops: list = field(default_factory=list)
    # Names (relative to the model) of the modules whose forward was called in the step: a
    # ModuleList or ModuleDict runs ops only through its children and is never called itself.
    called_modules: set = field(default_factory=set)
    # Per module, per forward call outside backward: [op id the call started at, tensor ids of
    # its arguments] (trace v10 meta.module_args). A module checkpointed by a plan holds every
    # tensor argument until its backward, those its ops never read too (a decoder layer's
    # position ids): the trace's reads alone miss them. Its calls are counted too: one called
    # several times back to back (ALBERT's shared layer group) runs its ops in one contiguous
    # run per forward, which the ops alone cannot tell from a single call.
    module_args: dict = field(default_factory=dict)
    # Op ids where backward starts running another autograd node (trace v9 meta.backward_nodes):
    # a node unpacks its saved tensors before its first op, which is when replay rebuilds one.
    node_starts: list = field(default_factory=list)

    @property
    def num_ops(self) -> int:
        return len(self.ops["op"])


_CHECKPOINT_FILE = ("torch", "utils", "checkpoint.py")
_NO_NODE = object()  # no backward op seen since the last forward or optimizer op
_current_node = getattr(torch._C, "_current_autograd_node", None)  # torch >= 2.1


def _in_checkpoint() -> bool:
    """Is ``torch.utils.checkpoint``'s code on the Python stack (recomputing a region)?"""
    tail = os.sep + os.path.join(*_CHECKPOINT_FILE)
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_filename.endswith(tail):
            return True
        f = f.f_back
    return False


def _leaf_safe_multi_grad_hook(tensors, fn, *, mode: str = "all"):
    """``register_multi_grad_hook`` as ModTracker calls it (on a module's inputs, to close the
    module in backward), safe under ``torch.autograd.grad``. In its ``"all"`` mode the first
    hook to fire asks the engine whether each input's node will run, and for a leaf input (a
    tensor the user made require grad: a gradient penalty's ``x.requires_grad_()``) the engine
    answers ``RuntimeError: A leaf node was passed to _will_engine_execute_node but we are
    currently running autograd.grad()``, aborting the user's step. So leaves are left out when
    other inputs carry the module's gradient, and a module whose inputs are all leaves is
    closed at the first of their gradients (``"any"``): where several leaf inputs get their
    gradients at different times, the module closes at the first (its later backward ops are
    then labelled with its parent)."""
    from torch.autograd.graph import register_multi_grad_hook

    if mode == "all":
        inner = [t for t in tensors if t.grad_fn is not None]
        if len(inner) < len(tensors):
            tensors, mode = (inner, "all") if inner else (tensors, "any")
    return register_multi_grad_hook(tensors, fn, mode=mode)


# What PyTorch's ModTracker warns when a module outside the model (named by its class alone) is
# called inside another of its class: transformers' Func around apply_rotary_pos_emb and
# rotate_half. Harmless to the recorder, which files such ops itself (Recorder._module).
HIERARCHY_WARNING = "The module hierarchy tracking maybe be messed up"


class _ModuleTracker(ModTracker):
    """PyTorch's ``ModTracker``, with the backward of a module whose inputs carry no gradient
    closed once all its parameters' gradients are made. ModTracker closes a module in backward
    through a hook on its inputs' gradients; where none requires grad (a relative position
    bias computed from an index buffer and a parameter table, as in every Swin block; the
    first block of a model, fed the batch) it closes the module only when the whole backward
    ends, and every later backward op reads as that module's (the deepest open one): on a
    Swin, the backward of the blocks before the first bias read as the bias's, and a block
    checkpointed whole was predicted 730 KB above its measured peak (its backward found at the
    wrong ops). Here each such call closes when the last of its parameters gets its gradient
    (hooks on the parameters, counted: no ``register_multi_grad_hook`` ``"all"``, which asks
    the engine about leaves and fails under ``torch.autograd.grad``), and at the end of the
    backward at the latest (ModTracker's own callback), once either way. It also counts when
    each module was opened (``opened``), for :meth:`Recorder._module` to tell apart equally
    deep open modules."""

    def __init__(self):
        super().__init__()
        self.opened: dict[str, int] = {}  # module name -> when it was last opened (a counter)
        self.opened_at: dict[str, int] = {}  # module name -> ops recorded when it was last opened
        self.ops_seen = 0  # ops recorded so far (counted by Recorder._module)
        self._opens = 0
        self._param_hooks: dict[int, list] = {}  # per call waiting for its gradients: its hooks
        self.root = ""  # the model's own name (Recorder): modules named outside it are not the model's

    def __exit__(self, *args):
        # a call whose backward never ran (the Python-reference probe, an eval forward) leaves
        # its hooks on the model's parameters: removed with the tracker, nothing stays behind
        for handles in self._param_hooks.values():
            for h in handles:
                h.remove()
        self._param_hooks.clear()
        return super().__exit__(*args)

    def _get_append_fn(self, w_mod, name, is_bw):
        append = super()._get_append_fn(w_mod, name, is_bw)
        root = self.root

        def fn(*args):
            if root and name != root and not name.startswith(root + "."):
                # A module that is not the model's own (transformers' Func around
                # apply_rotary_pos_emb, one object called in every layer): ModTracker names it
                # by its class, so its next call finds that name still open and warns "The
                # module hierarchy tracking maybe be messed up. Please file a bug to PyTorch".
                # Its ops are filed under the model's module that called it (Recorder._module).
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=HIERARCHY_WARNING)
                    append(*args)
            else:
                append(*args)
            self._opens += 1
            self.opened[name] = self._opens
            self.opened_at[name] = self.ops_seen

        return fn

    def _fw_post_hook(self, mod, input, output):
        """ModTracker's, except that the module's backward opens when the gradient of an output
        it made arrives, never of one it returns as it got it (``nn.Identity``, a drop path
        turned off). ModTracker hooks every output: for a passed-through input that hook runs
        right after the one that closes the module's backward (the same tensor's gradient,
        hooked first in the forward pre-hook), so the module opened there and stayed open to
        the end of the backward, and every later backward op read as its own (a ConvNeXt's
        stage: the backward of the downsampling before it, and a layer split in chunks was
        predicted 16-21 KB above its measured peak). ModTracker's own hook runs on the outputs
        less those (the recorder registers no user hooks, which would see them so)."""
        passed = {id(a) for a in tree_leaves(input) if isinstance(a, torch.Tensor)}
        super()._fw_post_hook(mod, input, [a for a in tree_leaves(output) if id(a) not in passed])

    def _fw_pre_hook(self, mod, input):
        queued = len(self._post_bw_callbacks_to_enqueue)
        super()._fw_pre_hook(mod, input)
        if len(self._post_bw_callbacks_to_enqueue) != queued + 1:
            return  # an input carries its gradient (ModTracker's own hook), or in backward
        params = [p for p in mod.parameters() if p.requires_grad]
        if not params:
            return
        pop = self._post_bw_callbacks_to_enqueue[-1]
        state = {"left": len(params), "done": False}
        key = id(state)

        def once(*_):
            if not state["done"]:
                state["done"] = True
                for h in self._param_hooks.pop(key, ()):
                    h.remove()
                pop()

        def counted(_grad):
            state["left"] -= 1
            if state["left"] == 0:
                once()

        self._post_bw_callbacks_to_enqueue[-1] = once
        self._param_hooks[key] = [p.register_hook(counted) for p in params]


@contextlib.contextmanager
def leaf_safe_module_tracking():
    """While active, PyTorch's ``ModTracker`` (the recorder's, and the one inside ``MemTracker``)
    registers its backward hooks with :func:`_leaf_safe_multi_grad_hook`. Besides the abort
    under ``autograd.grad``, its ``"all"`` mode reaches a leaf input's gradient accumulator
    through ``t.view_as(t)``: an op inside the model's call that the replay runtime would count
    as the model's own (a mismatch)."""
    saved = _mod_tracker_module.register_multi_grad_hook
    _mod_tracker_module.register_multi_grad_hook = _leaf_safe_multi_grad_hook
    try:
        yield
    finally:
        _mod_tracker_module.register_multi_grad_hook = saved


class Recorder(TorchDispatchMode):
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
        self._wrappers = _wrapper_subclasses()
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
        self._mod_tracker = _ModuleTracker()
        self._root = ""
        self._fqn_cache: dict[str, str] = {}
        if model is not None:
            get_name = getattr(self._mod_tracker, "_get_mod_name", None)
            if get_name is not None:  # name submodules relative to the model, not the first caller
                self._root = self._mod_tracker.root = get_name(model)

    # -- hooks ----------------------------------------------------------------------------------
    def model_hooks(self, model: torch.nn.Module):
        """Hooks that write down each call of ``model`` in the step: the op span it ran
        (``start`` .. ``end``, op ids), its tensor inputs, and whether it ran with grad and in
        training mode. Replay applies a plan per model call, so it needs to know which of the
        step's ops ran inside the model and which (a loss outside it, scaling) did not."""

        def pre(_module, args, kwargs):
            if self._rec is not None:
                self._rec.calls.append({"start": self._n, "end": None, "inputs": input_signature(args, kwargs),
                                        "grad": torch.is_grad_enabled() and not torch.is_inference_mode_enabled(),
                                        "training": bool(model.training), "trainable": trainable_signature(model),
                                        "autocast": autocast_of(model)})

        def post(_module, _args, _kwargs, _out):
            if self._rec is not None and self._rec.calls and self._rec.calls[-1]["end"] is None:
                self._rec.calls[-1]["end"] = self._n - 1

        return [model.register_forward_pre_hook(pre, with_kwargs=True),
                model.register_forward_hook(post, with_kwargs=True, always_call=True)]

    def optimizer_hooks(self, optimizer: torch.optim.Optimizer):
        def pre(*_):
            self._in_opt = True

        def post(*_):
            self._in_opt = False

        return [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]

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

    def _called(self, module, _args) -> None:
        self._call_starts.append(self._n)
        rec = self._rec
        if rec is not None:
            name = self._names.get(id(module))
            if name is not None:
                rec.called_modules.add(name)

    def _returned(self, module, args, *rest) -> None:
        # (module, args, kwargs, output); when the forward raised, PyTorch calls an always_call
        # hook with (module, args, output) whatever with_kwargs says: no finished call then.
        start = self._call_starts.pop() if self._call_starts else None
        rec = self._rec
        if rec is None or start is None or len(rest) != 2 or torch._C._current_graph_task_id() != -1:
            return  # (a checkpoint's re-run in backward is no forward call)
        kwargs = rest[0]
        name = self._names.get(id(module))
        if name is None:
            return
        tids = set()
        for x in tree_leaves((args, kwargs)):
            if isinstance(x, _Tensor):
                try:
                    tid = self._tid.get(local_tensor(x).untyped_storage()._cdata)
                except (RuntimeError, NotImplementedError):  # no storage (a sparse or nested tensor)
                    continue
                if tid is not None:
                    tids.add(tid)
        # [first op, argument tensor ids, the op after its last] (v15: the end, where planned
        # regions end: taichi_plan.problem.partition.regions)
        rec.module_args.setdefault(name, []).append([start, sorted(tids), self._n])

    def _patch_resize(self) -> None:
        """``UntypedStorage.resize_`` reaches no dispatch mode (MemTracker patches it too)."""
        if self._orig_resize is not None:
            return
        orig = self._orig_resize = torch.UntypedStorage.resize_
        on_resize = self._on_resize

        def resize_(st, size):
            out = orig(st, size)
            on_resize(st)
            return out

        torch.UntypedStorage.resize_ = resize_

    def _restore_resize(self) -> None:
        if self._orig_resize is not None:
            torch.UntypedStorage.resize_ = self._orig_resize
            self._orig_resize = None

    def _on_resize(self, st) -> None:
        rec = self._rec
        if rec is None:
            return
        key = st._cdata
        nbytes = st.nbytes()
        tid = self._tid.get(key)
        tens = rec.tensors
        if tid is not None:
            if tens["nbytes"][tid] == nbytes:
                return
            self._end_incarnation(tid, key)
        if nbytes == 0:
            return
        kind, dtype, shape = self.storage_labels.get(key, (None, "uint8", [nbytes]))
        tid = self._register_storage(st, dtype, shape, self._n, -1, kind)
        rec.incarnations.setdefault(key, []).append(tid)

    def _end_incarnation(self, tid: int, key: int) -> None:
        """A storage shrank or grew: its current row ends with the last op that ran."""
        tens = self._rec.tensors
        self._tid.pop(key, None)
        rows = self._rec.incarnations.setdefault(key, [])
        if tid not in rows:  # its first row, registered before it was ever resized
            rows.append(tid)
        if self._n == 0:  # resized before the step's first op: the row never held memory in it
            tens["nbytes"][tid] = 0
            tens["free_op"][tid] = 0
            if tens["alloc_op"][tid] < 0:
                tens["alloc_op"][tid] = 0
        else:
            tens["free_op"][tid] = self._n - 1

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

    def relabel(self, t: torch.Tensor, kind: str) -> None:
        """Give the current row of ``t``'s storage the kind ``kind`` (an add-on that knows
        what a storage is: FSDP's unsharded gradients)."""
        if self._rec is not None:
            tid = self._tid.get(local_tensor(t).untyped_storage()._cdata)
            if tid is not None:
                self._rec.tensors["kind"][tid] = kind

    def tensor_id(self, t: torch.Tensor) -> int | None:
        """The current step's row of ``t``'s storage, None if the step has not seen it."""
        return self._tid.get(local_tensor(t).untyped_storage()._cdata) if self._rec is not None else None

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

    def _register(self, t, st, op_id: int, producer: int, kind: str | None) -> int:
        label = self.storage_labels.get(st._cdata) if kind is None else None
        return self._register_storage(st, str(t.dtype).replace("torch.", ""), list(t.shape), op_id, producer,
                                      label[0] if label else kind)

    def _register_storage(self, st, dtype: str, shape: list, op_id: int, producer: int, kind: str | None) -> int:
        key = st._cdata
        rec = self._rec
        tens = rec.tensors
        tid = len(tens["nbytes"])
        self._tid[key] = tid
        if key not in self._alive:
            self._alive[key] = weakref.ref(st, partial(self._on_free, key))
        tens["nbytes"].append(st.nbytes())
        tens["dtype"].append(dtype)
        tens["shape"].append(shape)
        tens["kind"].append(kind)
        tens["producer_op"].append(producer)
        tens["alloc_op"].append(op_id)
        tens["free_op"].append(-1)
        rec.producer_phase.append(rec.ops["phase"][producer] if producer >= 0 else None)
        return tid

    def _on_free(self, key: int, _ref) -> None:
        """A storage died: its row is freed after the last op that started. When the callback
        runs on another thread than the step's, a collective's worker (gloo's) held the last
        reference: it lets go just after it marks the collective done, so whether that is
        before or after the step's own code drops the tensor, and so at which op the storage
        dies, is a race between the threads. The row is kept in ``offthread_freed``."""
        self._alive.pop(key, None)
        tid = self._tid.pop(key, None)
        if tid is not None:
            self._rec.tensors["free_op"][tid] = max(self._n - 1, 0)
            if threading.get_ident() != self._thread:
                self.offthread_freed.append(tid)

    def _note_rerun(self, rec: StepRecord, op_id: int) -> None:
        """A backward op ran with grad enabled: forward code re-run by a checkpoint (both
        ``torch.utils.checkpoint`` variants recompute under ``enable_grad``), or a backward
        with ``create_graph=True``. Once per run of such ops, the Python stack says which."""
        last, ckpt = self._rerun
        if last != op_id - 1:
            ckpt = _in_checkpoint()
        self._rerun = (op_id, ckpt)
        if ckpt:
            rec.rerun_ops.append(op_id)

    def _module(self) -> str:
        tracker = self._mod_tracker
        parents, opened = tracker.parents, tracker.opened
        best, depth = "Global", -1
        tracker.ops_seen += 1
        root = self._root
        if root and parents:
            # A module that is not the model's own (not among its named modules: ModTracker
            # names it by its class alone) but is called inside one of them belongs to that
            # one. transformers 5.25 with `kernels` installed makes `apply_rotary_pos_emb` such
            # a module (`Func`), called inside each attention; in backward it opens last, and
            # the rotary's backward read as no module's, which split every attention's backward
            # in two, so no attention could be partitioned or checkpointed whole.
            parents = [p for p in parents if p == root or p.startswith(root + ".")]
        if tracker.is_bw:
            # In backward, of the modules opened last (between the same two ops: a module and
            # its last child share an output, whose gradient opens both), the deepest. A module
            # opens there when its output's gradient arrives and closes when its inputs' are
            # complete, so one whose input another branch also reads (GPT-J's MLP beside its
            # attention, both reading the norm's output) stays open through that branch's
            # backward, and the deepest open module (the MLP's first linear layer) took the
            # attention's ops, though the attention opened after it.
            when = tracker.opened_at
            last = max((when.get(p, -1) for p in parents), default=-1)
            parents = [p for p in parents if when.get(p, -1) == last]
        for p in parents:
            d = p.count(".")
            # the deepest; of equally deep ones, the one opened last, not the first the set
            # yields: its order follows the string hash, which differs per process
            if d > depth or (d == depth and opened.get(p, -1) > opened.get(best, -1)):
                best, depth = p, d
        fqn = self._fqn_cache.get(best)
        if fqn is None:
            if self._root and best.startswith(self._root + "."):
                fqn = best[len(self._root) + 1 :]
            else:  # the model itself, no module, or one outside the model (e.g. a loss module)
                fqn = ""
            self._fqn_cache[best] = fqn
        return fqn

    # -- the hot path ---------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if self._wrappers and any(issubclass(t, self._wrappers) for t in types):
            return NotImplemented  # let DTensor run; the ops on its local tensors come back here
        info = self._infos.get(func)
        if info is None:
            info = self._infos[func] = _op_info(func)
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
                st = _storage(x, info.name)
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
            st = _storage(x, info.name)
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
                n, across = _group_extent(args, self.world_size, self.profile.devices_per_node)
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
                                   and not (info.name == "aten._to_copy.default" and _autocast_cached(args)))
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


def _group_extent(args, world_size: int, devices_per_node: int) -> tuple[int, bool | None]:
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


def _autocast_cached(args) -> bool:
    """Whether this may be one of autocast's cached casts (a cast of a leaf tensor that
    requires grad, with the cache enabled): the cache keeps it until the autocast region ends,
    so freeing it early frees nothing, and it is no candidate for rematerialization. (Inside a
    dispatch mode autocast reads as disabled, so every such cast counts: outside autocast these
    casts are rare in a training step, and keeping one only costs a candidate.)"""
    x = args[0] if args else None
    return isinstance(x, _Tensor) and x.is_leaf and x.requires_grad and torch.is_autocast_cache_enabled()
