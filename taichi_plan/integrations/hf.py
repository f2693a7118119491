"""The Hugging Face ``Trainer``: record the step it runs, and train with a plan.

``record_trainer(trainer)`` records inside ``trainer.train()``: a callback starts the recorder
when the Trainer begins an optimizer step (``on_step_begin``, after it fetched the step's
micro-batches and counted ``num_items_in_batch``) and stops it when the optimizer has stepped
(``on_optimizer_step``). In between runs the Trainer's own code: ``training_step`` for each of
the ``gradient_accumulation_steps`` micro-batches (``compute_loss`` passing
``num_items_in_batch`` to the model, so the loss ops are the model's, scaled as the Trainer
scales them; ``accelerator.backward``), clipping to ``args.max_grad_norm``, and the optimizer
that ``trainer.create_optimizer()`` made. ``model.zero_grad()`` runs after the step, outside it,
as ``zero_grad(set_to_none=True)`` runs before a recorded step elsewhere.

``PlanCallback(plan)`` applies a plan to ``trainer.train()``: at ``on_train_begin`` it applies
the plan to the Trainer's model (:func:`taichi_plan.apply`), at each ``on_optimizer_step`` it
marks the step boundary, at ``on_train_end`` it calls :func:`taichi_plan.finish`. Evaluation
runs the model in eval mode under ``no_grad``: those calls run unplanned and untouched.

Needs ``transformers`` and ``accelerate`` (``pip install taichi-plan[hf]``).
"""

from __future__ import annotations

from collections.abc import Callable

try:
    from transformers import Trainer, TrainerCallback
except ImportError as e:  # transformers' Trainer imports accelerate
    raise ImportError(f"taichi_plan.integrations.hf needs transformers and accelerate ({e}): "
                      "pip install 'taichi-plan[hf]'.") from e

from ..base.errors import PlanError, UsageError, WorkloadError
from ..plan.format import Plan
from ..record.api import (
    StepRecording,
    add_python_refs,
    check_calls,
    device_type,
    dtype_name,
    step_tensors,
    trace_from_records,
)
from ..record.recorder.step_record import StepRecord
from ..record.workloads import torch_optimizer
from ..torch_common.loop import Loop
from ..trace.format import Trace

TRAINER_STEP_DEFINITION = (
    "one optimizer step of transformers.Trainer.train(), recorded from on_step_begin to on_optimizer_step: "
    "gradient_accumulation_steps x training_step (compute_loss with num_items_in_batch, backward), clipping to "
    "args.max_grad_norm, optimizer.step(); model.zero_grad() runs after the step (outside it), so gradients "
    "do not exist at the step start; the step's micro-batches exist before it (inputs)"
)


def trainer_loop(trainer: Trainer) -> Loop:
    """The shape of the step ``trainer`` runs, as a :class:`~taichi_plan.record.Loop`."""
    args = trainer.args
    clip = float(args.max_grad_norm) if args.max_grad_norm and args.max_grad_norm > 0 else None
    autocast = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else None
    return Loop(micro_batches=int(args.gradient_accumulation_steps), autocast=autocast, clip_grad_norm=clip)


class _RecordSteps(TrainerCallback):
    """Records optimizer steps ``warmup`` .. ``warmup + steps - 1`` of a ``train()`` run, then
    stops it; suppresses evaluation, checkpoints and logs meanwhile (they run between steps,
    outside what is recorded)."""

    def __init__(self, warmup: int, steps: int, batches: list, say: Callable[[str], None],
                 probe: Callable[[StepRecord], None]):
        self.warmup, self.steps, self.batches, self.say, self.probe = warmup, steps, batches, say, probe
        self.session: StepRecording | None = None
        self.model = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.model = model
        self.session = StepRecording(model, torch_optimizer(optimizer))

    def on_step_begin(self, args, state, control, **kwargs):
        k = state.global_step - self.warmup
        if 0 <= k < self.steps:
            self.say(f"recording step {k + 1}/{self.steps}")
            self.session.begin(list(self.batches))
        elif k < 0:
            self.say(f"warm-up step {state.global_step + 1}/{self.warmup}")

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.session is not None and self.session.active:
            rec = self.session.end()
            if len(self.session.records) == self.steps:
                self.probe(rec)  # while the Trainer's state (its optimizer, this step's batches) is as recorded

    def on_step_end(self, args, state, control, **kwargs):
        control.should_evaluate = control.should_save = control.should_log = False
        if state.global_step >= self.warmup + self.steps:
            control.should_training_stop = True

    def on_epoch_end(self, args, state, control, **kwargs):
        control.should_evaluate = control.should_save = control.should_log = False

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


