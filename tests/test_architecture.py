"""The house rules of docs/architecture.md, checked on the package's own imports (every
``import``, function-local ones included): each module imports only its own floor or the
floors below it, nothing imports in a circle, no module imports another's private name, and
no module of ``taichi_plan`` is longer than the most a reader holds in the head."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

REPO = Path(__file__).resolve().parent.parent
MOST_LINES = 600

# Low to high: a module may import its own floor and those below, never one above. A floor is a
# folder (or module) of taichi_plan; the longest prefix names a module's floor. Kept in the
# order docs/architecture.md draws them.
FLOORS = [
    "base",
    "trace",
    "plan",
    "problem.core",
    "problem.live",
    "problem.options",
    "problem.describe",
    "problem.offload",
    "problem.sharding",
    "problem.partition",
    "problem.optimizer",
    "problem.fit",
    "simulate",
    "solve",
    "report",
    "torch_common",
    "runtime",
    "record",
    "compiled",
    "replay",
    "integrations",
    "explore",
    "commands",
    "cli",
    "errors",
    "__main__",
    "",  # the package itself: taichi_plan/__init__.py (the public API)
]


def _module_name(path: Path, repo: Path = REPO) -> str:
    parts = list(path.relative_to(repo).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources(repo: Path = REPO) -> dict[str, Path]:
    files = sorted((repo / "taichi_plan").rglob("*.py")) + sorted((repo / "benchmarks").glob("*.py"))
    return {_module_name(p, repo): p for p in files}


def _graph(repo: Path = REPO) -> tuple[nx.DiGraph, list[str]]:
    """The import graph of ``taichi_plan`` and ``benchmarks`` (an edge per importing module and
    module imported, ``from pkg import module`` naming the module), and each private name one
    module takes from another."""
    mods = _sources(repo)
    graph, private = nx.DiGraph(), []
    for me, path in mods.items():
        graph.add_node(me)
        package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text())
        modules_as = {}  # local name -> the package module it is (``from . import rebuilds as runtime``)
        for node in ast.walk(tree):
            found = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    found.append((sub, None) if sub in mods else (target, a.name))
                    if sub in mods:
                        modules_as[a.asname or a.name] = sub
            elif isinstance(node, ast.Import):
                found = [(a.name, None) for a in node.names]
                modules_as.update({a.asname: a.name for a in node.names if a.asname and a.name in mods})
            for target, name in found:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if not target or target == me:
                    continue
                graph.add_edge(me, target)
                if name and name.startswith("_") and not name.startswith("__"):
                    private.append(f"{me} imports {name} from {target}")
        for node in ast.walk(tree):  # a private name reached through an imported module: mod._name
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules_as
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                private.append(f"{me} uses {node.attr} of {modules_as[node.value.id]}")
    return graph, private


def floor_of(module: str) -> int:
    """The floor of a ``taichi_plan`` module: the longest entry of :data:`FLOORS` it is in."""
    rest = module.removeprefix("taichi_plan").removeprefix(".")
    best = None
    for i, f in enumerate(FLOORS):
        if rest == f or rest.startswith(f + ".") or (f == "" and rest == ""):
            if best is None or len(f) > len(FLOORS[best]):
                best = i
    if best is None:  # a folder's package file, where its sub-floors start: the lowest of them
        best = next((i for i, f in enumerate(FLOORS) if f.startswith(rest + ".")), None)
    assert best is not None, f"{module} is on no floor: add its folder to FLOORS and docs/architecture.md"
    return best


@pytest.fixture(scope="module")
def graph():
    return _graph()


def test_every_module_is_on_a_floor(graph):
    for m in graph[0]:
        if m.startswith("taichi_plan"):
            floor_of(m)


def back_arrows(g: nx.DiGraph) -> list[str]:
    return [f"{a} (floor {FLOORS[floor_of(a)] or 'taichi_plan'}) imports {b} (floor {FLOORS[floor_of(b)]})"
          for a, b in g.edges if a.startswith("taichi_plan") and b.startswith("taichi_plan")
          and floor_of(b) > floor_of(a)]


def circles(g: nx.DiGraph) -> list[list[str]]:
    return [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]


def test_no_arrow_runs_back_up_a_floor(graph):
    up = back_arrows(graph[0])
    assert not up, "\n".join(up)


def test_no_import_circle(graph):
    found = circles(graph[0])
    assert not found, found


def test_no_private_name_is_imported_from_another_module(graph):
    _, private = graph
    assert not private, "\n".join(private)


def test_the_planning_floors_never_import_torch():
    """Everything below ``torch_common`` (trace, plan, problem, simulate, solve, report) plans
    without torch: ``taichi-plan solve`` and ``inspect`` run where torch is not installed."""
    low = FLOORS.index("torch_common")
    found = []
    for m, path in _sources().items():
        if not m.startswith("taichi_plan") or floor_of(m) >= low:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{m} imports {n}" for n in names if n == "torch" or n.startswith("torch.")]
    assert not found, found


def test_benchmarks_sit_above_the_package(graph):
    g, _ = graph
    wrong = [f"{a} imports {b}" for a, b in g.edges if a.startswith("taichi_plan") and b.startswith("benchmarks")]
    assert not wrong, wrong


def test_no_module_is_longer_than_a_reader_holds(graph):
    long = {m: n for m, p in _sources().items() if m.startswith("taichi_plan")
            and (n := len(p.read_text().splitlines())) > MOST_LINES}
    assert not long, f"modules over {MOST_LINES} lines (split them by responsibility): {long}"


def test_the_rules_can_fail(tmp_path):
    """On a made-up package with one of each fault, the checks find each: a plan module that
    imports the solver (up a floor) which imports it back (a circle, lazily), and a report that
    takes a private name."""
    pkg = tmp_path / "taichi_plan"
    for d in ("plan", "solve", "report"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "plan" / "format.py").write_text("from ..solve.ilp import plan_ilp\n")
    (pkg / "solve" / "ilp.py").write_text("def plan_ilp():\n    from ..plan import format\n")
    (pkg / "report" / "html.py").write_text("from taichi_plan.solve.ilp import _model\n")
    (pkg / "report" / "text.py").write_text("from ..solve import ilp as solver\n\nsolver._model = None\n")
    g, private = _graph(tmp_path)
    assert back_arrows(g) == ["taichi_plan.plan.format (floor plan) imports taichi_plan.solve.ilp (floor solve)"]
    assert circles(g) == [["taichi_plan.plan.format", "taichi_plan.solve.ilp"]]
    assert private == ["taichi_plan.report.html imports _model from taichi_plan.solve.ilp",
                       "taichi_plan.report.text uses _model of taichi_plan.solve.ilp"]
