"""import_graph: public benchmark graphs -> traces whose baseline peak is the published topo_mem."""

from __future__ import annotations

import json
from pathlib import Path

import networkx as nx
import pandas as pd
import pytest
from click.testing import CliRunner
from conftest import graph_files

from taichi_plan.base.errors import TraceError, UsageError
from taichi_plan.cli import main
from taichi_plan.trace.format import baseline_peak, read_trace, write_trace
from taichi_plan.trace.import_graph import import_graph

GRAPHS = graph_files()


def topo_mem(json_path: Path) -> int:
    """The README's definition, written independently of taichi_plan: over the steps j of the
    order, the outputs of earlier nodes that still have a consumer at step j or later, plus
    node j's own output."""
    data = json.loads(json_path.read_text())
    links = data["links"] if "links" in data else data["edges"]
    if "cost_ram" in data["nodes"][0]:
        ids = [n["id"] for n in data["nodes"]]
        size = {n["id"]: n["cost_ram"] for n in data["nodes"]}
        edges = [(e["source"], e["target"]) for e in links]
    else:
        ids = [n["name"] for n in data["nodes"]]
        size = {n["name"]: n["out_cost"] for n in data["nodes"]}
        edges = [(e["0"], e["1"]) for e in links]
    order = data.get("graph", {}).get("order")
    if order is None:
        g = nx.DiGraph()
        g.add_nodes_from(ids)
        g.add_edges_from(edges)
        order = list(nx.topological_sort(g))
    step = {v: j for j, v in enumerate(order)}
    consumers_at = {v: [] for v in ids}
    for u, v in edges:
        consumers_at[u].append(step[v])
    peak = 0
    for j, v in enumerate(order):
        live = size[v]
        for u in order[:j]:
            if any(c >= j for c in consumers_at[u]):
                live += size[u]
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("path", GRAPHS, ids=[p.stem[:30] for p in GRAPHS])
def test_baseline_peak_is_topo_mem(path: Path, graphs_dir):
    trace = import_graph(path)
    peak, op = baseline_peak(trace)
    print(f"{path.name}: baseline peak {peak} bytes at op {op}")
    assert peak == topo_mem(path)
    data = json.loads(path.read_text())
    assert trace.num_ops == len(data["nodes"])
    assert len(trace.tensors) == len(data["nodes"])
    links = data.get("links", data.get("edges"))
    reads = trace.accesses[trace.accesses["role"] == "read"]
    assert len(reads) == len(links)
    assert (trace.accesses["role"] == "write").sum() == trace.num_ops


def test_resnet50(graphs_dir):
    path = graphs_dir / "ResNet50_256_224x224_train_nx.json"
    if not path.exists():
        pytest.skip("ResNet50 graph not present")
    data = json.loads(path.read_text())
    trace = import_graph(path)
    assert trace.num_ops == len(data["nodes"]) == 353
    assert set(trace.ops["phase"]) == {"forward", "backward"}
    n_backward = sum(1 for n in data["nodes"] if n["backward"])
    assert (trace.ops["phase"] == "backward").sum() == n_backward
    assert (trace.tensors["kind"] == "temporary").sum() == n_backward
    assert trace.ops["duration_s"].sum() == sum(n["cost_cpu"] for n in data["nodes"])
    assert trace.tensors["nbytes"].sum() == sum(n["cost_ram"] for n in data["nodes"])
    assert trace.meta["cost_unit"] == "units" and trace.cost_unit == "units"
    assert trace.meta["dialect"] == "train_nx"
    assert trace.meta["workload"]["name"] == path.stem
    assert set(trace.ops["cost_source"]) == {"imported"}


def test_random_layered_uses_graph_order(graphs_dir):
    paths = sorted(graphs_dir.glob("random_layered_*.json"))
    if not paths:
        pytest.skip("no random_layered graph present")
    data = json.loads(paths[0].read_text())
    trace = import_graph(paths[0])
    assert trace.ops["op"].tolist() == [str(v) for v in data["graph"]["order"]]
    assert set(trace.ops["phase"]) == {"forward"}
    assert trace.meta["dialect"] == "random_layered"
    assert trace.meta["param_cost_total"] == sum(n.get("param_cost", 0) for n in data["nodes"])
    assert set(trace.tensors["kind"]) == {"activation"}


@pytest.mark.parametrize("path", GRAPHS, ids=[p.stem[:30] for p in GRAPHS])
def test_round_trip(path: Path, tmp_path, graphs_dir):
    trace = import_graph(path)
    out = write_trace(trace, tmp_path / "t")
    back = read_trace(out)
    for name in ("ops", "tensors", "accesses"):
        pd.testing.assert_frame_equal(getattr(back, name), getattr(import_graph(path), name))
    assert back.content_hash() == trace.content_hash() == back.meta["content_hash"]
    assert baseline_peak(back) == baseline_peak(trace)
    assert back.meta["mode"] == "imported"


def _write(tmp_path: Path, obj, name="g.json") -> Path:
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return p