def record_trainer(trainer: Trainer, *, steps: int = 2, warmup: int = 1, name: str | None = None,
                   progress: Callable[[str], None] | None = None) -> Trace:
    """Record one optimizer step of ``trainer`` exactly as ``trainer.train()`` runs it.

    Runs ``trainer.train()`` for ``warmup + steps`` optimizer steps (the model's weights change,
    as with :func:`taichi_plan.record.record`), records the last ``steps`` and keeps the last one;
    their op sequences must match. Evaluation, checkpoints and logs are suppressed during
    the recording. Afterwards the Trainer's optimizer and scheduler are set back to what they
    were (normally none, so the next ``train()`` makes fresh ones). The trace's ``meta.loop``
    is :func:`trainer_loop`'s: ``gradient_accumulation_steps`` micro-batches, clipping to
    ``max_grad_norm``.
    """
    if steps < 1:
        raise UsageError(f"steps must be at least 1, got {steps}.")
    if warmup < 0:
        raise UsageError(f"warmup must be >= 0, got {warmup}.")
    if not isinstance(trainer, Trainer):
        raise UsageError(f"record_trainer() needs a transformers.Trainer, not a {type(trainer).__name__}.")
    if any(isinstance(cb, PlanCallback) for cb in trainer.callback_handler.callbacks):
        raise UsageError("This Trainer already has a PlanCallback: record before adding the plan "
                         "(trainer.remove_callback(PlanCallback)), so that the trace is of the unplanned step.")
    say = progress or (lambda msg: None)
    loop = trainer_loop(trainer)
    batches: list = []
    saved = {a: getattr(trainer, a) for a in ("optimizer", "lr_scheduler")}
    overridden = "get_batch_samples" in vars(trainer)
    fetch = trainer.get_batch_samples

    def get_batch_samples(epoch_iterator, num_batches, device):
        # The Trainer's public hook that fetches a step's micro-batches and counts
        # num_items_in_batch, wrapped (on this instance, during the recording only) to see the
        # tensors the step starts with: they are the step's inputs.
        samples, num_items = fetch(epoch_iterator, num_batches, device)
        batches[:] = [samples, num_items]
        return samples, num_items

    def probe(rec: StepRecord) -> None:
        # When the step's Python code lets go of each storage (meta.python_refs): the Trainer's
        # own training_step on the step's first micro-batch, forward only (record.pyrefs).
        samples, num_items = batches
        model = callback.model
        optimizer = torch_optimizer(trainer.optimizer)
        add_python_refs(rec, model, optimizer,
                        lambda: trainer.training_step(trainer.model_wrapped, samples[0], num_items),
                        step_tensors(model, optimizer, list(batches)), None, say)

    callback = _RecordSteps(warmup, steps, batches, say, probe)
    trainer.get_batch_samples = get_batch_samples
    trainer.add_callback(callback)
    try:
        trainer.train()
    finally:
        trainer.remove_callback(callback)
        if overridden:
            trainer.get_batch_samples = fetch
        else:
            del trainer.get_batch_samples
        callback.close()
        for attr, value in saved.items():
            setattr(trainer, attr, value)
        trainer.accelerator.free_memory()  # the recording's prepared optimizer and scheduler
    records = callback.session.records if callback.session is not None else []
    if len(records) < steps:
        raise WorkloadError(
            f"record_trainer() needs {warmup + steps} optimizer steps of trainer.train(), but it ran "
            f"{warmup + len(records)}: let it run longer (args.max_steps, args.num_train_epochs, a larger "
            "train_dataset), or record fewer steps.")
    model = callback.model
    where = f"record_trainer({name or type(model).__name__!r})"
    check_calls(records[-1], loop, where)
    args = trainer.args
    return trace_from_records(records, warmup=warmup, fake=False, loop=loop, meta={
        "device": device_type(model),
        "workload": {"name": name or type(model).__name__, "kind": "hf_trainer",
                     "args": {"batch": int(args.per_device_train_batch_size),
                              "gradient_accumulation_steps": int(args.gradient_accumulation_steps),
                              "max_grad_norm": float(args.max_grad_norm)}},
        "device_profile": None,
        "dtype": dtype_name(model),
        "step_definition": TRAINER_STEP_DEFINITION,
    })


