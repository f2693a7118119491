"""Import a public rematerialization benchmark graph (networkx node-link JSON) as a trace.

Two dialects are read (see ``docs/trace-format.md``, "Imported graphs"):

- ``train_nx`` (Checkmate's ``*_train_nx.json``): nodes ``id``, ``name``, ``backward``,
  ``cost_cpu``, ``cost_ram``; edges ``source``/``target``.
- ``random_layered`` (Moccasin's ``random_layered_*.json``): nodes ``name`` (the node id),
  ``duration``, ``out_cost``, ``param_cost``; edges ``"0"``/``"1"``.

One node becomes one op producing one tensor; an edge u->v is a read of u's tensor by v.
A tensor lives from its producer through its last consumer (inclusive), so
``baseline_peak(import_graph(f))`` is exactly the literature's "topo_mem" for the order
``graph["order"]`` (if present) else ``networkx.topological_sort``. Parameter costs of the
random graphs are not in that convention: they are kept in ``meta`` only, not as tensors.
Costs are abstract units (``meta["cost_unit"] == "units"``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

from ..base.errors import TraceError, UsageError
from .format import Trace, frame, op_signature


@dataclass(frozen=True)
class Dialect:
    """How one JSON dialect names its node id, cost, size and edge endpoints."""

    name: str
    node_id: str
    cost: str
    size: str
    source: str
    target: str
    required_node_keys: tuple[str, ...]


TRAIN_NX = Dialect(
    name="train_nx",
    node_id="id",
    cost="cost_cpu",
    size="cost_ram",
    source="source",
    target="target",
    required_node_keys=("id", "name", "backward", "cost_cpu", "cost_ram"),
)
RANDOM_LAYERED = Dialect(
    name="random_layered",
    node_id="name",
    cost="duration",
    size="out_cost",
    source="0",
    target="1",
    required_node_keys=("name", "duration", "out_cost"),
)
DIALECTS = (TRAIN_NX, RANDOM_LAYERED)

_EXPECTED = (
    "Expected networkx node-link JSON with 'nodes' and 'links' (or 'edges'), in one of two "
    "dialects: train_nx (node keys id, name, backward, cost_cpu, cost_ram; edge keys source, "
    "target) or random_layered (node keys name, duration, out_cost[, param_cost]; edge keys "
    "'0', '1')."
)
_MAX_SCALE_DIGITS = 6


def load_graph_json(json_path: str | Path) -> dict:
    """Read the JSON file; a missing file is a UsageError, bad contents a TraceError."""
    p = Path(json_path)
    if not p.exists():
        raise UsageError(f"Graph file {str(p)!r} does not exist. Check the path. {_EXPECTED}")
    if not p.is_file():
        raise UsageError(f"Graph file {str(p)!r} is not a file. Pass a node-link JSON file.")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TraceError(f"Graph file {str(p)!r} is not valid JSON ({e}). {_EXPECTED}") from e
    return data


def detect_dialect(data: object, where: str = "Graph") -> tuple[Dialect, str]:
    """(dialect, edges key) of node-link ``data``; TraceError naming the expected keys."""
    if not isinstance(data, dict):
        raise TraceError(f"{where} is a JSON {type(data).__name__}, not an object. {_EXPECTED}")
    edges_key = next((k for k in ("links", "edges") if k in data), None)
    nodes = data.get("nodes")
    if not isinstance(nodes, list) or edges_key is None or not isinstance(data[edges_key], list):
        raise TraceError(
            f"{where} has top-level keys {sorted(map(str, data))}, not node-link JSON. {_EXPECTED}"
        )
    node_keys: set[str] = set()
    for n in nodes:
        if not isinstance(n, dict):
            raise TraceError(f"{where}: a node is a JSON {type(n).__name__}, not an object. {_EXPECTED}")
        node_keys.update(n)
    edge_keys: set[str] = set()
    for e in data[edges_key]:
        if not isinstance(e, dict):
            raise TraceError(f"{where}: an edge is a JSON {type(e).__name__}, not an object. {_EXPECTED}")
        edge_keys.update(e)
    if not nodes:
        raise TraceError(f"{where} has no nodes; there is nothing to import. {_EXPECTED}")
    for d in DIALECTS:
        nodes_ok = all(all(k in n for k in d.required_node_keys) for n in nodes)
        edges_ok = all(d.source in e and d.target in e for e in data[edges_key])
        if nodes_ok and edges_ok:
            return d, edges_key
    raise TraceError(
        f"{where} is node-link JSON of neither known dialect: its nodes have keys "
        f"{sorted(node_keys)} and its edges {sorted(edge_keys)}. {_EXPECTED}"
    )


def _as_ints(values: list, what: str, where: str) -> tuple[list[int], int]:
    """Integers from JSON numbers; non-integral floats are scaled by the smallest power of ten
    (up to 10^6) that makes them integral, then rounded. Returns (ints, scale)."""
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise TraceError(f"{where}: {what} value {v!r} is not a finite non-negative number.")
    scale = 1
    for digits in range(_MAX_SCALE_DIGITS + 1):
        scale = 10**digits
        if all(abs(v * scale - round(v * scale)) < 1e-9 * max(1.0, abs(v * scale)) for v in values):
            break
    out = [int(round(v * scale)) for v in values]
    too_big = next((v for v in out if v >= 2**62), None)
    if too_big is not None:
        raise TraceError(f"{where}: {what} value {too_big} (after scaling by {scale}) is too large to be a size in "
                         "bytes (at most 2^62).")
    return out, scale


def schedule_order(g: nx.DiGraph, where: str = "Graph") -> list:
    """``g.graph["order"]`` if present (checked: a topological order of every node), else
    ``networkx.topological_sort`` (deterministic for a given file)."""
    if "order" not in g.graph:
        try:
            return list(nx.topological_sort(g))
        except nx.NetworkXUnfeasible as e:
            raise TraceError(f"{where} has a cycle, so it is not a computation graph ({e}).") from e
    order = list(g.graph["order"])
    pos = {v: i for i, v in enumerate(order)}
    if len(pos) != len(order) or set(pos) != set(g.nodes):
        raise TraceError(
            f"{where}: graph['order'] is not a permutation of the {g.number_of_nodes()} nodes "
            f"({len(order)} entries, {len(set(order) & set(g.nodes))} of them nodes)."
        )
    for u, v in g.edges:
        if pos[u] >= pos[v]:
            raise TraceError(f"{where}: graph['order'] runs node {v!r} before its input {u!r}.")
    return order


def import_graph(json_path: str | Path) -> Trace:
    """Read a node-link JSON benchmark graph and return it as an (unwritten) :class:`Trace`."""
    p = Path(json_path)
    where = f"Graph file {str(p)!r}"
    data = load_graph_json(p)
    dialect, edges_key = detect_dialect(data, where)
    try:
        g = nx.node_link_graph(
            data,
            directed=True,
            multigraph=False,
            source=dialect.source,
            target=dialect.target,
            name=dialect.node_id,
            edges=edges_key,
        )
    except (KeyError, TypeError, ValueError, nx.NetworkXError) as e:
        raise TraceError(f"{where}: networkx cannot build the graph ({e!r}). {_EXPECTED}") from e
    if g.is_multigraph() or not g.is_directed():
        raise TraceError(f"{where} says directed={g.is_directed()}, multigraph={g.is_multigraph()}; "
                         "expected a directed graph without parallel edges.")
    declared = {node.get(dialect.node_id) for node in data.get("nodes", ()) if isinstance(node, dict)}
    stray = next((v for v in g.nodes if v not in declared), None)
    if stray is not None:  # networkx adds an edge's end it does not know as a node without attributes
        raise TraceError(f"{where}: an edge names node {stray!r}, which is not in \"nodes\". {_EXPECTED}")
    order = schedule_order(g, where)
    pos = {v: i for i, v in enumerate(order)}
    n = len(order)
    attrs = [g.nodes[v] for v in order]
    costs = [a[dialect.cost] for a in attrs]
    for c in costs:
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
            raise TraceError(f"{where}: {dialect.cost} value {c!r} is not a finite non-negative number.")
    nbytes, nbytes_scale = _as_ints([a[dialect.size] for a in attrs], dialect.size, where)

    if dialect is TRAIN_NX:
        names = [str(a["name"]) for a in attrs]
        backward = [bool(a["backward"]) for a in attrs]
    else:
        names = [str(v) for v in order]
        backward = [False] * n
    phases = ["backward" if b else "forward" for b in backward]

    last_use = list(range(n))
    acc_op, acc_tensor, acc_role, acc_arg = [], [], [], []
    for j, v in enumerate(order):
        for k, u in enumerate(g.predecessors(v)):
            i = pos[u]
            last_use[i] = max(last_use[i], j)
            acc_op.append(j)
            acc_tensor.append(i)
            acc_role.append("read")
            acc_arg.append(k)
        acc_op.append(j)
        acc_tensor.append(j)
        acc_role.append("write")
        acc_arg.append(0)

    ops = frame(
        "ops",
        {
            "op_id": list(range(n)),
            "step": [0] * n,
            "phase": phases,
            "op": names,
            "module": [""] * n,
            "duration_s": [float(c) for c in costs],
            "flops": [0] * n,
            "cost_source": ["imported"] * n,
            "recomputable": [True] * n,
            "mutates": [False] * n,
        },
    )
    tensors = frame(
        "tensors",
        {
            "tensor_id": list(range(n)),
            "nbytes": nbytes,
            "dtype": ["uint8"] * n,
            "shape": [[b] for b in nbytes],
            "kind": ["temporary" if b else "activation" for b in backward],
            "producer_op": list(range(n)),
            "alloc_op": list(range(n)),
            "free_op": last_use,
        },
    )
    accesses = frame(
        "accesses",
        {"op_id": acc_op, "tensor_id": acc_tensor, "role": acc_role, "arg_index": acc_arg},
    )
    meta = {
        "name": p.stem,
        "mode": "imported",
        "source": p.name,
        "dialect": dialect.name,
        "graph_name": str(g.graph.get("name", p.stem)),
        "order_source": "graph['order']" if "order" in g.graph else "networkx.topological_sort",
        "cost_unit": "units",
        "nbytes_scale": nbytes_scale,
        "workload": {"name": p.stem, "args": {}},
        "device_profile": None,
        "dtype": None,
        "torch_version": None,
        "torch_build": None,
        "steps_recorded": 1,
        "steps_match": True,
        "first_mismatch": None,
        "signature": op_signature(names),
    }
    if dialect is RANDOM_LAYERED:
        params = [a.get("param_cost", 0) for a in attrs]
        param_ints, param_scale = _as_ints(params, "param_cost", where)
        meta["param_cost_total"] = sum(param_ints)
        meta["param_cost_scale"] = param_scale
    return Trace(ops, tensors, accesses, meta)
