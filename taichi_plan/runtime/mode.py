"""The replay runtime: per-tensor rematerialization inside the model's planned forward calls.

It executes what the simulator models (docs/planner.md#replay), one model call at a time:

* The trace says which of the step's ops ran inside a call of the model (``meta.model_calls``)
  and with which inputs. ``apply`` hooks the model: a call made with grad enabled, in the
  recorded training mode, is matched to the next recorded call of the step (:class:`CallPlan`).
  Its inputs' shapes and dtypes are checked first (a larger batch or sequence stops there,
  before it costs memory; smaller ones run the plan as it is: :func:`no_larger`). Calls under ``no_grad``/``inference_mode``, in eval mode, and calls
  whose plan has nothing to do run untouched: no mode, no hooks, no cost.
* For a planned call, a :class:`Frame` holds everything of that call; while the call runs, a
  ``TorchDispatchMode`` counts its ops exactly as the recorder did (``prim.*``, ``profiler.*``
  and ``IGNORED_OPS`` skipped), checks each op's name (and the size of what it creates) against
  the trace, and keeps a *recipe* for each storage the plan may need to rebuild: the op, its
  non-tensor arguments, for each tensor argument the storage it views (a weak reference and an
  id) with dtype, size, stride and offset, and, for an op whose result depends on the RNG
  (``torch.Tag.nondeterministic_seeded``, or a ``Generator`` argument), the RNG state it ran with.
* Saved-tensor hooks, active only during the call: when autograd saves a tensor whose storage
  the plan drops, the pack hook keeps a handle (the frame and a reference) instead, so the
  storage is freed as soon as the forward's own references die.
* When backward unpacks a handle, the storage is rebuilt from its frame's recipes: each input
  is used if it is still alive, else rebuilt too (recursively). A rebuilt storage that the plan
  drops is kept until all its handles are unpacked (the simulator's "rebuilt early, held until
  its last use"); any other rebuilt input is a transient, freed when the rebuild is done. A
  group the simulator rebuilds before backward unpacks any of its tensors runs at the last
  unpack of its *trigger*, a saved tensor its op reads for the last time (the pack hook keeps
  it as :class:`_Trigger`).

Frames are independent: two forwards before one backward, gradient accumulation, or an eval
pass in between each keep their own. A frame lives as long as autograd holds its handles.

A mismatch (another op, size or input shape) stops the plan for that call only: with
``on_mismatch="raise"`` the forward raises :class:`~taichi_plan.base.errors.MismatchError`; with
``"warn"`` the tensors already dropped are rebuilt at once and the call finishes unplanned.
Either way the mode and hooks are removed when the call ends, and the next call tries again.

Rebuilt ops run with the recorded RNG state and grad mode, on new tensors over the storages
(which require no grad: no graph is recorded), so values, and gradients, are bitwise those of
the unplanned run.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import re
import sys
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from ..base.errors import MismatchError
from ..torch_common.ops import IGNORED_OPS, draws_random
from .copies import to_device, to_host, wait_ready

_Tensor = torch.Tensor
_SKIP_NAMESPACES = ("prim", "profiler")
_SEEDED = getattr(torch.Tag, "nondeterministic_seeded", None)
LOOP_MOST = 256  # the longest loop iteration (counted ops) over routed data that a live call may skip
_REGIONS = object()  # a planned call whose mode and hooks come on in its planned regions only


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
    spec: object  # how (args, kwargs) were flattened: a _FlatSpec, or pytree's spec
    leaves: list  # leaves with tensors replaced by TRef
    out_pos: int | None  # flattened output index that is this storage (None: in-place write)
    rng: tuple | None  # (cpu state, {device: cuda state}) for random ops
    op: int = 0  # the op's index in its model call (rebuild groups run in this order)
    # Grad mode when it ran: some kernels make outputs only with grad enabled (the CPU LSTM's
    # mkldnn_rnn_layer returns its workspace, which backward reads, only then), so a rebuild
    # runs with the same mode. Its inputs are new tensors on the storages, requiring no
    # grad, so no graph is recorded either way.
    grad: bool = True


@dataclass
class _Info:
    name: str
    skip: bool
    mutates: bool
    write_args: list
    random: bool


def is_random(func) -> bool:
    """Whether ``func``'s result depends on the RNG state: PyTorch tags such ops
    ``nondeterministic_seeded`` (``randn_like``, ``rand``, ``native_dropout``, ``bernoulli_``,
    SDPA with its ``dropout_p``...), whether or not their schema takes a ``Generator``."""
    if _SEEDED is not None and _SEEDED in getattr(func, "tags", ()):
        return True
    schema = getattr(func, "_schema", None)
    return schema is not None and any("Generator" in str(a.type) for a in schema.arguments)


def _info(func) -> _Info:
    schema = getattr(func, "_schema", None)
    write_args = []
    if schema is not None:
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                write_args.append((-1 if a.kwarg_only else i, a.name))
    name = str(func)
    skip = func.namespace in _SKIP_NAMESPACES or name in IGNORED_OPS
    return _Info(name, skip, bool(write_args), write_args, is_random(func))


@dataclass
class CallPlan:
    """What the plan does in one recorded model call. Op indices are *counted* ops (the
    call's ops without ``IGNORED_OPS``), from 0 at the call's first op."""

    index: int  # which grad-enabled call of the step (0-based)
    ops: list  # (op name, module, {output index: bytes of the storage it creates})
    drops: dict[int, list[tuple[int, int]]]  # op -> [(flattened output index, tensor id)]
    recipe_ops: set[int] | None  # ops to keep recipes for (None: all)
    spans: dict[str, tuple[int, int]]  # partitioned module -> its op span in this call
    inputs: list  # [name, shape, dtype] per tensor input (the input-signature guard)
    grads_alive: bool | None  # whether gradients existed when the recorded call started
    training: bool = True
    # tensor id -> the simulator's rebuild group (the op before which it is rebuilt): a group's
    # dropped tensors are rebuilt together, their gone inputs re-made once for all of them.
    group_of: dict[int, int] = field(default_factory=dict)
    # Heads partitioned over tokens (module -> chunks) and the counted ops of this call that
    # their lazy logits do not run (the head's matmul, the loss ops on the logits): skipped.
    tokens: dict[str, int] = field(default_factory=dict)
    skip: frozenset = frozenset()
    # Run under the mode and hooks although the plan changes nothing here: what calibration
    # (taichi_plan.runtime.calibrate) measures the runtime's own cost on.
    probe: bool = False
    # op -> [(flattened output index, group)]: storages whose last unpack in backward runs
    # that rebuild group (one rebuilt early, before any of its tensors is unpacked).
    triggers: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    # Modules checkpointed whole (one chunk) whose outputs the plan drops: their forward runs
    # the recorded ops, so they are counted and tracked as any other (recipes, drops), where a
    # module split into chunks runs ops of its pieces, which are not counted.
    whole: frozenset = frozenset()
    # Counted op at which a recorded submodule call starts -> [(first, last, module)]: where the
    # call may go on after a live forward skipped it, outermost first (replay.module_calls, _resync).
    module_calls: dict = field(default_factory=dict)
    # module name -> the counted ops at which its recorded calls start, in order (replay.module_calls, _entered)
    module_starts: dict = field(default_factory=dict)
    # Counted ops that made or read a tensor sized by values (trace v11 meta.data_sized.ops): a
    # loop over what a step routes (a mixture of experts' experts hit) runs as many times as the
    # data says, so a live call may run fewer of them (_resync).
    sized_ops: frozenset = frozenset()
    # [count, bytes] of the model's parameters requiring grad when the call was recorded (trace
    # v12; None: older traces and sharded ones, not checked)
    trainable: tuple | None = None
    # The recorded step ran some of the model under saved-tensor hooks of its own (its own
    # activation checkpointing: trace v8 meta.forward_in_backward). Otherwise an op whose output
    # the plan drops must run with the runtime's hooks innermost (PlanRuntime._foreign_hooks).
    own_hooks: bool = False
    # The autocast the recorded call ran under (trace v13: "bf16", "fp16", None); "unknown" for
    # older traces, which are not checked (_autocast_problem).
    autocast: str | None = "unknown"
    # Planned regions (taichi_plan.problem.partition.regions): module name -> {its k-th call in this model call:
    # (first, last) counted op}. Where whole_call is False, the mode and saved-tensor hooks run
    # inside these module calls only (entered when the module is called, the op count set to
    # the call's recorded first op); elsewhere the forward runs with nothing of the runtime.
    regions: dict = field(default_factory=dict)
    # Run the mode and hooks over the whole call (a plan that drops in the model's top-level
    # code, traces without meta.module_args, calibration's probes).
    whole_call: bool = True
    # The counted ops at which the recorded module calls start, sorted (not the model's own
    # call, not calls inside a partitioned module or a head over tokens, which run uncounted):
    # outside the regions, a live forward that passes one without calling its module skipped it.
    entries: tuple = ()
    # Offloads (plan v14, taichi_plan/runtime/copies.py): op -> [(flattened output index, tensor
    # id)] of the storages it makes that the plan offloads; counted op -> [tensor id] copied to
    # host right after it runs (their last forward use); op -> [(flattened output index, [tensor
    # ids])]: saved tensors whose last unpack issues those copies back (the plan's prefetch points).
    offloads: dict = field(default_factory=dict)
    copy_out_at: dict = field(default_factory=dict)
    prefetch_triggers: dict = field(default_factory=dict)

    @property
    def active(self) -> bool:
        """Whether this call needs the dispatch mode and hooks at all."""
        return bool(self.drops) or bool(self.spans) or bool(self.tokens) or self.probe or bool(self.offloads)

    @property
    def lazy_only(self) -> bool:
        """The plan changes nothing in this call but heads split over tokens: their lazy logits
        and the loss's chunked function run through the head's wrapped forward and
        ``__torch_function__``, and the call runs without the dispatch mode and saved-tensor
        hooks (nothing is dropped, no op is counted). Its guards are the ones before the call
        (inputs, trainable parameters, autocast) and the lazy logits' own (a use that needs the
        full logits). Checking every op of the call cost a 4-layer GPT-2 or Llama about 8 ms a
        step (their heads' own split: 3-17 ms)."""
        return bool(self.tokens) and not (self.drops or self.spans or self.triggers or self.whole or self.probe
                                          or self.offloads)

    @property
    def in_regions(self) -> bool:
        """The mode and hooks run in the planned regions only (:attr:`regions`), not over the
        whole call: none at all where the call has none (a call that only partitions). The drop
        probe's plan and its copy that drops nothing (calibration) run in the same regions."""
        return not self.whole_call


def _checkpoints_itself(model) -> bool:
    """Whether ``model`` has transformers' activation checkpointing on (a module whose
    ``gradient_checkpointing`` is True: ``gradient_checkpointing_enable()``)."""
    return model is not None and any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


@dataclass
class Frame:
    """The state of one planned model call: recipes and handles, alive as long as autograd
    holds a handle of it."""

    call: CallPlan
    enabled: bool = True
    n: int = 0  # counted ops so far
    model: object = None  # a weak reference to the model called (read only to explain a mismatch)
    partition_depth: int = 0
    # partitioned modules (whole ones too) being run now: inside, the hooks on top are the
    # torch.utils.checkpoint the plan itself installed, not a foreign one (_foreign_hooks)
    checkpointed: int = 0
    sid_of: dict = field(default_factory=dict)  # live storage cdata -> sid
    alive: dict = field(default_factory=dict)  # sid -> weakref to the storage
    recipes: dict = field(default_factory=dict)  # sid -> [Step]
    dropped: dict = field(default_factory=dict)  # sid -> tensor id
    pending: dict = field(default_factory=dict)  # sid -> handles not unpacked yet
    cache: dict = field(default_factory=dict)  # sid -> rebuilt storage held for later handles
    building: dict = field(default_factory=dict)
    depth: int = 0  # rebuilds in progress (a rebuild rebuilds its gone inputs first)
    shared: dict | None = None  # while a group is rebuilt: its transients, re-made once
    trigger_of: dict = field(default_factory=dict)  # sid -> the rebuild group its last unpack runs
    trigger_pending: dict = field(default_factory=dict)  # sid -> its saved copies not unpacked yet
    next_sid: int = 0
    smaller: bool = False  # inputs no larger than the recorded ones in any dimension, some smaller
    entered: set = field(default_factory=set)  # partitioned modules whose wrapper ran in this call
    skipped: list = field(default_factory=list)  # (module, counted op) of the recorded calls it skipped
    module_seen: dict = field(default_factory=dict)  # module name -> its calls so far in this call
    # The mode and hooks are on: over the whole call, or inside a planned region now (frame.n
    # is the recorded op count only then).
    counting: bool = False
    # (module, name, first and last counted op, hooks context) of the planned region running
    # now; module None: the rest of the call is counted (_enter_rest)
    region: tuple | None = None
    pos: int = -1  # the recorded first op of the last module call entered (calls run in regions: _jumped)
    offloaded: dict = field(default_factory=dict)  # sid -> tensor id the plan offloads
    off_sid: dict = field(default_factory=dict)  # tensor id -> sid
    host: dict = field(default_factory=dict)  # sid -> (host copy, its copy's event, device) after the copy out
    restored: dict = field(default_factory=dict)  # sid -> (storage copied back, its event), held for its handles
    prefetch_of: dict = field(default_factory=dict)  # sid -> tensor ids whose copies back its last unpack issues


def no_larger(got: list, want: list) -> bool:
    """Are the call's tensor inputs ``got`` (:func:`~taichi_plan.torch_common.step.input_signature`)
    the recorded ones ``want`` with no dimension larger: the same names, dtypes and ranks, each
    size at most the recorded one? Such a call (a last, smaller batch; a shorter padded sequence)
    runs the plan as it is: the same ops, each storage at most its recorded size (checked op by
    op, :func:`_off`), so the same drops and rebuilds keep every op's live bytes at most the
    predicted ones."""
    if len(got) != len(want):
        return False
    for (n, s, d), (wn, ws, wd) in zip(got, want, strict=True):
        if n != wn or d != wd or len(s) != len(ws) or any(a > b for a, b in zip(s, ws, strict=True)):
            return False
    return True


def _off(got: int, want: int, smaller: bool) -> bool:
    """Is a storage of ``got`` bytes off the recorded ``want``: other (the recorded inputs) or
    larger (smaller inputs)?"""
    return got > want if smaller else got != want


def _out_leaves(out) -> list:
    """An op's result flattened as ``tree_leaves`` does (the trace's output order), without
    pytree's per-node bookkeeping for the usual results: a tensor, or a tuple or list of
    tensors (and Nones)."""
    if isinstance(out, _Tensor):
        return [out]
    if type(out) in (tuple, list) and all(o is None or isinstance(o, _Tensor) for o in out):
        return [o for o in out if o is not None]
    return tree_leaves(out)


def _flat_tensors(out) -> list:
    """The tensors of an op's result, in flattened output order (the trace's output index)."""
    return [o for o in _out_leaves(out) if isinstance(o, _Tensor)]


class _FlatSpec(NamedTuple):
    """How an op's ``(args, kwargs)`` were flattened when nothing in them nests deeper than one
    plain list or tuple (every aten op's usual arguments): per argument, then per keyword
    argument, None for a leaf or (list or tuple, its length). :func:`_flatten` makes it and
    :func:`_unflatten` reverses it; anything else keeps pytree's spec."""

    args: tuple
    kwargs: tuple  # ((name, layout), ...)


class _Deep(Exception):
    """An argument :class:`_FlatSpec` does not describe."""


def _flatten(args, kwargs) -> tuple[list, object]:
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


def _unflatten(leaves: list, spec) -> tuple[tuple, dict]:
    """``(args, kwargs)`` back from :func:`_flatten`'s ``leaves`` and ``spec``."""
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


class _GraphMark:
    """A pre-hook on an output's ``grad_fn`` that notes that backward reached it; the node
    holds it, so a weak reference to it dies with the call's autograd graph."""

    __slots__ = ("__weakref__", "fired")

    def __init__(self):
        self.fired = False

    def __call__(self, grad_outputs):
        self.fired = True


def _graph_ref(out, depth: int = 3):
    """A weak reference to a :class:`_GraphMark` registered on the ``grad_fn`` of each tensor
    output of a model call (in dicts, lists and tuples, ``depth`` levels down); None when no
    output is part of a graph."""
    mark = _GraphMark()
    found = False
    todo = [(out, 0)]
    while todo:
        x, d = todo.pop()
        if isinstance(x, torch.Tensor):
            if x.grad_fn is not None:
                x.grad_fn.register_prehook(mark)
                found = True
        elif d < depth and isinstance(x, dict):
            todo.extend((v, d + 1) for v in x.values())
        elif d < depth and isinstance(x, (list, tuple)):
            todo.extend((v, d + 1) for v in x)
    return weakref.ref(mark) if found else None


def _grads_alive(model, sentinel: list) -> bool | None:
    """Does a trainable parameter of ``model`` hold a gradient (None: none is trainable)? Any
    of them, as the recorder reads ``grads_alive`` off the trace (a gradient alive when the call
    starts), not the first alone: one the forward never uses (XLNet's ``mask_emb``) has no
    gradient in the middle of a step either, and a second micro-batch then looked like a new
    step and ran the first one's plan (1.4% over budget, silently). ``sentinel`` ([weakref or
    None]) holds the parameter last seen with a gradient, checked first, so a call with
    gradients costs one look; the full scan runs when it has none (``zero_grad``)."""
    p = sentinel[0]() if sentinel[0] is not None else None
    if p is not None and p.grad is not None:
        return True
    trainable = False
    for p in model.parameters():
        if p.requires_grad:
            trainable = True
            if p.grad is not None:
                sentinel[0] = weakref.ref(p)
                return True
    return False if trainable else None


class _Trigger:
    """What autograd keeps instead of a saved tensor whose last unpack runs a rebuild group
    (the tensor itself, held as autograd would)."""

    __slots__ = ("frame", "sid", "tensor")

    def __init__(self, frame: Frame, sid: int, tensor: _Tensor):
        self.frame, self.sid, self.tensor = frame, sid, tensor


class _Handle:
    """What autograd keeps instead of a dropped tensor."""

    __slots__ = ("frame", "ref")

    def __init__(self, frame: Frame, ref: TRef):
        self.frame = frame
        self.ref = ref


class PlanRuntime(TorchDispatchMode):
    """One instance per planned model. :meth:`begin_call` / :meth:`end_call` around each call
    of the model (``apply`` does this with module hooks); :meth:`end_step` when the optimizer
    steps. ``calls``: the plan of each grad-enabled call of the recorded step, in order."""

    def __init__(self, calls: list[CallPlan], on_mismatch: str = "raise", loop: dict | None = None,
                 steps_differed: dict | None = None, step_at: int | None = None, warmup: int = 0):
        super().__init__()
        self.calls = calls
        # the saved-tensor hooks, bound once: the guard at a dropping op tells them by identity
        self._pack_hook, self._unpack_hook = self._pack, self._unpack
        # (bytes, tensors) of the optimizer state the recorded step held, where apply() was given
        # the optimizer (check_state); None: not checked
        self.state_bytes: tuple[int, int] | None = None
        self._state_checked = False
        # grad-enabled calls of the recorded step before its optimizer.step(): fewer than all
        # when the step calls the model again after it (a GAN's discriminator: real and fake,
        # its step, then the generator's loss through it)
        self.step_at = len(calls) if step_at is None else min(step_at, len(calls))
        # where the recorded steps already differed from each other (trace meta.first_mismatch)
        self.steps_differed = steps_differed
        self.on_mismatch = on_mismatch
        self.loop = loop or {}
        self._infos: dict = {}
        self._index = 0  # grad-enabled calls so far in this step
        self.steps_seen = 0  # optimizer steps since the plan was applied (end_step)
        self.warmup = warmup  # unrecorded warm-up steps before the recorded one (trace meta.warmup_steps)
        self.counted_now = False  # whether the call begun last is one of the step's (begin_call)
        self._graphs: list = []  # per call of this step: a weak reference into its autograd graph (after_call)
        self._grad_sentinel: list = [None]  # a parameter last seen with a gradient (_grads_alive)
        self._params = None  # (the model, weakly; [(parameter, bytes)]): _trainable
        self._frame: Frame | None = None
        self._stack: list = []  # (frame, hooks context) of the calls running now
        self.hidden = 0  # > 0 while FSDP's own machinery runs: its ops are not counted
        self.mismatch: str | None = None
        self.mismatches = 0
        # Measurements since the last reset_counters().
        self.recompute_s = 0.0
        self.recompute_ops = 0
        self.dropped_storages = 0
        self.planned_calls = 0
        self.skipped_calls = 0  # recorded module calls a live forward did not make (_resync, _entered)
        self.skipped_sized_ops = 0  # recorded ops of loop iterations over routed data a live forward did not run
        self.regions_run = 0  # planned regions entered (_enter_region)
        # (copy_out, tensor id, counted op of its call) and (copy_in, tensor id, "prefetch" or
        # "on-demand"), in the order the copies were made (plan v14 offloads)
        self.copies: list[tuple] = []
        # global forward pre- and post-hooks while a planned call runs (_entered, _left)
        self._module_hook: tuple | None = None
        self._names: dict[int, str] = {}
        self._names_root = None

    def reset_counters(self) -> None:
        self.recompute_s = 0.0
        self.recompute_ops = 0
        self.dropped_storages = 0
        self.planned_calls = 0
        self.skipped_calls = 0
        self.skipped_sized_ops = 0
        self.regions_run = 0
        self.copies = []

    # -- calls and steps ------------------------------------------------------------------------------
    def begin_call(self, model, args, kwargs) -> bool:
        """Start a call of the model; returns whether it runs planned (then :meth:`end_call`
        must follow, also when the forward raises). :attr:`counted_now` says whether the call
        is one of the step's (then :meth:`after_call` follows it)."""
        self.counted_now = False
        if not self.calls or not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return False
        if torch._C._current_graph_task_id() != -1:  # a forward re-run inside backward
            return False
        n = len(self.calls)
        if self._index >= n > self.step_at:  # the recorded step's calls after its optimizer.step() are done
            self._index = 0
        pos = self._index % n
        alive = _grads_alive(model, self._grad_sentinel)
        if self._index and alive is False and (
                self.calls[pos].grads_alive or all((m := g()) is None or m.fired for g in self._graphs)):
            # The gradients were cleared where the recorded call at this point started with
            # them alive, or after every earlier call of this step ran its backward or let go
            # of its graph: a new step began, and the last one ended without optimizer.step()
            # (a batch the loop skipped, an exception it caught, a GradScaler step skipped).
            self._index = pos = 0
            self._graphs.clear()
        call = self.calls[pos]
        if bool(model.training) != call.training:
            return False
        self._index += 1
        self.counted_now = True
        problem, smaller = self._check_inputs(call, model, args, kwargs, alive)
        if problem is not None:
            if self.on_mismatch == "raise":  # the call raises: it does not run, so it is not one of the step's
                self._index -= 1
                self.counted_now = False
            self._mismatch(problem)
            return False
        if not call.active:
            return False
        frame = Frame(call, smaller=smaller, model=weakref.ref(model))
        if call.lazy_only:
            # its head's lazy logits run through the head's forward, without the mode and hooks
            self._frame = frame
            self._stack.append((frame, None))
            self.planned_calls += 1
            return True
        if call.module_starts:
            self._names_of(model)
            if self._module_hook is None:
                self._module_hook = (torch.nn.modules.module.register_module_forward_pre_hook(self._entered),
                                     torch.nn.modules.module.register_module_forward_hook(self._left, always_call=True))
        self._frame = frame
        if call.in_regions:  # the mode and hooks come on in each planned region (_entered), if any
            self._stack.append((frame, _REGIONS))
            self.planned_calls += 1
            return True
        self._stack.append((frame, self._mode_on(frame)))
        self.planned_calls += 1
        return True

    def end_call(self, failed: bool) -> None:
        """``failed``: the forward raised, so the step holds nothing of this call (a loop that
        catches it runs the call again, or another step): it is not counted."""
        frame, hooks = self._stack.pop()
        if hooks is None:  # nothing seen in this call (lazy logits, partitions): no mode, no ops counted
            self._frame = self._stack[-1][0] if self._stack else None
            return
        rest = False
        try:
            if hooks is _REGIONS:
                if frame.region is not None:  # the forward raised inside a region, or the rest was counted
                    rest = frame.region[0] is None
                    self._leave_region(frame, check=False)
            else:
                try:
                    hooks.__exit__(None, None, None)
                finally:
                    self.__exit__(None, None, None)
                    frame.counting = False
        finally:
            self._frame = self._stack[-1][0] if self._stack else None
            if not self._stack and self._module_hook is not None:
                for h in self._module_hook:
                    h.remove()
                self._module_hook = None
        if hooks is _REGIONS and not rest:
            self._end_regions(frame, failed)
            return
        self._skip(frame)
        if not failed and frame.enabled and self._missed_partition(frame):
            return
        if not failed and frame.enabled and frame.n < len(frame.call.ops):  # a loop over routed data ended it?
            at = self._past_iterations(frame, frame.n, None)
            if at is not None:
                self.skipped_sized_ops += at - frame.n
                frame.n = at
        if not failed and frame.enabled and frame.n != len(frame.call.ops):
            self._frame_mismatch(frame, (
                f"The model's forward ran {frame.n} ops but call {frame.call.index} of the plan's trace has "
                f"{len(frame.call.ops)}. The model or its inputs changed since the trace was recorded: record "
                "and solve again, or apply the plan with on_mismatch='warn'."), ended=True)

    def after_call(self, out, failed: bool) -> None:
        """A call of the step (:attr:`counted_now`) returned ``out``, or raised (``failed``: the
        step holds nothing of it, and a loop that catches it runs it again or starts another
        step, so it is not counted). Keeps a weak reference into its autograd graph: a hook
        object on the ``grad_fn`` of its outputs, which lives as long as that graph does."""
        if failed:
            self._index = max(self._index - 1, 0)
            return
        ref = _graph_ref(out)
        if ref is not None:
            self._graphs.append(ref)

    def end_step(self) -> None:
        """The optimizer stepped: the next call is the first of a new step. Says so when this
        step called the model more often than the recorded one. Fewer calls (the last step of
        an epoch, with fewer micro-batches left) each ran their recorded call's plan, and the
        calls not made hold nothing: within the prediction."""
        n, want = self._index, self.step_at
        self._graphs.clear()
        self.steps_seen += 1
        # a step whose recorded calls go on after optimizer.step() continues at the first of them
        self._index = 0 if want >= len(self.calls) else want
        if n and want and n > want:
            self._mismatch(
                f"This training step called the model {n} time(s) with grad before optimizer.step(), but "
                f"the plan's trace has {want} ({self._loop_words()}). The plan's memory prediction holds only for "
                "the recorded loop: record it with the same loop (taichi-plan record --micro-batches N) and "
                "solve again.", once=True)

    def _autocast_problem(self, call: CallPlan, model) -> str | None:
        """Why the call cannot run the plan when its autocast differs from the recorded call's
        (trace v13 ``meta.model_calls[].autocast``; older traces are not checked), else None.
        Under an autocast the trace was recorded without, the first matmul is a cast
        (``_to_copy``) where the plan expects the matmul, and the op mismatch said to run
        warm-up steps; without the recorded autocast, every activation is twice its size."""
        if call.autocast == "unknown":
            return None
        from ..torch_common.step import autocast_of

        got, want = autocast_of(model), call.autocast
        if got == want:
            return None

        def said(a):
            return "without autocast" if a is None else f"under torch.autocast({a})"

        return (f"The model was called {said(got)}, but the plan's trace was recorded {said(want)}: every tensor "
                f"the plan counted has another size or op. Record the loop as it runs (taichi-plan record "
                f"{'--autocast ' + got if got else 'without --autocast'}, Loop(autocast={got!r}) in Python) and solve "
                "again, or apply the plan with on_mismatch='warn' to run such calls unplanned.")

    def check_state(self, optimizer, at_apply: bool = False) -> None:
        """Once the optimizer holds state (after a warm-up step, or the first planned step): its
        bytes against the recorded step's. An optimizer with more state than the recorded one
        (AdamW's two moments where the recording ran SGD with momentum) puts every step that many
        bytes over the plan's prediction: a 2-layer GPT-2 recorded with SGD, planned at 70% and
        trained with AdamW peaked 15.21 MB against its 12.71 MB budget, with nothing said. Less
        state is within the prediction. One pass over the state, once. ``at_apply``: called by
        ``apply()`` (the state of a warm-up step): raises :class:`MismatchError` there unless the
        plan was applied with ``on_mismatch="warn"``; after a step, it warns (the step ran)."""
        if self._state_checked or self.state_bytes is None or not optimizer.state:
            return
        self._state_checked = True
        from ..torch_common.step import optimizer_state

        storages = {st._cdata: st.nbytes() for st in (v.untyped_storage() for v in optimizer_state(optimizer))}
        live, count = sum(storages.values()), sum(1 for b in storages.values() if b)
        want, n = self.state_bytes
        if live <= want:
            return
        from ..base.units import format_bytes

        self._mismatch(
            f"The optimizer ({type(optimizer).__name__}) holds {format_bytes(live)} of state in {count} tensors, "
            f"where the plan's recorded step held {format_bytes(want)} in {n}: every step holds "
            f"{format_bytes(live - want)} more than the plan's prediction, which can put it over the budget. Record "
            "the step with this optimizer (taichi-plan record --optimizer, or the optimizer your --entry returns) "
            "and solve again.", once=not at_apply or self.on_mismatch == "warn")

    def _loop_words(self) -> str:
        mb = self.loop.get("micro_batches", 1)
        return f"recorded with {mb} micro-batch{'es' if mb != 1 else ''} per step"

    def _check_inputs(self, call: CallPlan, model, args, kwargs, alive: bool | None) -> tuple[str | None, bool]:
        """(why this call cannot run the plan or None, whether its inputs are smaller than the
        recorded ones: :func:`no_larger`); ``alive``: whether the model holds gradients
        (:func:`_grads_alive`)."""
        from ..torch_common.step import input_signature

        got = input_signature(args, kwargs)
        smaller = got != call.inputs and no_larger(got, call.inputs)
        if got != call.inputs and not smaller:
            want = {n: (s, d) for n, s, d in call.inputs}
            have = {n: (s, d) for n, s, d in got}
            diffs = [f"{n} is {have[n][0]} {have[n][1]}, the plan's trace has {want[n][0]} {want[n][1]}"
                     for n in have if n in want and have[n] != want[n]]
            diffs += [f"{n} is new" for n in have if n not in want]
            diffs += [f"{n} is missing" for n in want if n not in have]
            return (f"The model was called with other inputs than the plan was made for: {'; '.join(diffs[:3])}. "
                    "A plan runs on the shapes it was recorded with, or smaller ones (a last, smaller batch; a "
                    "shorter padded sequence): record and solve again for these shapes, or apply the plan with "
                    "on_mismatch='warn' to run such calls unplanned."), False
        autocast = self._autocast_problem(call, model)
        if autocast is not None:
            return autocast, False
        if call.trainable is not None:
            live = self._trainable(model)
            if live != call.trainable and live[0] == call.trainable[0]:
                # the same parameters in other bytes: a dtype change (model.to(torch.bfloat16))
                dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters() if p.requires_grad})
                return (f"The model's {live[0]} trainable parameters hold {live[1]:,} bytes now ({', '.join(dtypes)}), "
                        f"but {call.trainable[1]:,} in the plan's trace: their dtype changed since the recording "
                        "(model.to(torch.bfloat16), .half()), and with it every tensor the plan counted. Record the "
                        "model in the dtype it trains in (taichi-plan record --dtype, or autocast: --autocast) and "
                        "solve again, or apply the plan with on_mismatch='warn' to run such calls unplanned."), False
            if live != call.trainable:
                return (f"The model trains {live[0]} parameters ({live[1]:,} bytes) now, but the plan's trace was "
                        f"recorded with {call.trainable[0]} ({call.trainable[1]:,} bytes): parameters were frozen or "
                        "unfrozen since. Autograd then saves other tensors for backward, and the gradients and "
                        "optimizer state differ from what the plan counted: record the model as it trains now and "
                        "solve again, or apply the plan with on_mismatch='warn' to run such calls unplanned."), False
        if call.grads_alive is not None:
            if alive and not call.grads_alive:  # (freed where the trace had them only saves memory)
                return ("The model was called with gradients alive, but in the plan's trace "
                        f"({self._loop_words()}) call {call.index} started with none. The gradients' memory is not "
                        "in the plan's prediction: record the loop you run and solve again (gradient accumulation: "
                        "--micro-batches N, Loop(micro_batches=N) in Python; zero_grad(set_to_none=False), or "
                        "zero_grad() only right before backward, so that the last step's gradients live through "
                        "the forward: --keep-grads, Loop(set_to_none=False))."), False
        return None, smaller

    def _trainable(self, model) -> tuple[int, int]:
        """The model's ``[count, bytes]`` of parameters requiring grad (the recorder's
        ``trainable_signature``), from its parameters listed once: walking the modules costs
        about 0.3 ms a call on GPT-2 small, the list's flags 0.04 ms."""
        cached = self._params
        if cached is None or cached[0]() is not model:
            cached = self._params = (weakref.ref(model), [(p, p.numel() * p.element_size())
                                                          for p in model.parameters()])
        n = b = 0
        for p, size in cached[1]:
            if p.requires_grad:
                n += 1
                b += size
        return n, b

    def smaller_call(self) -> bool:
        """Does the call running now have smaller inputs than the recorded one (:func:`no_larger`)?"""
        return self._frame is not None and self._frame.smaller

    # -- mismatches -----------------------------------------------------------------------------------
    def _mismatch(self, msg: str, once: bool = False) -> None:
        self.mismatch = msg
        self.mismatches += 1
        if self.on_mismatch == "warn" and not once:  # (already so: the advice to do it is left out)
            msg = re.sub(r",? or apply (?:the plan|it) with on_mismatch='warn'(?: \([^)]*\))?(?: to run such \w+ unplanned)?",
                         "", msg)
        if self.on_mismatch == "warn" or once:
            warnings.warn(msg + (" This call runs unplanned; the next one tries the plan again."
                                 if not once else ""), stacklevel=3)
            return
        raise MismatchError(msg)

    def _frame_mismatch(self, frame: Frame, msg: str, ended: bool = False) -> None:
        """Stop the plan for ``frame``'s call: what it already dropped is rebuilt now, so the
        rest of the forward may change anything; then raise or warn."""
        frame.enabled = False
        if ended and self.on_mismatch == "raise":  # raised by end_call: the call returns nothing
            self.after_call(None, failed=True)
        if self.on_mismatch == "warn":
            for sid in [s for s, k in frame.pending.items() if k > 0]:
                frame.cache[sid] = self._storage(frame, sid)
        self._mismatch(msg)

    def _foreign_hooks(self, frame: Frame, i: int, name: str) -> None:
        """Op ``i``, whose output the plan drops, runs under saved-tensor hooks that are not the
        runtime's: the model's own activation checkpointing (``gradient_checkpointing_enable()``,
        ``torch.utils.checkpoint``), CPU offloading (``save_on_cpu``) or another
        ``saved_tensors_hooks``, turned on after the recording. Those hooks, not the plan's, would
        keep what this op's consumers save, so the plan would drop nothing there while holding its
        recipes: a 2-layer GPT-2 planned at 70% of its peak and trained with transformers'
        checkpointing turned on peaked 5.5% over the plan's budget, with nothing said."""
        module = frame.call.ops[i][1] if i < len(frame.call.ops) else ""
        self._frame_mismatch(frame, (
            f"The model runs saved-tensor hooks of its own at op {i} of the model's call {frame.call.index} ({name} "
            f"in {module or '<top level>'}), whose output the plan drops, and the trace was recorded without them: "
            "its own activation checkpointing (a transformers model's gradient_checkpointing_enable(), "
            "torch.utils.checkpoint) or torch.autograd.graph.save_on_cpu / saved_tensors_hooks. They, not the plan, "
            "decide what is kept there, so the plan cannot hold its budget. Turn the model's own checkpointing off "
            "(model.gradient_checkpointing_disable()) and let the plan choose what to recompute, or record and solve "
            "again with it on."))

    def _op_mismatch(self, frame: Frame, i: int, name: str) -> None:
        ops = frame.call.ops
        expected = ops[i] if i < len(ops) else None
        where = (f"op {i} of the model's call {frame.call.index}: the plan expects {expected[0]} in "
                 f"{expected[1] or '<top level>'}" if expected else
                 f"op {i} of the model's call {frame.call.index}: the plan's call has only {len(ops)} ops")
        self._frame_mismatch(frame, (
            f"The live op sequence differs from the one the plan was made for, at {where}, but the model ran "
            f"{name}. {self._why(frame, i)}"))

    def _module_mismatch(self, frame: Frame, name: str, calls: int, want: int) -> None:
        """A planned call run in regions called module ``name`` more often than the recorded
        call (its ``calls``-th call, ``want`` recorded): the ops of that call are not in the
        trace, and their memory is not in the plan's prediction."""
        why = self._why(frame, None) if self.steps_differed else (
            "The live forward differs from the recorded one: a step that calls a module its recorded step skipped "
            "(layerdrop, stochastic depth, a branch on a tensor's value, an expert the recorded step routed no token "
            "to) runs ops the plan never saw. Record more --steps (the trace keeps the step with the most module "
            "calls) or at a batch that reaches every module, turn the skipping off for training with a plan (e.g. "
            "layerdrop=0), or apply the plan with on_mismatch='warn' to run such calls unplanned.")
        self._frame_mismatch(frame, (
            f"The model called module {name!r} {calls} time(s) in its call {frame.call.index}, where the plan's "
            f"trace has {want}: the ops of that call are not in the trace, and what they hold is not in the plan's "
            f"memory prediction. {why}"))

    def _why(self, frame: Frame, i: int | None) -> str:
        """What a mismatch at counted op ``i`` (None: at a module call) likely means, and what to do."""
        why = ("The model or its code changed since the trace was recorded: record and solve again, or apply the "
               "plan with on_mismatch='warn'.")
        if self.steps_differed:  # random control flow (layerdrop, stochastic depth): no one step to plan
            d = self.steps_differed
            why = (f"The recorded steps already differed from each other (step {d.get('step')} ran {d.get('got')} "
                   f"where the first ran {d.get('expected')}): the model changes its op sequence from step to step, "
                   "as random layer skipping (layerdrop, stochastic depth) or data-dependent branches do. The plan "
                   "runs on steps that skip module calls its step made, not on one that calls a module its step "
                   "did not, as this one did: record more --steps (the trace keeps the step with the most module "
                   "calls), turn the skipping off for training with a plan (e.g. layerdrop=0), or apply the plan "
                   "with on_mismatch='warn' to run such steps unplanned.")
        elif frame.skipped:
            why = self._after_skip(frame)
        elif not frame.call.own_hooks and _checkpoints_itself(frame.model() if frame.model else None):
            why = ("The model has its own activation checkpointing on (transformers' gradient_checkpointing_enable(): "
                   "a module's gradient_checkpointing is True), which the recording did not run: it changes the "
                   "model's ops (transformers turns the KV cache off with it) and re-runs each layer's forward in "
                   "backward. Turn it off (model.gradient_checkpointing_disable()) and let the plan choose what to "
                   "recompute, or record and solve again with it on.")
        elif i is not None and (i in frame.call.sized_ops or i - 1 in frame.call.sized_ops):
            why = ("The ops here follow tensors sized by values (trace meta.data_sized): a loop over what the data "
                   "routes, as a mixture of experts' loop over the experts that got tokens, ran another number of "
                   "times than in the recorded step. Fewer iterations run planned; one more, an expert the recorded "
                   "step routed no token to, has no ops in the trace. Record at a batch that routes tokens to every "
                   "expert, or apply the plan with on_mismatch='warn' to run such calls unplanned.")
        elif frame.smaller:  # e.g. at batch 1 an already contiguous tensor skips the clone of .contiguous()
            why = ("These inputs are smaller than the recorded ones, and at these sizes the model takes another op "
                   "path (a dimension of size 1 makes some copies unnecessary). Apply the plan with "
                   "on_mismatch='warn' to run such calls unplanned, drop such a last batch (a DataLoader's "
                   "drop_last=True), or record and solve at these sizes.")
        elif self.steps_seen == 0 and self.warmup:
            why = (f"This is the first step with the plan, and the plan's step was recorded after {self.warmup} "
                   "unrecorded warm-up step(s): a model that builds something on its first calls (a mask or cache "
                   "buffer, a lazy module) runs other ops before that. Run as many steps before applying the plan, "
                   "or apply it with on_mismatch='warn' (such a step then runs unplanned, at the unplanned peak); "
                   "if later steps differ too, the model changed since the recording: record and solve again.")
        return why

    def _size_mismatch(self, frame: Frame, i: int, name: str, j: int, got: int, want: int) -> None:
        why = self._after_skip(frame) if frame.skipped else (
            "The input shapes or the model changed since the trace was recorded: record and solve again, or apply "
            "the plan with on_mismatch='warn'.")
        self._frame_mismatch(frame, (
            f"The live op sequence differs from the one the plan was made for, at op {i} of the model's call "
            f"{frame.call.index} ({name} in {frame.call.ops[i][1] or '<top level>'}): its output {j} has {got} "
            f"bytes, the plan's trace has {want}{' (or fewer, for these smaller inputs)' if frame.smaller else ''}. "
            + why))

    @staticmethod
    def _after_skip(frame: Frame) -> str:
        """Why a call that skipped recorded module calls (layerdrop) then ran other ops."""
        names = list(dict.fromkeys(m for m, _ in frame.skipped))
        more = f" and {len(names) - 2} more" if len(names) > 2 else ""
        return (f"Earlier in this call the model skipped {', '.join(names[:2])}{more}, which the recorded step ran "
                "(random layer skipping: layerdrop), and what it ran after that differs from the recorded step: a "
                "skipped layer changed the shapes or the op path after it (Informer's layerdrop skips a layer with the "
                "convolution that halves its sequence). The plan cannot predict such a step: turn the layer skipping "
                "off for training with a plan (layerdrop=0 in the model's config), or apply the plan with "
                "on_mismatch='warn' to run such calls unplanned.")

    # -- identity -------------------------------------------------------------------------------------
    @staticmethod
    def _sid(frame: Frame, st: torch.UntypedStorage) -> int:
        key = st._cdata
        sid = frame.sid_of.get(key)
        if sid is None:
            sid = frame.next_sid
            frame.next_sid += 1
            frame.sid_of[key] = sid
            ref = weakref.ref(frame)

            def forget(_r, key=key, sid=sid):
                f = ref()
                if f is not None:
                    if f.sid_of.get(key) == sid:
                        del f.sid_of[key]
                    f.alive.pop(sid, None)

            frame.alive[sid] = weakref.ref(st, forget)
        return sid

    def _ref(self, frame: Frame, t: _Tensor) -> TRef:
        return TRef(self._sid(frame, t.untyped_storage()), t.dtype, t.device, tuple(t.size()), tuple(t.stride()),
                    t.storage_offset())

    def _note_triggers(self, frame: Frame, i: int, out) -> None:
        """Mark the outputs of op ``i`` whose last unpack runs a rebuild group (after their
        recipes, if kept: a storage gets its recipe when its id is new)."""
        flat = _flat_tensors(out)
        for j, group in frame.call.triggers[i]:
            if j < len(flat):
                frame.trigger_of[self._sid(frame, flat[j].untyped_storage())] = group

    # -- dispatch -------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        info = self._infos.get(func)
        if info is None:
            info = self._infos[func] = _info(func)
        frame = self._frame
        if info.skip or frame is None or not frame.enabled or frame.partition_depth or self.hidden \
                or torch._C._current_graph_task_id() != -1:
            return func(*args, **kwargs)
        call = frame.call
        i = self._skip(frame)
        frame.n += 1
        if i >= len(call.ops) or call.ops[i][0] != info.name:
            j = self._resync(frame, i, info.name)
            if j is None:
                self._op_mismatch(frame, i, info.name)
                return func(*args, **kwargs)
            i = j
            frame.n = j + 1
        keep = call.recipe_ops is None or i in call.recipe_ops
        rng = _rng_state(args, kwargs) if info.random and keep and draws_random(func, args, kwargs) else None
        out = func(*args, **kwargs)
        sizes = call.ops[i][2]
        if call.copy_out_at and not self._copy_out_at(frame, i):
            return out
        if not keep:
            if i in call.triggers:
                self._note_triggers(frame, i, out)
            if i in call.offloads or i in call.prefetch_triggers:
                self._note_offloads(frame, i, out)
            if sizes:
                flat = _flat_tensors(out)
                for j, want in sizes.items():
                    if j < len(flat) and _off(flat[j].untyped_storage().nbytes(), want, frame.smaller):
                        self._size_mismatch(frame, i, info.name, j, flat[j].untyped_storage().nbytes(), want)
                        return out
            return out
        leaves, spec = _flatten(args, kwargs)
        grad = torch.is_grad_enabled()
        in_sids = set()
        refs = []
        for x in leaves:
            if isinstance(x, _Tensor):
                r = self._ref(frame, x)
                in_sids.add(r.sid)
                refs.append(r)
            else:
                refs.append(x)
        outs = []
        for j, x in enumerate(_flat_tensors(out)):
            st = x.untyped_storage()
            fresh = st._cdata not in frame.sid_of
            sid = self._sid(frame, st)
            outs.append(sid)
            if fresh and sid not in in_sids:
                frame.recipes[sid] = [Step(func, spec, refs, j, rng, i, grad)]
                want = sizes.get(j)
                if want is not None and _off(st.nbytes(), want, frame.smaller):
                    self._size_mismatch(frame, i, info.name, j, st.nbytes(), want)
                    return out
        if info.mutates:
            for pos, name in info.write_args:
                v = args[pos] if 0 <= pos < len(args) else kwargs.get(name)
                for w in tree_leaves(v):
                    if isinstance(w, _Tensor):
                        sid = self._sid(frame, w.untyped_storage())
                        if sid in frame.recipes:
                            frame.recipes[sid].append(Step(func, spec, refs, None, rng, i, grad))
        if i in call.drops and not call.own_hooks and not frame.checkpointed and \
                (torch._C._autograd._top_saved_tensors_default_hooks(False) or (None,))[0] is not self._pack_hook:
            self._foreign_hooks(frame, i, info.name)
            return out
        for j, tid in call.drops.get(i, ()):
            if j < len(outs) and outs[j] in frame.recipes:
                frame.dropped[outs[j]] = tid
                self.dropped_storages += 1
        if i in call.triggers:
            self._note_triggers(frame, i, out)
        if i in call.offloads or i in call.prefetch_triggers:
            self._note_offloads(frame, i, out)
        return out

    def _note_offloads(self, frame: Frame, i: int, out) -> None:
        """Mark the outputs of op ``i`` that the plan offloads, and those whose last unpack issues
        copies back (after their recipes, if kept: a storage gets its recipe when its id is new)."""
        call = frame.call
        flat = _flat_tensors(out)
        for j, tid in call.offloads.get(i, ()):
            if j < len(flat):
                sid = self._sid(frame, flat[j].untyped_storage())
                frame.offloaded[sid] = tid
                frame.off_sid[tid] = sid
        for j, tids in call.prefetch_triggers.get(i, ()):
            if j < len(flat):
                frame.prefetch_of.setdefault(self._sid(frame, flat[j].untyped_storage()), []).extend(tids)

    def _copy_out_at(self, frame: Frame, i: int) -> bool:
        """Op ``i`` ran: copy to host the offloaded storages whose last forward use it was.
        False when the plan stopped for this call (a storage to copy is gone)."""
        call = frame.call
        for tid in call.copy_out_at.get(i, ()):
            sid = frame.off_sid.get(tid)
            st = self._alive(frame, sid) if sid is not None else None
            if st is None:
                self._frame_mismatch(frame, (
                    f"The plan copies tensor {tid} to host after op {i} of model call {call.index}, but that storage "
                    "was not made in this call, or is gone by then: the model differs from the recorded one. Record "
                    "and solve again, or apply the plan with on_mismatch='warn'."))
                return False
            host, ready = to_host(st)
            frame.host[sid] = (host, ready, st.device)
            self.copies.append(("copy_out", tid, i))
        return True

    def _copy_in(self, frame: Frame, sid: int, how: str) -> torch.UntypedStorage:
        """Copy offloaded ``sid`` back (at its prefetch point, or on demand at its first unpack)."""
        got = frame.restored.get(sid)
        if got is not None:
            return got[0]
        if sid not in frame.host:
            raise MismatchError(f"Backward needs tensor {frame.offloaded[sid]} back from the host, but it was never "
                                "copied there (its call ended before its last forward use): the plan does not match "
                                "this model. Record and solve again.")
        host, ready, device = frame.host.pop(sid)
        st, done = to_device(host, ready, device)
        frame.restored[sid] = (st, done)
        self.copies.append(("copy_in", frame.offloaded[sid], how))
        return st

    def _prefetch(self, frame: Frame, tids: list[int]) -> None:
        for tid in tids:
            sid = frame.off_sid.get(tid)
            if sid is not None and sid in frame.host and frame.pending.get(sid, 0) > 0:
                self._copy_in(frame, sid, "prefetch")

    def _names_of(self, model) -> None:
        """Module names as the recorder saw them: ``model.named_modules()`` (cached per model)."""
        if self._names_root is not model:
            self._names = {id(m): name for name, m in model.named_modules()}
            self._names_root = model

    def _entered(self, module, _args) -> None:
        """A module's forward starts (a global pre-hook, installed while a planned call runs).

        Counting (over the whole call, or in a planned region): where its recorded call starts
        later than the op the call has reached, and a recorded module call starts there, the
        live forward skipped that call (and its caller's code after it, up to this module's):
        its ops never run, and the count moves on to this one. It finds what op names alone
        cannot, a skipped layer followed by a module that starts with the same ops (the head
        after a last layer skipped).

        Outside the planned regions, where no op is seen: a module called more often than in
        the recorded call is a mismatch (its ops are not in the trace); a recorded module call
        that starts between the last module called and this one was skipped (layerdrop), and
        the rest of the call is then counted as a whole call is (:meth:`_enter_rest`: a skip
        may change the shapes after it, Informer's skipped distilling convolution); a planned
        region's module call starts its region (:meth:`_enter_region`)."""
        frame = self._frame
        if (frame is None or not frame.enabled or frame.partition_depth or self.hidden
                or torch._C._current_graph_task_id() != -1):
            return
        name = self._names.get(id(module))
        if name is None:
            return
        starts = frame.call.module_starts.get(name, ())
        k = frame.module_seen.get(name, 0)
        frame.module_seen[name] = k + 1
        regions = frame.call.in_regions
        if k >= len(starts):
            if regions and name:  # (the op check sees it over a whole call)
                self._module_mismatch(frame, name, k + 1, len(starts))
            return
        want = starts[k]
        if not frame.counting:
            if regions and name:
                jumped = self._jumped(frame, want)
                frame.pos = want
                if jumped:
                    self._enter_rest(frame, want)
                    return
                region = frame.call.regions.get(name)
                if region is not None and k in region:
                    self._enter_region(frame, module, name, region[k])
            return
        frame.pos = max(frame.pos, want)
        n = self._skip(frame)
        if want <= n:
            return
        if self._note_skipped(frame, self._walk(frame, n, want)):
            frame.n = want

    def _note_skipped(self, frame: Frame, skipped: list | None) -> bool:
        """Note ``skipped`` (:meth:`_walk`'s) as module calls the live forward did not make;
        False when there was no walk (None)."""
        if skipped is None:
            return False
        frame.skipped.extend(skipped)
        self.skipped_calls += len(skipped)
        return True

    @staticmethod
    def _walk(frame: Frame, n: int, want: int) -> list | None:
        """The recorded module calls from counted op ``n`` up to ``want`` that a live forward
        skipped, outermost first, (module, op) each, the caller's own code between them
        skipped with them; None when no recorded module call starts at ``n``."""
        table = frame.call.module_calls
        if n not in table:
            return None
        skipped, p = [], n
        while p < want:
            fits = [(first, m) for first, _last, m in table.get(p, ()) if first <= want]
            if fits:  # outermost first
                skipped.append((fits[0][1], p))
                p = fits[0][0]
            else:  # the caller's own code between skipped calls
                p += 1
        return skipped

    def _jumped(self, frame: Frame, want: int) -> bool:
        """Outside the planned regions: did the live forward skip recorded module calls that
        start after the last module called (``frame.pos``) and before counted op ``want``?
        Notes the outermost of them as skipped."""
        entries = frame.call.entries
        lo, hi = bisect.bisect_right(entries, frame.pos), bisect.bisect_left(entries, want)
        found, past = False, -1
        for s in entries[lo:hi]:
            calls = frame.call.module_calls.get(s)
            if s < past or not calls:  # inside a call noted already, or a call of no ops
                continue
            end, _glue, m = calls[0]
            frame.skipped.append((m, s))
            self.skipped_calls += 1
            found, past = True, end
        return found

    def _enter_rest(self, frame: Frame, at: int) -> None:
        """Count the rest of the call from counted op ``at``, with the mode and hooks on until
        it ends, as a call run whole is (after a skipped module call: what runs after it may
        differ, and only op by op can that be seen)."""
        frame.n = at
        frame.region = (None, None, at, len(frame.call.ops) - 1, self._mode_on(frame))

    def _enter_region(self, frame: Frame, module, name: str, span: tuple[int, int]) -> None:
        """A planned region's module call starts (:mod:`taichi_plan.problem.partition.regions`): the op count
        moves to its recorded first op, and the mode and the saved-tensor hooks come on until
        it returns (:meth:`_left`)."""
        first, last = span
        frame.n = first
        frame.region = (module, name, first, last, self._mode_on(frame))
        self.regions_run += 1

    def _mode_on(self, frame: Frame):
        """Enter the dispatch mode and the saved-tensor hooks (the hooks innermost); returns
        the hooks' context, to leave after them."""
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack_hook, self._unpack_hook)
        self.__enter__()
        hooks.__enter__()
        frame.counting = True
        return hooks

    def _left(self, module, _args, _out) -> None:
        """A module's forward returned (a global forward hook, ``always_call``, while a planned
        call runs): where it is the planned region running now, the region ends."""
        frame = self._frame
        if frame is None or frame.region is None or frame.region[0] is not module:
            return
        self._leave_region(frame, check=sys.exc_info()[0] is None)  # (in its handler when the forward raised)

    def _leave_region(self, frame: Frame, check: bool = True) -> None:
        """End the planned region running now: the mode and hooks go off. ``check``: the
        region's module must have run every op of its recorded call (fewer are the iterations
        a loop over routed data did not run, else a mismatch); more ran as recorded, op by op."""
        _module, name, first, last, hooks = frame.region
        frame.region = None
        frame.counting = False
        frame.pos = max(frame.pos, last)
        try:
            hooks.__exit__(None, None, None)
        finally:
            self.__exit__(None, None, None)
        if not check or not frame.enabled:
            return
        n = self._skip(frame)
        if n <= last:
            at = self._past_iterations(frame, n, None, last + 1)
            if at is not None:
                self.skipped_sized_ops += at - n
                return
            if self._note_skipped(frame, self._walk(frame, n, last + 1)):  # its last module calls skipped (layerdrop)
                return
            self._frame_mismatch(frame, (
                f"Module {name!r} ran {n - first} ops in call {frame.call.index} of the model, where the plan's trace "
                f"has {last + 1 - first}. The model or its inputs changed since the trace was recorded: record and solve "
                "again, or apply the plan with on_mismatch='warn'."))

    def _end_regions(self, frame: Frame, failed: bool) -> None:
        """The end of a call run in planned regions: the recorded module calls after the last
        module called were skipped. A partitioned module whose wrapper did not run, and that no
        skipped call holds, ran its ops whole another way (a mismatch)."""
        if failed or not frame.enabled:
            return
        self._jumped(frame, len(frame.call.ops))  # the recorded module calls after the last one called: skipped
        self._missed_partition(frame)

    def _missed_partition(self, frame: Frame) -> bool:
        """At the end of a call: a partitioned module whose wrapper did not run, and that no
        skipped module call holds, ran its ops whole another way: a mismatch (True)."""
        gone = [m for m, _ in frame.skipped]
        missed = [m for m in frame.call.spans if m not in frame.entered
                  and not any(m == g or m.startswith(g + ".") for g in gone)]
        if not missed:
            return False
        self._frame_mismatch(frame, (
            f"The plan partitions module {missed[0]!r}, but its forward was not called in call "
            f"{frame.call.index} of the model, so its ops ran whole and the plan's memory prediction does "
            "not hold. The model's code reaches that module's ops another way than through its forward: "
            "record and solve again."), ended=True)
        return True

    def _resync(self, frame: Frame, i: int, name: str) -> int | None:
        """The op index at which op ``name`` continues the recorded call when the live forward
        skipped the recorded module call(s) starting at op ``i`` (layerdrop's skipped layer, a
        branch on a tensor's value), else None (a mismatch). The skipped calls' ops never run: what
        the plan drops there is never made, their rebuild groups are never needed, and every
        other op keeps its recorded index, so the plan goes on as recorded with less memory
        live than predicted (tests/test_skipped_modules.py)."""
        ops, table = frame.call.ops, frame.call.module_calls
        paths = [(i, [])]  # (op after the calls skipped so far, those calls): breadth first
        for _ in range(8):  # at most 8 calls skipped back to back
            longer = []
            for k, path in paths:
                for first, last, module in table.get(k, ()):  # outermost first
                    for j in range(first, last + 1):  # the first op of the caller's code it matches
                        if j in frame.call.skip:
                            continue
                        if j < len(ops) and ops[j][0] == name:
                            frame.skipped.extend([*path, (module, k)])
                            self.skipped_calls += len(path) + 1
                            return j
                    longer.append((first, [*path, (module, k)]))
            paths = longer
            if not paths:
                break
        j = self._past_iterations(frame, i, name)
        if j is not None:
            self.skipped_sized_ops += j - i
            return j
        return None

    @staticmethod
    def _past_iterations(frame: Frame, i: int, name: str | None, end: int | None = None) -> int | None:
        """Where the recorded call goes on when the live one left a loop over routed data
        after fewer iterations than the recorded one, at op ``i`` (``name``: the live op, None
        at the call's end); None when the ops from ``i`` on are no such loop's iterations.

        transformers' eager experts loop over the experts that got tokens (``for expert_idx in
        expert_hit``): a step that routes none to an expert runs one iteration less. The
        recorded ops from ``i`` on must repeat the ``p`` ops before ``i`` (op and module), a
        whole number of times, each time with an op that makes or reads a tensor sized by
        values (trace v11 ``meta.data_sized.ops``: the loop follows the data), and the op after
        the last repeat must be the live one. Those recorded iterations are skipped as a skipped
        module call is: their ops never run, so what the plan drops there is never made; the
        live iterations ran on the earlier recorded ones' indices, and their tensors are
        rebuilt at their live sizes. ``end``: where the ops looked at end (at ``name`` None,
        the call's or a planned region's end), by default the call's last op."""
        ops, sized = frame.call.ops, frame.call.sized_ops
        n = len(ops) if end is None else min(end, len(ops))
        if not sized or i >= n:
            return None

        def repeats(j: int, p: int) -> bool:  # ops j..j+p-1 are the p ops before i again, one sized by values
            return j + p <= n and any(j + k in sized for k in range(p)) and all(
                ops[j + k][0] == ops[i - p + k][0] and ops[j + k][1] == ops[i - p + k][1] for k in range(p))

        for p in range(1, min(i, LOOP_MOST) + 1):
            j = i
            while repeats(j, p):
                j += p
            if j != i and ((name is None and j == n) or (j < n and ops[j][0] == name)):
                return j
        return None

    @staticmethod
    def _skip(frame: Frame) -> int:
        """Move the op counter past the recorded ops a lazy head does not run."""
        while frame.n in frame.call.skip:
            frame.n += 1
        return frame.n

    # -- heads partitioned over tokens ----------------------------------------------------------------
    def token_head(self, name: str):
        """The owner of the lazy logits of head ``name`` in the call running now, or None when
        this call does not partition that head (unplanned, eval, a mismatch, backward)."""
        frame = self._frame
        if (frame is None or not frame.enabled or name not in frame.call.tokens
                or torch._C._current_graph_task_id() != -1):
            return None
        return _TokenOwner(self, frame, name)

    # -- partitions -----------------------------------------------------------------------------------
    def enter_partition(self, name: str) -> None:
        """A partitioned module starts: its ops are not the trace's, so they are not counted."""
        frame = self._frame
        if frame is None or torch._C._current_graph_task_id() != -1:
            return
        span = frame.call.spans.get(name)
        if frame.partition_depth == 0 and frame.enabled and frame.counting and span is not None and frame.n != span[0]:
            self._frame_mismatch(frame, f"The partitioned module {name!r} started at op {frame.n} of the model's "
                                        f"call, but the plan expects it at op {span[0]}. Record and solve again.")
        frame.entered.add(name)
        frame.checkpointed += 1
        if name not in frame.call.whole:
            frame.partition_depth += 1

    def leave_partition(self, name: str) -> None:
        frame = self._frame
        if frame is None or torch._C._current_graph_task_id() != -1:
            return
        frame.checkpointed -= 1
        if name in frame.call.whole:
            return
        frame.partition_depth -= 1
        span = frame.call.spans.get(name)
        if frame.partition_depth == 0 and span is not None:
            frame.n = span[1] + 1

    # -- saved tensors --------------------------------------------------------------------------------
    def _pack(self, t: _Tensor):
        # What is kept is detached: the tensor a pack hook gets still has its grad_fn, and a
        # node's own output kept so (tanh, softmax, exp save theirs) makes a cycle, output ->
        # node -> kept output, that nothing reclaims when backward never runs that node (a
        # pooler's output the loss does not use: FNet leaked 3 tensors a step). Autograd keeps
        # the grad_fn itself, so unpacking a detached tensor loses nothing (PyTorch's own
        # SavedVariable keeps an output's data alone for the same reason).
        if not isinstance(t, _Tensor):
            return t
        frame = self._frame
        if frame is None or not frame.enabled:
            return t.detach()
        sid = frame.sid_of.get(t.untyped_storage()._cdata)
        if sid is not None and (sid in frame.trigger_of or sid in frame.prefetch_of) and sid not in frame.offloaded \
                and sid not in frame.dropped:
            frame.trigger_pending[sid] = frame.trigger_pending.get(sid, 0) + 1
            return _Trigger(frame, sid, t.detach())
        if sid is not None and sid in frame.offloaded:
            frame.pending[sid] = frame.pending.get(sid, 0) + 1
            return _Handle(frame, self._ref(frame, t))
        if sid is None or sid not in frame.dropped:
            return t.detach()
        frame.pending[sid] = frame.pending.get(sid, 0) + 1
        return _Handle(frame, self._ref(frame, t))

    def _unpack(self, packed):
        if isinstance(packed, _Trigger):
            frame, sid = packed.frame, packed.sid
            left = frame.trigger_pending.get(sid, 1) - 1
            frame.trigger_pending[sid] = left
            if left == 0 and frame.enabled and frame.depth == 0:
                if sid in frame.trigger_of:
                    self._fire(frame, frame.trigger_of[sid])
                if sid in frame.prefetch_of:
                    self._prefetch(frame, frame.prefetch_of[sid])
            return packed.tensor
        if not isinstance(packed, _Handle):
            return packed
        frame, ref = packed.frame, packed.ref
        t = self._tensor(frame, ref)
        left = frame.pending.get(ref.sid, 1) - 1
        if left <= 0:
            frame.pending.pop(ref.sid, None)
            st = frame.cache.pop(ref.sid, None)
            if st is None and ref.sid in frame.restored:
                st = frame.restored.pop(ref.sid)[0]
            if ref.sid in frame.prefetch_of and frame.enabled:
                self._prefetch(frame, frame.prefetch_of[ref.sid])
            if st is not None:
                # Released by the runtime, but alive while autograd holds what it unpacked: a
                # node unpacks all its saved tensors before it runs, so a later one of them
                # rebuilt now (an attention's logsumexp, after its query, key and value) reads
                # this storage as the simulator does, not a third copy rebuilt from scratch.
                frame.alive[ref.sid] = weakref.ref(st)
        else:
            frame.pending[ref.sid] = left
        return t

    # -- rebuilding -----------------------------------------------------------------------------------
    def _fire(self, frame: Frame, group: int) -> None:
        """Rebuild ``group`` now (its trigger's last unpack: the inputs it reads are alive), if
        one of its tensors is still awaited and gone."""
        group_of = frame.call.group_of
        for sid, tid in list(frame.dropped.items()):
            if (group_of.get(tid) == group and frame.pending.get(sid, 0) > 0 and sid not in frame.cache
                    and self._alive(frame, sid) is None):
                self._rebuild_group(frame, sid)
                return

    def _tensor(self, frame: Frame, ref: TRef) -> _Tensor:
        if 0 in ref.size:  # an empty tensor (e.g. a cache's torch.tensor([])): nothing to rebuild
            return torch.empty(ref.size, dtype=ref.dtype, device=ref.device)
        st = self._storage(frame, ref.sid)
        return torch.empty(0, dtype=ref.dtype, device=ref.device).set_(st, ref.offset, ref.size, ref.stride)

    def _alive(self, frame: Frame, sid: int):
        w = frame.alive.get(sid)
        return w() if w is not None else None

    def _storage(self, frame: Frame, sid: int) -> torch.UntypedStorage:
        if sid in frame.building:
            return frame.building[sid]
        if sid in frame.cache:
            return frame.cache[sid]
        if sid in frame.offloaded:  # on the host (plan v14): back at its prefetch point, or now
            got = frame.restored.get(sid)
            if got is None and self._alive(frame, sid) is not None:
                return self._alive(frame, sid)  # its forward's own references still hold it
            st = got[0] if got is not None else self._copy_in(frame, sid, "on-demand")
            wait_ready(st, frame.restored[sid][1])
            return st
        st = self._alive(frame, sid)
        if st is not None:  # still alive (its value cannot have changed: see remat_deadline)
            return st
        if frame.shared is not None and sid in frame.shared:
            return frame.shared[sid]
        if frame.depth == 0 and sid in frame.dropped and frame.call.group_of:
            return self._rebuild_group(frame, sid)
        return self._build(frame, sid)

    def _build(self, frame: Frame, sid: int) -> torch.UntypedStorage:
        st = self._run_recipe(frame, sid)
        if sid in frame.dropped and frame.pending.get(sid, 0) > 0:
            frame.cache[sid] = st
        return st

    def _run_recipe(self, frame: Frame, sid: int, siblings: dict[int, int] | None = None,
                    made: dict | None = None, only: list | None = None) -> torch.UntypedStorage | None:
        """Re-run the recipe of ``sid`` (its inputs: alive, cached, shared, or rebuilt first),
        or ``only`` those of its steps (None from steps that write in place).
        ``siblings``: other storages (sid -> output position) the recipe's first op makes too;
        their storages from this run go into ``made`` (sid -> storage), so an op of several
        outputs is not run once per output."""
        steps = frame.recipes.get(sid) if only is None else only
        if not steps:
            raise MismatchError(f"A storage the plan needs back (id {sid}) has no recipe; the plan does not "
                                "match this model. Record and solve again.")
        t0 = time.perf_counter()
        frame.depth += 1
        try:
            with torch.no_grad():
                st = None
                for step in steps:
                    args, kwargs = _unflatten(
                        [self._tensor(frame, x) if isinstance(x, TRef) else x for x in step.leaves], step.spec)
                    out = _run(step, args, kwargs)
                    self.recompute_ops += 1
                    if step.out_pos is not None:
                        flat = _flat_tensors(out)
                        st = flat[step.out_pos].untyped_storage()
                        frame.building[sid] = st
                        if siblings and made is not None and step is frame.recipes[sid][0]:
                            made.update({other: flat[pos].untyped_storage() for other, pos in siblings.items()})
                        del flat
        finally:
            frame.building.pop(sid, None)
            frame.depth -= 1
        if frame.depth == 0:
            self.recompute_s += time.perf_counter() - t0
        return st

    def _rebuild_group(self, frame: Frame, sid: int) -> torch.UntypedStorage:
        """Rebuild ``sid`` together with the other dropped tensors of its simulator group that a
        handle still awaits, exactly as the simulator's group runs: each storage the group needs
        (its members and their gone inputs, recursively) is re-made once, in op order; a member
        is held until its handles unpack, any other storage is freed after its last use in the
        group."""
        call = frame.call
        group = call.group_of.get(frame.dropped[sid])
        targets = [sid] + [s for s, tid in frame.dropped.items()
                           if s != sid and call.group_of.get(tid) == group and frame.pending.get(s, 0) > 0
                           and s not in frame.cache and self._alive(frame, s) is None]
        first_op: dict[int, int] = {}
        reads: dict[int, set[int]] = {}
        stack = list(targets)
        while stack:
            x = stack.pop()
            if x in first_op:
                continue
            steps = frame.recipes.get(x)
            if not steps:
                raise MismatchError(f"A storage the plan needs back (id {x}) has no recipe; the plan does not "
                                    "match this model. Record and solve again.")
            first_op[x] = steps[0].op
            reads[x] = {r.sid for st in steps for r in st.leaves
                        if isinstance(r, TRef) and r.sid != x and 0 not in r.size}
            stack.extend(u for u in reads[x] if u not in first_op and u not in frame.cache
                         and self._alive(frame, u) is None)
        order = sorted(first_op, key=lambda x: (first_op[x], x))
        # Each step runs at its op's place, as the simulator's group runs the ops: a storage
        # written in place later in forward (DeBERTa's ``scores.add_(c2p / scale)``) gets that
        # write after the ops that make what it adds, not with its producer (which re-made
        # those inputs once more, nested, and again in their own turn: 0.5 MB over).
        events = sorted((st.op, i, k) for i, x in enumerate(order) for k, st in enumerate(frame.recipes[x]))
        step_reads: dict[tuple[int, int], set[int]] = {}
        left: dict[int, int] = {}
        for _op, i, k in events:
            x = order[i]
            r = {ref.sid for ref in frame.recipes[x][k].leaves
                 if isinstance(ref, TRef) and ref.sid != x and 0 not in ref.size and ref.sid in first_op}
            if k > 0:  # a later write keeps its storage as a read would
                r.add(x)
            step_reads[(i, k)] = r
            for u in r:
                left[u] = left.get(u, 0) + 1
        # Storages of the group made by one op (a batch norm's output, mean and invstd): the op
        # runs once, as the simulator re-runs it, and its other outputs are taken from that run
        # (when their recipe is that op alone).
        made_by: dict[int, list[int]] = {}
        for x in order:
            first = frame.recipes[x][0]
            if first.out_pos is not None:
                made_by.setdefault(first.op, []).append(x)
        premade: dict[int, torch.UntypedStorage] = {}
        frame.shared = {}
        try:
            for _op, i, k in events:
                x = order[i]
                if k > 0:
                    self._run_recipe(frame, x, only=[frame.recipes[x][k]])
                else:
                    if x in premade:
                        st = premade.pop(x)
                    else:
                        sibs = {y: frame.recipes[y][0].out_pos for y in made_by.get(frame.recipes[x][0].op, ())
                                if y != x and len(frame.recipes[y]) == 1}
                        st = self._run_recipe(frame, x, sibs, premade, only=frame.recipes[x][:1])
                    if x in frame.dropped and frame.pending.get(x, 0) > 0:
                        frame.cache[x] = st
                    else:
                        frame.shared[x] = st
                for u in step_reads[(i, k)]:
                    left[u] -= 1
                    if left[u] == 0:
                        frame.shared.pop(u, None)
            return frame.cache.get(sid) or frame.shared[sid]
        finally:
            frame.shared = None