def test_tiny_graph_by_hand(tmp_path):
    # a -> b -> c, a -> c; sizes 10, 20, 5. Order a, b, c: step a: 10; step b: 10 + 20;
    # step c: a (10) + b (20) + c (5) = 35.
    g = {
        "directed": True, "multigraph": False, "graph": {},
        "nodes": [
            {"id": 0, "name": "a", "backward": False, "cost_cpu": 1, "cost_ram": 10},
            {"id": 1, "name": "b", "backward": False, "cost_cpu": 2, "cost_ram": 20},
            {"id": 2, "name": "c", "backward": True, "cost_cpu": 3, "cost_ram": 5},
        ],
        "links": [{"source": 0, "target": 1}, {"source": 1, "target": 2}, {"source": 0, "target": 2}],
    }
    trace = import_graph(_write(tmp_path, g))
    assert baseline_peak(trace) == (35, 2)
    assert trace.tensors["free_op"].tolist() == [2, 2, 2]
    acc = trace.accesses
    reads_c = acc[(acc["op_id"] == 2) & (acc["role"] == "read")]
    assert reads_c[["tensor_id", "arg_index"]].values.tolist() == [[1, 0], [0, 1]]
    assert trace.tensors["kind"].tolist() == ["activation", "activation", "temporary"]


def test_float_sizes_are_scaled(tmp_path):
    g = {
        "directed": True, "multigraph": False, "graph": {"order": [1, 0]},
        "nodes": [{"name": 0, "duration": 1, "out_cost": 0.5, "param_cost": 0},
                  {"name": 1, "duration": 1, "out_cost": 2, "param_cost": 3}],
        "edges": [{"0": 1, "1": 0}],
    }
    trace = import_graph(_write(tmp_path, g))
    assert trace.meta["nbytes_scale"] == 10
    assert trace.tensors["nbytes"].tolist() == [20, 5]
    assert baseline_peak(trace) == (25, 1)


def test_bad_order_is_rejected(tmp_path):
    g = {
        "directed": True, "multigraph": False, "graph": {"order": [0, 1]},
        "nodes": [{"name": 0, "duration": 1, "out_cost": 1}, {"name": 1, "duration": 1, "out_cost": 1}],
        "links": [{"0": 1, "1": 0}],
    }
    with pytest.raises(TraceError, match="before its input"):
        import_graph(_write(tmp_path, g))


def test_missing_file(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        import_graph(tmp_path / "nope.json")


def test_invalid_json(tmp_path):
    with pytest.raises(TraceError, match="not valid JSON"):
        import_graph(_write(tmp_path, "{not json"))


def test_unknown_dialect(tmp_path):
    g = {"directed": True, "nodes": [{"id": 0, "size": 3}], "links": []}
    with pytest.raises(TraceError, match="neither known dialect") as e:
        import_graph(_write(tmp_path, g))
    assert "cost_ram" in str(e.value) and "out_cost" in str(e.value)
    with pytest.raises(TraceError, match="not node-link JSON"):
        import_graph(_write(tmp_path, {"foo": 1}))
    with pytest.raises(TraceError, match="not an object"):
        import_graph(_write(tmp_path, [1, 2]))


def test_cli_import_graph(tmp_path, monkeypatch, graphs_dir):
    path = min(graphs_dir.glob("*.json"), key=lambda p: p.stat().st_size)
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    r = runner.invoke(main, ["import-graph", str(path)])
    assert r.exit_code == 0, r.output
    out = tmp_path / "traces" / path.stem
    trace = read_trace(out)
    peak, op = baseline_peak(trace)
    assert r.output.strip().splitlines()[-1].startswith(f"Wrote traces/{path.stem} ({trace.num_ops} ops, baseline peak ")
    assert r.output.strip().endswith(f"at op {op})")
    r = runner.invoke(main, ["import-graph", str(path)])
    assert r.exit_code == 8 and "--force" in _flat(r.output)
    r = runner.invoke(main, ["import-graph", str(path), "-o", str(tmp_path / "x"), "--force"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "x" / "meta.json").exists()


def _flat(text: str) -> str:
    """CLI errors are wrapped at 88 columns; compare with whitespace collapsed."""
    return " ".join(text.split())


def test_cli_import_graph_errors(tmp_path):
    runner = CliRunner()
    r = runner.invoke(main, ["import-graph", str(tmp_path / "missing.json")])
    assert r.exit_code == 2 and "does not exist" in _flat(r.output)
    r = runner.invoke(main, ["import-graph", str(_write(tmp_path, "[oops"))])
    assert r.exit_code == 3 and "not valid JSON" in _flat(r.output)
    r = runner.invoke(main, ["import-graph", str(_write(tmp_path, {"nodes": [{"x": 1}], "links": []}, "h.json"))])
    assert r.exit_code == 3 and "cost_cpu" in _flat(r.output)


def _tiny(cost_ram=10, links=None):
    return {"directed": True, "multigraph": False, "graph": {},
            "nodes": [{"id": 0, "name": "a", "backward": False, "cost_cpu": 1, "cost_ram": cost_ram},
                      {"id": 1, "name": "b", "backward": True, "cost_cpu": 1, "cost_ram": 10}],
            "links": links if links is not None else [{"source": 0, "target": 1}]}


def test_an_edge_to_a_node_not_listed_is_named(tmp_path):
    # networkx adds it as a node without attributes: a KeyError('cost_cpu') traceback before
    with pytest.raises(TraceError, match=r"an edge names node 7, which is not in \"nodes\""):
        import_graph(_write(tmp_path, _tiny(links=[{"source": 0, "target": 1}, {"source": 1, "target": 7}])))


def test_a_size_too_large_for_bytes_is_refused(tmp_path):
    # an OverflowError from pyarrow when the trace was written, before
    with pytest.raises(TraceError, match="cost_ram value 10+ .*too large"):
        import_graph(_write(tmp_path, _tiny(cost_ram=10**30)))
