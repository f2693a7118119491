"""The hook into ``torch.compile``: AOTAutograd's partitioner with our choice of saved values.

Why this hook (docs/planner.md): ``min_cut_rematerialization_partition`` is the one place where
both aot_eager and inductor decide which forward values a compiled backward reads and which it
recomputes. It takes that decision in one module-level function, ``choose_saved_values_set``
(its knapsack under ``activation_memory_budget``); everything around it (CSE, the extraction of
the forward and backward graphs with the recomputation placed in backward, the reordering that
mimics the autograd engine, inductor's joint-graph passes before it, its fusion and code
generation after) stays PyTorch's. :func:`partition` runs that partitioner with the choice
replaced for the duration of the call: by "every value the backward reads" when recording
(:func:`save_everything`), by the recorded set minus the plan's drops when applying.
Inductor takes it through its ``custom_partitioner_fn`` extension point (a
:class:`~torch._inductor.custom_graph_pass.CustomPartitionerFn`), aot_eager as AOTAutograd's
``partition_fn``.
"""

from __future__ import annotations

import functools
import hashlib
import re
import threading
from collections.abc import Callable

from ..base.errors import PlanError

BACKENDS = ("aot_eager", "inductor")
LOWERED_KEY = "taichi_plan_lowered"  # a recorded graph's meta: node name -> what inductor made of it
_patch_lock = threading.Lock()


def compiled_kind(model) -> str | None:
    """``"module"`` for ``torch.compile(m)`` (an ``OptimizedModule``), ``"method"`` for
    ``m.compile()`` (``_compiled_call_impl`` set), None for an eager module."""
    import torch

    if isinstance(model, getattr(torch._dynamo.eval_frame, "OptimizedModule", ())):
        return "module"
    if getattr(model, "_compiled_call_impl", None) is not None:
        return "method"
    return None


def eager_module(model):
    """The module a compiled ``model`` runs (``_orig_mod`` of ``torch.compile(m)``, ``m`` itself
    for ``m.compile()``)."""
    return model._orig_mod if compiled_kind(model) == "module" else model


def _val_key(v) -> str:
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        return f"{tuple(v.shape)}:{v.dtype}"
    return type(v).__name__


def graph_signature(graph) -> str:
    """A hash of a joint graph as the partitioner gets it: each node's kind, target, value
    shape and dtype, and arguments (by node name). Recording and applying run the same
    pipeline on the same code, so the same graph hashes the same; another model, shape,
    dtype or torch version does not."""
    h = hashlib.sha256()
    for n in graph.nodes:
        args = re.sub(r"0x[0-9a-f]+", "", str(n.args))
        h.update(f"{n.op}|{n.name}|{n.target}|{_val_key(n.meta.get('val'))}|{args}\n".encode())
    return h.hexdigest()[:16]


def is_random(node) -> bool:
    """Does this call draw random numbers (dropout's ``native_dropout``, ``rand_like``)? The
    partitioner's extraction would re-draw them in backward: such a value is never dropped."""
    import torch

    tags = getattr(node.target, "tags", ()) if node.op == "call_function" else ()
    return torch.Tag.nondeterministic_seeded in tags


def _saveable(n) -> bool:
    """A tensor or symbolic-size value (a multi-output node's tuple is saved as its getitems)."""
    import torch

    val = n.meta.get("val")
    return isinstance(val, torch.Tensor | torch.SymInt | torch.SymFloat | torch.SymBool)


def save_everything(joint_graph, node_info) -> list:
    """Every forward value (inputs included) that a node outside the forward reads: nothing is
    recomputed. Where that is a multi-output node's tuple, the getitem reading it is saved.
    And inductor's dropout seeds (:func:`is_seeds`), a few bytes, so that a plan can recompute
    a dropout mask from them."""
    import operator

    saved: dict = {}
    for u in joint_graph.nodes:
        if u.op in ("output", "placeholder") or node_info.is_required_fw(u):
            continue
        for a in u.all_input_nodes:
            if not node_info.is_required_fw(a):
                continue
            if _saveable(a):
                saved[a] = None
            elif u.target is operator.getitem and _saveable(u):
                saved[u] = None
    for n in joint_graph.nodes:  # inductor's dropout seeds: a plan may recompute a mask from them
        if is_seeds(n) and node_info.is_required_fw(n):
            saved[n] = None
    order = {n: i for i, n in enumerate(joint_graph.nodes)}
    return sorted(saved, key=order.__getitem__)


def is_seeds(node) -> bool:
    """Is this inductor's ``inductor_seeds`` call (one draw of seeds per forward, after its
    joint-graph pass replaced each dropout with ``inductor_random(seed)``)? Given its seed,
    ``inductor_random`` is deterministic: a mask recomputed in backward from the saved seeds
    is the forward's mask, so a plan may drop what depends on it (``native_dropout``, under
    aot_eager, draws again: never)."""
    import torch

    target = getattr(torch.ops.prims, "inductor_seeds", None)
    return node.op == "call_function" and target is not None and node.target is target.default


@functools.cache
def choice_digest() -> str:
    """What names this module's code in a compiled plan's cache key: inductor's caches keep a
    graph partitioned by an earlier version of the choice (:func:`planned_choice`) under the
    same plan otherwise, and would hand it back."""
    from pathlib import Path

    from ..base.version import __version__

    return hashlib.sha256(f"{__version__}".encode() + Path(__file__).read_bytes()).hexdigest()[:16]


