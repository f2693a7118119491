"""What inductor's fusion does to memory: which values of a partitioned graph get a buffer.

An FX interpreter (what :mod:`.record` runs instead of generated code) allocates every node's
output; inductor's generated code allocates only the buffers its lowering realizes and its
scheduler keeps. A value fused into the kernel that reads it (a ``Pointwise`` or reduction
body inlined there), a buffer the scheduler found local to one fused kernel, and a view of
another buffer never exist as memory of their own. :func:`lowered_values` lowers a copy of the
graph with inductor's own ``GraphLowering`` (``compile_fx_inner``, caches off, so lowering
really runs) and says, per node name, what the lowering made of it. :mod:`.record` then
records the storages a node without a buffer allocated as 0 bytes: the trace's peak, and every
plan's prediction, is then of what the compiled code allocates.

Read at the end of the lowering: the IR a node lowered to is realized in place when a later
user needs it as a buffer (a ``StorageBox`` whose data becomes a ``ComputedBuffer``), so its
state after the whole graph is lowered is what the code allocates.

And *where* it computes a value a post-grad pattern replaced: a pattern puts its replacement
where its last node stands (``mm`` + ``add`` become one ``addmm`` at the add, which holds the
mm's inputs until there). :func:`lowered_values` names the nodes that never reached the
lowering; :func:`run_in_lowered_order` runs each just before its first user in the recording.

And *when* the code allocates and frees: per kernel, not per node. Every buffer a kernel writes
is allocated before it runs, what it read last is freed after it (:func:`kernels`), except an
input it writes its output into (:func:`in_place`); and the kernels run in the scheduler's
order, which inductor reorders to lower its peak (:func:`lowered_order`).
"""

from __future__ import annotations

import copy
import threading

_lock = threading.Lock()
BUFFER, NO_BUFFER, UNKNOWN = "buffer", "no buffer", "unknown"


def classify(value, removed) -> str:
    """``BUFFER`` if the lowered ``value`` (a ``TensorBox``) is a realized buffer the scheduler
    kept, ``NO_BUFFER`` for a fused computation, a kernel-local buffer or a view, ``UNKNOWN``
    for anything else (a tuple of outputs, a symbolic size): then the trace keeps what the
    interpreter allocated."""
    from torch._inductor import ir

    if not isinstance(value, ir.TensorBox):
        return UNKNOWN
    data = value.data
    if not isinstance(data, ir.StorageBox):
        return NO_BUFFER  # a view (ReinterpretView, View, ...) of another value's storage
    inner = data.data
    if isinstance(inner, ir.Buffer):
        return NO_BUFFER if inner.get_name() in removed else BUFFER
    return NO_BUFFER  # Pointwise / Reduction never realized: inlined where it is read


def input_copies(graph, node_of: dict[str, str]) -> list[int]:
    """Bytes of each buffer the lowered ``graph`` keeps that no node's value is (``node_of``:
    :func:`buffer_nodes`) and that is made from graph inputs only: a copy of an input in the
    layout a kernel wants (a convolution's input and weight in channels-last). The interpreter
    makes no such copy; inductor's code does, and keeps it while the graph's outputs (the values
    saved for backward) hold it."""
    from torch._inductor import ir

    out = []
    for buf in graph.buffers:
        name = buf.get_name()
        if name in node_of or name in graph.removed_buffers or isinstance(buf.layout, ir.MultiOutputLayout | ir.NoneLayout):
            continue
        origins = buf.get_origins()
        if origins and all(o.op == "placeholder" for o in origins):
            try:
                out.append(int(buf.get_numel()) * buf.get_dtype().itemsize)
            except TypeError:  # a symbolic size: not recorded
                continue
    return out


