"""What record and the runtime both decide about one op call: whether torch's checkpointing
ignores it (:data:`IGNORED_OPS`), whether it draws random numbers, and the clock ops are timed with."""

from __future__ import annotations

import time

import torch


def draws_random(func, args, kwargs) -> bool:
    """Does this call of a ``nondeterministic_seeded`` op draw random numbers? Decided from the
    call, not only the schema: SDPA with ``dropout_p=0``, dropout with ``p=0`` or ``train=False``
    draw nothing; everything else tagged seeded (``rand``, ``randn_like``, ``bernoulli_``,
    ``native_dropout``, SDPA with ``dropout_p > 0``...) does."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return True
    for i, a in enumerate(schema.arguments):
        if a.name not in _NO_DRAW_ARGS:
            continue
        if not a.kwarg_only and i < len(args):
            value = args[i]
        elif a.name in kwargs:
            value = kwargs[a.name]
        elif a.has_default_value():
            value = a.default_value
        else:
            continue
        if a.name == "train" and value is False:
            return False
        if a.name != "train" and isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
            return False
    return True


def op_clock():
    """The clock real recordings time ops with: ``time.thread_time`` when torch runs one
    intra-op thread (every CPU kernel then runs on the calling thread, so its CPU time is the
    op's, without the time a loaded machine makes the thread wait), else ``time.perf_counter``
    (several threads share a kernel: its wall time)."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


# Ops whose presence depends on how autograd saves tensors (saved-tensor hooks remove the
# ``detach`` of saved outputs), or that only query metadata: not counted, here or in the trace.
IGNORED_OPS = frozenset(str(op) for op in torch.utils.checkpoint.SAC_IGNORED_OPS) | {"aten.detach.default"}


# Arguments that, at these values, make a seeded op draw nothing: SDPA's ``dropout_p`` (every
# attention kernel is tagged seeded), dropout's ``p``, ``native_dropout``'s ``train``.
_NO_DRAW_ARGS = ("dropout_p", "p", "train")
