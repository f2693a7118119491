"""Checks that a plan file is whole and sane (``check_plan_json``); whether it fits the trace it
names is :func:`taichi_plan.problem.fit.check_plan_against_trace`. No torch, no simulator.

Every problem is a :class:`~taichi_plan.base.errors.PlanError` whose message names the field,
what it holds, what it must hold and what to do. ``load_plan`` runs the first check; the
second runs wherever the trace is at hand (``locate_trace``), before anything is drawn,
simulated or replayed from the plan.
"""

from __future__ import annotations

import math

from ..base.errors import PlanError

STATUSES = ("optimal", "feasible", "infeasible", "not_solved")
COST_UNITS = ("s", "units")
EVENT_KINDS = ("run", "recompute")
OFFLOAD_EVENT_KINDS = ("copy_out", "copy_in")  # v14
OFFLOAD_FIELDS = ("tensor", "op", "op_name", "module", "nbytes", "after", "before", "freed_after", "prefetch_at",
                  "copy_out_s", "copy_in_s", "stall_s", "why")
RECOMPUTE_FIELDS = ("tensor", "op", "op_name", "module", "nbytes", "free_after", "remat_before", "why")
PARTITION_FIELDS = ("module", "dim", "chunks", "why", "over", "random_draws")  # `over`, `random_draws`: v4
RANDOM_DRAWS = ("as-unpartitioned", "per-chunk")
# Schedule ids of a partition's concatenation transients (partition.py makes them from
# -10**12 down): no trace tensor stands behind them.
PARTITION_TRANSIENT_IDS_FROM = -(10**12)
COPY_ID_BASE = -4 * 10**12  # tensor ids of an optimizer group's own copy of a tensor shared by all groups
_REMEDY = ("The file was edited or damaged: restore it, or solve the trace again with "
           "`taichi-plan solve TRACE --budget ...`.")


