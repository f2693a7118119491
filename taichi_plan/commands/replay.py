"""``taichi-plan replay PLAN``: measured peak and step time of a plan in real training."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..base.atomic import check_output, write_json_atomic
from ..base.units import format_bytes, format_cost
from ._common import Status, handle_errors


def render(r: dict) -> str:
    def pct(x):
        return "-" if x is None else f"{x:.3f}"

    lines = [
        f"Replay of {r['plan']} ({r['workload']}, {r['device']}, {r['steps']} steps each)",
        f"  budget             {format_bytes(r['budget_bytes']) if r['budget_bytes'] else '-'}",
        f"  peak predicted     {format_bytes(r['predicted_peak_bytes'])}",
        f"  peak measured      {format_bytes(r['measured_peak_bytes'])} (op {r['measured_peak_op']}), "
        f"ratio {pct(r['peak_ratio'])}, {'within' if r['within_budget'] else 'OVER'} budget",
        f"  unplanned peak     predicted {format_bytes(r['baseline_predicted_peak_bytes'])}, "
        f"measured {format_bytes(r['baseline_measured_peak_bytes'])}",
        *([f"  offload            {r['offload']['tensors']} tensors, host peak "
           f"{format_bytes(r['offload']['host_peak_bytes'] or 0)} predicted; {r['offload']['note']}"]
          if r.get("offload") and r["offload"].get("note") else
          [f"  offload            {r['offload']['tensors']} tensors, host peak "
           f"{format_bytes(r['offload']['host_peak_bytes'] or 0)} predicted"] if r.get("offload") else []),
        "  MemTracker peak    " + (f"- ({r.get('memtracker_note') or 'not measured'})"
                                  if r.get("memtracker_peak_bytes") is None or
                                  r.get("baseline_memtracker_peak_bytes") is None else
                                  f"planned {format_bytes(r['memtracker_peak_bytes'])}, unplanned "
                                  f"{format_bytes(r['baseline_memtracker_peak_bytes'])} (PyTorch's "
                                  "torch.distributed._tools MemTracker, one more step)"),
        f"  step time          unplanned {format_cost(r['step_s_unplanned'])}, planned "
        f"{format_cost(r['step_s_planned'])} (x{pct(r['step_time_ratio'])})",
        f"  extra compute      predicted {format_cost(r['predicted_extra_s']) if r['predicted_extra_s'] is not None else '-'}"
        f", measured in rebuilds {format_cost(r['measured_recompute_s'])} ({r['recompute_ops']} ops re-run)",
        "  extra time         predicted " + (
            "-" if r.get("predicted_extra_time_s") is None else
            f"{format_cost(r['predicted_extra_time_s'])} (runtime {format_cost(r['predicted_runtime_overhead_s'])})")
        + ", measured " + ("-" if r.get("measured_extra_time_s") is None else format_cost(r["measured_extra_time_s"]))
        + " (step time planned - unplanned)",
    ]
    if r.get("skipped_calls"):
        lines.append(f"  skipped calls      {r['skipped_calls']} recorded module call(s) the planned steps did not make "
                     "(layerdrop, a branch on a tensor's value): their ops did not run, the plan went on around them, "
                     "and the peak measured may be below the prediction")
    if r.get("skipped_sized_ops"):
        lines.append(f"  skipped iterations {r['skipped_sized_ops']} recorded op(s) of loop iterations over routed data "
                     "(a mixture of experts' experts that got no token) the planned step did not run")
    for run, c in (r.get("cuda") or {}).items():
        def b(x):
            return "-" if x is None else format_bytes(x)

        lines.append(f"  CUDA {run:<13} allocated {b(c['measured_allocated_bytes'])} measured / "
                     f"{b(c['predicted_allocated_bytes'])} predicted (x{pct(c['allocated_ratio'])}); reserved "
                     f"{b(c['measured_reserved_bytes'])} / {b(c['predicted_reserved_bytes'])} (x{pct(c['reserved_ratio'])})")
    mem = r.get("memory")
    if mem:
        lines.append(f"  memory             needs about {format_bytes(mem['needed_bytes'])}, "
                     f"{format_bytes(mem['available_bytes'])} of {mem['available_source']} here"
                     + (" (--force: ran anyway)" if mem.get("forced") else ""))
    if r.get("trace_mode") == "fake":
        lines.append("  note               the trace was recorded fake; replay ran it on real tensors")
    if r.get("random_draws"):
        lines.append(f"  random draws       {r['random_draws']}")
    if "grads_match" in r:
        lines.append(f"  gradients          {'match' if r['grads_match'] else 'DIFFER'} ({r['grads_check']}, "
                     f"max abs diff {r['grads_max_abs_diff']:.3g})")
    return "\n".join(lines)


def render_sharded(r: dict) -> str:
    lines = [f"Replay of {r['plan']} on {r['nproc']} {r['backend']} ranks ({r.get('parallelism', 'FSDP2')}), "
             f"{r['steps']} steps each",
             f"  budget             {format_bytes(r['budget_bytes']) if r['budget_bytes'] else '-'} per rank",
             f"  peak predicted     {format_bytes(r['predicted_peak_bytes'])} per rank (unplanned "
             f"{format_bytes(r['baseline_predicted_peak_bytes'])})"]
    for k in r["ranks"]:
        lines.append(
            f"  rank {k['rank']:<13} measured {format_bytes(k['measured_peak_bytes'])} (op {k['measured_peak_op']}), "
            f"ratio {k['peak_ratio']:.3f}, {'within' if k['within_budget'] else 'OVER'} budget; unplanned measured "
            f"{format_bytes(k['baseline_measured_peak_bytes'])}; {k['recompute_ops']} ops re-run; gradients "
            f"{'match' if k['grads_match'] and k['params_match'] else 'DIFFER'}")
    lines.append(f"  gradients          {'match' if r['grads_match'] else 'DIFFER'} ({r['grads_check']})")
    units = r["ranks"][0].get("reshard_after_forward") if r["ranks"] else None
    off = [m for m, on in units or () if on is False]
    smaller = [f"{m} to {on} ranks" for m, on in units or () if not isinstance(on, bool)]
    if units:
        said = ([f"not resharding after forward: {', '.join(off)}"] if off else []) + (
            [f"resharding after forward {', '.join(smaller)}"] if smaller else [])
        lines.append(f"  reshard            as run: {'; '.join(said)}" if said
                     else "  reshard            as run: every FSDP unit reshards after forward")
    prefetch = r["ranks"][0].get("fsdp_prefetch") if r["ranks"] else None
    if units and prefetch is not None:
        said = [f"{m or '<root>'} " + ", ".join(
            ([f"forward {'+'.join(t or '<root>' for t in v['forward'])}"] if v["forward"] else [])
            + (["no backward prefetch"] if v["backward"] == [] else [])) for m, v in prefetch.items()]
        lines.append(f"  prefetch           as run: {'; '.join(said)}" if said
                     else "  prefetch           as run: FSDP's defaults")
    return "\n".join(lines)


def _is_replay_report(path: Path) -> bool:
    """A report an earlier replay wrote, which a new one replaces (no other file is replaced)."""
    try:
        obj = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(obj, dict) and "plan" in obj and "measured_peak_bytes" in obj


@click.command("replay")
@click.argument("plan_path", metavar="PLAN", type=click.Path(path_type=Path))
@click.option("--steps", default=3, show_default=True, type=int, help="Timed steps per run.")
@click.option("--check-grads/--no-check-grads", default=True, show_default=True,
              help="Compare gradients and parameters with the unplanned run.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed for building both runs.")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="Report JSON [default: beside the plan, <plan>.replay.json].")
@click.option("--force", is_flag=True,
              help="Run even when the predicted peaks exceed this machine's memory (free CUDA memory, or "
                   "available RAM on CPU).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON instead of the text.")
@click.option("--trace", "trace_dir", type=click.Path(path_type=Path), default=None,
              help="The trace the plan was solved for, when it is not where the plan says (checked by content hash).")
@click.option("--nproc", type=int, default=None, metavar="N",
              help="A plan of a sharded or DDP trace (record --fsdp N, --ddp N): run N gloo ranks here, FSDP2 or "
                   "DDP, and report each rank's measured peak and whether its gradients match. See docs/sharding.md.")
@handle_errors
def command(plan_path: Path, steps: int, check_grads: bool, seed: int, output: Path | None, force: bool,
            as_json: bool, trace_dir: Path | None, nproc: int | None) -> None:
    """Rebuild the plan's workload, run it unplanned and planned, and compare the measured
    peak with the predicted one (also step time, extra compute and gradients). Refuses, before
    building anything, a plan whose predicted peaks exceed this machine's memory (--force to
    try anyway)."""
    from ..replay.measure import replay

    out = output or plan_path.with_name(plan_path.name.replace(".plan.json", "") + ".replay.json")
    check_output(out, True, what="replay report", option="-o", owned=_is_replay_report)
    if nproc is not None:
        from ..replay.distributed import replay_sharded

        with Status(f"replaying on {nproc} ranks"):
            report = replay_sharded(plan_path, nproc, steps=steps, seed=seed, trace=trace_dir)
    else:
        with Status("replaying") as status:
            report = replay(plan_path, steps=steps, check_grads=check_grads, seed=seed, force=force,
                            progress=status.update, trace=trace_dir)
    if as_json:
        click.echo(json.dumps(report, indent=1))
    else:
        click.echo(render_sharded(report) if nproc is not None else render(report))
    write_json_atomic(out, report, what="replay report")
    click.echo(f"Wrote {out}", err=as_json)
    if not report["within_budget"] or (check_grads and not report["grads_match"]):
        raise SystemExit(1)