class _TokenOwner:
    """What lazy logits tell the runtime: the ops they run are not the trace's (not counted),
    and when they must materialize (the plan's memory no longer holds)."""

    def __init__(self, rt: PlanRuntime, frame: Frame, name: str):
        self.rt, self.frame, self.name = rt, frame, name

    @contextlib.contextmanager
    def quiet(self):
        self.frame.partition_depth += 1
        try:
            yield
        finally:
            self.frame.partition_depth -= 1

    def materialized(self, why: str) -> None:
        msg = (f"The plan computes the logits of {self.name!r} chunk by chunk over tokens, but {why} needs all of "
               "them at once, so the full logits were computed and the plan's memory prediction no longer holds. "
               "Compute the loss with F.cross_entropy / F.nll_loss on the logits (views, slices of the leading "
               "dims, .float() and log_softmax are fine), or solve again without partitioning the head "
               "(apply with on_mismatch='warn' to go on unplanned).")
        if self.rt._frame is self.frame and self.frame.enabled:
            self.rt._frame_mismatch(self.frame, msg)
        else:
            self.rt._mismatch(msg)


def _rng_state(args, kwargs):
    devices = {x.device for x in tree_leaves((args, kwargs)) if isinstance(x, _Tensor) and x.device.type == "cuda"}
    if not devices and torch.cuda.is_available() and torch.cuda.is_initialized():
        devices = {torch.device("cuda", torch.cuda.current_device())}  # e.g. torch.rand(..., device="cuda")
    cuda = {d: torch.cuda.get_rng_state(d) for d in devices}
    return torch.get_rng_state(), cuda


