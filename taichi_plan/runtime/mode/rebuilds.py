"""The runtime's saved-tensor hooks and rebuilds (:class:`RebuildsMixin`, composed by
:class:`~taichi_plan.runtime.mode.PlanRuntime`): the pack hook keeps a handle instead of a saved
tensor whose storage the plan drops or offloads (a trigger for one whose last unpack runs a
rebuild group or a prefetch), and the unpack hook gets the storage back, rebuilt from its
frame's recipes, alone or with its simulator rebuild group; an op re-runs with its recorded RNG
state and grad mode, and without the running statistics a batch norm writes (:func:`run_recorded_op`)."""

from __future__ import annotations

import time
import weakref

import torch

from ...base.errors import MismatchError
from ..copies import wait_ready
from .flatten import flat_tensors, unflatten_args
from .frame import Frame, Step, TRef

_Tensor = torch.Tensor


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


class RebuildsMixin:
    """The saved-tensor hooks and rebuilds of :class:`~taichi_plan.runtime.mode.PlanRuntime`."""

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
                    args, kwargs = unflatten_args(
                        [self._tensor(frame, x) if isinstance(x, TRef) else x for x in step.leaves], step.spec)
                    out = run_recorded_op(step, args, kwargs)
                    self.recompute_ops += 1
                    if step.out_pos is not None:
                        flat = flat_tensors(out)
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
        group. An offloaded input is copied back (:meth:`_storage`), not re-made."""
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
            # An offloaded input (a checkpoint on the host) is not re-made: it is read back
            # (_storage: at its prefetch point, or now on demand), as the simulator has it.
            stack.extend(u for u in reads[x] if u not in first_op and u not in frame.cache
                         and u not in frame.offloaded and self._alive(frame, u) is None)
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


def run_recorded_op(step: Step, args, kwargs):
    """Run one recorded op of a rebuild (``step``) on ``args`` in its recorded grad mode and RNG
    state, its hidden in-place writes (a batch norm's running statistics, :data:`_HIDDEN_WRITES`)
    switched off, so a re-run draws what the forward drew and changes no state."""
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
