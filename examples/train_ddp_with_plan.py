"""Train under DistributedDataParallel with a plan solved for one rank, in your own torchrun script.

Record one rank's step of the 2-rank DDP job (one process: a DDP rank's memory does not
depend on the number of ranks), solve it for half its peak, then run the job:

    taichi-plan record --model gpt2 --layers 2 --hidden 64 --heads 4 --vocab 500 --seq 128 --batch 8 \
        --ddp 2 --bucket-cap-mb 0.1 -o traces/tiny-gpt2-ddp2
    taichi-plan solve traces/tiny-gpt2-ddp2 --budget 50% --time-limit 10 -o plans/tiny-gpt2-ddp2.plan.json
    torchrun --nproc_per_node 2 examples/train_ddp_with_plan.py plans/tiny-gpt2-ddp2.plan.json --bucket-cap-mb 0.1

DDP must be set up as it was recorded: the same ``bucket_cap_mb`` (``record --bucket-cap-mb``,
here ``--bucket-cap-mb`` too) and ``gradient_as_bucket_view``, and the same number of ranks;
``apply`` refuses a plan of another layout. On GPUs: ``init_process_group("nccl")``,
``torch.cuda.set_device(local_rank)``, the model on that device and
``DistributedDataParallel(model, device_ids=[local_rank])``; across nodes, torchrun's
``--nnodes``/``--rdzv-endpoint``.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import taichi_plan
from taichi_plan.record import get_workload


def main(plan_path: str, steps: int = 3, bucket_cap_mb: float | None = None,
         gradient_as_bucket_view: bool = False) -> None:
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank = dist.get_rank()

    # Your model, batch and loss, built as they were recorded (here: the built-in tiny GPT-2).
    torch.manual_seed(0)
    workload = get_workload(model="gpt2", layers=2, hidden=64, heads=4, vocab=500, seq=128, batch=8)
    model, batch, loss_fn, optimizer = workload.build(False)
    model = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=gradient_as_bucket_view)

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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bucket-cap-mb", type=float, default=None)
    parser.add_argument("--gradient-as-bucket-view", action="store_true")
    a = parser.parse_args()
    main(a.plan, a.steps, a.bucket_cap_mb, a.gradient_as_bucket_view)
