"""The recorder's module tracking: PyTorch's ``ModTracker`` adapted (``ModuleTracker``: a
module whose inputs carry no gradient closes in backward once its parameters' gradients are
made, passed-through outputs open nothing, modules outside the model stay quiet), and its
backward hooks made safe under ``torch.autograd.grad`` (``leaf_safe_module_tracking``)."""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch.distributed._tools import mod_tracker as _mod_tracker_module
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._pytree import tree_leaves


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


class ModuleTracker(ModTracker):
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
