"""Running CP-SAT: a solve that Ctrl-C and a wall deadline can stop at once, and the callback
that reports progress (the best plan found, the bound) at each of CP-SAT's solutions."""

from __future__ import annotations

import time
from collections.abc import Callable

from ortools.sat.python import cp_model


def interruptible_solve(solver: cp_model.CpSolver, model: cp_model.CpModel, callback=None,
                        deadline: float | None = None) -> int:
    """``solver.Solve(model, callback)`` in a worker thread, so that Ctrl-C reaches Python at
    once: the search is stopped and ``KeyboardInterrupt`` raised. CP-SAT's own SIGINT handling
    (``catch_sigint_signal``, which the caller turns off) ended only the round, and the rounds
    went on to the time limit and wrote a plan. At ``deadline`` (perf_counter) the search is
    stopped too: CP-SAT's own time limit is not always honoured (a generated 1,000-node
    forward-only graph at ``--time-limit 20``: a round given 5.8 s ran 26 s)."""
    import threading

    out: dict = {}
    done = threading.Event()

    def run() -> None:
        try:
            out["code"] = solver.Solve(model, callback)
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
            out["error"] = e
        finally:
            done.set()

    worker = threading.Thread(target=run, name="cp-sat", daemon=True)
    worker.start()
    try:
        stopped = False
        while not done.wait(0.05):
            if deadline is not None and not stopped and time.perf_counter() > deadline:
                solver.stop_search()
                stopped = True
    except BaseException:  # Ctrl-C (or anything else raised here): stop the search, then go
        solver.stop_search()
        while not done.is_set():  # (not Thread.join: interrupted, it may return early)
            time.sleep(0.01)
        raise
    finally:
        while worker.is_alive():  # the solver's own threads are gone when its thread is
            time.sleep(0.001)
    if "error" in out:
        raise out["error"]
    return out["code"]


class Progress(cp_model.CpSolverSolutionCallback):
    """Reports (the cheapest plan the simulator accepted so far or None, the bound) at each of
    CP-SAT's solutions. A solution is a candidate of the relaxation, not yet a plan: its cost
    is not reported as one (a search that never found a plan showed "best" costs)."""

    def __init__(self, report, unit, best: Callable[[], float | None]):
        super().__init__()
        self.report, self.unit, self.best = report, unit, best

    def on_solution_callback(self):
        if self.report:
            best = self.best()
            bound = self.BestObjectiveBound() * self.unit
            self.report(best, bound if best is None else min(bound, best))
