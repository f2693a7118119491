"""Train under FSDP2 with a plan solved for rank 0, in your own torchrun script.

Record rank 0's step of the 2-rank job on one CPU (no process group needed: it runs on
PyTorch's fake one), solve it for half its per-rank peak, then run the job:

    taichi-plan record --model gpt2 --layers 2 --hidden 64 --heads 4 --vocab 500 --seq 128 --batch 4 \
        --fake --fsdp 2 -o traces/tiny-gpt2-fsdp2
    taichi-plan solve traces/tiny-gpt2-fsdp2 --budget 50% -o plans/tiny-gpt2-fsdp2.plan.json
    torchrun --nproc_per_node 2 examples/train_fsdp_with_plan.py plans/tiny-gpt2-fsdp2.plan.json

With FSDP2's mixed precision (parameters gathered in bf16, gradients reduced in fp32, as most
sharded jobs run), record it so (``--fsdp-param-dtype bf16 --fsdp-reduce-dtype fp32``) and run
the job with the same ``MixedPrecisionPolicy`` (here: a second argument ``bf16``): a plan of one
precision is refused on a job of the other.

On GPUs: ``init_process_group("nccl")``, ``init_device_mesh("cuda", ...)`` and
``torch.cuda.set_device(local_rank)``; across nodes, torchrun's ``--nnodes``/``--rdzv-endpoint``.
The model must be sharded as it was recorded (each repeated block, then the root), each unit
with the ``reshard_after_forward`` the plan runs it with (``taichi_plan.reshard_settings(plan)``:
FSDP2 takes an int, resharding to a smaller mesh after forward, only in ``fully_shard``):
``apply`` refuses a plan of another layout. ``apply`` then sets each unit's bool
``reshard_after_forward`` as the plan decides (``decisions.reshard_after_forward``) and its
prefetching (``decisions.fsdp_prefetch``: ``set_modules_to_forward_prefetch`` /
``set_modules_to_backward_prefetch``), and ``finish`` restores them.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import taichi_plan
from taichi_plan.record import get_workload


def main(plan_path: str, precision: str | None = None, steps: int = 3) -> None:
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    # Your model, batch and loss, built as they were recorded (here: the built-in tiny GPT-2).
    torch.manual_seed(0)
    workload = get_workload(model="gpt2", layers=2, hidden=64, heads=4, vocab=500, seq=128, batch=4)
    model, batch, loss_fn, _ = workload.build(False)
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16"
              else MixedPrecisionPolicy())
    settings = taichi_plan.reshard_settings(plan_path)  # per unit: True, False, or ranks to reshard to
    for k, block in enumerate(model.transformer.h):
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=settings.get(f"transformer.h.{k}", True))
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=settings.get("", True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)  # after sharding: over the shards

    model = taichi_plan.apply(model, plan_path, optimizer=optimizer)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(**batch), batch)
        loss.backward()
        optimizer.step()
        # one write per line: the ranks share the terminal
        sys.stdout.write(f"rank {rank} step {step} loss {loss.item():.6f}\n")
        sys.stdout.flush()
    taichi_plan.finish(model)
    # let go of the model (its DDP reducer or FSDP state holds the group) while the group is up,
    # so that its destructor does not run in the interpreter's exit. (A rank still aborts in
    # gloo's teardown now and then, after training: "terminate called without an active
    # exception", about 1 run in 20 on CPU; tests/ranks.py.)
    del model, optimizer
    dist.barrier()  # every rank done before the group goes: a rank that leaves first can abort the other
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
