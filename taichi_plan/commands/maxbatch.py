"""``taichi-plan maxbatch --model M --budget B``: the largest batch that fits, per planner."""

from __future__ import annotations

import json

import click

from ..base.errors import BudgetError
from ..base.units import parse_budget
from ..explore.maxbatch import (
    DEFAULT_TIME_LIMIT,
    MAX_BATCH,
    fake_recorder,
    max_batch,
    parse_overhead,
    render_max_batch,
)
from ..trace.devices import get_profile
from ._common import Status, handle_errors, offload_options, size_options, units_option

DEFAULT_PROFILE = "a100-40gb"  # the recorder's default for fake runs

@click.command("maxbatch")
@click.option("--model", "model_name", metavar="NAME", help="Built-in model: mlp, gpt2, bert, llama, resnet50, vit.")
@click.option("--entry", metavar="MOD:FN", help="Your workload (its function must take batch=...).")
@size_options(batch=False)
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default="fp32", show_default=True)
@click.option("--optimizer", type=click.Choice(["sgd", "adamw"]), default=None, help="Built-in models only. [default: adamw]")
@click.option("--no-kv-cache", is_flag=True,
              help="gpt2, llama: config.use_cache = False, as training runs them. [default: transformers' setting, "
                   "whose forward keeps every layer's keys and values in a KV cache]")
@click.option("--device-profile", metavar="NAME", default=DEFAULT_PROFILE, show_default=True,
              help="Device the fake steps are costed on; its memory is the default budget. See `taichi-plan devices`.")
@click.option("--budget", "-b", default=None,
              help="Memory budget: 16GB, 16GiB or 512MB [default: the device profile's memory].")
@click.option("--max-overhead", default="33%", show_default=True,
              help="Most extra compute a plan may add, as % of the step (33% is about one extra forward).")
@click.option("--method", "-m", type=click.Choice(["auto", "ilp", "heuristic"]), default="auto", show_default=True,
              help="Our planner to size with (compared against none, sqrt-n, full and dtr).")
@click.option("--time-limit", default=DEFAULT_TIME_LIMIT, show_default=True, type=float,
              help="Seconds each solve may search.")
@click.option("--seed", default=0, show_default=True, type=int, help="Solver seed.")
@click.option("--limit", default=MAX_BATCH, show_default=True, type=int, help="Largest batch the search tries.")
@click.option("--fsdp", type=int, default=None, metavar="N",
              help="Search the batch per rank of an N-rank FSDP2 job (rank 0 recorded fake, docs/sharding.md).")
@click.option("--hsdp", "replicas", type=int, default=1, show_default=True, metavar="R",
              help="With --fsdp N: an HSDP job of R replicas of N/R-rank shard groups (docs/sharding.md).")
