"""Record a compiled training step: the ops of the graphs compile runs, node by node.

The model is compiled again with the user's backend and our recording partitioner
(:func:`.graphs.save_everything`), and the partitioned forward and backward graphs run through
an FX interpreter instead of their generated code: each node's aten ops reach the recorder
(a :class:`Recorder` that lets compiled code run under it: ``ignore_compile_internals``), each
intermediate is freed after its last use as the generated code frees it, and each op is tagged
with its graph and node. Eager code between graphs (a graph break, the loss outside the model,
the optimizer step) is recorded as in an eager step. ``meta.compiled`` (trace v21) lists the
graphs (signature, saved values, random nodes) and, per forward node, its op span and the
tensors it made: what :mod:`.apply` turns a plan's drops into.
"""

from __future__ import annotations

import re
import warnings

from ..base.errors import WorkloadError
from ..record.recorder import Recorder
from .fusion import NO_BUFFER, run_in_lowered_order
from .graphs import (
    LOWERED_KEY,
    compiled_kind,
    eager_module,
    graph_signature,
    is_random,
    make_backend,
    partition,
    save_everything,
)

GRAPH_KEY = "taichi_plan_graph"


class CompiledRecorder(Recorder):
    """A recorder under which ``torch.compile``'d code runs compiled (dynamo would fall back to
    eager under any other dispatch mode), so that it sees the ops the compiled graphs run."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


def module_of(node) -> str:
    """The FQN (relative to the model) of the module a graph node came from: its
    ``nn_module_stack`` (forward) or ``fwd_nn_module_stack`` (backward), innermost entry."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    path = re.sub(r"^L\['[^']*'\]\.?", "", str(path))
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"^_orig_mod\.?", "", path)
    return path if re.fullmatch(r"[\w.]*", path) else ""


class Capture:
    """What a recording compile saw: one entry per partitioned joint graph."""

    def __init__(self):
        self.graphs: list[dict] = []
        self.compiles = 0  # joint graphs partitioned so far (a recompile counts again)

    def add(self, joint_graph, saved) -> int:
        self.graphs.append({
            "signature": graph_signature(joint_graph),
            "saved": [n.name for n in saved if hasattr(n.meta.get("val"), "shape")],
            "random": [n.name for n in joint_graph.nodes if is_random(n)],
        })
        return len(self.graphs) - 1

    def partition_fn(self, joint_module, joint_inputs, **kwargs):
        self.compiles += 1
        seen: list[int] = []
        fw, bw = partition(joint_module, joint_inputs, choose=save_everything,
                           on_graph=lambda g, _info, saved: seen.append(self.add(g, saved)), **kwargs)
        if seen:  # a graph with no backward goes to the default partitioner: nothing to plan
            fw.meta[GRAPH_KEY] = (seen[-1], "forward")
            bw.meta[GRAPH_KEY] = (seen[-1], "backward")
        return fw, bw


def _recorder():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, CompiledRecorder):
            return mode
    return None


def interpreting_compiler(gm, _example_inputs):
    """Compile a partitioned graph into a boxed function that runs it node by node under
    ``torch.fx.Interpreter`` (values freed after their last use), telling the active
    :class:`CompiledRecorder` which ops each node ran."""
    import torch
    from torch.utils._pytree import tree_leaves

    graph, part = gm.meta.get(GRAPH_KEY, (None, None))
    modules = {n.name: module_of(n) for n in gm.graph.nodes}
    lowered = gm.meta.get(LOWERED_KEY) or {}  # inductor: node name -> buffer / no buffer, input copies
    run_in_lowered_order(gm, lowered)  # in the order inductor's code computes them
    no_buffer = {name for name, what in lowered.get("nodes", {}).items() if what == NO_BUFFER}
    copies = lowered.get("input_copies", [])
    seen: dict[str, tuple[int, int, list[int]]] = {}  # this run: node -> its ops [start, end), its tensors
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    users = {n.name: [u.name for u in n.users] for n in gm.graph.nodes}

    def tensors_of(rec, out) -> list[int]:
        return sorted({t for t in (rec.tensor_id(x) for x in tree_leaves(out) if isinstance(x, torch.Tensor))
                       if t is not None})

    class Tagging(torch.fx.Interpreter):
        def run_node(self, n):
            rec = _recorder()
            step = rec.current if rec is not None else None
            if step is None or n.op in ("placeholder", "output"):
                return super().run_node(n)
            start = rec.op_count
            out = super().run_node(n)
            tids = tensors_of(rec, out)
            seen[n.name] = (start, rec.op_count, tids)
            step.extras.setdefault("compiled_nodes", []).append(
                [graph, part, n.name, start, rec.op_count, tids, modules.get(n.name, ""), n.name in no_buffer])
            return out

    interp = Tagging(gm, garbage_collect_values=True)

    def run(args):
        rec = _recorder()
        step = rec.current if rec is not None else None
        start = rec.op_count if step is not None else None
        seen.clear()
        if step is not None:  # (boxed_run binds the placeholders without run_node; and no name here
            # may hold an argument: boxed_run frees each at its last use)
            seen.update({n.name: (start, start, tensors_of(rec, a)) for n, a in zip(placeholders, args, strict=False)})
        try:
            return interp.boxed_run(args)
        finally:
            interp.env = {}  # the interpreter keeps the last run's values (its outputs) otherwise
            if step is not None and graph is not None:
                step.extras.setdefault("compiled_runs", []).append([graph, part, start, rec.op_count, copies])
            if step is not None:
                step.extras.setdefault("compiled_holds", []).extend(kernel_holds(lowered, seen))
                step.extras.setdefault("compiled_kernel_ends", []).extend(kernel_ends(lowered, seen, users))

    run._boxed_call = True
    return run