class PlanCallback(TrainerCallback):
    """Train with ``plan`` (a plan file or :class:`~taichi_plan.plan.format.Plan`): add it to a
    ``Trainer`` (``callbacks=[PlanCallback(plan)]`` or ``trainer.add_callback``).

    The plan and its trace are loaded and checked here, before training starts; ``trace``
    overrides where the plan says its trace is. ``on_mismatch``: as in :func:`taichi_plan.apply`
    (``"warn"`` runs a call that does not match, e.g. a smaller last batch, unplanned). The
    plan's trace must have been recorded with the Trainer's ``gradient_accumulation_steps``
    (:func:`record_trainer` does). :attr:`runtime` is the plan's runtime while training runs
    and after (its counters: ``planned_calls``, ``dropped_storages``, ``mismatches``).
    """

    def __init__(self, plan: Plan | str, *, on_mismatch: str = "raise", trace: Trace | str | None = None):
        from ..problem.optimizer.plan import plan_mode
        from ..runtime.calls import plan_and_trace

        if on_mismatch not in ("raise", "warn"):
            raise PlanError(f"on_mismatch must be 'raise' or 'warn', not {on_mismatch!r}.")
        self.plan, self.trace = plan_and_trace(plan, trace)
        mode = plan_mode(self.plan)
        if mode != "as-recorded":
            raise PlanError(
                f"The plan steps the optimizer {mode} (decisions.optimizer), which PlanCallback does not run: the "
                "Trainer steps its own (accelerate-wrapped) optimizer after clipping every gradient to "
                "args.max_grad_norm, and it reads the gradients, which stepping in backward frees. Solve the "
                "Trainer's trace again with --optimizer as-recorded (solve(..., optimizer=\"as-recorded\")).")
        self.on_mismatch = on_mismatch
        self.model = None
        self.runtime = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from ..replay import apply

        micro = int((self.trace.meta.get("loop") or {}).get("micro_batches", 1))
        if micro != args.gradient_accumulation_steps:
            raise PlanError(
                f"The plan's trace was recorded with {micro} micro-batch(es) per step, but this Trainer runs "
                f"gradient_accumulation_steps={args.gradient_accumulation_steps}: the plan's memory prediction "
                "does not hold for it. Record this Trainer (taichi_plan.integrations.hf.record_trainer) and "
                "solve again.")
        self.finish()  # a train() that raised never reached on_train_end
        self.model = apply(model, self.plan, on_mismatch=self.on_mismatch, trace=self.trace)
        self.runtime = model._taichi_plan["runtime"]

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.model is not None:
            self.runtime.end_step()

    def on_train_end(self, args, state, control, **kwargs):
        self.finish()

    def finish(self) -> None:
        """Remove the plan from the model (:func:`taichi_plan.finish`); ``on_train_end`` does."""
        from ..replay import finish

        if self.model is not None:
            finish(self.model)
            self.model = None
