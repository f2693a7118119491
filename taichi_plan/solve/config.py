"""The solver's tuning constants, typed: one frozen dataclass per component (the heuristic and
its local search, the ILP, the offload heuristic, the FSDP screen, the baselines, the reserved
rounds, the solve's time shares), each field's default the value the planners were tuned with,
gathered in :class:`SolverConfig`. ``solve(..., config=SolverConfig(ilp=IlpConfig(workers=1)))``
overrides some; the functions below :func:`~taichi_plan.solve.solve` take the component config
they use (its defaults when not given). With the defaults every planner behaves as before.

Only tuning constants live here (thresholds, time shares, counts, tolerances of a search);
format constants, status names and tables of facts stay where they are, and so do the
margins that keep a proven bound valid (:data:`taichi_plan.solve.bound.SAFETY`,
:data:`taichi_plan.solve.result.BOUND_TOLERANCE`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LocalSearchConfig:
    """The simulator-in-the-loop local search (:mod:`.local`): of forward-only graphs, and of
    recorded steps where the sweeps missed."""

    trials: int = 48  # best-estimated moves simulated per step (count)
    # The same on a recorded step, where the search runs only when every sweep missed (count): a
    # simulation there takes a millisecond, and 16 reached the least budgets 48 did (a compiled
    # Phi's 134.55 MB, eager BERT's and GPT-2's of tests/replay_cases.py) in a quarter of the time.
    recorded_trials: int = 16
    # Share of the search's time (a fraction) for the search with revivals from the start; the
    # search without them gets what is left (local_search).
    first_share: float = 0.4


@dataclass(frozen=True)
class HeuristicConfig:
    """The greedy sweep and the partition rounds of the heuristic (:mod:`.heuristic`)."""

    # Rounds of the sweep (plan_remat), each checked by the simulator and its target lowered by
    # the excess it finds (count).
    max_rounds: int = 30
    # Seconds the local search (forward-only graphs; recorded steps whose sweeps missed) may take per call.
    local_max_s: float = 10.0
    # Plans of drops alone the heuristic simulated last, per problem (_judge): its candidates are
    # judged again by best_by_simulator and _fits, and on a generated 1,000-node forward-only graph
    # each simulation of a sweep's plan took seconds (`--time-limit 20` ran 25 s). (count)
    judged_kept: int = 8
    # Per round of partitions: the best-ranked option classes tried, by each of the two
    # rankings (count).
    tries: int = 4
    local_search: LocalSearchConfig = field(default_factory=LocalSearchConfig)  # its local search


@dataclass(frozen=True)
class IlpConfig:
    """The CP-SAT search (:mod:`.ilp`), the relaxation it builds (:mod:`.ilp_model` and its
    mixins, from :mod:`.ilp_structure`) and its bound phase (:mod:`.bound`)."""

    workers: int = 2  # CP-SAT's search workers per round (threads; more than one interleaves them)
    initial_ops: int = 24  # budget-binding ops modelled in the first round (count)
    max_terms: int = 400_000  # stop adding ops (still a relaxation) past this many chain terms (count)
    # Chain constraints (a dropped tensor brought back early by a rebuild that needs it) grow with
    # the square of the options per gap; past this many options the model leaves them out, which
    # keeps it a relaxation (a tensor counts as away over its whole gap), only a weaker one. (count)
    chain_max_options: int = 2_000
    # Pairs of options per op that re-run it in two groups (apart_reruns): each a constraint. (count)
    apart_max_pairs: int = 64
    # The dead-input constraints (RelaxationModel._dead_inputs) are left out of models with more
    # options than this (None: chain_max_options), or more options and revivals than
    # dead_inputs_max_vars: CP-SAT's rounds with them run past the time limit there (a generated
    # 1,000-node forward-only graph, 16,783 options and 411,684 revivals, `solve --time-limit 20`:
    # 43-48 s, 18-19 s without them; random_layered n250, 9,875 options: `--time-limit 5` 6.3 s in
    # `make test`'s load, where the limit allows 5.7). (counts)
    dead_inputs_max_options: int | None = None
    dead_inputs_max_vars: int = 200_000
    # Levels of inputs a re-made dead input's rule follows (_dead_inputs, there): each level needs
    # its inputs kept, revived or re-made in turn. (count)
    remade_depth: int = 1
    # Past this many options and revivals, CP-SAT's presolve keeps every feasible solution (no
    # dual reductions): its dominance detection ignores the time limit, and with two no-good cuts
    # over 497k options (a generated 1,000-node forward-only graph at 0.9) it took 25 s of a
    # round given 4.6, so `--time-limit 20` ran 40-48 s; without it, 19.1 s. (count)
    presolve_dual_max_vars: int = 100_000
    # The bound phase (bound.py) gets this share of the time limit first (a fraction; 0: no bound
    # phase); with a work limit, bound_nodes_per_work branch-and-bound nodes per unit of work
    # instead (a limit that does not depend on load).
    bound_share: float = 0.6
    merged_bound_share: float = 0.9  # the same, for a bound model of merged options (merged_structure)
    bound_nodes_per_work: int = 200

    @property
    def dead_inputs_options(self) -> int:
        """The options past which the dead-input constraints are left out."""
        return self.chain_max_options if self.dead_inputs_max_options is None else self.dead_inputs_max_options


@dataclass(frozen=True)
class OffloadPlanConfig:
    """The keep, drop or offload heuristic (:mod:`.offload_plan`)."""

    sweeps: int = 3  # tries per start (step 4: each without the largest offload of the try before) (count)


@dataclass(frozen=True)
class FsdpConfig:
    """The screen of FSDP settings, reshard and prefetch (:mod:`.fsdp`)."""

    # Of the time left (a fraction), for screening the settings with the heuristic (reshard, then prefetch).
    screen_share: float = 1 / 3
    full_prefixes: int = 8  # a family of settings with at most this many units: every prefix screened (count)


@dataclass(frozen=True)
class BaselinesConfig:
    """The baselines (:mod:`.baselines`)."""

    dtr_rounds: int = 8  # rounds of DTR's eviction, its limit lowered by the simulated excess each (count)


@dataclass(frozen=True)
class ReservedConfig:
    """Solving against a budget on reserved bytes (:mod:`.reserved`)."""

    max_rounds: int = 8  # solves at a lowered allocated target before giving up (count)


@dataclass(frozen=True)
class TimeConfig:
    """How :func:`~taichi_plan.solve.solve` shares its time limit."""

    finish_share: float = 0.05  # of the time limit, kept for simulating the chosen plan and writing it
    # Of the time limit, kept after the optimizer options are screened (their views of the step,
    # floors) for saying what the heuristic reaches when no plan was found.
    report_share: float = 0.15
    # Share of the warm start's time the heuristic's bisection may take when no warm start fits
    # (_warm_start): the rest is the search's.
    reach_share: float = 0.15
    # Seconds of local search per bisection step for the least reachable budget, at least (each step
    # gets an equal share of the time left to the deadline, at most HeuristicConfig.local_max_s).
    bisect_local_max_s: float = 1.0


@dataclass(frozen=True)
class SolverConfig:
    """Every component's tuning, for :func:`~taichi_plan.solve.solve`."""

    time: TimeConfig = field(default_factory=TimeConfig)
    heuristic: HeuristicConfig = field(default_factory=HeuristicConfig)
    ilp: IlpConfig = field(default_factory=IlpConfig)
    offload: OffloadPlanConfig = field(default_factory=OffloadPlanConfig)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    baselines: BaselinesConfig = field(default_factory=BaselinesConfig)
    reserved: ReservedConfig = field(default_factory=ReservedConfig)
