"""What each recorded op ran inside: the recorder's hooks on the model's calls (their op span
and signature, ``trainable_signature``), on every module call (which modules were called, with
which tensor arguments), on the optimizer step (the ``optimizer`` phase), the module an op is
filed under, and the forward code a checkpoint re-runs in backward (``CallsMixin``, composed
by :class:`~taichi_plan.record.recorder.Recorder`)."""

from __future__ import annotations

import os
import sys

import torch
from torch.utils._pytree import tree_leaves

from ...torch_common.step import autocast_of, input_signature
from .step_record import StepRecord
from .storages import local_tensor

_Tensor = torch.Tensor


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


_CHECKPOINT_FILE = ("torch", "utils", "checkpoint.py")


def _in_checkpoint() -> bool:
    """Is ``torch.utils.checkpoint``'s code on the Python stack (recomputing a region)?"""
    tail = os.sep + os.path.join(*_CHECKPOINT_FILE)
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_filename.endswith(tail):
            return True
        f = f.f_back
    return False


class CallsMixin:
    """The recorder's call tracking: model and optimizer hooks, module calls and their
    arguments, the module of each op, checkpoint re-runs (state set up by ``Recorder``)."""

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
