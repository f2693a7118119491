"""How calibration runs and times its variants: one trial run each, which must run cleanly
(:func:`runs_cleanly`), interleaved rounds within a budget after an untimed warm-up
(:func:`interleaved`), and rounds beyond the budget for variants that need more repetitions
(:func:`top_up`)."""

from __future__ import annotations

import time

from .config import CalibrationConfig, default_config


def runs_cleanly(forward, variants: dict, runtimes: list, ran: set[str]) -> bool:
    """Whether each of ``variants`` (name -> variant) runs once, forward and backward, with no
    error and no mismatch (a trial run: its runtime is not kept among ``runtimes``). Each name
    run goes to ``ran``: that was the variant's first run, which :func:`interleaved` then need
    not repeat untimed."""
    n = len(runtimes)
    try:
        for name, v in variants.items():
            forward(v)
            ran.add(name)
    except Exception:  # noqa: BLE001  (calibration only: a module that cannot run in chunks is not timed)
        return False
    finally:
        ok = not any(rt.mismatches for rt in runtimes[n:])
        del runtimes[n:]
    return ok


def top_up(forward, variants: dict, times: dict[str, list[float]], least: int) -> None:
    """More rounds of ``variants`` alone (:func:`interleaved`, no budget, no warm-up: they ran
    already), appended to their ``times``, until each has ``least`` repetitions: the budget's
    rounds run every variant, and a model whose rounds fit fewer times than ``least`` would
    leave out what needs that many."""
    more = least - len(times[next(iter(variants))])
    if more > 0:
        for n, t in interleaved(forward, variants, more, float("inf"), time.perf_counter, set(variants)).items():
            times[n].extend(t)


def interleaved(forward, variants: dict, repeats: int, budget_s: float, clock,
                ran: set[str] | None = None, config: CalibrationConfig | None = None) -> dict[str, list[float]]:
    """Seconds of ``forward(variant)`` per variant, ``repeats`` times each (fewer when the
    rounds would take more than ``budget_s``), each round in another order, after one untimed
    run of each variant not already run once (``ran``: their names): a variant's
    first run pays one-time costs (the runtime's op table, the first checkpoint or chunked loss
    of the process) that a step in training does not. Without ``config.warm_up`` (the test suite:
    its tests count, they do not time) only the rounds run."""
    names = list(variants)
    if (config or default_config()).warm_up:
        for n in names:
            if n not in (ran or ()):
                forward(variants[n])
    times: dict[str, list[float]] = {n: [] for n in names}
    t0 = clock()
    for r in range(repeats):
        if r and (clock() - t0) * (r + 1) / r > budget_s:  # the next round would pass the budget
            break
        for i in range(len(names)):
            n = names[(r + i) % len(names)]
            times[n].append(forward(variants[n]))
    return times
