"""The runtime's rebuild path measured on the model: :func:`rebuild_all` re-runs every recipe
of a call through it, timing the path and the ops apart (``rebuild_op_s``), and
:func:`time_ratios` sets the ops' seconds there against the trace's (``rebuild_time_ratio``)."""

from __future__ import annotations


def time_ratios(trace, call: dict, ops: list, rebuilt_s: dict[int, list[float]]) -> dict[str, float]:
    """Per op name: the seconds one re-run of its ops took in the rebuilds (``rebuilt_s``,
    counted op of the call -> [seconds, times it ran]) over the seconds the trace recorded for
    them. Per run of the op, not per rebuild: a rebuild of every recipe runs an op of several
    outputs once per output (``native_batch_norm``'s three: its ratio read about 3 on
    ResNet-50), where a plan's rebuild runs it for the outputs it dropped."""
    from ..calls import counted_ops

    counted = counted_ops(trace)
    op_ids = [o for o in range(int(call["start"]), int(call["end"]) + 1) if counted[o]]
    recorded = trace.ops["duration_s"].to_numpy()
    ran: dict[str, float] = {}
    rec: dict[str, float] = {}
    for i, (sec, times) in rebuilt_s.items():
        name = ops[i][0]
        ran[name] = ran.get(name, 0.0) + sec / times
        rec[name] = rec.get(name, 0.0) + float(recorded[op_ids[i]])
    return {n: ran[n] / rec[n] for n in sorted(ran) if rec[n] > 0}


def rebuild_all(rt, frame, clock, op_seconds: dict[int, list[float]] | None = None) -> list[float]:
    """Re-run every recipe of ``frame`` (a call run with every recipe kept) through the runtime's
    rebuild path, in op order, each storage held until its last reader has re-run; returns
    [(seconds - the seconds of the ops themselves) / re-run ops]: the path's own cost per op,
    the ops timed where they run (added, per counted op of the call, to ``op_seconds``: [seconds,
    times run]).
    [] when a recipe cannot re-run here (an input overwritten in place, say): then nothing is
    measured."""
    from ..mode import rebuilds as runtime
    from ..mode.frame import TRef

    order = sorted(frame.recipes, key=lambda sid: (frame.recipes[sid][0].op, sid))
    last_reader: dict[int, int] = {}
    for k, sid in enumerate(order):
        for step in frame.recipes[sid]:
            for x in step.leaves:
                if isinstance(x, TRef):
                    last_reader[x.sid] = k
    run_op = runtime.run_recorded_op
    op_s = [0.0]

    per_op: dict[int, list[float]] = {}

    def timed_op(step, args, kwargs):
        t = clock()
        try:
            return run_op(step, args, kwargs)
        finally:
            dt = clock() - t
            op_s[0] += dt
            got = per_op.setdefault(step.op, [0.0, 0])
            got[0] += dt
            got[1] += 1

    n0 = rt.recompute_ops
    runtime.run_recorded_op = timed_op
    try:
        t0 = clock()
        for k, sid in enumerate(order):
            frame.cache[sid] = rt._run_recipe(frame, sid)
            for step in frame.recipes[sid]:
                for x in step.leaves:
                    if isinstance(x, TRef) and last_reader.get(x.sid) == k:
                        frame.cache.pop(x.sid, None)
        dt = clock() - t0
    except Exception:  # noqa: BLE001  (calibration only: the microbenchmark's term stays)
        return []
    finally:
        runtime.run_recorded_op = run_op
        frame.cache.clear()
    n = rt.recompute_ops - n0
    if n and op_seconds is not None:
        for i, (sec, times) in per_op.items():
            acc = op_seconds.setdefault(i, [0.0, 0])
            acc[0] += sec
            acc[1] += times
    return [(dt - op_s[0]) / n] if n else []