def kernel_holds(lowered: dict, seen: dict) -> list[tuple[int, int, int]]:
    """``(tensor, op, end)``: each tensor a run of a lowered graph must hold up to ``op`` at least,
    as its generated code does (:func:`.fusion.kernels`). The interpreter frees a value at its
    last read, in the middle of the kernel that reads it; the code frees it after that kernel,
    whose buffers are all allocated before it runs: a kernel's inputs and outputs are alive
    together. The kernel ends, in the recording, at ``end``: the last op of the nodes it writes.
    An input the kernel writes its output into in place (:func:`.fusion.in_place`) is held only
    until that output is made (``op`` < ``end``): its storage becomes the output's."""
    into = {old: new for old, new in lowered.get("in_place", ())}
    holds = []
    for kernel in lowered.get("kernels", ()):
        end = _kernel_end(kernel, seen)
        if end is None:
            continue
        for name in kernel["free"]:
            if name not in seen:
                continue
            until = end
            if into.get(name) in kernel["out"] and into[name] in seen:
                until = min(end, seen[into[name]][0] - 1)  # its storage becomes the output's there
            holds.extend((t, until, end) for t in seen[name][2])
    return holds


def kernel_ends(lowered: dict, seen: dict, users: dict) -> list[list[int]]:
    """``[start, end, kernel_end]`` for each node of a run whose ops ``[start, end)`` are part of
    a kernel that ends later (``kernel_end``): a node whose buffer a kernel writes, at that
    kernel's end; a node with no buffer of its own (fused into the kernels that read it, a view)
    at the end of the last kernel its value is read in. What its ops read is held to there
    (``meta.compiled.kernel_ends``: a plan's recomputation holds what it reads as the kernel does)."""
    end_of: dict[str, int] = {}
    for kernel in lowered.get("kernels", ()):
        end = _kernel_end(kernel, seen)
        for name in kernel["out"]:
            if end is not None and name in seen:
                end_of[name] = max(end_of.get(name, -1), end)
    if not end_of:
        return []
    for name in reversed(seen):  # (the run's order: a node's users come after it)
        if name not in end_of:
            end_of[name] = max([seen[name][1] - 1, *(end_of[u] for u in users.get(name, ()) if u in end_of)])
    return sorted([start, end, end_of[name]] for name, (start, end, _tids) in seen.items()
                  if end > start and end_of[name] > end - 1)


def _kernel_end(kernel: dict, seen: dict) -> int | None:
    """The last op, in the recording's run, of the nodes ``kernel`` writes (None: none ran)."""
    ends = [seen[name][1] - 1 for name in kernel["out"] if name in seen and seen[name][1] > seen[name][0]]
    return max(ends) if ends else None


