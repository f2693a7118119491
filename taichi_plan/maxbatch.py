"""The largest batch size whose training step fits a memory budget, per planner.

For a workload sized by everything but its batch, :func:`max_batch` records FAKE traces
(no memory, any size; cached per batch size) and searches, for each planner, the largest
batch at which the step fits ``budget_bytes`` with extra compute at most ``max_overhead_pct``
of the step (33% is about one extra forward):

* ``none``: the trace's own (baseline) peak fits the budget;
* the baselines ``sqrt-n``, ``full`` (checkpoint every block) and ``dtr``, and ours (``auto``,
  ``ilp`` or ``heuristic``): :func:`taichi_plan.solve.solve` finds a plan that fits, and the
  simulator's extra compute is within the overhead.

A planner whose search ends on a batch above which its plan fits the budget but costs more
than the overhead is *excluded by the overhead cap* there; each result says so
(``PlannerResult.stop``, :func:`exclusion`), with the batch, the plan's extra compute and
the cap, and the table prints it under the rows.

Search: every planner fits wherever ``none`` does (a budget that does not bind needs no
plan), so ``none`` is searched first from batch 1 and the others start from its answer.
Each search doubles the batch until it does not fit, then bisects; it ends on a batch that
fits next to one that does not (``batch + 1`` was tried and failed), unless it reached
``limit``. No torch here; the recorder is passed in (:func:`fake_recorder` builds one).
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from .errors import InfeasibleBudgetError, UsageError
from .partition import floor_bytes
from .problem import Problem, build_problem, min_live_bytes
from .solve import OURS, solve
from .trace import Trace
from .units import format_bytes

DEFAULT_MAX_OVERHEAD_PCT = 33.0
DEFAULT_TIME_LIMIT = 30.0
MAX_BATCH = 1 << 16
COMPARED = ("none", "sqrt-n", "full", "dtr")
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
                  **sizes) -> Callable[[int], Trace]:
    """A ``record(batch)`` recording a fake step of the workload at that batch size
    (``sizes``: seq, layers, hidden, heads, vocab, image_size, dtype, optimizer); with
    ``fsdp`` = N, rank 0's step of an N-rank FSDP2 job at that batch per rank."""
    from .record import get_workload, record_workload

    if "batch" in sizes:
        raise UsageError("maxbatch searches the batch size: do not give --batch.")
    probe = get_workload(model=model, entry=entry, batch=1, **sizes)  # bad flags fail here, before any search
    if probe.kind == "entry" and "batch" not in probe.args:
        raise UsageError(f"--entry {entry!r} does not take a 'batch' argument, so maxbatch cannot vary the "
                         "batch size. Give make_step a batch=... parameter.")
    say = progress or (lambda msg: None)

    def record(batch: int) -> Trace:
        say(f"recording batch {batch}")
        w = get_workload(model=model, entry=entry, batch=batch, **sizes)
        if fsdp is not None:
            from .record.fsdp import record_fsdp_workload

            return record_fsdp_workload(w, fsdp, device_profile=device_profile, steps=1, check_tracker=False)
        return record_workload(w, fake=True, device_profile=device_profile, steps=1)

    return record


def probe_planner(problem: Problem, batch: int, budget_bytes: int, planner: str, max_overhead_pct: float, *,
                  time_limit: float = DEFAULT_TIME_LIMIT, seed: int = 0) -> Probe:
    """Does ``planner`` fit ``budget_bytes`` at this batch within the overhead?"""
    base_peak = problem.baseline_peak[0]
    if base_peak <= budget_bytes:
        return Probe(batch, True, base_peak, 0.0, "fits")
    if planner == "none":
        return Probe(batch, False, base_peak, 0.0, "over budget")
    # The same test solve() starts with (it would raise); skipping it saves its error's search.
    if budget_bytes < int(min_live_bytes(problem).max()) and budget_bytes < int(floor_bytes(problem).max()):
        return Probe(batch, False, None, None, "over budget")
    try:
        # activation plans against the baselines: the recorded optimizer step (the options are another lever)
        plan = solve(problem.trace, budget_bytes, planner, time_limit=time_limit, seed=seed, problem=problem,
                     optimizer="as-recorded")
    except InfeasibleBudgetError:
        return Probe(batch, False, None, None, "over budget")
    p = plan.predicted
    extra = float(p["extra_compute_pct"])
    ok = extra <= max_overhead_pct
    return Probe(batch, ok, int(p["planned_peak_bytes"]), extra, "fits" if ok else "over overhead")


