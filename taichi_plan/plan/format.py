"""Plan format v10: one JSON file (see ``docs/plan-format.md``). No torch, no simulator.

A plan names the trace it was solved for (its path relative to the plan file and its
absolute path, content hash, op-sequence signature), the budget, the solver's status and
bound, the simulator's prediction, the decisions (each with a ``why``) and the explicit
schedule from which anyone can recompute the peak. Version 3 adds the allocator model's
reserved peaks (``predicted.*_reserved_peak_bytes``); version 4 the optimizer option
(``decisions.optimizer``), the FSDP layout of a sharded trace (``trace.layout``, null for
one process), partitions over tokens (``decisions.partitions[].over``), a partition's random
draws (``Partition.random_draws``) and whether the solve allowed partitioning modules that
draw random numbers (``solver.partition_random``); version 5 FSDP2's ``reshard_after_forward``
per unit (``decisions.reshard_after_forward``: the plan's op and tensor ids are then those of the
step with those units not resharding, :mod:`taichi_plan.problem.sharding.reshard`), a partition of one chunk
along the batch (``chunks: 1``: the module checkpointed whole) and the DDP settings of a DDP
trace's layout (``trace.layout.ddp``); version 6 FSDP2's prefetching per unit
(``decisions.fsdp_prefetch``: the op and tensor ids are then those of the step with those
all-gathers issued so, :mod:`taichi_plan.problem.sharding.prefetch`); version 7 revivals in
``decisions.recompute`` on forward-only graphs (an entry freed after the tensor's own last op,
kept or rebuilt for later rebuilds that read it); version 8 partitions of a position-wise
module over its positions (``over: "sequence"``, ``dim: 1``: :mod:`taichi_plan.problem.partition.position_span`);
version 9 counts the runtime's per-re-run and per-drop costs in ``extra_compute`` (the
objective) instead of ``predicted.runtime_overhead`` (:mod:`taichi_plan.problem.partition.overhead`);
version 10 drops of the outputs of a module checkpointed whole (``chunks: 1``), rebuilt
through its insides (:func:`taichi_plan.problem.partition.tensors.whole_outputs`); version 11 predicts a head
over tokens as one fused pass, whose cost may be below 0 (:mod:`taichi_plan.problem.partition.token_span`);
version 13 layouts whose units reshard to a smaller mesh after forward (an int
``reshard_after_forward``, trace v17); version 14 offloads (``decisions.offload``: saved
activations copied to host after their last forward use and back before backward,
:mod:`taichi_plan.problem.offload`), the host memory they hold and the stalls they cost
(``predicted.host_peak_bytes``, ``predicted.stall_s``), and ``copy_out`` / ``copy_in`` events
in the schedule.
Version 13 files, version 12 files, version 11 files, version 10 files, version 9 files, version 8 files, version 7 files, version 6 files, version 5 files, version 4 files, version 3 files (no ``over``: every
partition is along the batch), version 2 files (no reserved peaks) and
version 1 files (trace path relative to the directory ``solve`` ran in) are still read.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..base.atomic import check_output, write_json_atomic
from ..base.errors import PlanError
from ..trace.layout import planned_layout
from .check import STATUSES, check_plan_json

FORMAT_VERSION = 14
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14)
__all__ = ["FORMAT_VERSION", "READABLE_VERSIONS", "STATUSES", "Offloaded", "Partition", "Plan", "Recompute", "load_plan",
           "peak_from_schedule", "save_plan"]


@dataclass
class Recompute:
    """Free ``tensor`` after op ``free_after``; rebuild it by re-running ``op`` before ``remat_before``."""

    tensor: int
    op: int
    op_name: str
    module: str
    nbytes: int
    free_after: int
    remat_before: int
    why: str = ""


@dataclass
class Offloaded:
    """Copy ``tensor`` to host after op ``after`` (its last forward use) and back before op
    ``before`` (its first backward use's unpack point), the copy-in issued before op
    ``prefetch_at``; its device bytes are freed after op ``freed_after`` (when the copy-out has
    ended). The seconds are the simulator's (v14, :mod:`taichi_plan.problem.offload`)."""

    tensor: int
    op: int
    op_name: str
    module: str
    nbytes: int
    after: int
    before: int
    freed_after: int
    prefetch_at: int
    copy_out_s: float
    copy_in_s: float
    stall_s: float
    why: str = ""


@dataclass
class Partition:
    """Run ``module`` on ``chunks`` pieces of its input along ``dim`` (``over="batch"``), or,
    ``over="tokens"``, the head ``module`` and the cross-entropy on its logits on ``chunks``
    pieces of the tokens (v4), or, ``over="sequence"`` (``dim`` 1, v8), a position-wise module
    on ``chunks`` runs of its positions (batch x sequence, in memory order). Each chunk is
    checkpointed (its forward re-runs in backward); ``chunks == 1`` along the batch (v5) is the
    module checkpointed whole."""

    module: str
    dim: int
    chunks: int
    why: str = ""
    over: str = "batch"
    # None: the module draws no random numbers. "as-unpartitioned": its chunks draw exactly
    # what the whole batch would have (one dropout, CPU). "per-chunk": they draw their own
    # (dropout masks differ: training changes statistically). See taichi_plan/problem/partition/__init__.py.
    random_draws: str | None = None


@dataclass
class Plan:
    trace: dict  # path, path_absolute, name, content_hash, signature, num_ops, workload
    budget_bytes: int | None
    solver: dict  # method, status, objective, lower_bound, gap, wall_s, seed, notes
    predicted: dict  # from the simulator
    recompute: list[Recompute] = field(default_factory=list)
    partitions: list[Partition] = field(default_factory=list)
    schedule: dict | None = None
    # How the optimizer step runs (v4, ``decisions.optimizer``): None = as recorded; else
    # {"mode": "in-backward"|"groups", "why": ..., ...} (taichi_plan/problem/optimizer/plan.py).
    optimizer: dict | None = None
    # FSDP2's reshard_after_forward per unit (v5, ``decisions.reshard_after_forward``): None for
    # one process; else {"units": [{"module", "reshard_after_forward", "recorded", "why"?}],
    # "step_compute_saved": seconds, "chosen_by": "auto"|"asked"|None} (taichi_plan/problem/sharding/decisions.py).
    reshard: dict | None = None
    # FSDP2's prefetching (v6, ``decisions.fsdp_prefetch``): None for one process; else
    # {"forward": [module], "backward": [module] (the units gathered early in each pass),
    # "units": [{"module", "forward_prefetch", "backward_prefetch"}], "overlap", "recorded_overlap",
    # "why"?, "chosen_by"} (taichi_plan/problem/sharding/prefetch.py).
    prefetch: dict | None = None
    # Offloads (v14, ``decisions.offload``): None when the solve did not allow them; else
    # {"host_link_bytes_per_s": float, "host_budget_bytes": int | None} with ``offloads`` the
    # tensors (taichi_plan/problem/offload.py).
    offload: dict | None = None
    offloads: list[Offloaded] = field(default_factory=list)
    format_version: int = FORMAT_VERSION
    # The file the plan was read from (not written): a relative ``trace['path']`` is
    # relative to it. None for a plan made in memory, whose path is as ``solve`` was given it.
    source: Path | None = field(default=None, compare=False, repr=False)

    def to_json(self, plan_dir: str | Path | None = None) -> dict:
        """The file's JSON; with ``plan_dir`` (where the file goes) the trace path is written
        relative to it, so plan and traces can move together, with the absolute path beside
        (without ``plan_dir`` both are absolute)."""
        # A v1/v2 plan saved again has no reserved peaks, which v3 requires: it stays v2.
        version = FORMAT_VERSION if self.predicted.get("planned_reserved_peak_bytes") is not None else 2
        decisions = {
            "recompute": [asdict(r) for r in self.recompute],
            "partitions": [asdict(p) for p in self.partitions],
        }
        if self.optimizer is not None:
            decisions["optimizer"] = self.optimizer
        if self.reshard is not None:
            decisions["reshard_after_forward"] = self.reshard
        if self.prefetch is not None:
            decisions["fsdp_prefetch"] = self.prefetch
        if self.offload is not None:
            decisions["offload"] = {**self.offload, "tensors": [asdict(o) for o in self.offloads]}
        return {
            "format_version": version,
            "trace": self._trace_json(plan_dir),
            "budget_bytes": self.budget_bytes,
            "solver": self.solver,
            "predicted": self.predicted,
            "decisions": decisions,
            "schedule": self.schedule,
        }

    def _trace_json(self, plan_dir: str | Path | None) -> dict:
        trace = dict(self.trace)
        raw = trace.get("path")
        absolute = trace.get("path_absolute")
        if raw is not None:
            # v2 files: relative to the file; v1 files and plans made in memory: to the
            # working directory. Where that path holds a trace it beats a recorded absolute
            # path (the plan and its traces may have moved together).
            beside = self.source is not None and self.format_version >= 2
            here = os.path.abspath(os.path.join(self.source.parent, raw) if beside else raw)
            if absolute is None or (self.source is not None and os.path.isdir(here)):
                absolute = here
        trace["path_absolute"] = absolute
        if absolute is not None:
            trace["path"] = absolute  # where the file will be is unknown: absolute is right anywhere
        if plan_dir is not None and absolute is not None:
            try:
                trace["path"] = Path(os.path.relpath(absolute, os.path.abspath(plan_dir))).as_posix()
            except ValueError:  # another drive: no relative path
                pass
        return trace

    @classmethod
    def from_json(cls, obj: dict, where: str = "plan") -> Plan:
        if not isinstance(obj, dict):
            raise PlanError(f"{where} is not a JSON object; it is not a taichi-plan plan.")
        version = obj.get("format_version")
        if version not in READABLE_VERSIONS or isinstance(version, bool):
            raise PlanError(
                f"{where} has format version {version!r}; this taichi-plan reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}. Solve the trace again with `taichi-plan solve`."
            )
        check_plan_json(obj, where)
        dec = obj["decisions"]
        return cls(
            trace=dict(obj["trace"]),
            budget_bytes=obj["budget_bytes"],
            solver=dict(obj["solver"]),
            predicted=dict(obj["predicted"]),
            recompute=[Recompute(**r) for r in dec.get("recompute", [])],
            partitions=[Partition(**p) for p in dec.get("partitions", [])],
            schedule=obj.get("schedule"),
            optimizer=dict(dec["optimizer"]) if dec.get("optimizer") is not None else None,
            reshard=dict(dec["reshard_after_forward"]) if dec.get("reshard_after_forward") is not None else None,
            prefetch=dict(dec["fsdp_prefetch"]) if dec.get("fsdp_prefetch") is not None else None,
            offload=({k: v for k, v in dec["offload"].items() if k != "tensors"}
                     if dec.get("offload") is not None else None),
            offloads=[Offloaded(**o) for o in (dec.get("offload") or {}).get("tensors", [])],
            format_version=version,
        )


def is_plan_file(path: str | Path) -> bool:
    """Whether ``path`` is a plan this tool wrote (a JSON object with ``format_version`` and
    ``solver``), so that ``force`` may replace it; a plan of any format version counts."""
    try:
        with open(path, "rb") as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(obj, dict) and "format_version" in obj and "solver" in obj


def check_plan_output(path: str | Path, force: bool, option: str | None = None) -> Path:
    """Check, before any work, that a plan can be written to ``path``: an existing file is
    replaced only with ``force`` and only if it is a plan; see :func:`taichi_plan.base.atomic.check_output`."""
    return check_output(path, force, what="plan file", option=option, owned=is_plan_file)


def save_plan(plan: Plan, path: str | Path, force: bool = False) -> Path:
    """Write ``plan`` to ``path`` atomically (missing parent directories are created);
    ``force`` replaces an existing plan file, never anything else."""
    p = check_plan_output(path, force)
    return write_json_atomic(p, plan.to_json(plan_dir=p.parent), what="plan file")


def load_plan(path: str | Path) -> Plan:
    p = Path(path)
    if not p.is_file():
        raise PlanError(f"Plan {str(p)!r} does not exist. Make one with `taichi-plan solve TRACE --budget ...`.")
    try:
        obj = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"Plan {str(p)!r} is not valid JSON ({e}); it may be truncated. Solve again.") from e
    plan = Plan.from_json(obj, where=f"Plan {str(p)!r}")
    plan.source = p
    return plan


