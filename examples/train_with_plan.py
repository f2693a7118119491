"""Train with a taichi-plan plan in a plain PyTorch loop.

    taichi-plan record --model gpt2 --layers 2 --hidden 128 --heads 4 --vocab 1000 --seq 64 \\
        --batch 4 -o traces/tiny-gpt2
    taichi-plan solve traces/tiny-gpt2 --budget 70% -o plans/tiny-gpt2.plan.json
    python examples/train_with_plan.py plans/tiny-gpt2.plan.json --steps 5

The loop is ordinary PyTorch; ``taichi_plan.apply`` is the only addition. The model is built
the way the trace's workload was (the same built-in config), because a plan is tied to the
op sequence it was solved for: a different model, batch or sequence length stops at the
first differing op with a clear error (or, with ``on_mismatch="warn"``, trains unplanned).
"""

from __future__ import annotations

import argparse

import torch

import taichi_plan
from taichi_plan.record import get_workload
from taichi_plan.runtime.calls import plan_and_trace


def main(argv: list[str] | None = None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)

    plan, trace = plan_and_trace(args.plan)
    wl = trace.meta["workload"]
    workload = get_workload(model=wl["name"], **wl["args"]) if wl["kind"] == "builtin" else \
        get_workload(entry=wl["name"], **wl["args"])
    torch.manual_seed(0)
    model, batch, loss_fn, optimizer = workload.build(False)  # your own model, batch, loss, optimizer

    # One unplanned step first, so the optimizer state exists as it did when the trace was recorded.
    optimizer.zero_grad(set_to_none=True)
    loss_fn(model(**batch) if isinstance(batch, dict) else model(batch), batch).backward()
    optimizer.step()

    model = taichi_plan.apply(model, plan, optimizer=optimizer)  # <- the only line a training loop adds
    losses = []
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        out = model(**batch) if isinstance(batch, dict) else model(batch)
        loss = loss_fn(out, batch)
        del out
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().item())
        print(f"step {step}: loss {losses[-1]:.4f}")
    taichi_plan.finish(model)                         # remove the hooks when done
    return losses


if __name__ == "__main__":
    main()
