"""``taichi-plan record``: record one training step of a model into a trace directory."""

from __future__ import annotations

from pathlib import Path

import click

from ..base.units import format_bytes
from ..trace.devices import get_profile
from ..trace.format import check_trace_output
from ._common import Status, handle_errors, size_options


@click.command("record")
@click.option("--model", "model_name", metavar="NAME", help="Built-in model: mlp, gpt2, bert, llama, resnet50, vit.")
@click.option("--entry", metavar="MOD:FN", help="Your workload: a function returning (model, batch, loss_fn, optimizer).")
@size_options(batch=True)
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default="fp32", show_default=True)
@click.option("--optimizer", type=click.Choice(["sgd", "adamw"]), default=None, help="Built-in models only. [default: adamw]")
@click.option("--no-kv-cache", is_flag=True,
              help="gpt2, llama: config.use_cache = False, as training runs them. [default: transformers' setting, "
                   "whose forward keeps every layer's keys and values in a KV cache]")
@click.option("--fake", is_flag=True, help="Trace under FakeTensorMode: no memory, any size; costs are roofline estimates.")
@click.option("--device-profile", metavar="NAME", default=None,
              help="Device to cost a fake run on (default a100-40gb); metadata only for real runs. See `taichi-plan devices`.")
@click.option("--cpu-kernels", is_flag=True,
              help="With --fake and a GPU profile: record this torch's own kernels instead of mapping dropout, "
                   "attention and the optimizer to the GPU's (docs/gpu.md).")
@click.option("--steps", type=int, default=2, show_default=True, help="Steps recorded after one warm-up step.")
@click.option("--micro-batches", type=int, default=1, show_default=True,
              help="Gradient accumulation: forward + backward this many times per optimizer step.")
@click.option("--forwards", type=int, default=1, show_default=True,
              help="Model calls per backward (their losses averaged; all their activations alive at once).")
@click.option("--autocast", type=click.Choice(["bf16", "fp16"]), default=None,
              help="Run forward and loss under torch.autocast with this dtype.")
@click.option("--clip-grad-norm", type=float, default=None, metavar="X",
              help="clip_grad_norm_(model.parameters(), X) before the optimizer step.")
@click.option("--keep-grads", is_flag=True, help="zero_grad(set_to_none=False): gradients stay allocated between steps.")
@click.option("--fsdp", "fsdp", type=int, default=None, metavar="N",
              help="Rank 0 of an N-rank FSDP2 job, each block and the root sharded: with --fake on PyTorch's fake process "
                   "group (any N), else N gloo processes here. See docs/sharding.md.")
@click.option("--no-reshard-after-forward", is_flag=True,
              help="With --fsdp: fully_shard(..., reshard_after_forward=False): units keep their parameters "
                   "gathered from forward to backward.")
@click.option("--reshard-to", "reshard_to", type=int, default=None, metavar="K",
              help="With --fsdp: each block's fully_shard(..., reshard_after_forward=K): after forward its parameters "
                   "stay sharded over groups of K ranks (a factor of the shard group's size), and backward gathers "
                   "them within that group.")
@click.option("--fsdp-param-dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="With --fsdp: FSDP2's MixedPrecisionPolicy(param_dtype=...): each unit gathers its parameters, and "
                   "runs forward and backward, in this dtype. [default: the parameters' own]")
@click.option("--fsdp-reduce-dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="With --fsdp: MixedPrecisionPolicy(reduce_dtype=...): gradients are reduce-scattered in this dtype. "
                   "[default: the param dtype]")
@click.option("--hsdp", "replicas", type=int, default=None, metavar="R",
              help="With --fsdp N: HSDP, FSDP2 on a 2-D mesh (R, N/R): each unit sharded within a group of N/R ranks "
                   "and its gradients all-reduced across the R replicas (R divides N).")
@click.option("--ddp", "ddp", type=int, default=None, metavar="N",
              help="One rank of an N-rank DistributedDataParallel job, recorded for real in this process (a 1-rank "
                   "gloo group: a rank's memory does not depend on N); the all-reduces are costed over N ranks. "
                   "See docs/sharding.md#ddp.")
