"""The runtime's guards (:class:`GuardsMixin`, composed by
:class:`~taichi_plan.runtime.mode.PlanRuntime`): what a call must match before it runs the plan
(its inputs, no larger than the recorded ones: :func:`no_larger`; its trainable parameters,
autocast and gradients), the live op sequence resynchronised past the recorded module calls or
loop iterations a live forward skipped, and the mismatches: what the runtime says when a call
does not match the trace, and how it stops the plan for that call."""

from __future__ import annotations

import re
import warnings
import weakref

from ...base.errors import MismatchError
from .call_plan import CallPlan
from .frame import Frame

LOOP_MOST = 256  # the longest loop iteration (counted ops) over routed data that a live call may skip


def _checkpoints_itself(model) -> bool:
    """Whether ``model`` has transformers' activation checkpointing on (a module whose
    ``gradient_checkpointing`` is True: ``gradient_checkpointing_enable()``)."""
    return model is not None and any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


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


class GuardsMixin:
    """The guards of :class:`~taichi_plan.runtime.mode.PlanRuntime`: checks before a call,
    mismatches, and resynchronising past what a live forward skipped."""

    def _autocast_problem(self, call: CallPlan, model) -> str | None:
        """Why the call cannot run the plan when its autocast differs from the recorded call's
        (trace v13 ``meta.model_calls[].autocast``; older traces are not checked), else None.
        Under an autocast the trace was recorded without, the first matmul is a cast
        (``_to_copy``) where the plan expects the matmul, and the op mismatch said to run
        warm-up steps; without the recorded autocast, every activation is twice its size."""
        if call.autocast == "unknown":
            return None
        from ...torch_common.step import autocast_of

        got, want = autocast_of(model), call.autocast
        if got == want:
            return None

        def said(a):
            return "without autocast" if a is None else f"under torch.autocast({a})"

        return (f"The model was called {said(got)}, but the plan's trace was recorded {said(want)}: every tensor "
                f"the plan counted has another size or op. Record the loop as it runs (taichi-plan record "
                f"{'--autocast ' + got if got else 'without --autocast'}, Loop(autocast={got!r}) in Python) and solve "
                "again, or apply the plan with on_mismatch='warn' to run such calls unplanned.")

    def _check_inputs(self, call: CallPlan, model, args, kwargs, alive: bool | None) -> tuple[str | None, bool]:
        """(why this call cannot run the plan or None, whether its inputs are smaller than the
        recorded ones: :func:`no_larger`); ``alive``: whether the model holds gradients
        (:func:`_grads_alive`)."""
        from ...torch_common.step import input_signature

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