def lowered_values(gm, example_inputs, kwargs: dict) -> dict:
    """Lower a copy of the partitioned graph ``gm`` as inductor does (post-grad passes, lowering,
    scheduling): ``{"nodes": {name: what}}`` for each call node (:func:`classify`; a node the
    post-grad passes replaced is absent, ``UNKNOWN`` to the caller), ``"input_copies"``: the
    bytes of its copies of inputs (:func:`input_copies`), ``"replaced"``: the call nodes that never
    reached the lowering (a post-grad pattern replaced them: :func:`lowered_order`),
    ``"kernels"`` (:func:`kernels`) and ``"in_place"`` (:func:`in_place`)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.graph import GraphLowering

    seen: list = []
    original_init, original_run_node = GraphLowering.__init__, GraphLowering.run_node

    def init(self, *args, **kw):
        seen.append(self)
        self._taichi_plan_values = {}
        return original_init(self, *args, **kw)

    def run_node(self, n):
        out = original_run_node(self, n)
        values = getattr(self, "_taichi_plan_values", None)
        if values is not None and n.op == "call_function":
            values[n.name] = out  # the interpreter drops values after their last use; keep them
        return out

    with _lock, inductor_config.patch(force_disable_caches=True):
        GraphLowering.__init__, GraphLowering.run_node = init, run_node
        try:
            compile_fx_inner(copy.deepcopy(gm), example_inputs, **kwargs)
        finally:
            GraphLowering.__init__, GraphLowering.run_node = original_init, original_run_node
    main = [g for g in seen if not getattr(g, "is_const_graph", False)]
    if not main:
        return {"nodes": {}, "input_copies": [], "replaced": [], "kernels": [], "in_place": []}
    graph = main[0]  # the graph itself (subgraphs of higher-order ops are lowered inside it, after it)
    values = graph._taichi_plan_values
    replaced = [n.name for n in gm.graph.nodes if n.op == "call_function" and n.name not in values]
    node_of = buffer_nodes(graph, values)
    return {"nodes": {name: classify(v, graph.removed_buffers) for name, v in values.items()},
            "input_copies": input_copies(graph, node_of), "replaced": replaced,
            "kernels": kernels(graph, node_of), "in_place": in_place(graph, node_of)}


def kernels(graph, node_of: dict[str, str]) -> list[dict]:
    """Each kernel of the lowered ``graph`` (a scheduled node: a fused kernel, an extern kernel
    such as a matmul), in the scheduler's order: ``{"out": [...], "free": [...]}``, the nodes
    whose buffers it writes and those whose buffers the generated code frees right after it (its
    ``last_usage``: a buffer is freed after the kernel that reads it last, not at the read). A
    graph input is named by its placeholder; a buffer no node names (``node_of``:
    :func:`buffer_nodes`) is left out."""
    out = []
    for snode in getattr(getattr(graph, "scheduler", None), "nodes", None) or ():
        writes = [node_of[b.get_name()] for sub in snode.get_nodes() for b in sub.get_outputs()
                  if b.get_name() in node_of]
        frees = [node_of[b] for b in sorted(getattr(snode, "last_usage", ()) or ()) if b in node_of]
        if writes:
            out.append({"out": writes, "free": frees})
    return out


def buffer_nodes(graph, values: dict) -> dict[str, str]:
    """Buffer name -> the node of the lowered ``graph`` that is that buffer (graph inputs: their
    placeholders)."""
    from torch._inductor import ir

    node_of = {}
    for name, v in values.items():
        if isinstance(v, ir.TensorBox) and isinstance(v.data, ir.StorageBox) and isinstance(v.data.data, ir.Buffer):
            node_of.setdefault(v.data.data.get_name(), name)
    for name in graph.graph_inputs:
        node_of.setdefault(name, name)
    return node_of


def in_place(graph, node_of: dict[str, str]) -> list[tuple[str, str]]:
    """``(input, output)`` node names of each buffer a kernel of the lowered ``graph`` writes its
    output into in place (the generated code's ``bufN = input; del input  # reuse`` before the
    kernel): the input's storage becomes the output's, so the two are never alive at once."""
    reuses = getattr(getattr(graph, "wrapper_code", None), "reuses", None) or {}
    return [(node_of[old], node_of[new]) for new, old in reuses.items() if old in node_of and new in node_of]


def lowered_order(graph, replaced: set[str], schedule: list[dict] = ()) -> list:
    """The nodes of the FX ``graph`` in the order inductor's code computes them. With the
    lowering's ``schedule`` (:func:`kernels`, in the scheduler's order, which inductor reorders to
    lower its peak memory): each node whose buffer a kernel writes where that kernel runs, and
    every other node (fused into a kernel, a view, a node a post-grad pattern ``replaced``) just
    before its first user. Without them, after the post-grad patterns only: a replaced node is
    computed where its replacement stands, which a pattern inserts at its last node (``mm`` +
    ``add`` become one ``addmm`` at the add): just before its first user, chains of replaced nodes
    alike; every other node where it is. Always a topological order; a node with side effects (an
    input mutation, a random draw's state) keeps its place: nothing moves across it."""
    import heapq

    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    if schedule:
        place = {}
        for k, kernel in enumerate(schedule):
            for name in kernel["out"]:
                place.setdefault(name, k)
        last = len(schedule)
    else:
        place = {n.name: index[n] for n in nodes if n.name not in replaced}
        last = len(nodes)
    key: dict = {}
    for n in reversed(nodes):
        if n.op == "placeholder":  # (they bind the arguments in their order)
            key[n] = (-1, index[n])
        elif n.name in place and n.name not in replaced:
            key[n] = (place[n.name], index[n])
        else:
            key[n] = min((key[u] for u in n.users), default=(last, index[n]))
    segment, s = {}, 0
    for n in nodes:
        barrier = n.op == "call_function" and n.is_impure()
        s += barrier
        segment[n] = -1 if n.op == "placeholder" else s
        s += barrier
    waiting = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [(segment[n], key[n], index[n]) for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        n = nodes[heapq.heappop(ready)[2]]
        out.append(n)
        for u in n.users:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (segment[u], key[u], index[u]))
    return out if len(out) == len(nodes) else nodes


def run_in_lowered_order(gm, lowered: dict) -> None:
    """Reorder ``gm``'s graph in place to :func:`lowered_order` (the recording's own copy of a
    partitioned graph: it only runs under the recorder)."""
    replaced, kernel_list = set(lowered.get("replaced", ())), lowered.get("kernels", ())
    if not replaced and not kernel_list:
        return
    order = lowered_order(gm.graph, replaced, kernel_list)
    if order == list(gm.graph.nodes):
        return
    prev = order[0]
    for n in order[1:]:
        prev.append(n)
        prev = n
    gm.graph.lint()
    gm.recompile()