def _bad(where: str, field: str, value, must: str) -> PlanError:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return PlanError(f"{where}: field `{field}` is {shown}, but it must be {must}. {_REMEDY}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _int(where, field, v, lo: int | None = None, hi: int | None = None, none: bool = False):
    if v is None and none:
        return
    ok = _is_int(v) and (lo is None or v >= lo) and (hi is None or v <= hi)
    if not ok:
        rng = ("" if lo is None and hi is None else f" from {lo}" if hi is None else f" from {lo} to {hi}")
        raise _bad(where, field, v, f"an integer{rng}" + (" or null" if none else ""))


def _num(where, field, v, lo: float | None = None, none: bool = False):
    if v is None and none:
        return
    if not _is_num(v) or (lo is not None and v < lo):
        low = "" if lo is None else f" >= {lo:g}"
        raise _bad(where, field, v, f"a finite number{low}" + (" or null" if none else ""))


def _str(where, field, v, none: bool = False, choices: tuple | None = None):
    if v is None and none:
        return
    if not isinstance(v, str) or (choices is not None and v not in choices):
        must = "a string" if choices is None else "one of " + ", ".join(repr(c) for c in choices)
        raise _bad(where, field, v, must + (" or null" if none else ""))


def _kind(where, field, v, typ: type, name: str, none: bool = False):
    if v is None and none:
        return
    if not isinstance(v, typ):
        raise _bad(where, field, v, name + (" or null" if none else ""))


def check_plan_json(obj: dict, where: str) -> None:
    """Types and ranges of every field of a plan file's JSON (format v1, v2 or v3)."""
    for key, typ, name in (("trace", dict, "an object"), ("solver", dict, "an object"),
                           ("predicted", dict, "an object"), ("decisions", dict, "an object")):
        if key not in obj:
            raise PlanError(f"{where} has no `{key}` field, so it is not a complete plan. {_REMEDY}")
        _kind(where, key, obj[key], typ, name)
    if "budget_bytes" not in obj:
        raise PlanError(f"{where} has no `budget_bytes` field, so it is not a complete plan. {_REMEDY}")
    _int(where, "budget_bytes", obj["budget_bytes"], lo=1, none=True)

    t = obj["trace"]
    for key in ("path", "path_absolute", "name", "signature"):
        _str(where, f"trace.{key}", t.get(key), none=True)
    h = t.get("content_hash")
    if h is not None and not (isinstance(h, str) and len(h) == 64 and all(c in "0123456789abcdef" for c in h)):
        raise _bad(where, "trace.content_hash", h, "a sha256 hex digest (64 characters 0-9a-f) or null")
    _int(where, "trace.num_ops", t.get("num_ops"), lo=0)
    _kind(where, "trace.workload", t.get("workload"), dict, "an object", none=True)
    lay = t.get("layout")  # v4: the FSDP layout of a sharded trace
    _kind(where, "trace.layout", lay, dict, "an object", none=True)
    if lay is not None:
        _int(where, "trace.layout.world_size", lay.get("world_size"), lo=1)
        _kind(where, "trace.layout.units", lay.get("units"), list, "a list of [module, reshard_after_forward]")
        _kind(where, "trace.layout.ddp", lay.get("ddp"), dict, "an object of DDP's settings", none=True)  # v5
        mixed = lay.get("mixed_precision")  # v12: FSDP2's MixedPrecisionPolicy per unit
        _kind(where, "trace.layout.mixed_precision", mixed, list, "a list of [module, param_dtype, reduce_dtype]",
              none=True)
        for k, row in enumerate(mixed or ()):
            _kind(where, f"trace.layout.mixed_precision[{k}]", row, list, "a [module, param_dtype, reduce_dtype]")
            if len(row) != 3 or not all(x is None or isinstance(x, str) for x in row):
                _kind(where, f"trace.layout.mixed_precision[{k}]", None, list, "a [module, param_dtype, reduce_dtype]")
    n = t["num_ops"]
    opt = (obj.get("decisions") or {}).get("optimizer") if isinstance(obj.get("decisions"), dict) else None
    if isinstance(opt, dict) and opt.get("num_ops") is not None:
        # v4: op ids are positions in the step as the optimizer option runs it (stepped in groups,
        # the split step has more ops than the recorded one)
        _int(where, "decisions.optimizer.num_ops", opt.get("num_ops"), lo=0)
        n = opt["num_ops"]
    rsd = (obj.get("decisions") or {}).get("reshard_after_forward") if isinstance(obj.get("decisions"), dict) else None
    if isinstance(rsd, dict) and rsd.get("num_ops") is not None:
        # v13: a unit resharding to a smaller mesh runs FSDP's post-forward ops: the step the
        # plan's ids refer to has more ops than the recorded one
        _int(where, "decisions.reshard_after_forward.num_ops", rsd.get("num_ops"), lo=0)
        n = rsd["num_ops"]

    s = obj["solver"]
    _str(where, "solver.method", s.get("method"))
    _str(where, "solver.status", s.get("status"), choices=STATUSES)
    for key in ("objective", "extra_compute", "lower_bound"):
        _num(where, f"solver.{key}", s.get(key), none=True)
    _num(where, "solver.gap", s.get("gap"), none=True)
    _num(where, "solver.wall_s", s.get("wall_s"), lo=0, none=True)
    _int(where, "solver.seed", s.get("seed"), none=True)
    notes = s.get("notes")
    if notes is not None and not (isinstance(notes, list) and all(isinstance(x, str) for x in notes)):
        raise _bad(where, "solver.notes", notes, "a list of strings")
    _kind(where, "solver.stats", s.get("stats"), dict, "an object", none=True)
    _kind(where, "solver.partition_random", s.get("partition_random"), bool, "true or false", none=True)

    p = obj["predicted"]
    for key in ("baseline_peak_bytes", "planned_peak_bytes"):
        _int(where, f"predicted.{key}", p.get(key), lo=0)
    for key in ("baseline_peak_op", "planned_peak_op"):
        _int(where, f"predicted.{key}", p.get(key), lo=-1, hi=max(n - 1, -1), none=True)
    _kind(where, "predicted.planned_peak_in_recompute", p.get("planned_peak_in_recompute"), bool,
          "true or false", none=True)
    # v11: a head split over tokens may cost less than none (a fused pass), so these may be < 0
    _num(where, "predicted.extra_compute", p.get("extra_compute"))
    for key in ("extra_compute_pct", "partition_compute"):
        _num(where, f"predicted.{key}", p.get(key), none=True)
    _num(where, "predicted.step_compute", p.get("step_compute"), lo=0, none=True)
    _str(where, "predicted.cost_unit", p.get("cost_unit", "s"), choices=COST_UNITS)
    _int(where, "predicted.recompute_ops", p.get("recompute_ops"), lo=0, none=True)
    # v3: the allocator model's reserved peaks (docs/allocator.md); older plans have none.
    v3 = _is_int(obj.get("format_version")) and obj["format_version"] >= 3
    for key in ("baseline_reserved_peak_bytes", "planned_reserved_peak_bytes"):
        _int(where, f"predicted.{key}", p.get(key), lo=0, none=not v3)
    _kind(where, "predicted.allocator", p.get("allocator"), dict, "an object", none=True)
    _str(where, "solver.budget_on", s.get("budget_on"), none=True, choices=("allocated", "reserved"))

    v5 = _is_int(obj.get("format_version")) and obj["format_version"] >= 5
    v8 = _is_int(obj.get("format_version")) and obj["format_version"] >= 8
    d = obj["decisions"]
    rec, parts = d.get("recompute", []), d.get("partitions", [])
    _kind(where, "decisions.recompute", rec, list, "a list")
    _kind(where, "decisions.partitions", parts, list, "a list")
    seen: set[int] = set()
    for i, r in enumerate(rec):
        f = f"decisions.recompute[{i}]"
        _tensor_decision(where, f, r, RECOMPUTE_FIELDS, n)
        _int(where, f"{f}.free_after", r["free_after"], lo=0, hi=n - 1)
        _int(where, f"{f}.remat_before", r["remat_before"], lo=r["free_after"] + 1, hi=n - 1)
        _str(where, f"{f}.why", r.get("why", ""))
        if r["tensor"] in seen:
            raise _bad(where, f"{f}.tensor", r["tensor"], "a tensor no other recompute decision drops")
        seen.add(r["tensor"])
    mods: set[str] = set()
    for i, q in enumerate(parts):
        f = f"decisions.partitions[{i}]"
        _fields(where, f, q, PARTITION_FIELDS)
        _str(where, f"{f}.module", q["module"])
        # v8: a position-wise module split over its positions, along dim 1 (the sequence).
        seq = q.get("over") == "sequence"
        _int(where, f"{f}.dim", q["dim"], lo=1 if seq else 0, hi=1 if seq else 0)
        # v5: one chunk along the batch (the module checkpointed whole); tokens need two or more.
        _int(where, f"{f}.chunks", q["chunks"], lo=2 if q.get("over") == "tokens" or not v5 else 1)
        _str(where, f"{f}.why", q.get("why", ""))
        _str(where, f"{f}.over", q.get("over", "batch"), choices=("batch", "tokens", "sequence") if v8 else ("batch", "tokens"))
        _str(where, f"{f}.random_draws", q.get("random_draws"), none=True, choices=RANDOM_DRAWS)
        if q["module"] in mods:
            raise _bad(where, f"{f}.module", q["module"], "a module no other partition names")
        mods.add(q["module"])

    if opt is not None:  # v4: how the optimizer step runs (taichi_plan/problem/optimizer/plan.py)
        _kind(where, "decisions.optimizer", opt, dict, "an object")
        _str(where, "decisions.optimizer.mode", opt.get("mode"), choices=("in-backward", "groups"))
        _str(where, "decisions.optimizer.why", opt.get("why", ""))

    rs = (obj.get("decisions") or {}).get("reshard_after_forward")
    if rs is not None:  # v5: FSDP2's reshard_after_forward per unit (taichi_plan/problem/sharding/reshard.py)
        _kind(where, "decisions.reshard_after_forward", rs, dict, "an object")
        _kind(where, "decisions.reshard_after_forward.units", rs.get("units"), list, "a list of units")
        for i, u in enumerate(rs["units"]):
            f = f"decisions.reshard_after_forward.units[{i}]"
            _kind(where, f, u, dict, "an object")
            _str(where, f"{f}.module", u.get("module"))
            for key in ("reshard_after_forward", "recorded"):  # v13: or the ranks of a smaller mesh
                v = u.get(key)
                if not (isinstance(v, bool) or (isinstance(v, int) and v > 1)):
                    _kind(where, f"{f}.{key}", None, bool, "true, false, or a number of ranks above 1")
        _num(where, "decisions.reshard_after_forward.step_compute_saved", rs.get("step_compute_saved"), none=True)

    pf = (obj.get("decisions") or {}).get("fsdp_prefetch")
    if pf is not None:  # v6: FSDP2's prefetching (taichi_plan/problem/sharding/prefetch.py)
        _kind(where, "decisions.fsdp_prefetch", pf, dict, "an object")
        for key in ("forward", "backward", "units"):
            _kind(where, f"decisions.fsdp_prefetch.{key}", pf.get(key), list, "a list")
        for key in ("forward", "backward"):
            for i, m in enumerate(pf[key]):
                _str(where, f"decisions.fsdp_prefetch.{key}[{i}]", m)
        for i, u in enumerate(pf["units"]):
            f = f"decisions.fsdp_prefetch.units[{i}]"
            _kind(where, f, u, dict, "an object")
            _str(where, f"{f}.module", u.get("module"))
            _kind(where, f"{f}.forward_prefetch", u.get("forward_prefetch"), list, "a list of modules")
            if u.get("backward_prefetch") not in (None, []):
                raise _bad(where, f"{f}.backward_prefetch", u.get("backward_prefetch"),
                           "null (FSDP's default) or [] (no backward prefetch)")

    v14 = _is_int(obj.get("format_version")) and obj["format_version"] >= 14
    off = (obj.get("decisions") or {}).get("offload")
    if off is not None:  # v14: offloads (taichi_plan/problem/offload.py)
        if not v14:
            raise _bad(where, "decisions.offload", "(present)", f"absent below format version 14. {_REMEDY}")
        _check_offload(off, where, n, seen)
        for key in ("host_peak_bytes",):
            _int(where, f"predicted.{key}", p.get(key), lo=0)
        _num(where, "predicted.stall_s", p.get("stall_s"), lo=0)

    if obj.get("schedule") is not None:
        _check_schedule(obj["schedule"], where, n, EVENT_KINDS + (OFFLOAD_EVENT_KINDS if v14 else ()))


def _tensor_decision(where: str, f: str, r, fields, n: int) -> None:
    """The fields a recompute and an offload decision share: the tensor, the op that made it, its size."""
    _fields(where, f, r, fields)
    _int(where, f"{f}.tensor", r["tensor"])
    _int(where, f"{f}.op", r["op"], lo=0, hi=n - 1)
    _str(where, f"{f}.op_name", r["op_name"])
    _str(where, f"{f}.module", r["module"])
    _int(where, f"{f}.nbytes", r["nbytes"], lo=0)


def _check_offload(off, where: str, n: int, dropped: set[int]) -> None:
    _kind(where, "decisions.offload", off, dict, "an object")
    _num(where, "decisions.offload.host_link_bytes_per_s", off.get("host_link_bytes_per_s"), lo=0)
    if not off["host_link_bytes_per_s"] > 0:
        raise _bad(where, "decisions.offload.host_link_bytes_per_s", off["host_link_bytes_per_s"], "above 0")
    _int(where, "decisions.offload.host_budget_bytes", off.get("host_budget_bytes"), lo=0, none=True)
    tensors = off.get("tensors")
    _kind(where, "decisions.offload.tensors", tensors, list, "a list")
    seen: set[int] = set()
    for i, o in enumerate(tensors):
        f = f"decisions.offload.tensors[{i}]"
        _tensor_decision(where, f, o, OFFLOAD_FIELDS, n)
        _int(where, f"{f}.after", o["after"], lo=0, hi=n - 1)
        _int(where, f"{f}.before", o["before"], lo=o["after"] + 1, hi=n - 1)
        _int(where, f"{f}.freed_after", o["freed_after"], lo=o["after"], hi=n - 1)
        _int(where, f"{f}.prefetch_at", o["prefetch_at"], lo=o["after"] + 1, hi=o["before"])
        for key in ("copy_out_s", "copy_in_s", "stall_s"):
            _num(where, f"{f}.{key}", o[key], lo=0)
        _str(where, f"{f}.why", o.get("why", ""))
        if o["tensor"] in seen or o["tensor"] in dropped:
            raise _bad(where, f"{f}.tensor", o["tensor"], "a tensor no other decision drops or offloads")
        seen.add(o["tensor"])


def _fields(where: str, f: str, entry, fields: tuple[str, ...]) -> None:
    if not isinstance(entry, dict):
        raise _bad(where, f, entry, "an object")
    missing = [k for k in fields if k not in ("why", "over", "random_draws") and k not in entry]
    extra = [k for k in entry if k not in fields]
    if missing:
        raise PlanError(f"{where}: {f} has no `{missing[0]}` field. {_REMEDY}")
    if extra:
        raise PlanError(f"{where}: {f} has an unknown field `{extra[0]}`; it may only have "
                        f"{', '.join(fields)}. {_REMEDY}")


def _check_schedule(sched, where: str, n: int, kinds: tuple = EVENT_KINDS) -> None:
    _kind(where, "schedule", sched, dict, "an object or null")
    nb = sched.get("nbytes")
    if not isinstance(nb, dict):
        raise _bad(where, "schedule.nbytes", nb, "an object from tensor id to bytes")
    known: set[int] = set()
    for k, v in nb.items():
        try:
            tid = int(k)
        except ValueError:
            raise _bad(where, "schedule.nbytes key", k, "a tensor id (an integer)") from None
        _int(where, f"schedule.nbytes[{k}]", v, lo=0)
        known.add(tid)
    initial = sched.get("initial")
    _kind(where, "schedule.initial", initial, list, "a list of tensor ids")
    for tid in initial:
        if not _is_int(tid) or tid not in known:
            raise _bad(where, "schedule.initial", tid, "a tensor id that schedule.nbytes lists")
    events = sched.get("events")
    _kind(where, "schedule.events", events, list, "a list of [kind, op, allocated ids, freed ids]")
    for i, ev in enumerate(events):
        f = f"schedule.events[{i}]"
        if not (isinstance(ev, list) and len(ev) == 4):
            raise _bad(where, f, ev, "a list [kind, op, allocated ids, freed ids]")
        kind, op, allocs, frees = ev
        _str(where, f"{f} kind", kind, choices=kinds)
        _int(where, f"{f} op", op, lo=0, hi=n - 1)
        for what, ids in (("allocated", allocs), ("freed", frees)):
            if not isinstance(ids, list):
                raise _bad(where, f"{f} {what} ids", ids, "a list of tensor ids")
            for tid in ids:
                if not _is_int(tid) or tid not in known:
                    raise PlanError(
                        f"{where}: {f} names {what} tensor {tid!r}, which schedule.nbytes does not list, "
                        f"so the schedule names a tensor that does not exist. {_REMEDY}")
