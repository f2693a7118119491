"""Shared by the partition tests: record a workload; the drops of the outputs of modules
checkpointed whole; replay a plan of given partitions and check that its measured peak is
the predicted one, to the byte, with gradients allclose."""

from __future__ import annotations

from taichi_plan.plan.format import load_plan, save_plan
from taichi_plan.replay.measure import replay
from taichi_plan.solve.result import Decisions, make_plan


def recorded(directory, **sizes):
    """A workload recorded for real, its trace written to ``directory``: (directory, problem)."""
    from taichi_plan.problem.core import build_problem
    from taichi_plan.record import get_workload, record_workload
    from taichi_plan.trace.format import write_trace

    trace = record_workload(get_workload(**sizes), fake=False)
    write_trace(trace, directory)
    return directory, build_problem(trace)


def innermost_with_outputs(p):
    """The innermost modules (along the batch) that may be checkpointed whole and have outputs
    a plan may then drop (``partition.whole_outputs``), as the trace finds them."""
    from taichi_plan.problem.partition.find import module_spans
    from taichi_plan.problem.partition.span import is_under
    from taichi_plan.problem.partition.tensors import whole_outputs

    spans = module_spans(p)
    return [s for s in spans if s.over == "batch" and 1 in s.chunk_choices and whole_outputs(p, s)
            and not any(o is not s and is_under(o.module, s.module) for o in spans)]


def whole_output_drops(p, spans, every=True):
    """The drops of the spans' outputs, at their gaps in the problem with the spans whole
    (every one of them, or those that stay candidates there: with several modules whole, an
    output that is another whole module's input is held by that checkpoint, and one whose
    rebuild in the unplanned step re-makes a tensor a whole module keeps to itself, such as
    a dropout's mask, is not offered)."""
    from taichi_plan.problem.partition.apply import apply_partitions
    from taichi_plan.problem.partition.span import as_partition
    from taichi_plan.problem.partition.tensors import whole_outputs
    from taichi_plan.simulate.core import Drop

    parted, _ = apply_partitions(p, [as_partition(s, 1) for s in spans])
    gap = {int(t): (int(a), int(b)) for t, a, b in zip(parted.candidates, parted.cand_free_after,
                                                      parted.cand_remat_before, strict=True)}
    outs = sorted(set().union(*(whole_outputs(p, s) for s in spans)))
    assert outs and (all(t in gap for t in outs) if every else any(t in gap for t in outs))
    return [Drop(t, *gap[t]) for t in outs if t in gap]


def replay_partitions(problem, parts, tmp_path):
    """(the plan as written, the replay report) of ``parts`` on ``problem`` (its trace written)."""
    plan = make_plan(problem, None, "manual", Decisions(partitions=parts), 0.0, 0)
    path = tmp_path / "part.plan.json"
    save_plan(plan, path, force=True)
    return load_plan(path), replay(path, steps=1)


def assert_measured_as_predicted(r: dict) -> None:
    assert r["measured_peak_bytes"] == r["predicted_peak_bytes"], r
    assert r["grads_match"] and r["grads_check"].startswith("allclose"), r
