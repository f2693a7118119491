"""The shape of the training loop a trace records (no torch)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..base.errors import UsageError

AUTOCAST_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class Loop:
    """The shape of the training loop a trace records (``meta.loop``); replay runs the same.

    One step: ``micro_batches`` times [``forwards`` calls of the model on the batch, their
    losses averaged, scaled by ``1 / micro_batches``, backward], gradients accumulating; then
    ``clip_grad_norm_`` when ``clip_grad_norm`` is set, then ``optimizer.step()``. Before the
    step (outside it) ``optimizer.zero_grad(set_to_none=set_to_none)``. ``autocast`` (``bf16``,
    ``fp16``) runs the forwards and losses under ``torch.autocast``.
    """

    micro_batches: int = 1
    forwards: int = 1
    autocast: str | None = None
    clip_grad_norm: float | None = None
    set_to_none: bool = True

    def __post_init__(self):
        if self.micro_batches < 1:
            raise UsageError(f"--micro-batches must be at least 1, got {self.micro_batches}.")
        if self.forwards < 1:
            raise UsageError(f"--forwards must be at least 1, got {self.forwards}.")
        if self.autocast is not None and self.autocast not in AUTOCAST_DTYPES:
            raise UsageError(f"--autocast must be one of {', '.join(AUTOCAST_DTYPES)}, not {self.autocast!r}.")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise UsageError(f"--clip-grad-norm must be positive, got {self.clip_grad_norm}.")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_meta(cls, meta: dict) -> Loop:
        return cls(**{k: v for k, v in (meta.get("loop") or {}).items() if k in cls.__dataclass_fields__})
