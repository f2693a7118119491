"""What calibration's tuning constants are: :class:`CalibrationConfig`, one frozen dataclass
whose defaults are what a real recording calibrates under, and the configuration a calibration
runs under when its caller passes none (:func:`default_config`; record() passes none), which
:func:`using_default` replaces for a block (the test suite's session: its tests count what
calibration measures, they do not time it)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class CalibrationConfig:
    """How :func:`~taichi_plan.runtime.calibrate.measure_on_model` measures the runtime's
    cost on the model: each field with what it tunes and its unit."""

    # About the most a real recording spends measuring, in seconds: the rounds stop before one
    # that would pass it (fewer repetitions on a large model: there the runtime's cost is a
    # small part of the step, and an error in it matters less).
    budget_s: float = 15.0
    # Timed repetitions of each variant, at most (a count; the budget may stop them earlier).
    repeats: int = 7
    # Run each variant once untimed before the timed rounds (its one-time costs out of the
    # measurement); a flag. The test suite turns it off: its tests count what calibration measures.
    warm_up: bool = True
    # Chunks partitions are calibrated split into, besides checkpointed whole (a count; fewer
    # when the batch is smaller): the planner's chunk choices are 2, 4 and 8.
    probe_chunks: int = 4
    # The least share of the call's ops (a fraction, 0 to 1) the modules partitions are
    # calibrated on must hold: a few ops (a ResNet's classifier, its modules with batch norm
    # being unsplittable) time noise, not a rate.
    probe_min_share: float = 0.25
    # The most chunks a span partitioned over something else than the batch (a head and its
    # loss over tokens) is calibrated split into (a count): it is split into its fewest chunks
    # and into each of its choices up to this many: its most chunks (32), so the costs of the
    # counts between are interpolated, not extrapolated. Probed at 2 and 8, the difference of
    # two noisy whole-step extras (a 4-layer Llama's read -5.0 to 48.7 ms at 2 chunks in three
    # recordings) gave a per-chunk rate of 161-510 us per op, and where it came out near 0 the
    # planner took 32 chunks as if free: measured 191-204 ms slower than planned, a loss
    # against checkpointing every block (docs/benchmarks.md). At 2 and 32: 456-500 us in three
    # recordings.
    span_probe_most: int = 32
    # The fewest repetitions (a count) region_op_s and the whole module_call_s are taken from
    # (rates.region_outside, rates.module_hook_rates): differences of whole forwards, which a
    # model whose step fits twice in the budget measures as noise. The region variants are run
    # to at least this many, in rounds of their own beyond the budget (timing.top_up): within
    # the budget alone a 4-layer GPT-2 and Llama ran 4 on a slower afternoon of the same
    # machine type, and their plans, then charged no region_op_s, measured 3-6 ms over their
    # predictions (2026-12-05).
    region_min_repeats: int = 5
    # Shares of the trace's peak (fractions, tried in order) at which a plan of drops is solved
    # (heuristic), the first that fits, to measure what a drop costs beyond what the other
    # terms model (drop_s).
    drop_probe_fractions: tuple[float, ...] = (0.8, 0.9)


_default = CalibrationConfig()


def default_config() -> CalibrationConfig:
    """The configuration a calibration runs under when its caller passes none (read at call
    time): :class:`CalibrationConfig`'s defaults, unless :func:`using_default` says otherwise."""
    return _default


@contextlib.contextmanager
def using_default(config: CalibrationConfig) -> Iterator[CalibrationConfig]:
    """Within the block, calibrations passed no configuration (a real recording's) run under
    ``config``; the one before is restored after it."""
    global _default
    saved, _default = _default, config
    try:
        yield config
    finally:
        _default = saved