def is_view(node) -> bool:
    """Is ``node`` an aten view op (its result aliases its first argument, unwritten)?"""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None or not schema.returns or not schema.arguments:
        return False
    out, first = schema.returns[0].alias_info, schema.arguments[0].alias_info
    return out is not None and not out.is_write and first is not None


def view_bases(node) -> list:
    """The nodes whose storage ``node`` is a view of (its base, the base's base, ...)."""
    out = []
    while is_view(node) and node.args and hasattr(node.args[0], "op"):
        node = node.args[0]
        out.append(node)
    return out


def planned_choice(recorded: list[str], dropped: set[str]) -> Callable:
    """The choice of a plan for one graph: the recorded saved values but ``dropped``, with the
    forward inputs (parameters, the batch) that the recomputation of a dropped value reads
    added (they are alive through the step anyway), and so the bases of saved views that it
    reads: a saved view holds its base's storage, which the recording (and so the plan) counts
    as alive, but the partitioner sees a node, and would recompute a base it was not given
    from the base's own inputs (a BERT layer's input, saved only as the view its projections'
    weight gradients read, recomputed from the whole forward before it). Refuses a drop whose
    recomputation would re-draw random numbers."""

    def choose(joint_graph, node_info) -> list:
        by_name = {n.name: n for n in joint_graph.nodes}
        missing = [x for x in list(recorded) + sorted(dropped) if x not in by_name]
        if missing:
            raise PlanError(f"The compiled graph lacks the value(s) {missing[:5]} the plan names, although its "
                            "signature matched: record the compiled step again and solve again.")
        keep = [by_name[x] for x in recorded if x not in dropped]
        kept = set(keep)
        held = {b for k in keep for b in view_bases(k)} - {by_name[x] for x in dropped}
        inputs: list = []
        seen: set = set()
        stack = [by_name[x] for x in sorted(dropped)]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n.op == "placeholder" or n in held:
                if n not in kept:
                    inputs.append(n)
                    kept.add(n)
                continue
            if is_random(n):
                raise PlanError(f"The plan recomputes {n.name} ({n.target}) in a compiled backward, which would "
                                "draw its random numbers again: solve again with a trace recorded by this version.")
            stack.extend(a for a in n.all_input_nodes if a not in kept)
        return keep + inputs

    return choose


def partition(joint_module, joint_inputs, *, choose: Callable, on_graph: Callable | None = None, **kwargs):
    """PyTorch's min-cut partitioner with ``choose(joint_graph, node_info)`` deciding the saved
    values; ``on_graph(joint_graph, node_info, saved)`` sees each decision (recording keeps it)."""
    from torch._functorch import partitioners

    original = partitioners.choose_saved_values_set

    def chosen(joint_graph, node_info, memory_budget=1):
        saved = choose(joint_graph, node_info)
        if on_graph is not None:
            on_graph(joint_graph, node_info, saved)
        return saved

    kwargs.setdefault("compiler", "inductor")
    with _patch_lock:
        partitioners.choose_saved_values_set = chosen
        try:
            return partitioners.min_cut_rematerialization_partition(joint_module, joint_inputs, **kwargs)
        finally:
            partitioners.choose_saved_values_set = original


def make_backend(name: str, partition_fn: Callable, key: str, fw_compiler: Callable | None = None):
    """A ``torch.compile`` backend: ``name`` (aot_eager or inductor) with ``partition_fn`` as its
    partitioner. ``fw_compiler`` (recording) replaces what compiles the partitioned graphs:
    then both graphs run through it, under inductor after inductor's own joint-graph passes.
    ``key`` names the partition choice for inductor's caches."""
    if name not in BACKENDS:
        raise PlanError(f"taichi-plan plans torch.compile with the backends {', '.join(BACKENDS)}, not {name!r}: "
                        "compile with one of those (backend='inductor' is torch.compile's default).")
    if name == "aot_eager":
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import (
            boxed_nop,  # aot_eager's own: frees inputs at last use
        )

        compiler = fw_compiler or boxed_nop
        return aot_autograd(fw_compiler=compiler, bw_compiler=compiler, partition_fn=partition_fn,
                            keep_inference_input_mutations=True)

    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class Partitioner(CustomPartitionerFn):
        def __call__(self, gm, joint_inputs, **kwargs):
            return partition_fn(gm, joint_inputs, **kwargs)

        def uuid(self):
            return None if fw_compiler is not None else key

        def __reduce__(self):
            # Inductor's caches pickle the config, this object included (torch 2.13 does not
            # leave it out as it does custom passes): it stands for its key, which is the plan.
            return (str, (f"taichi-plan partitioner {self.uuid()}",))

    partitioner = Partitioner()

    def backend(gm, example_inputs):
        # recording: no cache may answer for a graph, or the partitioner and the recording
        # compiler would not see it
        with inductor_config.patch(custom_partitioner_fn=partitioner, force_disable_caches=fw_compiler is not None):
            if fw_compiler is None:
                return compile_fx(gm, example_inputs)

            def inner(graph, inputs, **kwargs):
                from .fusion import lowered_values

                graph.meta[LOWERED_KEY] = lowered_values(graph, inputs, kwargs)  # what gets a buffer
                return fw_compiler(graph, inputs)

            return compile_fx(gm, example_inputs, inner_compile=inner)

    return backend
