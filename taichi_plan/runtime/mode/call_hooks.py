"""The runtime's hooks around the model's calls (:class:`CallHooksMixin`, composed by
:class:`~taichi_plan.runtime.mode.PlanRuntime`): :meth:`begin_call`, :meth:`end_call` and
:meth:`after_call` around each call of the model (which recorded call it is, whether a new step
began, the dispatch mode and saved-tensor hooks on and off, a weak reference into the call's
autograd graph), and the partition wrappers' :meth:`enter_partition` and
:meth:`leave_partition`, whose ops are not the trace's."""

from __future__ import annotations

import weakref

import torch

from .frame import Frame

_REGIONS = object()  # a planned call whose mode and hooks come on in its planned regions only


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


class CallHooksMixin:
    """The hooks of :class:`~taichi_plan.runtime.mode.PlanRuntime` around each call of the
    model and each partitioned module's call."""

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
