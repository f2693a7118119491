"""The replay runtime: per-tensor rematerialization inside the model's planned forward calls.

It executes what the simulator models (docs/planner.md#replay), one model call at a time:

* The trace says which of the step's ops ran inside a call of the model (``meta.model_calls``)
  and with which inputs. ``apply`` hooks the model: a call made with grad enabled, in the
  recorded training mode, is matched to the next recorded call of the step
  (:class:`~taichi_plan.runtime.mode.call_plan.CallPlan`). Its inputs' shapes and dtypes are checked
  first (a larger batch or sequence stops there, before it costs memory; smaller ones run the
  plan as it is: :func:`~taichi_plan.runtime.mode.guards.no_larger`). Calls under
  ``no_grad``/``inference_mode``, in eval mode, and calls whose plan has nothing to do run
  untouched: no mode, no hooks, no cost.
* For a planned call, a :class:`~taichi_plan.runtime.mode.frame.Frame` holds everything of that call;
  while the call runs, a ``TorchDispatchMode`` counts its ops exactly as the recorder did
  (``prim.*``, ``profiler.*`` and ``IGNORED_OPS`` skipped), checks each op's name (and the size
  of what it creates) against the trace, and keeps a *recipe* for each storage the plan may need
  to rebuild: the op, its non-tensor arguments, for each tensor argument the storage it views (a
  weak reference and an id) with dtype, size, stride and offset, and, for an op whose result
  depends on the RNG (``torch.Tag.nondeterministic_seeded``, or a ``Generator`` argument), the
  RNG state it ran with.
* Saved-tensor hooks, active only during the call: when autograd saves a tensor whose storage
  the plan drops, the pack hook keeps a handle (the frame and a reference) instead, so the
  storage is freed as soon as the forward's own references die.
* When backward unpacks a handle, the storage is rebuilt from its frame's recipes: each input
  is used if it is still alive, else rebuilt too (recursively). A rebuilt storage that the plan
  drops is kept until all its handles are unpacked (the simulator's "rebuilt early, held until
  its last use"); any other rebuilt input is a transient, freed when the rebuild is done. A
  group the simulator rebuilds before backward unpacks any of its tensors runs at the last
  unpack of its *trigger*, a saved tensor its op reads for the last time (the pack hook keeps
  it as :class:`~taichi_plan.runtime.mode.rebuilds._Trigger`).

Frames are independent: two forwards before one backward, gradient accumulation, or an eval
pass in between each keep their own. A frame lives as long as autograd holds its handles.

A mismatch (another op, size or input shape) stops the plan for that call only: with
``on_mismatch="raise"`` the forward raises :class:`~taichi_plan.base.errors.MismatchError`; with
``"warn"`` the tensors already dropped are rebuilt at once and the call finishes unplanned.
Either way the mode and hooks are removed when the call ends, and the next call tries again.

Rebuilt ops run with the recorded RNG state and grad mode, on new tensors over the storages
(which require no grad: no graph is recorded), so values, and gradients, are bitwise those of
the unplanned run.

:class:`PlanRuntime` here is the dispatch mode: it counts and checks each op and keeps its
recipe (the lazy logits' owner and :func:`calibrate_overhead`, which times the runtime, are
here too). It composes the rest by responsibility, each a mixin in a module of its own: the hooks
around the model's calls (:mod:`~taichi_plan.runtime.mode.call_hooks`), the module hooks and planned
regions (:mod:`~taichi_plan.runtime.mode.regions`), the guards, mismatches and resyncs
(:mod:`~taichi_plan.runtime.mode.guards`), the saved-tensor hooks and rebuilds
(:mod:`~taichi_plan.runtime.mode.rebuilds`), the offloads (:mod:`~taichi_plan.runtime.mode.offloads`) and
the step bookkeeping (:mod:`~taichi_plan.runtime.mode.bookkeeping`).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ...torch_common.ops import IGNORED_OPS, draws_random
from .bookkeeping import BookkeepingMixin
from .call_hooks import CallHooksMixin
from .call_plan import CallPlan
from .flatten import flat_tensors, flatten_args
from .frame import Frame, Step, TRef
from .guards import GuardsMixin
from .offloads import OffloadsMixin
from .rebuilds import RebuildsMixin
from .regions import RegionsMixin

_Tensor = torch.Tensor
_SKIP_NAMESPACES = ("prim", "profiler")
_SEEDED = getattr(torch.Tag, "nondeterministic_seeded", None)


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


def _off(got: int, want: int, smaller: bool) -> bool:
    """Is a storage of ``got`` bytes off the recorded ``want``: other (the recorded inputs) or
    larger (smaller inputs)?"""
    return got > want if smaller else got != want


class PlanRuntime(CallHooksMixin, RegionsMixin, GuardsMixin, RebuildsMixin, OffloadsMixin, BookkeepingMixin,
                  TorchDispatchMode):
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
        flat = flat_tensors(out)
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
        if not keep:
            if i in call.triggers:
                self._note_triggers(frame, i, out)
            if i in call.offloads or i in call.prefetch_triggers:
                self._note_offloads(frame, i, out)
            if sizes:
                flat = flat_tensors(out)
                for j, want in sizes.items():
                    if j < len(flat) and _off(flat[j].untyped_storage().nbytes(), want, frame.smaller):
                        self._size_mismatch(frame, i, info.name, j, flat[j].untyped_storage().nbytes(), want)
                        return out
            if call.copy_out_at:
                self._copy_out_at(frame, i)
            return out
        leaves, spec = flatten_args(args, kwargs)
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
        for j, x in enumerate(flat_tensors(out)):
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
        if call.copy_out_at:
            # after the notes: a storage whose last forward use is the op that made it (a layer
            # norm's mean, read only by backward) is copied right after that op
            self._copy_out_at(frame, i)
        return out

    # -- heads partitioned over tokens ----------------------------------------------------------------
    def token_head(self, name: str):
        """The owner of the lazy logits of head ``name`` in the call running now, or None when
        this call does not partition that head (unplanned, eval, a mismatch, backward)."""
        frame = self._frame
        if (frame is None or not frame.enabled or name not in frame.call.tokens
                or torch._C._current_graph_task_id() != -1):
            return None
        return _TokenOwner(self, frame, name)


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

    from ...torch_common.ops import op_clock

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
