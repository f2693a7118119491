"""``taichi-plan solve TRACE --budget B``: a rematerialization plan under a memory budget."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import click

from ..base.units import format_bytes, format_cost, parse_budget
from ..plan.format import check_plan_output, save_plan
from ..problem.core import build_problem
from ..problem.optimizer.plan import CHOICES
from ..simulate.allocator import AllocatorConfig
from ..solve import MIN_TIME_LIMIT_S, PREFETCH_CHOICES, RESHARD_CHOICES, methods, solve
from ..trace.format import read_trace
from ._common import Status, handle_errors, offload_config, offload_options, units_option

DEFAULT_DIR = Path("plans")


def render_solve_summary(plan, units: str = "auto") -> str:
    p, s = plan.predicted, plan.solver

    def b(x):
        return format_bytes(x, units)

    unit = p["cost_unit"]
    lines = [
        f"Trace      {plan.trace['name']} ({plan.trace['num_ops']} ops)",
        f"Budget     {b(plan.budget_bytes)}",
        f"Baseline   peak {b(p['baseline_peak_bytes'])} at op {p['baseline_peak_op']}",
        f"Planned    peak {b(p['planned_peak_bytes'])} at op {p['planned_peak_op']}"
        + (" (while recomputing)" if p.get("planned_peak_in_recompute") else ""),
        f"Reserved   peak {b(p['planned_reserved_peak_bytes'])} (unplanned {b(p['baseline_reserved_peak_bytes'])}), "
        f"budget on {s.get('budget_on') or 'allocated'} bytes",
        f"Extra      {format_cost(p['extra_compute'], unit)} of compute, {p['extra_compute_pct']:.2f}% of the step "
        f"({p['recompute_ops']} recomputed ops, {len(plan.recompute)} tensors dropped)"
        + (f"; the replay runtime adds about {format_cost(p['runtime_overhead'], unit)}"
           if p.get("runtime_overhead") else ""),
    ]
    off = [u["module"] or "<root>" for u in (plan.reshard or {}).get("units", []) if u["reshard_after_forward"] is False
           and u["recorded"] is True]
    smaller = [f"{u['module'] or '<root>'} to {u['reshard_after_forward']} ranks"
               for u in (plan.reshard or {}).get("units", []) if not isinstance(u["reshard_after_forward"], bool)
               and u["recorded"] is True]
    if off or smaller:
        said = ([f"not resharding after forward: {', '.join(off)}"] if off else []) + (
            [f"resharding after forward {', '.join(smaller)}"] if smaller else [])
        lines.append(f"FSDP       {'; '.join(said)} (saves "
                     f"{format_cost(plan.reshard['step_compute_saved'], unit)} of backward all-gathers)")
    pf = plan.prefetch or {}
    if pf.get("units"):
        lines.append(f"FSDP       prefetch: early all-gathers forward {', '.join(m or '<root>' for m in pf['forward']) or '-'}"
                     f", backward {', '.join(m or '<root>' for m in pf['backward']) or '-'}; overlapped step "
                     f"{format_cost(pf['overlap']['step_time'], unit)} (FSDP's defaults "
                     f"{format_cost(pf['recorded_overlap']['step_time'], unit)})")
    if plan.optimizer is not None:
        lines.append(f"Optimizer  {plan.optimizer['mode']} ({plan.optimizer.get('chosen_by', 'asked')}): "
                     f"{plan.optimizer['why']}")
    if plan.offload is not None:
        cap = plan.offload.get("host_budget_bytes")
        lines.append(f"Offload    {len(plan.offloads)} tensors offloaded ({b(sum(o.nbytes for o in plan.offloads))}); "
                     f"host peak {b(p.get('host_peak_bytes') or 0)}" + (f" of {b(cap)}" if cap is not None else "")
                     + f"; the step waits {format_cost(p.get('stall_s') or 0.0, unit)} for copies (in the extra); "
                     f"host link {plan.offload['host_link_bytes_per_s'] / 1e9:g} GB/s")
    lb, gap = s.get("lower_bound"), s.get("gap")
    bound = (f"lower bound {format_cost(lb, unit)}, gap {100 * gap:.2f}%" if lb is not None and gap is not None
             else "no lower bound")
    lines.append(f"Solver     {s['method']}: {s['status']}, {bound}, {s['wall_s']:.2f} s")
    why = (plan.optimizer or {}).get("why")
    lines += [f"Note       {n}" for n in s.get("notes", []) if not (why and why in n)]  # the optimizer's is above
    return "\n".join(lines)


def command_started() -> float:
    """The ``time.perf_counter()`` value when this command started: when run as the
    ``taichi-plan`` program on Linux, when the process started (Python's start-up and imports,
    about a second, count against --time-limit); otherwise (called in-process, as by tests)
    now."""
    now = time.perf_counter()
    argv0 = Path(sys.argv[0] if sys.argv else "")
    if argv0.name != "taichi-plan" and argv0.resolve() != Path(__file__).resolve().parents[1] / "__main__.py":
        return now  # not our program (a test runner, a notebook): count from the call
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        age = float(Path("/proc/uptime").read_text().split()[0]) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return now
    return now - min(max(age, 0.0), 60.0)


def default_plan_path(trace_dir: Path) -> Path:
    """``plans/<name>.plan.json``, named after the trace directory the user chose (not the
    model name recorded inside it), so ``solve traces/vgg`` writes ``plans/vgg.plan.json``."""
    return DEFAULT_DIR / f"{Path(os.path.abspath(trace_dir)).name}.plan.json"


@click.command("solve")
@click.argument("trace_dir", metavar="TRACE", type=click.Path(path_type=Path))
@click.option("--budget", "-b", required=True, help="Memory budget: 16GB, 16GiB, 512MB or 60% (of the baseline peak).")
@click.option("--method", "-m", default="auto", show_default=True,
              help="auto, ilp, heuristic, or a baseline: none, full, sqrt-n, dtr, selective-mm.")
@click.option("--on", "budget_on", type=click.Choice(["allocated", "reserved"]), default="allocated",
              show_default=True, help="What the budget holds: allocated tensor bytes, or the bytes the CUDA "
              "caching allocator reserves (predicted by its model; docs/allocator.md).")
@click.option("--alloc-conf", default=None, metavar="CONF",
              help="The caching allocator settings the reserved peak is predicted for (expandable_segments:True, "
              "max_split_size_mb:N) [default: those of $PYTORCH_CUDA_ALLOC_CONF, else PyTorch's defaults].")
@click.option("--time-limit", default=60.0, show_default=True, type=float,
              help="Wall-clock seconds for the whole command (loading, warm start and search included); the best "
                   f"plan so far is written when it runs out. Honoured within 10% for limits of "
                   f"{MIN_TIME_LIMIT_S:g} s or more.")
@click.option("--work-limit", default=None, type=float,
              help="CP-SAT's deterministic time for the search (summed over its rounds): the same trace, budget, "
                   "seed and work limit give the same plan, as long as --time-limit is not reached first.")
@click.option("--optimizer", "optimizer", type=click.Choice(list(CHOICES)), default="auto", show_default=True,
              help="How the optimizer step runs: as-recorded; in-backward (each parameter updated as its gradient "
                   "is complete, gradients freed at once; loops without accumulation or clipping); groups (a foreach "
                   "step over subsets of the parameters); auto: the recorded step whenever a plan fits with it, "
                   "else what the loop allows.")
@click.option("--reshard", "reshard", type=click.Choice(list(RESHARD_CHOICES)), default="auto", show_default=True,
              help="Sharded traces (record --fsdp N): auto lets the planner choose which FSDP units keep their "
                   "gathered parameters from forward to backward (reshard_after_forward=False: no backward "
                   "all-gather, more memory) and which reshard to a smaller mesh of K ranks (an int: 1/K of "
                   "them held, the backward all-gather within that group); as-recorded keeps every unit as "
                   "recorded.")
@click.option("--prefetch", "prefetch", type=click.Choice(list(PREFETCH_CHOICES)), default="auto", show_default=True,
              help="Sharded traces: auto lets the planner choose which FSDP all-gathers are issued early (FSDP2's "
                   "set_modules_to_forward_prefetch / set_modules_to_backward_prefetch: the all-gather overlaps the "
                   "unit before, its buffer is held longer); as-recorded keeps FSDP's defaults.")
@click.option("--seed", default=0, show_default=True, type=int, help="Solver seed (same seed, same plan).")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="Plan file [default: plans/<TRACE directory's name>.plan.json].")
@click.option("--force", is_flag=True, help="Replace the plan file if it exists (only a plan, never other files).")
@click.option("--partition-random", is_flag=True,
              help="Allow partitioning modules that draw random numbers (dropout): their chunks draw their own "
                   "masks, so training changes statistically, not bitwise. The plan, inspect and replay say so.")
@offload_options
@units_option
@handle_errors
def command(trace_dir, budget, method, budget_on, alloc_conf, time_limit, work_limit, optimizer, reshard, prefetch,
            seed, output, force, partition_random, offload, host_budget, host_link, units) -> None:
    """Solve TRACE into a rematerialization plan whose simulated peak fits the budget."""
    started = command_started()
    if method not in methods():
        from ..base.errors import UsageError

        raise UsageError(f"Unknown method {method!r}; choose one of {', '.join(methods())}.")
    try:
        allocator = (AllocatorConfig.parse(alloc_conf) if alloc_conf is not None
                     else AllocatorConfig.parse(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), strict=False))
    except ValueError as e:
        from ..base.errors import UsageError

        where = "--alloc-conf" if alloc_conf is not None else "PYTORCH_CUDA_ALLOC_CONF"
        raise UsageError(f"{where}: {e}.") from e
    trace = read_trace(trace_dir)
    offload = offload_config(trace, offload, host_budget, host_link)
    if output is None:
        output = default_plan_path(trace_dir)
    check_plan_output(output, force, option="-o")
    problem = build_problem(trace)
    budget_bytes = parse_budget(budget, problem.baseline_peak[0])
    plan = _solve_with_progress(trace, problem, budget_bytes, method, time_limit, seed, on=budget_on,
                                allocator=allocator, work_limit=work_limit, started=started, optimizer=optimizer,
                                partition_random=partition_random, reshard=reshard, prefetch=prefetch,
                                offload=offload)
    click.echo(render_solve_summary(plan, units or "auto"))
    path = save_plan(plan, output, force=force)
    click.echo(f"Wrote {path}")


def _solve_with_progress(trace, problem, budget_bytes, method, time_limit, seed, on="allocated", allocator=None,
                         work_limit=None, started=None, optimizer="auto", partition_random=False, reshard="auto",
                         prefetch="auto", offload=None):
    unit = "s" if trace.cost_unit == "s" else "u"
    with Status("solving", time_limit, timed=True) as status:
        status.update(f"{method} (limit {time_limit:g}s)")

        def report(incumbent: float | None, bound: float) -> None:
            best = "no plan fits yet" if incumbent is None else f"best {incumbent:.4g}{unit}"
            status.update(f"{method}: {best}, bound {bound:.4g}{unit}")

        return solve(trace, budget_bytes, method, time_limit=time_limit, seed=seed, progress=report,
                     problem=problem, on=on, allocator=allocator, work_limit=work_limit, started=started,
                     optimizer=optimizer, partition_random=partition_random, reshard=reshard, prefetch=prefetch,
                     offload=offload)