def _hidden_writes() -> dict:
    """Ops that write arguments their schema does not mark as written: a batch norm in training
    mode updates its running mean and variance (arguments 3 and 4) in place. A rebuild re-runs
    such an op without them (None): its outputs are computed from the batch's statistics alone
    (bitwise the same, checked on CPU by tests/test_hidden_writes.py), and the running
    statistics are updated once, by the forward, as without a plan."""
    out = {}
    for name in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm"):
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None and "default" in packet.overloads():
            out[packet.default] = (3, 4, 5)  # running mean, running var; training
    return out


_HIDDEN_WRITES = _hidden_writes()


def _run(step: Step, args, kwargs):
    hidden = _HIDDEN_WRITES.get(step.func)
    if hidden is not None and len(args) > hidden[-1] and args[hidden[-1]] is True:
        args = tuple(None if i in hidden[:-1] else a for i, a in enumerate(args))
    with torch.set_grad_enabled(step.grad):
        if step.rng is None:
            return step.func(*args, **kwargs)
        cpu, cuda = step.rng
        with torch.random.fork_rng(devices=list(cuda), enabled=True):
            torch.set_rng_state(cpu)
            for d, s in cuda.items():
                torch.cuda.set_rng_state(s, d)
            return step.func(*args, **kwargs)


