"""Hand-written models whose Python code holds a tensor after its last use (tests of
``meta.python_refs``): in a local until the end of the block, in the tuple the model returns
(as ``output_attentions`` does), on ``self`` (until the next step replaces it)."""

from __future__ import annotations

import torch
from torch import nn

from taichi_plan.record.workloads import Workload

DIM, BATCH, LAYERS = 16, 256, 3


class Block(nn.Module):
    def __init__(self, dim: int, hold: str):
        super().__init__()
        self.hold = hold
        self.fc_a = nn.Linear(dim, 4 * dim)
        self.fc_b = nn.Linear(4 * dim, dim)
        self.fc_c = nn.Linear(dim, 4 * dim)
        self.fc_d = nn.Linear(4 * dim, dim)

    def forward(self, x):
        a = torch.tanh(self.fc_a(x))  # saved (tanh's output, fc_b's input); last forward use: fc_b
        y = self.fc_b(a) + x
        h = torch.relu(self.fc_c(y))  # ``a`` is still referenced here (local, tuple, self)
        y = self.fc_d(h) + y
        if self.hold == "self":
            self.kept = a  # held until the next step's forward replaces it
        return y, a


class Held(nn.Module):
    """``hold``: ``local`` (a local of each block, alive until the block returns), ``tuple``
    (every block's ``a`` returned in a tuple, as attention weights with output_attentions),
    ``self`` (stored on the block), ``none`` (deleted right after its last use)."""

    def __init__(self, hold: str, dim: int = DIM, layers: int = LAYERS):
        super().__init__()
        self.hold = hold
        self.blocks = nn.ModuleList(Block(dim, hold) for _ in range(layers))
        self.head = nn.Linear(dim, 1)

    def forward(self, x):
        kept = []
        for blk in self.blocks:
            x, a = blk(x)
            if self.hold == "tuple":
                kept.append(a)
            del a
        out = self.head(x)
        return (out, tuple(kept)) if self.hold == "tuple" else (out,)


def loss_fn(out, batch):
    return out[0].pow(2).mean()


def workload(hold: str) -> Workload:
    def build(fake: bool):
        torch.manual_seed(0)
        model = Held(hold)
        x = torch.randn(BATCH, DIM)
        return model, x, loss_fn, torch.optim.SGD(model.parameters(), lr=0.01)

    return Workload(f"held-{hold}", {"batch": BATCH}, build, "fp32", "python")
