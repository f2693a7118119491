"""Bitwise comparison of a planned training run against the unplanned one, with a diagnosis.

A planned run equal to the unplanned one bit for bit is the runtime's promise; it holds only
where the unplanned run itself repeats bit for bit. So on a difference the unplanned run is
run again: if it does not repeat its own bits, this machine's kernels are not run-to-run
deterministic here and the comparison cannot say anything (skipped, with the reason); if it
does, the plan changed the training and the test fails naming what differs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch


def _differs(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> list[str]:
    out = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if not torch.equal(x, y):
            d = (x.double() - y.double()).abs().max().item() if x.shape == y.shape else float("nan")
            out.append(f"tensor {i} {tuple(x.shape)}: max |diff| {d:.3g}")
    return out


def assert_bitwise(base: Sequence[torch.Tensor], planned: Sequence[torch.Tensor],
                   rerun: Callable[[], Sequence[torch.Tensor]] | None = None, context: str = "") -> None:
    """Assert ``planned`` equals ``base`` bitwise; ``rerun`` re-makes ``base`` (the unplanned
    run) to tell a nondeterministic machine from a plan that changed training."""
    diffs = _differs(base, planned)
    if not diffs:
        return
    if rerun is not None:
        again = _differs(base, rerun())
        if again:
            pytest.skip("the unplanned run does not repeat its own bits on this machine "
                        f"({len(again)} tensors differ between two unplanned runs, first: {again[0]}), "
                        "so a bitwise comparison with the planned run says nothing here")
    raise AssertionError(f"the planned run differs from the unplanned one in {len(diffs)} of {len(base)} "
                         f"tensors (first: {'; '.join(diffs[:3])}){'; ' + context if context else ''}")


def splits(plan) -> bool:
    """Does ``plan`` run a module (or a head and its loss) in several chunks? Their sums are
    rounded apart from the unsplit run's, so parameters after training are allclose, not
    bitwise; a module checkpointed whole (one chunk) and drops stay bitwise."""
    return any(q.chunks > 1 for q in plan.partitions)


def assert_trains_like(base, planned, plan, rerun=None, context: str = "", autocast: str | None = None) -> None:
    """What ``plan`` promises: bitwise equal parameters, or, where it splits a module into
    chunks, allclose at ``torch.testing.assert_close``'s float32 tolerances (rtol 1.3e-6,
    atol 1e-5) after the test's few steps; under ``autocast`` (the loop's dtype), where the
    chunks' weight gradients are summed in that dtype, the parameters within ``chunks``
    roundings of it in relative L2 distance (replay's own check, replay/measure/compare.py)."""
    if not splits(plan):
        assert_bitwise(base, planned, rerun, context)
        return
    if autocast is not None:
        from taichi_plan.replay.measure.compare import UNIT_ROUNDOFF, _rel_distance

        tol = max(q.chunks for q in plan.partitions) * UNIT_ROUNDOFF[autocast]
        dist = _rel_distance(list(base), list(planned))
        assert dist <= tol, f"parameters {dist:.3g} apart (relative L2), more than {tol:.3g}; {context}"
        return
    for a, b in zip(base, planned, strict=True):
        torch.testing.assert_close(b, a, msg=lambda m: f"{m}; {context}")
