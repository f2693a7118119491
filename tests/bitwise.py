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