@functools.cache
def calibrate_overhead(n: int = 200, repeats: int = 5) -> dict:
    """What this runtime costs per op on this machine, in seconds (medians of ``repeats``):
    ``check_op_s``, an op of a planned call it only counts and checks; ``recipe_op_s``, one
    it also keeps a recipe for; ``rebuild_op_s``, the bookkeeping of re-running one op in a
    rebuild (beyond the op's own time). Measured on ``n`` one-element additions, so the ops'
    own time is nothing, and ``checkpoint_call_s``, what one ``torch.utils.checkpoint`` call
    costs beyond its ops (a one-element op checkpointed, forward and backward, against the
    same op plain); the recorder stores it in the trace (``meta.runtime_overhead``) and
    the planner adds it to a plan's predicted extra time. Measured once per process (a
    property of the machine and this code, not of the trace: ``maxbatch`` records many)."""
    import statistics

    from ..torch_common.ops import op_clock

    clock = op_clock()
    x = torch.ones(1)
    name = str(torch.ops.aten.add.Tensor)
    ops = [(name, "", {0: x.untyped_storage().nbytes()})] * n

    def chain(steps: int) -> _Tensor:
        y = x
        for _ in range(steps):
            y = y + 1
        return y

    def timed(recipes: set | None) -> float:
        rt = PlanRuntime([CallPlan(0, ops, {}, recipes, {}, [], None)])
        frame = rt._frame = Frame(rt.calls[0])
        t0 = clock()
        with rt:
            chain(n)
        dt = clock() - t0
        assert frame.n == n and frame.enabled
        return dt

    def rebuild(steps: int) -> float:
        rt = PlanRuntime([CallPlan(0, ops[:steps], {}, None, {}, [], None)])
        frame = rt._frame = Frame(rt.calls[0])
        with rt:
            sid = rt._sid(frame, chain(steps).untyped_storage())  # the chain's storages are gone now
        t0 = clock()
        with torch.no_grad():
            rt._storage(frame, sid)
        return clock() - t0

    leaf = torch.ones(1, requires_grad=True)
    calls = 20
    modules = 100
    chain_of = torch.nn.Sequential(*[torch.nn.Identity() for _ in range(modules)])
    starts = {str(i): [0] for i in range(modules)}

    def module_calls(hooked: bool) -> float:
        """A forward through ``modules`` modules that run no op, with a planned call's module
        hooks installed (no region among them) or not."""
        rt = PlanRuntime([CallPlan(0, [], {}, set(), {}, [], None, module_starts=starts, whole_call=False,
                                   entries=(0,))])
        handles = []
        if hooked:
            rt._names_of(chain_of)
            rt._frame = Frame(rt.calls[0])
            handles = [torch.nn.modules.module.register_module_forward_pre_hook(rt._entered),
                       torch.nn.modules.module.register_module_forward_hook(rt._left, always_call=True)]
        t0 = clock()
        try:
            chain_of(x)
        finally:
            for h in handles:
                h.remove()
        return clock() - t0

    def step(checkpointed: bool) -> float:
        """Forward and backward of one one-element op, in a checkpoint or not (``calls`` times)."""
        from torch.utils.checkpoint import checkpoint

        t0 = clock()
        for _ in range(calls):
            y = checkpoint(torch.neg, leaf, use_reentrant=False) if checkpointed else torch.neg(leaf)
            y.backward()
        return clock() - t0

    plain, check, recipe, rebuilt = [], [], [], []
    # (with, without) per repeat: a stall of the machine in one block only adds time, so these
    # two small terms are the least time with minus the least time without (a median of the
    # repeats' differences read 0 for a checkpoint call once, under a loaded make test)
    ckpt: tuple[list, list] = ([], [])
    hooks: tuple[list, list] = ([], [])
    for _ in range(repeats):
        hooks[0].append(module_calls(True))
        hooks[1].append(module_calls(False))
        t0 = clock()
        with torch.no_grad():
            chain(n)
        plain.append(clock() - t0)
        check.append(timed(set()))
        recipe.append(timed(None))
        rebuilt.append(rebuild(min(n, 100)))
        ckpt[0].append(step(True))
        ckpt[1].append(step(False))
    base = statistics.median(plain) / n
    return {
        "check_op_s": max(statistics.median(check) / n - base, 0.0),
        "recipe_op_s": max(statistics.median(recipe) / n - base, 0.0),
        "rebuild_op_s": max(statistics.median(rebuilt) / min(n, 100) - base, 0.0),
        # What one torch.utils.checkpoint call costs beyond its ops (its frame, the saved-tensor
        # hooks, the RNG state it stashes, the re-run's bookkeeping): once per checkpointed chunk.
        "checkpoint_call_s": max((min(ckpt[0]) - min(ckpt[1])) / calls, 0.0),
        # What the module hooks of a planned call cost per module call (trace v15): a call the
        # plan drops or partitions in has them over its whole forward (taichi_plan.problem.partition.regions).
        "module_call_s": max((min(hooks[0]) - min(hooks[1])) / modules, 0.0),
        "ops": n,
        "repeats": repeats,
    }
