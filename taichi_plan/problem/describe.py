"""How messages name an op of a :class:`~taichi_plan.problem.core.Problem` (no torch).

:func:`describe_op` names an op with its module; a backward op is filed under the module of
the forward op it is the backward of (:func:`forward_module`), read from what it reads rather
than from ``ModTracker``'s label, which can stay on a module through the rest of backward.
"""

from __future__ import annotations

from .core import Problem, op_stem


def _common_module(modules: list[str]) -> str:
    """The deepest FQN every module is, or is inside (``''`` if none)."""
    split = [m.split(".") if m else [] for m in modules]
    out: list[str] = []
    for parts in zip(*split):
        if any(p != parts[0] for p in parts):
            break
        out.append(parts[0])
    return ".".join(out)


def forward_module(problem: Problem, op: int) -> str | None:
    """For a backward op, the module of the forward op it is the backward of; None for other
    ops, or when it reads nothing made in forward.

    The trace's own ``module`` of a backward op is the innermost module PyTorch's
    ``ModTracker`` had open when it ran, and ModTracker leaves a module open through the
    rest of backward when that module's inputs need no gradient (Swin's
    ``relative_position_bias``): every later backward op is then filed under it. What a
    backward op reads (saved activations, weights) says better where it belongs: the forward
    op that used it with the same name (``gelu`` for ``gelu_backward``), else the deepest
    module common to every forward op that used it. A backward op that reads nothing forward
    used takes the answer of its nearest such neighbour.
    """
    phase = problem._phase_array
    if phase[op] != "backward":
        return None
    # An op that reads only gradients (a view, a transpose) belongs with its neighbours:
    # the nearest backward op before it, else after it, that reads something forward used.
    for k in [*range(op, -1, -1), *range(op + 1, problem.num_ops)]:
        if phase[k] != "backward":
            continue
        owner = _forward_module_of(problem, k)
        if owner is not None:
            return owner
    return None


def _forward_module_of(problem: Problem, op: int) -> str | None:
    phase = problem._phase_array
    users = sorted({int(u) for t in problem.op_reads[op].tolist() for u in problem.uses[t].tolist()
                    if phase[u] == "forward"})
    if not users:
        return None
    stem = op_stem(problem.op_name[op])
    named = [u for u in users if op_stem(problem.op_name[u]) == stem]
    if named:
        return problem.op_module[named[-1]]
    return _common_module([problem.op_module[u] for u in users])


def describe_op(problem: Problem, op: int) -> str:
    """``op 12 (aten.mm.default in layers.0.mlp)``; a backward op is described by the module
    of its forward op (:func:`forward_module`): ``(aten.gelu_backward.default, backward of
    layers.0.mlp.act)``."""
    name = problem.op_name[op]
    owner = forward_module(problem, op)
    if owner is not None:
        return f"op {op} ({name}, backward of {owner or 'the top-level model'})"
    module = problem.op_module[op]
    return f"op {op} ({name}" + (f" in {module}" if module else "") + ")"