@click.option("--fsdp-param-dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="With --fsdp: FSDP2's MixedPrecisionPolicy(param_dtype=...). [default: the parameters' own]")
@click.option("--fsdp-reduce-dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="With --fsdp: MixedPrecisionPolicy(reduce_dtype=...). [default: the param dtype]")
@click.option("--guide", is_flag=True,
              help="Record batch 2 and 3 first and search each planner on steps drawn through them; then "
                   "recordings confirm each answer (fewer recordings: for large models).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of the table.")
@offload_options
@units_option
@handle_errors
def command(model_name, entry, seq, image_size, layers, hidden, heads, vocab, dtype, optimizer, no_kv_cache,
            device_profile, budget, max_overhead, method, time_limit, seed, limit, fsdp, replicas, fsdp_param_dtype,
            fsdp_reduce_dtype, guide, as_json, offload, host_budget, host_link, units) -> None:
    """The largest batch size whose training step fits the budget with extra compute within
    --max-overhead: for our planner, for no planning, sqrt(n) checkpointing, checkpointing every
    block and DTR (offline); a planner stopped by the overhead cap rather than the budget is
    named under the table, with its plan's extra compute."""
    from ..base.errors import UsageError

    profile = get_profile(device_profile)
    if budget is None:
        budget_bytes = profile.memory_bytes
    else:
        if budget.strip().endswith("%"):
            raise BudgetError(f"Budget {budget!r} is a percentage, but maxbatch has no baseline to take it of: "
                              "give a size such as 16GB or 16GiB (the default is the device's memory).")
        budget_bytes = parse_budget(budget)
    overhead = parse_overhead(max_overhead)
    if not (isinstance(time_limit, (int, float)) and time_limit > 0):
        raise UsageError(f"--time-limit must be a positive number of seconds, not {time_limit!r}.")
    if limit < 1:
        raise UsageError(f"--limit must be a positive batch size, got {limit}.")
    from ..torch_common.fsdp import mixed_precision

    off = _offload(profile, offload, host_budget, host_link, fsdp)

    with Status('searching') as status:
        record = fake_recorder(model_name, entry, device_profile=profile.name, progress=status, fsdp=fsdp,
                               replicas=replicas, mixed_precision=mixed_precision(fsdp_param_dtype, fsdp_reduce_dtype),
                               seq=seq,
                               image_size=image_size, layers=layers, hidden=hidden, heads=heads, vocab=vocab,
                               dtype=dtype, optimizer=optimizer, kv_cache=not no_kv_cache)
        result = max_batch(record, budget_bytes, method=method, max_overhead_pct=overhead, time_limit=time_limit,
                           seed=seed, limit=limit, progress=status, guide=guide, offload=off)
    result["workload"] = {"model": model_name, "entry": entry, "seq": seq, "image_size": image_size,
                          "layers": layers, "hidden": hidden, "heads": heads, "vocab": vocab, "dtype": dtype,
                          "optimizer": optimizer, **({"kv_cache": False} if no_kv_cache else {})}
    result["device_profile"] = profile.name
    result["fsdp"] = fsdp
    if fsdp is not None:
        result["hsdp_replicas"] = replicas
        result["fsdp_mixed_precision"] = mixed_precision(fsdp_param_dtype, fsdp_reduce_dtype)
    if as_json:
        click.echo(json.dumps(result, indent=1))
        return
    sizes = ", ".join(f"{k} {v}" for k, v in result["workload"].items()
                      if v is not None and k not in ("model", "entry"))
    title = f"{model_name or entry} ({sizes}), fake steps costed on {profile.name}"
    if fsdp is not None:
        title += f", rank 0 of {fsdp} FSDP2 ranks (batch per rank)"
        if replicas > 1:
            title += f", HSDP: {replicas} replicas of {fsdp // replicas}-rank shard groups"
        if fsdp_param_dtype or fsdp_reduce_dtype:
            title += (f", gathered in {fsdp_param_dtype or 'the parameters dtype'}, reduced in "
                      f"{fsdp_reduce_dtype or fsdp_param_dtype or 'it'}")
    click.echo(render_max_batch(result, title, units or "auto"), nl=False)


def _offload(profile, offload: bool, host_budget: str | None, host_link: float | None, fsdp: int | None):
    """The offload setting the flags ask for (``--host-link``, else the profile's host link)."""
    from ..base.errors import UsageError
    from ..base.units import parse_budget
    from ..problem.offload import OffloadConfig

    if not offload:
        if host_budget is not None or host_link is not None:
            raise UsageError("--host-budget and --host-link only apply with --offload; add --offload, or leave them out.")
        return None
    if fsdp is not None:
        raise UsageError("--offload is not planned for sharded jobs (--fsdp) yet: leave one of them out.")
    if host_link is not None and not host_link > 0:
        raise UsageError(f"The host link bandwidth must be above 0 GB/s, not {host_link!r}.")
    if host_budget is not None and str(host_budget).strip().endswith("%"):
        raise UsageError(f"--host-budget {host_budget!r}: give bytes (16GB, 512MB), not a percentage.")
    bw = host_link * 1e9 if host_link is not None else profile.host_link_bytes_per_s
    return OffloadConfig(bw, parse_budget(host_budget) if host_budget is not None else None)