def hold_kernel_inputs(rec, holds) -> list[list[int]]:
    """Free each tensor no earlier than its :func:`kernel_holds` op. Returns ``[tensor, end]``
    for each one held less than to its kernel's end (written into in place): a copy a plan
    rebuilds is a buffer of the planned graph, not the one the recorded code reused, and is
    read to the kernel's end like any input (``meta.compiled.rebuilt_ends``)."""
    free = rec.tensors["free_op"]
    rebuilt = {}
    for t, op, end in holds:
        if 0 <= free[t] < op:
            free[t] = op
        if op < end and free[t] >= 0:
            rebuilt[t] = max(rebuilt.get(t, end), end)
    return [[t, e] for t, e in sorted(rebuilt.items())]


def backend_of(model, backend: str | None) -> str:
    """The backend to plan for: ``backend`` if given, else the one ``model`` was compiled with."""
    if backend is not None:
        return backend
    ctx = getattr(model, "dynamo_ctx", None) if compiled_kind(model) == "module" else None
    found = _backend_name(ctx)
    if found is None:
        raise WorkloadError(
            "taichi-plan could not tell which backend this model was compiled with (a model compiled with "
            "model.compile() does not say): pass backend='inductor' or backend='aot_eager' (--compile on the "
            "command line).")
    return found


def _backend_name(ctx) -> str | None:
    """The backend's name behind dynamo's wrappers of it (``_torchdynamo_orig_backend``, on torch 2.13:
    CatchErrorsWrapper -> ConvertFrame -> WrapBackendDebug named after the backend)."""
    obj = getattr(ctx, "callback", None)
    for _ in range(6):
        if obj is None:
            return None
        name = getattr(obj, "compiler_name", None) or getattr(obj, "__name__", None)
        if name in ("aot_eager", "inductor", "compile_fx"):
            return "inductor" if name == "compile_fx" else name
        obj = getattr(obj, "_torchdynamo_orig_backend", None)
    return None


def recording_model(model, backend: str):
    """``model``'s module compiled again for recording, as ``model`` is compiled (or, for an
    eager ``model``, as ``torch.compile(model, backend=backend)`` would be): the module to
    call, the capture, and a function that puts a ``model.compile()``'d model back."""
    import torch

    capture = Capture()
    rec_backend = make_backend(backend, capture.partition_fn, "record", fw_compiler=interpreting_compiler)
    torch._dynamo.reset()  # our compile must not reuse a cache entry of the user's
    if compiled_kind(model) == "method":  # m.compile(): record through a wrapper, as torch.compile(m)
        before = model._compiled_call_impl  # (the recorder's module tracking sees m entered once)
        model._compiled_call_impl = None

        def restore():
            model._compiled_call_impl = before
            torch._dynamo.reset()

        return torch.compile(model, backend=rec_backend), capture, restore
    return torch.compile(eager_module(model), backend=rec_backend), capture, torch._dynamo.reset


def fused_storages(rec, nodes) -> None:
    """Record as 0 bytes each storage that a node inductor gives no buffer (fused into the
    kernel that reads it, local to one kernel, a view) allocated: the interpreter made it, the
    compiled code never does (:mod:`.fusion`). The rows stay (the ops still read them)."""
    alloc = rec.tensors["alloc_op"]
    spans = sorted((start, end) for _g, _p, _name, start, end, _tids, _module, fused in nodes if fused)
    if not spans:
        return
    import bisect

    starts = [s for s, _e in spans]
    for tid, op in enumerate(alloc):
        i = bisect.bisect_right(starts, op) - 1
        if i >= 0 and spans[i][0] <= op < spans[i][1]:
            rec.tensors["nbytes"][tid] = 0


def saved_view_detaches(rec, nodes) -> None:
    """Drop the reads of the ``detach`` ops AOTAutograd's wrapper runs right after a compiled
    forward, one per saved value that is a view (``x.detach() if x._is_view()``, before
    ``ctx.save_for_backward``). They read the view's storage once the graph is done only
    because the value is saved: a plan that drops it saves it not, and the detach is not run.
    Counted as uses they pinned every such storage across the forward's end (the peak of a
    compiled step), as if no plan could free it there."""
    inside = set()
    ends = set()
    for graph, part, _name, start, end, _tids, _module, _fused in nodes:
        inside.update(range(start, end))
        if graph is not None and part == "forward":
            ends.add(end)
    last_ends = {e for e in ends if e not in inside}  # the op after each forward graph's last node
    names = rec.ops["op"]
    wrapper = set()
    for op in sorted(last_ends):
        while op < len(names) and op not in inside and names[op] == "aten.detach.default":
            wrapper.add(op)
            op += 1
    if not wrapper:
        return
    acc = rec.accesses
    keep = [i for i, (op, role) in enumerate(zip(acc["op_id"], acc["role"], strict=True))
            if not (op in wrapper and role == "read")]
    for k in acc:
        acc[k][:] = [acc[k][i] for i in keep]