def search(probe: Callable[[int], Probe], start: Probe | None = None, limit: int = MAX_BATCH,
           guess: int | None = None) -> PlannerResult:
    """Largest batch that fits: double from ``start`` (a probe known to fit) or from 1, then
    bisect. With ``guess`` (where the answer is expected: :class:`LineGuide`), that batch
    and the one above it are probed first: if the first fits and the second does not, that is
    the answer (two probes); otherwise the search goes on from what they showed (the batch
    below a failing guess next, then bisection; doubling above a fitting one). Returns the
    fitting probe with the probes made (``max_batch`` 0 if 1 fails)."""
    probes: list[Probe] = []
    best = start
    lo = start.batch if start else 0
    hi = None

    def run(b: int) -> Probe:
        nonlocal best, lo, hi
        p = probe(b)
        probes.append(p)
        if p.fits:
            best, lo = p, b
        else:
            hi = b
        return p

    if guess is not None:
        g = min(max(guess, lo + 1), limit)
        if g > lo and run(g).fits:
            if g + 1 <= limit:
                run(g + 1)
        elif g - 1 > lo:  # the guess failed: most often by one batch
            run(g - 1)
    b = max(1, 2 * lo)
    while hi is None and b <= limit:
        if run(b).fits:
            b = 2 * b
    capped = hi is None
    if capped and lo < limit:  # the doubling jumped past the limit: bisect up to it
        hi = limit + 1
    while hi is not None and hi - lo > 1:
        run((lo + hi) // 2)
    capped = capped and lo >= limit
    stop = next((p for p in probes if p.batch == lo + 1 and not p.fits), None)
    if best is None:
        return PlannerResult("", 0, None, None, False, probes, stop)
    return PlannerResult("", best.batch, best.peak_bytes, best.extra_pct, capped, probes, stop)


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
    (:func:`taichi_plan.batch_line.line_trace`): where each planner's search is run first, to
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
              compared: tuple[str, ...] = COMPARED, guide: bool = False) -> dict:
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
                                 time_limit=time_limit, seed=seed)
        return probe

    line = LineGuide(cache) if guide and limit >= max(GUIDE_BATCHES) else None
    drawn = line if line is not None and line.why_not is None else None
    results: dict[str, PlannerResult] = {}
    guesses: dict[str, int] = {}
    start = guess_start = None
    for planner in (*compared[:1], method, *compared[1:]):  # none first: the others start from its answer
        if drawn is not None:
            g = search(prober(planner, drawn.problem, " (drawn)"), guess_start, limit)
            guesses[planner] = g.max_batch
            if planner == "none":
                guess_start = _start_probe(g)
        r = search(prober(planner, cache.problem), start, limit, guesses.get(planner))
        r.planner = planner
        results[planner] = r
        if planner == "none":
            start = _start_probe(r)
    ours = results[method].max_batch
    rows = []
    for planner in (method, *compared):
        row = asdict(results[planner])
        row["ours"] = planner in OURS
        row["guess"] = guesses.get(planner)
        row["excluded"] = exclusion(row, max_overhead_pct)
        rows.append(row)
    return {
        "budget_bytes": budget_bytes,
        "max_overhead_pct": max_overhead_pct,
        "method": method,
        "planners": rows,
        "ratios": {f"ours/{c}": (ours / results[c].max_batch if results[c].max_batch else None) for c in compared},
        "batches_recorded": cache.recorded,
        "limit": limit,
        "guide": None if line is None else {"batches": list(line.batches), "why_not": line.why_not,
                                            "drawn": line.drawn},
    }


def _start_probe(none: PlannerResult) -> Probe | None:
    if none.max_batch == 0:
        return None
    return Probe(none.max_batch, True, none.peak_bytes, 0.0, "fits")


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
    lines.append(f"{'planner':<16}{'max batch':>10}{'peak at it':>14}{'extra %':>10}" + head)
    lines.append("-" * (50 + len(head)))
    for r in result["planners"]:
        name = r["planner"] + (" (ours)" if r["ours"] else "")
        mb = f"{r['max_batch']}" + ("+" if r["capped"] else "")
        extra = f"{r['extra_pct']:.2f}" if r["extra_pct"] is not None else "-"
        ratios = ""
        for c in ratio_to:
            den = by[c]["max_batch"]
            cell = "-" if r["planner"] == c else (f"{r['max_batch'] / den:.2f}x" if den else "n/a")
            ratios += f"{cell:>{RATIO_TO[c]}}"
        lines.append(f"{name:<16}{mb:>10}{size(r['peak_bytes']):>14}{extra:>10}" + ratios)
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
