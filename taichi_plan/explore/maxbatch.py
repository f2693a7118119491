"""The largest batch size whose training step fits a memory budget, per planner.

For a workload sized by everything but its batch, :func:`max_batch` records FAKE traces
(no memory, any size; cached per batch size) and searches, for each planner, the largest
batch at which the step fits ``budget_bytes`` with extra compute at most ``max_overhead_pct``
of the step (33% is about one extra forward):

* ``none``: the trace's own (baseline) peak fits the budget;
* the baselines ``sqrt-n``, ``full`` (checkpoint every block) and ``dtr``, and ours (``auto``,
  ``ilp`` or ``heuristic``): the planner's plan for the budget fits it, and the simulator's
  extra compute is within the overhead (on sharded traces, :func:`taichi_plan.solve.solve`'s
  plan, which also chooses the FSDP units' resharding).

With ``offload`` (an :class:`~taichi_plan.problem.offload.OffloadConfig`), ours is searched a second
time with offload allowed (the row ``<method>+offload``: :mod:`taichi_plan.solve.offload_plan`),
from ours' answer (a plan without offload is one of its plans), its extra compute counting the
copies' stalls and its plans held to the host budget.

A planner whose search ends on a batch above which its plan fits the budget but costs more
than the overhead is *excluded by the overhead cap* there; each result says so
(``PlannerResult.stop``, :func:`exclusion`), with the batch, the plan's extra compute and
the cap, and the table prints it under the rows.

Search: every planner fits wherever ``none`` does (a budget that does not bind needs no
plan), so ``none`` is searched first from batch 1 and the baselines start from its answer;
ours starts from the best baseline's answer when it fits there. Each search doubles the batch
until it does not fit, then bisects; it ends on a batch that fits next to one that does not
(``batch + 1`` was tried and failed), unless it reached ``limit``. Every new batch costs a fake
recording, so the plans that do not depend on the budget (``none``, ``sqrt-n``, ``full``:
their peak grows about linearly with the batch) are searched along the line through their
last two peaks (:func:`search`'s ``target``), which ends in about four probes; where those
peaks grew much slower than the batch (parameters and optimizer state set them), the line
may not send the search past ``GUESS_REACH`` times the largest batch that fits. A probe asks
the planner for its plan at the budget and the simulator for its peak and extra compute
(:func:`plan_once`), not :func:`taichi_plan.solve.solve`'s fallbacks and diagnosis when the
plan does not fit (minutes per probe on a large trace). No torch here; the recorder is
passed in (:func:`fake_recorder` builds one).
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from ..base.errors import InfeasibleBudgetError, UsageError
from ..base.units import format_bytes
from ..problem.core import Problem, build_problem
from ..problem.live import min_live_bytes
from ..problem.offload import OffloadConfig, allow_offload
from ..problem.partition.floor import floor_bytes
from ..problem.sharding.units import reshard_units
from ..solve import run_method, solve
from ..solve.messages import OURS
from ..solve.result import Decisions, host_fits, simulate_plan_of
from ..trace.format import Trace

DEFAULT_MAX_OVERHEAD_PCT = 33.0
DEFAULT_TIME_LIMIT = 30.0
MAX_BATCH = 1 << 16
# search: where two fitting probes' peaks grew less than FLAT_SHARE as fast as their batch, a
# line guess goes at most GUESS_REACH times past the largest batch that fits
GUESS_REACH = 8
FLAT_SHARE = 0.05
COMPARED = ("none", "sqrt-n", "full", "dtr")
BUDGET_FREE = ("none", "sqrt-n", "full")  # plans that do not depend on the budget: their peak grows with the batch
RATIO_TO = {"none": 10, "sqrt-n": 11}  # the table's ratio columns and widths (MegTaiChi's two headline ratios)
_LABEL = {"none": "none", "sqrt-n": "sqrt(n)", "full": "every block", "dtr": "DTR"}

_PCT_RE = re.compile(r"^([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)%$")


def parse_overhead(text: str) -> float:
    """``"33%"`` -> 33.0 (percent of the step's compute); in (0%, 1000%]."""
    raw = str(text).strip()
    m = _PCT_RE.match(raw)
    if not m:
        raise UsageError(f"--max-overhead {text!r} is not a percentage. Write it with a % sign, e.g. "
                         "33% (about one extra forward pass) or 100%.")
    pct = float(m.group(1))
    if not (math.isfinite(pct) and 0 < pct <= 1000):
        raise UsageError(f"--max-overhead {text!r} is outside (0%, 1000%]: it is the extra compute a plan "
                         "may add, as a percentage of the step's own compute (33% = about one extra forward).")
    return pct


@dataclass
class Probe:
    """One (planner, batch) tried: did it fit, and with what peak and extra compute."""

    batch: int
    fits: bool
    peak_bytes: int | None
    extra_pct: float | None
    reason: str  # fits | over budget | over overhead


@dataclass
class PlannerResult:
    planner: str
    max_batch: int
    peak_bytes: int | None  # at max_batch
    extra_pct: float | None
    capped: bool = False  # the search stopped at the limit, not at a batch that failed
    probes: list[Probe] = field(default_factory=list)
    stop: Probe | None = None  # the failed probe at max_batch + 1: why the search ended there


class TraceCache:
    """``record(batch) -> Trace``, called at most once per batch size; problems built once."""

    def __init__(self, record: Callable[[int], Trace]):
        self._record = record
        self._problems: dict[int, Problem] = {}

    def problem(self, batch: int) -> Problem:
        if batch not in self._problems:
            self._problems[batch] = build_problem(self._record(batch))
        return self._problems[batch]

    def __contains__(self, batch: int) -> bool:
        return batch in self._problems

    @property
    def recorded(self) -> list[int]:
        return sorted(self._problems)


def fake_recorder(model: str | None = None, entry: str | None = None, *, device_profile: str | None = None,
                  progress: Callable[[str], None] | None = None, fsdp: int | None = None,
                  replicas: int = 1, mixed_precision: dict | None = None, **sizes) -> Callable[[int], Trace]:
    """A ``record(batch)`` recording a fake step of the workload at that batch size
    (``sizes``: seq, layers, hidden, heads, vocab, image_size, dtype, optimizer); with
    ``fsdp`` = N, rank 0's step of an N-rank FSDP2 job at that batch per rank (``replicas``:
    HSDP's; ``mixed_precision``: FSDP2's policy, :func:`taichi_plan.torch_common.fsdp.mixed_precision`)."""
    from ..record import get_workload, record_workload

    if "batch" in sizes:
        raise UsageError("maxbatch searches the batch size: do not give --batch.")
    if fsdp is None and (replicas != 1 or mixed_precision):
        raise UsageError("--hsdp and --fsdp-param-dtype/--fsdp-reduce-dtype describe an FSDP2 job: add --fsdp N.")
    if fsdp is not None:
        from ..torch_common.fsdp import check_replicas

        check_replicas(fsdp, replicas)
    probe = get_workload(model=model, entry=entry, batch=1, **sizes)  # bad flags fail here, before any search
    if probe.kind == "entry" and "batch" not in probe.args:
        raise UsageError(f"--entry {entry!r} does not take a 'batch' argument, so maxbatch cannot vary the "
                         "batch size. Give make_step a batch=... parameter.")
    say = progress or (lambda msg: None)

    def record(batch: int) -> Trace:
        say(f"recording batch {batch}")
        w = get_workload(model=model, entry=entry, batch=batch, **sizes)
        if fsdp is not None:
            from ..record.fsdp import record_fsdp_workload

            return record_fsdp_workload(w, fsdp, device_profile=device_profile, steps=1, check_tracker=False,
                                        replicas=replicas, mixed_precision=mixed_precision)
        return record_workload(w, fake=True, device_profile=device_profile, steps=1)

    return record


OFFLOAD_SUFFIX = "+offload"  # ours searched again with offload allowed: "auto+offload"


def probe_planner(problem: Problem, batch: int, budget_bytes: int, planner: str, max_overhead_pct: float, *,
                  time_limit: float = DEFAULT_TIME_LIMIT, seed: int = 0, offload: OffloadConfig | None = None) -> Probe:
    """Does ``planner`` fit ``budget_bytes`` at this batch within the overhead? ``planner``
    ``<ours>+offload``: ours with ``offload`` allowed."""
    if planner.endswith(OFFLOAD_SUFFIX):
        if offload is None:
            raise UsageError(f"{planner!r} needs an offload setting (the host link, the host budget).")
        planner = planner[: -len(OFFLOAD_SUFFIX)]
        problem = allow_offload(problem, offload)
    base_peak = problem.baseline_peak[0]
    if base_peak <= budget_bytes:
        return Probe(batch, True, base_peak, 0.0, "fits")
    if planner == "none":
        return Probe(batch, False, base_peak, 0.0, "over budget")
    sharded = bool(reshard_units(problem.trace.meta))
    # The same test solve() starts with (it would raise); skipping it saves its error's search.
    # Not on a sharded trace: solve() plans it under the FSDP prefetching it chooses, whose
    # floor is not the recorded setting's (without FSDP's backward prefetch, a unit's next
    # all-gather is not held at the peak: the fake 7B at batch 36 fits 85.33 GB, under the
    # recorded setting's 87.35 GB floor).
    if not sharded and budget_bytes < int(min_live_bytes(problem).max()) and budget_bytes < int(floor_bytes(problem).max()):
        return Probe(batch, False, None, None, "over budget")
    if sharded:
        # sharded traces: solve() chooses the FSDP units' resharding too (solve/fsdp.py)
        try:
            # activation plans against the baselines: the recorded optimizer step (the options are another lever)
            plan = solve(problem.trace, budget_bytes, planner, time_limit=time_limit, seed=seed, problem=problem,
                         optimizer="as-recorded")
        except InfeasibleBudgetError:
            return Probe(batch, False, None, None, "over budget")
        peak, extra = int(plan.predicted["planned_peak_bytes"]), float(plan.predicted["extra_compute_pct"])
    else:
        peak, extra = plan_once(problem, budget_bytes, planner, time_limit=time_limit, seed=seed)
        if peak > budget_bytes:
            return Probe(batch, False, peak, extra, "over budget")
    ok = extra <= max_overhead_pct
    return Probe(batch, ok, peak, extra, "fits" if ok else "over overhead")


def plan_once(problem: Problem, budget_bytes: int, planner: str, *, time_limit: float = DEFAULT_TIME_LIMIT,
              seed: int = 0) -> tuple[int, float]:
    """(peak bytes, extra compute %) of ``planner``'s plan for the budget, as the simulator
    judges it, with the recorded optimizer step (activation plans against the baselines; the
    optimizer options are another lever). What :func:`taichi_plan.solve.solve` plans for a
    budget it can meet, without what it does when the plan does not fit: its fallback plans
    for lower budgets and its error's diagnosis (the least reachable budget, the floor's parts
    under each optimizer option) cost minutes a probe on a large trace, and a probe needs only
    whether this plan fits. A batch at which only such a fallback would fit counts as not
    fitting: the search's answer is a batch some plan is known to fit."""
    dec: Decisions = run_method(problem, budget_bytes, planner, time_limit=time_limit, seed=seed)
    sim, _ = simulate_plan_of(problem, dec)  # with offload allowed: the copies' stalls in its extra compute
    if not host_fits(problem, sim):  # over the host budget: as good as over the device's
        return max(int(sim.peak_bytes), budget_bytes + 1), float(sim.extra_pct)
    return int(sim.peak_bytes), float(sim.extra_pct)


def search(probe: Callable[[int], Probe], start: Probe | None = None, limit: int = MAX_BATCH,
           target: int | None = None, guess: int | None = None) -> PlannerResult:
    """Largest batch that fits: double from ``start`` (a probe known to fit) or from 1, then
    bisect. Returns the fitting probe with the probes made (``max_batch`` 0 if 1 fails).

    ``guess`` (where the answer is expected: :class:`LineGuide`): that batch and the one above
    it are probed first: if the first fits and the second does not, that is the answer (two
    probes); otherwise the search goes on from what they showed (the batch below a failing
    guess next, then as below).

    ``target`` (bytes; for planners whose plan does not depend on the budget, so that their
    peak grows with the batch about linearly): a step may instead go where the line through
    the two nearest probes' peaks crosses ``target`` (:func:`_crossing`), and the next to the
    batch after it, which ends the search in two probes where the peak is linear. A guess on
    the wrong side of the threshold is followed by a plain step, so the search never takes
    more than about twice bisection's probes; its answer is the same either way (a batch that
    fits next to one that does not). Two guesses in a row that each leave more than half the
    bracket are followed by a plain step too (the line's crossing creeps where the peak bends)."""
    probes: list[Probe] = []
    best = start
    fitted: list[Probe] = []  # this search's fitting probes (``start`` is not one: its peak may be no plan's)
    lo = start.batch if start else 0
    hi: Probe | None = None

    def run(b: int) -> Probe:
        nonlocal best, lo, hi
        p = probe(b)
        probes.append(p)
        if p.fits:
            best, lo = p, b
            fitted.append(p)
        elif hi is None or b < hi.batch:
            hi = p
        return p

    if guess is not None:
        g = min(max(guess, lo + 1), limit)
        if g > lo and run(g).fits:
            if g + 1 <= limit:
                run(g + 1)
        elif g - 1 > lo:  # the guess failed: most often by one batch
            run(g - 1)
    guess_ok = True  # the last guess landed on the side the line predicted, and guesses still halve the bracket
    slow = 0  # guesses in a row that left more than half the bracket (a line bent one way creeps up on it)
    while True:
        if (hi is not None and hi.batch - lo <= 1) or (hi is None and lo >= limit):
            break
        b, predicted = (max(1, 2 * lo), None) if hi is None else ((lo + hi.batch) // 2, None)
        if target is not None and guess_ok:
            if hi is None:
                g = _crossing(*fitted[-2:], target) if len(fitted) >= 2 else None
            else:
                g = _crossing(best, hi, target) if fitted else None
            if g is not None:
                g_fit = int(math.floor(g))
                # Before any batch fails, a line may cross far off: at small batches the peak can
                # be where nothing grows with the batch (an 8 MB GPT-2's batches 1 and 2 peak 512 B
                # apart, a line that crossed at 10467 where 17 was the answer), and each probe
                # records a step of that size. Where the peak grew much slower than the batch
                # (_flat), no step goes past GUESS_REACH times what fits.
                top = limit if hi is None else hi.batch - 1
                if hi is None and _flat(*fitted[-2:]):
                    top = min(top, GUESS_REACH * max(lo, 1))
                if lo < g_fit <= top:
                    b, predicted = g_fit, True
                elif g_fit > top and hi is None and top < limit:  # capped (_flat): as far as it may go
                    b, predicted = top, True
                elif g_fit <= lo:
                    b, predicted = lo + 1, False
        if b > limit:
            if lo >= limit:
                break
            b = limit if hi is None else b  # the doubling jumped past the limit: try the limit
        lo0, hi0 = lo, hi
        p = run(b)
        if predicted is not None and hi0 is not None:
            left = (hi0.batch - b) if p.fits else (b - lo0)
            slow = slow + 1 if 2 * left > hi0.batch - lo0 else 0
        guess_ok = (predicted is None or predicted == p.fits) and slow < 2
        if slow >= 2:
            slow = 0
    capped = lo >= limit and hi is None
    stop = next((p for p in probes if p.batch == lo + 1 and not p.fits), None)
    if best is None:
        return PlannerResult("", 0, None, None, False, probes, stop)
    return PlannerResult("", best.batch, best.peak_bytes, best.extra_pct, capped, probes, stop)


def _flat(a: Probe, b: Probe) -> bool:
    """Did the peak grow less than FLAT_SHARE as fast as the batch from ``a`` to ``b``
    (relatively)? Then the two peaks are mostly what does not grow with the batch, and a line
    through them says little about where the budget is crossed."""
    if a.peak_bytes is None or b.peak_bytes is None or a.peak_bytes <= 0 or b.batch <= a.batch:
        return False
    return (b.peak_bytes / a.peak_bytes - 1) < FLAT_SHARE * (b.batch / a.batch - 1)


def _crossing(a: Probe, b: Probe, target: int) -> float | None:
    """The batch where the line through two probes' peaks reaches ``target`` (None without
    peaks that grow)."""
    if a.peak_bytes is None or b.peak_bytes is None or b.batch == a.batch:
        return None
    slope = (b.peak_bytes - a.peak_bytes) / (b.batch - a.batch)
    if slope <= 0:
        return None
    return a.batch + (target - a.peak_bytes) / slope


def exclusion(row: dict, max_overhead_pct: float) -> str | None:
    """A sentence when the overhead cap, not the budget, ended ``row``'s search (a row of
    :func:`max_batch`): at the next batch its plan fits the budget but costs more."""
    stop = row.get("stop")
    if not stop or stop["reason"] != "over overhead":
        return None
    name = _LABEL.get(row["planner"], row["planner"])
    kind = "cheapest plan" if row["planner"] in OURS else "plan"
    head = (f"{name}: excluded at batch {stop['batch']} and above by the overhead cap"
            if row["max_batch"] == 0 else f"{name}: stops at batch {row['max_batch']}, excluded above by the "
            "overhead cap")
    return (f"{head}: its {kind} at batch {stop['batch']} fits ({format_bytes(stop['peak_bytes'])}) but costs "
            f"+{stop['extra_pct']:.1f}% > {max_overhead_pct:g}%.")


class LineGuide:
    """Problems at any batch size drawn through the recordings at :data:`GUIDE_BATCHES`
    (:func:`taichi_plan.explore.batch_line.line_trace`): where each planner's search is run first, to
    guess its answer (:func:`search` on them: a guess, never an answer). ``why_not``: why
    no line could be drawn (the two recordings differ in more than sizes), else None."""

    def __init__(self, cache: TraceCache, batches: tuple[int, int] | None = None):
        from .batch_line import same_structure

        self.cache = cache
        self.batches = batches or GUIDE_BATCHES
        self.lo, self.hi = (cache.problem(b).trace for b in self.batches)
        self.why_not = same_structure(self.lo, self.hi)
        self._problems: dict[int, Problem] = {}

    def problem(self, batch: int) -> Problem:
        from .batch_line import line_trace

        if batch in self.batches or batch in self.cache:  # recorded: the step itself
            return self.cache.problem(batch)
        if batch not in self._problems:
            (a, b) = self.batches
            self._problems[batch] = build_problem(line_trace(self.lo, a, self.hi, b, batch))
        return self._problems[batch]

    @property
    def drawn(self) -> list[int]:
        """The batch sizes whose steps were drawn, not recorded."""
        return sorted(self._problems)


GUIDE_BATCHES = (2, 3)  # recorded first when the search is guided: the line the guesses are drawn on


def max_batch(record: Callable[[int], Trace], budget_bytes: int, *, method: str = "auto",
              max_overhead_pct: float = DEFAULT_MAX_OVERHEAD_PCT, time_limit: float = DEFAULT_TIME_LIMIT,
              seed: int = 0, limit: int = MAX_BATCH, progress: Callable[[str], None] | None = None,
              compared: tuple[str, ...] = COMPARED, guide: bool = False, offload: OffloadConfig | None = None) -> dict:
    """Max batch for ``method`` (ours) and each of ``compared`` (``none`` and any of
    :data:`COMPARED`); see the module docstring.

    ``guide``: record the step at :data:`GUIDE_BATCHES` first and search each planner on steps
    drawn through them (:class:`LineGuide`: planning only, no recording); each planner's real
    search then starts with that guess and the batch above it, and goes on from there where
    the recordings disagree. An answer holds as an unguided one does (it fits on its
    recording, the batch above does not); where fitting is not monotone in the batch, the two
    searches may stop at different such batches. The guide saves recordings (one at a large
    size is minutes). ``result["guide"]`` says what it did.

    Returns ``{"budget_bytes", "max_overhead_pct", "method", "planners": [...],
    "ratios": {"ours/none", ...}, "batches_recorded", "guide"}``;
    With ``offload``, a row ``<method>+offload`` (ours with offload allowed, searched from ours'
    answer) follows ours', and ``ratios`` gains ``ours+offload/<c>``.
    each planner row has ``planner``, ``ours``, ``max_batch``, ``peak_bytes``, ``extra_pct``,
    ``capped``, ``probes``, ``stop`` (the failed probe one batch above, or None), ``guess``
    (None unguided) and ``excluded`` (:func:`exclusion`'s sentence, or None). A ratio is None
    when the denominator is 0.
    """
    if method not in OURS:
        raise UsageError(f"--method {method!r}: maxbatch compares one of our planners ({', '.join(OURS)}) "
                         f"against the baselines ({', '.join(COMPARED)}).")
    if not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise UsageError(f"The budget must be a positive number of bytes, got {budget_bytes!r}.")
    if not (0 < max_overhead_pct <= 1000):
        raise UsageError(f"max_overhead_pct must be in (0, 1000], got {max_overhead_pct!r}.")
    if not (isinstance(limit, int) and limit >= 1):
        raise UsageError(f"limit must be a positive integer, got {limit!r}.")
    unknown = [c for c in compared if c not in COMPARED]
    if unknown or "none" not in compared:
        raise UsageError(f"compared must hold 'none' and any of {', '.join(COMPARED)}, got {list(compared)!r}.")
    compared = tuple(c for c in COMPARED if c in compared)
    cache = TraceCache(record)
    say = progress or (lambda msg: None)

    def prober(planner: str, problem_at: Callable[[int], Problem], what: str = "") -> Callable[[int], Probe]:
        def probe(batch: int) -> Probe:
            problem = problem_at(batch)
            say(f"{planner}: batch {batch}{what}")
            return probe_planner(problem, batch, budget_bytes, planner, max_overhead_pct,
                                 time_limit=time_limit, seed=seed, offload=offload)
        return probe

    line = LineGuide(cache) if guide and limit >= max(GUIDE_BATCHES) else None
    drawn = line if line is not None and line.why_not is None else None
    results: dict[str, PlannerResult] = {}
    guesses: dict[str, int] = {}
    guess_start = None

    def guessed(planner: str) -> int | None:
        """The answer the search on drawn steps gives (no recording), when the search is guided."""
        nonlocal guess_start
        if drawn is None:
            return None
        g = search(prober(planner, drawn.problem, " (drawn)"), guess_start, limit,
                   target=budget_bytes if planner in BUDGET_FREE else None)
        guesses[planner] = g.max_batch
        if planner == "none":
            guess_start = _start_probe(g)
        return g.max_batch

    def searched(planner: str, start: Probe | None) -> PlannerResult:
        r = search(prober(planner, cache.problem), start, limit,
                   target=budget_bytes if planner in BUDGET_FREE else None, guess=guessed(planner))
        r.planner = planner
        results[planner] = r
        return r

    start = _start_probe(searched("none", None))  # none first: the others start from its answer
    for planner in compared[1:]:
        searched(planner, start)
    # Ours from the best baseline's answer when it fits there (a batch already recorded), so
    # its search does not walk up through what the baselines already showed fits.
    ours_start = start
    top = max(compared, key=lambda c: results[c].max_batch)
    if results[top].max_batch > (start.batch if start else 0):
        p = prober(method, cache.problem)(results[top].max_batch)
        if p.fits:
            ours_start = p
    r = searched(method, ours_start)
    if ours_start is not start:
        r.probes.insert(0, ours_start)
    ours = results[method].max_batch
    with_offload = ()
    if offload is not None:
        # from ours' answer: a plan without offload is one of the plans offload allows
        with_offload = (method + OFFLOAD_SUFFIX,)
        r = search(prober(with_offload[0], cache.problem), _start_probe(results[method]), limit)
        r.planner = with_offload[0]
        results[with_offload[0]] = r
    rows = []
    for planner in (method, *with_offload, *compared):
        row = asdict(results[planner])
        row["ours"] = planner in OURS or planner in with_offload
        row["guess"] = guesses.get(planner)
        row["excluded"] = exclusion(row, max_overhead_pct)
        rows.append(row)
    return {
        "budget_bytes": budget_bytes,
        "max_overhead_pct": max_overhead_pct,
        "method": method,
        "planners": rows,
        "ratios": {f"ours/{c}": (ours / results[c].max_batch if results[c].max_batch else None) for c in compared}
        | {f"ours+offload/{c}": (results[w].max_batch / results[c].max_batch if results[c].max_batch else None)
           for w in with_offload for c in compared},
        "offload": offload.to_dict() if offload is not None else None,
        "batches_recorded": cache.recorded,
        "limit": limit,
        "guide": None if line is None else {"batches": list(line.batches), "why_not": line.why_not,
                                            "drawn": line.drawn},
    }


def _start_probe(none: PlannerResult) -> Probe | None:
    if none.max_batch == 0:
        return None
    return Probe(none.max_batch, True, none.peak_bytes, none.extra_pct or 0.0, "fits")


def render_max_batch(result: dict, title: str = "", units: str = "auto", width: int = 80) -> str:
    """The result as a table; the title and notes are wrapped to ``width`` columns, never cut."""
    def size(b):
        return format_bytes(b, units) if b is not None else "-"

    def wrap(text: str) -> list[str]:
        return textwrap.wrap(text, width, subsequent_indent="  ", break_on_hyphens=False,
                             break_long_words=False)

    lines = wrap(title) if title else []
    lines += wrap(f"Budget {size(result['budget_bytes'])}, extra compute at most {result['max_overhead_pct']:g}% "
                  "of the step")
    lines.append("")
    by = {r["planner"]: r for r in result["planners"]}
    ratio_to = [c for c in RATIO_TO if c in by]  # the planners compared (max_batch's ``compared``)
    head = "".join(f"{'vs ' + c:>{RATIO_TO[c]}}" for c in ratio_to)
    names = [r["planner"] + (" (ours)" if r["ours"] else "") for r in result["planners"]]
    nw = max(16, *(len(n) + 1 for n in names))
    lines.append(f"{'planner':<{nw}}{'max batch':>10}{'peak at it':>14}{'extra %':>10}" + head)
    lines.append("-" * (nw + 34 + len(head)))
    for r, name in zip(result["planners"], names, strict=True):
        mb = f"{r['max_batch']}" + ("+" if r["capped"] else "")
        extra = f"{r['extra_pct']:.2f}" if r["extra_pct"] is not None else "-"
        ratios = ""
        for c in ratio_to:
            den = by[c]["max_batch"]
            cell = "-" if r["planner"] == c else (f"{r['max_batch'] / den:.2f}x" if den else "n/a")
            ratios += f"{cell:>{RATIO_TO[c]}}"
        lines.append(f"{name:<{nw}}{mb:>10}{size(r['peak_bytes']):>14}{extra:>10}" + ratios)
    lines.append("")
    notes = []
    if by["none"]["max_batch"] == 0:
        notes.append("Without planning the step does not fit even at batch 1 (max batch 0).")
    if all(r["max_batch"] == 0 for r in result["planners"]):
        notes.append("No planner fits the step at batch 1: the model alone is too big for this budget.")
    if any(r["capped"] for r in result["planners"]):
        notes.append(f"+ the search stopped at its limit (batch {result['limit']}): the step's memory may not "
                     "grow with the batch.")
    notes += [r["excluded"] for r in result["planners"] if r.get("excluded")]
    off = result.get("offload")
    if off:
        cap = f", at most {size(off['host_budget_bytes'])} on the host" if off.get("host_budget_bytes") else ""
        notes.append(f"+offload: ours with saved activations also copied to host and back on a "
                     f"{off['host_link_bytes_per_s'] / 1e9:g} GB/s host link{cap}; its extra compute counts the "
                     "copies' stalls (docs/planner.md#offload).")
    notes.append("MegTaiChi (ICS 2022) reports 5x over no planning and 2.4x over sqrt(n).")
    notes.append(f"Recorded {len(result['batches_recorded'])} fake step(s), batch sizes "
                 + ", ".join(map(str, result["batches_recorded"])) + ".")
    notes += guide_notes(result)
    for note in notes:
        lines += wrap(note)
    return "\n".join(lines) + "\n"


def guide_notes(result: dict) -> list[str]:
    """What the guide (``max_batch(guide=True)``) did, for the notes under the table."""
    g = result.get("guide")
    if not g:
        return []
    a, b = g["batches"]
    if g["why_not"]:
        return [f"No guide: the steps recorded at batch {a} and {b} differ in {g['why_not']}, not only in sizes; "
                "every probe was a recording."]
    guesses = ", ".join(f"{_LABEL.get(r['planner'], r['planner'])} {r['guess']}" for r in result["planners"])
    return [f"Guided: each search ran first on steps drawn through the recordings at batch {a} and {b} "
            f"(guesses: {guesses}); every answer is the recordings' (it fits, the batch above does not)."]


__all__ = ["COMPARED", "DEFAULT_MAX_OVERHEAD_PCT", "MAX_BATCH", "PlannerResult", "Probe", "TraceCache",
           "GUIDE_BATCHES", "LineGuide", "exclusion", "fake_recorder", "guide_notes",
           "max_batch", "parse_overhead", "probe_planner", "render_max_batch", "search"]
