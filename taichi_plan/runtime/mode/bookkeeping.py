"""The runtime's step bookkeeping (:class:`BookkeepingMixin`, composed by
:class:`~taichi_plan.runtime.mode.PlanRuntime`): where a training step ends (:meth:`end_step`,
which says so when a step called the model more often than the recorded one), the optimizer's
state against the recorded step's (:meth:`check_state`), and the counters measured since the
last reset."""

from __future__ import annotations


class BookkeepingMixin:
    """The step bookkeeping of :class:`~taichi_plan.runtime.mode.PlanRuntime`: the end of a
    step, the optimizer's state against the recorded step's, the counters."""

    def reset_counters(self) -> None:
        self.recompute_s = 0.0
        self.recompute_ops = 0
        self.dropped_storages = 0
        self.planned_calls = 0
        self.skipped_calls = 0
        self.skipped_sized_ops = 0
        self.regions_run = 0
        self.copies = []

    def end_step(self) -> None:
        """The optimizer stepped: the next call is the first of a new step. Says so when this
        step called the model more often than the recorded one. Fewer calls (the last step of
        an epoch, with fewer micro-batches left) each ran their recorded call's plan, and the
        calls not made hold nothing: within the prediction."""
        n, want = self._index, self.step_at
        self._graphs.clear()
        self.steps_seen += 1
        # a step whose recorded calls go on after optimizer.step() continues at the first of them
        self._index = 0 if want >= len(self.calls) else want
        if n and want and n > want:
            self._mismatch(
                f"This training step called the model {n} time(s) with grad before optimizer.step(), but "
                f"the plan's trace has {want} ({self._loop_words()}). The plan's memory prediction holds only for "
                "the recorded loop: record it with the same loop (taichi-plan record --micro-batches N) and "
                "solve again.", once=True)

    def check_state(self, optimizer, at_apply: bool = False) -> None:
        """Once the optimizer holds state (after a warm-up step, or the first planned step): its
        bytes against the recorded step's. An optimizer with more state than the recorded one
        (AdamW's two moments where the recording ran SGD with momentum) puts every step that many
        bytes over the plan's prediction: a 2-layer GPT-2 recorded with SGD, planned at 70% and
        trained with AdamW peaked 15.21 MB against its 12.71 MB budget, with nothing said. Less
        state is within the prediction. One pass over the state, once. ``at_apply``: called by
        ``apply()`` (the state of a warm-up step): raises :class:`MismatchError` there unless the
        plan was applied with ``on_mismatch="warn"``; after a step, it warns (the step ran)."""
        if self._state_checked or self.state_bytes is None or not optimizer.state:
            return
        self._state_checked = True
        from ...torch_common.step import optimizer_state

        storages = {st._cdata: st.nbytes() for st in (v.untyped_storage() for v in optimizer_state(optimizer))}
        live, count = sum(storages.values()), sum(1 for b in storages.values() if b)
        want, n = self.state_bytes
        if live <= want:
            return
        from ...base.units import format_bytes

        self._mismatch(
            f"The optimizer ({type(optimizer).__name__}) holds {format_bytes(live)} of state in {count} tensors, "
            f"where the plan's recorded step held {format_bytes(want)} in {n}: every step holds "
            f"{format_bytes(live - want)} more than the plan's prediction, which can put it over the budget. Record "
            "the step with this optimizer (taichi-plan record --optimizer, or the optimizer your --entry returns) "
            "and solve again.", once=not at_apply or self.on_mismatch == "warn")

    def _loop_words(self) -> str:
        mb = self.loop.get("micro_batches", 1)
        return f"recorded with {mb} micro-batch{'es' if mb != 1 else ''} per step"
