"""A user workload for ``taichi-plan record --entry``: copy it and put your own model in.

Run it from the repository root::

    taichi-plan record --entry examples.my_workload:make_step --batch 512 -o traces/mine
    taichi-plan solve traces/mine --budget 85%
    taichi-plan record --entry examples.my_workload:make_step --fake --batch 4096

At ``--batch 512`` the step peaks at 27.2 MB in backward; no plan goes below 21.2 MB (the
activations its backward needs). At the default ``--batch 32`` the optimizer step is the peak
(19.25 MB): parameters, gradients and AdamW state are live there, so with the recorded step no
budget below 100% can be reached; ``solve --optimizer auto`` (the default) then steps the
optimizer in backward, freeing each gradient once its parameter is updated, and reaches 16.4 MB.

The contract: ``make_step(**kwargs)`` returns ``(model, batch, loss_fn, optimizer)``.

- ``model``: an ``nn.Module``; the recorder calls ``model(**batch)`` for a dict batch,
  ``model(*batch)`` for a tuple, ``model(batch)`` for a tensor;
- ``loss_fn(output, batch)`` returns a scalar tensor;
- ``optimizer``: a ``torch.optim.Optimizer`` over the model's parameters.

``make_step`` receives the sizing flags given on the command line (``batch``, ``seq``,
``hidden``, ``layers``, ``dtype``, ...) that its signature names (or all of them with
``**kwargs``). Under ``--fake`` it runs inside a ``FakeTensorMode``: create every tensor
inside ``make_step``, do not read tensor values (no ``.item()``), and build modules in their
dtype (``nn.Linear(..., dtype=...)``) rather than converting them with ``.to(dtype)``:
PyTorch cannot convert a module's fake parameters ("Couldn't swap ...").
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class TinyClassifier(nn.Module):
    def __init__(self, features: int, hidden: int, layers: int, classes: int, dtype=torch.float32):
        super().__init__()
        kw = {"dtype": dtype}
        self.inp = nn.Linear(features, hidden, **kw)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(hidden, **kw), nn.Linear(hidden, 4 * hidden, **kw), nn.GELU(),
                nn.Linear(4 * hidden, hidden, **kw),
            )
            for _ in range(layers)
        )
        self.head = nn.Linear(hidden, classes, **kw)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def cross_entropy(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    return F.cross_entropy(logits, batch["labels"])


def make_step(batch: int = 32, hidden: int = 256, layers: int = 2, dtype: str = "fp32"):
    """Return (model, batch, loss_fn, optimizer) for one training step."""
    torch.manual_seed(0)
    features, classes = 64, 10
    model = TinyClassifier(features, hidden, layers, classes, dtype=_DTYPES[dtype])
    data = {
        "x": torch.randn(batch, features, dtype=_DTYPES[dtype]),
        "labels": torch.randint(0, classes, (batch,)),
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, data, cross_entropy, optimizer