def peak_from_schedule(schedule: dict) -> tuple[int, int]:
    """(peak bytes, index of the event where it happens), from the schedule alone."""
    nb = {int(k): int(v) for k, v in schedule["nbytes"].items()}
    live = sum(nb[t] for t in schedule["initial"])
    peak, where = live, -1
    for i, (_kind, _op, allocs, frees) in enumerate(schedule["events"]):
        live += sum(nb[t] for t in allocs)
        if live > peak:
            peak, where = live, i
        live -= sum(nb[t] for t in frees)
    return peak, where


def reshard_settings(plan) -> dict:
    """Each FSDP unit's ``reshard_after_forward`` as a plan (a path or Plan) runs the job:
    FQN (``""`` the root) -> True, False, or an int; empty for a plan of one process or of DDP.
    Pass each to the unit's ``fully_shard``: FSDP2 takes an int (reshard to a smaller mesh after
    forward, ``decisions.reshard_after_forward``, plan v13) only there, and ``apply`` refuses a
    model sharded otherwise; the bools it sets itself."""
    p = plan if isinstance(plan, Plan) else load_plan(plan)
    lay = planned_layout(p.trace.get("layout"), p.reshard)
    if lay is None or lay.get("ddp") is not None:
        return {}
    return {m: r for m, r in lay["units"]}