def add_input_copies(rec, runs) -> None:
    """Add a storage for each copy of its inputs a forward graph's inductor code makes
    (:func:`.fusion.input_copies`), alive from the graph's first op to the last op of its
    backward (it is saved where the backward reads the input in that layout: a convolution's;
    an over-estimate where it is not, for the forward only). No plan drops it."""
    tens = rec.tensors
    for i, (graph, part, start, end, copies) in enumerate(runs):
        if part != "forward" or not copies or end <= start:
            continue
        later = [e for g, p, _s, e, _c in runs[i + 1:] if g == graph and p == "backward"]
        last = (later[0] if later else end) - 1
        for nbytes in copies:
            tens["nbytes"].append(nbytes)
            tens["dtype"].append("uint8")
            tens["shape"].append([nbytes])
            tens["kind"].append("activation")
            tens["producer_op"].append(-1)
            tens["alloc_op"].append(start)
            tens["free_op"].append(last)
            rec.producer_phase.append(None)


SEEDS_OP = "prims.inductor_seeds.default"


def seeds_through_backward(rec, nodes) -> None:
    """Keep inductor's dropout seeds (saved by the recording: :func:`.graphs.is_seeds`) alive to
    the end of their graph's backward, as a plan that recomputes a mask from them holds them
    there (a few bytes). Unread by the recorded backward, they were freed at its start, and no
    mask could be recomputed after that."""
    last_bw: dict = {}
    for graph, part, _name, _start, end, _tids, _module, _fused in nodes:
        if graph is not None and part == "backward":
            last_bw[graph] = max(last_bw.get(graph, 0), end - 1)
    ops, alloc, free = rec.ops["op"], rec.tensors["alloc_op"], rec.tensors["free_op"]
    for graph, part, _name, start, end, tids, _module, _fused in nodes:
        if part != "forward" or graph not in last_bw or not any(ops[i] == SEEDS_OP for i in range(start, end)):
            continue
        for tid in tids:
            if start <= alloc[tid] < end and 0 <= free[tid] < last_bw[graph]:
                free[tid] = last_bw[graph]


def tag_record(rec, capture: Capture) -> dict:
    """Set the module of each op the compiled graphs ran from their nodes, mark every op
    outside a planned graph's forward (and every random node's) as not recomputable by a
    plan, make each op of a compiled backward its own unpack point, and return ``meta.compiled``'s graphs and nodes for this step."""
    nodes = rec.extras.pop("compiled_nodes", [])
    n = rec.num_ops
    planned = [False] * n
    random = {(g, name) for g, entry in enumerate(capture.graphs) for name in entry["random"]}
    fused_storages(rec, nodes)
    rebuilt_ends = hold_kernel_inputs(rec, rec.extras.pop("compiled_holds", []))
    kernel_spans = rec.extras.pop("compiled_kernel_ends", [])
    saved_view_detaches(rec, nodes)
    seeds_through_backward(rec, nodes)
    add_input_copies(rec, rec.extras.pop("compiled_runs", []))
    for graph, part, name, start, end, _tids, module, _fused in nodes:
        for op in range(start, min(end, n)):
            if module:
                rec.ops["module"][op] = module
            if graph is not None and part == "forward" and (graph, name) not in random:
                planned[op] = True
    # A compiled backward is one autograd node that unpacks every saved value at its start, but
    # the values are read, and recomputed ones rebuilt, inside its graph op by op: each of its
    # ops is where what it reads is needed (meta.backward_nodes).
    starts = set(rec.node_starts)
    for graph, part, _name, start, end, _tids, _module, _fused in nodes:
        if graph is not None and part == "backward":
            starts.update(range(start, min(end, n)))
    rec.node_starts[:] = sorted(starts)
    rec.ops["recomputable"] = [bool(r) and p for r, p in zip(rec.ops["recomputable"], planned, strict=True)]
    forward = [[g, name, s, e, tids] for g, part, name, s, e, tids, _m, _f in nodes if part == "forward" and g is not None]
    return {"graphs": capture.graphs, "nodes": forward, "rebuilt_ends": rebuilt_ends, "kernel_ends": kernel_spans}