@click.option("--bucket-cap-mb", type=float, default=None, metavar="X",
              help="With --ddp: DDP's bucket_cap_mb (MiB per gradient bucket). [default: DDP's, 25]")
@click.option("--gradient-as-bucket-view", is_flag=True,
              help="With --ddp: DDP(gradient_as_bucket_view=True): the gradients are views of DDP's buckets.")
@click.option("--compile", "compile_backend", type=click.Choice(["inductor", "aot_eager"]), default=None,
              help="Record the step as torch.compile(model, backend=...) runs it: the ops of the graphs compile runs "
                   "(partitioned by AOTAutograd), for a plan that taichi_plan.apply() runs on the compiled model. "
                   "Real runs of one process only.")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="Trace directory. Default: traces/<model>-b<batch>...")
@click.option("--force", is_flag=True, help="Replace an existing trace directory (only a trace, never other files).")
@handle_errors
def command(model_name, entry, batch, seq, image_size, layers, hidden, heads, vocab, dtype, optimizer,
            no_kv_cache, fake, device_profile, cpu_kernels, steps, micro_batches, forwards, autocast, clip_grad_norm, keep_grads,
            fsdp, no_reshard_after_forward, reshard_to, fsdp_param_dtype, fsdp_reduce_dtype, replicas, ddp, bucket_cap_mb,
            gradient_as_bucket_view, compile_backend, output, force) -> None:
    """Record one training step (forward, backward, optimizer) into a trace directory."""
    from ..base.errors import UsageError
    from ..record import Loop, get_workload, record_workload
    from ..trace.format import baseline_peak, data_sized_note, write_trace

    if device_profile is not None:
        get_profile(device_profile)
    if steps < 1:
        raise UsageError(f"--steps must be at least 1, got {steps}.")
    loop = Loop(micro_batches=micro_batches, forwards=forwards, autocast=autocast, clip_grad_norm=clip_grad_norm,
                set_to_none=not keep_grads)
    workload = get_workload(
        model=model_name, entry=entry, batch=batch, seq=seq, image_size=image_size, layers=layers,
        hidden=hidden, heads=heads, vocab=vocab, dtype=dtype, optimizer=optimizer, kv_cache=not no_kv_cache,
    )
    if (no_reshard_after_forward or reshard_to is not None) and fsdp is None:
        raise UsageError("--no-reshard-after-forward and --reshard-to apply to sharded recordings: add --fsdp N.")
    if no_reshard_after_forward and reshard_to is not None:
        raise UsageError("--no-reshard-after-forward and --reshard-to K are two settings of reshard_after_forward: "
                         "give one of them.")
    if reshard_to is not None:
        from ..torch_common.fsdp import reshard_setting

        reshard_setting(reshard_to, fsdp // (replicas or 1), "--reshard-to")
    if replicas is not None and fsdp is None:
        raise UsageError("--hsdp R shards over a 2-D mesh of R replicas: add --fsdp N (N ranks in all).")
    if replicas is not None and fsdp is not None:
        from ..torch_common.fsdp import check_replicas

        check_replicas(fsdp, replicas)
    if (fsdp_param_dtype or fsdp_reduce_dtype) and fsdp is None:
        raise UsageError("--fsdp-param-dtype and --fsdp-reduce-dtype set FSDP2's MixedPrecisionPolicy: add --fsdp N "
                         "(for one process, record with --autocast or --dtype).")
    if ddp is not None and fsdp is not None:
        raise UsageError("--ddp and --fsdp are two layouts of a job: give one of them.")
    if ddp is None and (bucket_cap_mb is not None or gradient_as_bucket_view):
        raise UsageError("--bucket-cap-mb and --gradient-as-bucket-view are DDP's settings: add --ddp N.")
    if compile_backend is not None and (fake or fsdp is not None or ddp is not None):
        raise UsageError("--compile records a real step of one process as torch.compile runs it: leave out --fake, "
                         "--fsdp and --ddp (taichi-plan does not plan compiled sharded or fake steps yet).")
    if output is None:
        output = Path("traces") / (workload.default_output_name() + (f"-fsdp{fsdp}" if fsdp else "")
                                   + (f"-hsdp{replicas}" if replicas and replicas > 1 else "")
                                   + (f"-ddp{ddp}" if ddp else "") + ("-fake" if fake else "")
                                   + (f"-{compile_backend}" if compile_backend else ""))
    check_trace_output(output, force, option="-o")

    with Status('recording') as status:
        if fsdp is not None:
            from ..record.fsdp import record_fsdp_workload
            from ..torch_common.fsdp import mixed_precision

            trace = record_fsdp_workload(workload, fsdp, fake=fake, device_profile=device_profile, steps=steps, loop=loop,
                                         reshard_after_forward=(reshard_to if reshard_to is not None
                                                                else not no_reshard_after_forward),
                                         mixed_precision=mixed_precision(fsdp_param_dtype, fsdp_reduce_dtype),
                                         replicas=replicas or 1, progress=status.update)
        elif ddp is not None:
            from ..record.ddp import record_ddp_workload

            trace = record_ddp_workload(workload, ddp, bucket_cap_mb=bucket_cap_mb,
                                        gradient_as_bucket_view=gradient_as_bucket_view, fake=fake,
                                        device_profile=device_profile, steps=steps, loop=loop, progress=status.update)
        elif compile_backend is not None:
            from ..compiled import record_compiled

            model, batch, loss_fn, opt = workload.build(False)
            trace = record_compiled(model, batch, loss_fn, opt, backend=compile_backend, name=workload.name,
                                    steps=steps, loop=loop, args=workload.args, device_profile=device_profile,
                                    progress=status.update)
        else:
            trace = record_workload(workload, fake=fake, device_profile=device_profile, steps=steps, loop=loop,
                                    progress=status.update, gpu_kernels=not cpu_kernels)
    if not trace.meta["steps_match"]:
        m = trace.meta["first_mismatch"]
        click.echo(
            f"Warning: the recorded steps differ: step {m['step']} op {m['op_index']} is {m['got']}, "
            f"expected {m['expected']}. The trace keeps step {trace.meta['kept_step']}, the one that called the "
            "model's modules the most times. A plan made from it runs on steps that skip some of those calls "
            "(layerdrop), within its prediction, but stops at a step that calls a "
            "module this one did not: record more --steps to catch a step that calls every module.",
            err=True,
        )
    path = write_trace(trace, output, force=force)
    peak, at = baseline_peak(trace)
    click.echo(f"Wrote {path} ({len(trace.ops)} ops, peak {format_bytes(peak)} at op {at})")
    sized = data_sized_note(trace.meta)
    if sized is not None:
        click.echo(f"Note: {sized}")
    if trace.meta.get("ddp") is not None:
        d = trace.meta["ddp"]
        click.echo(f"One rank of {d['world_size']} (DDP): {len(d['buckets'])} gradient buckets, "
                   f"{format_bytes(sum(b['nbytes'] for b in d['buckets']))}"
                   + (", the gradients are views of them" if d["gradient_as_bucket_view"] else ""))
    tracker = (trace.meta.get("fsdp") or {}).get("mem_tracker")
    if tracker and tracker["peak_bytes"]:
        diff = 100.0 * (peak - tracker["peak_bytes"]) / tracker["peak_bytes"]
        shape = trace.meta["fsdp"].get("mesh_shape") or []
        hsdp = f" (HSDP: {shape[0]} replicas of {shape[1]}-rank shard groups)" if len(shape) == 2 else ""
        click.echo(f"Rank 0 of {trace.meta['fsdp']['world_size']}{hsdp}: FSDPMemTracker's peak for the same step is "
                   f"{format_bytes(tracker['peak_bytes'])} ({diff:+.2f}%)")