EXTRA_WARMUP = 3  # warm-up steps beyond the asked ones while a step still compiles something


def steady_state(step, optimizer, loop, capture: Capture, warmup: int, say, name: str) -> int:
    """Run ``warmup`` unrecorded steps, then more (up to :data:`EXTRA_WARMUP`) while the last one
    compiled a graph: a model can compile again on its second step (a Hugging Face model's loss
    sets ``config.problem_type`` on its first call, a guard of the first graph). A compile under
    the recorder would trace the recorder's own hooks into the graphs, breaking them where the
    steady-state step does not. Returns the number of warm-up steps run."""
    done = 0
    while True:
        before = capture.compiles
        say(f"warm-up step {done + 1}")
        optimizer.zero_grad(set_to_none=loop.set_to_none)
        step()
        done += 1
        if done >= warmup and capture.compiles == before:
            return done
        if done >= warmup + EXTRA_WARMUP:
            raise WorkloadError(
                f"record_compiled({name!r}): torch.compile compiled the model again on each of {done} warm-up "
                "steps: the step has no steady state to record. Find what changes between steps "
                "(TORCH_LOGS=recompiles names the failing guard) and make it stable, then record again.")


def record_compiled(model, batch, loss_fn, optimizer, *, backend: str | None = None, name: str = "compiled",
                    steps: int = 2, warmup: int = 1, loop=None, args: dict | None = None, inputs=None,
                    device_profile: str | None = None, progress=None):
    """Record one training step of ``model`` as ``torch.compile`` runs it (``model`` compiled, or
    eager with ``backend`` given): a :class:`~taichi_plan.trace.format.Trace` whose ``meta.compiled``
    says which graphs and nodes its ops are, for :func:`taichi_plan.apply` on the compiled model.
    ``warmup`` steps compile; then ``steps`` recorded steps (the weights change) must match.
    ``device_profile``: metadata only, as for any real recording."""
    from ..record.api import (
        caller_meta,
        check_counts,
        make_step_fn,
        run_and_record,
        trace_from_records,
    )
    from ..torch_common.loop import Loop

    check_counts(steps, warmup)
    backend = backend_of(model, backend) if compiled_kind(model) else (backend or "inductor")
    loop = loop or Loop()
    rec_model, capture, restore = recording_model(model, backend)
    step = make_step_fn(rec_model, batch, loss_fn, optimizer, f"record_compiled({name!r})", loop)
    if inputs is None:  # what record() registers as the step's inputs (record.api.registered_tensors)
        inputs = [batch, list(getattr(loss_fn, "inputs", ()))]
    say = progress or (lambda msg: None)
    try:
        warmup = steady_state(step, optimizer, loop, capture, warmup, say, name)
        before = capture.compiles
        with warnings.catch_warnings():
            # the recorder tracks modules with global hooks, which dynamo warns also fire for the
            # torch.compile(module) wrapper: a wrapper the recording made, not the user's
            warnings.filterwarnings("ignore", message="Using `torch.compile\\(module\\)` when there are global hooks")
            records = run_and_record(rec_model, optimizer, step, inputs, loop=loop, steps=steps, warmup=0,
                                     say=say, recorder_cls=CompiledRecorder)
    finally:
        restore()
    if capture.compiles != before:
        raise WorkloadError(
            f"record_compiled({name!r}): torch.compile compiled the model again during a recorded step, after "
            f"{warmup} warm-up step(s) that compiled nothing new: the recording would hold graphs the steady-state "
            "step does not run. Find what changes between steps (TORCH_LOGS=recompiles names the failing guard) "
            "and make it stable, or mark the changing sizes dynamic, then record again.")
    if not capture.graphs:
        raise WorkloadError(
            f"record_compiled({name!r}): compile made no graph with a backward (nothing in the model's forward "
            "needs a gradient, or every op ran eagerly): there is nothing to plan. Record the eager model instead.")
    compiled = [tag_record(r, capture) for r in records]
    trace = trace_from_records(records, warmup=warmup, fake=False, loop=loop,
                               meta=caller_meta(eager_module(model), name, args, device_profile))
    # No replay runtime runs beside a compiled step (the partitioner's backward graph holds the
    # recomputation): its rates would charge the plan for checks and recipes that never run.
    trace.meta.pop("runtime_overhead", None)
    kept = trace.meta["kept_step"] - warmup
    trace.meta["compiled"] = {"backend": backend, **compiled[kept]}
    return trace
