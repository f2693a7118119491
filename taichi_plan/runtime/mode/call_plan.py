"""What the plan does in one recorded model call (:class:`CallPlan`), as
:func:`~taichi_plan.runtime.calls.call_plans` makes it from a plan and its trace and
:class:`~taichi_plan.runtime.mode.PlanRuntime` runs it: the ops to check, the tensors to drop
and offload, the recipes to keep, the partitions, the regions and the guards' recorded values."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CallPlan:
    """What the plan does in one recorded model call. Op indices are *counted* ops (the
    call's ops without ``IGNORED_OPS``), from 0 at the call's first op."""

    index: int  # which grad-enabled call of the step (0-based)
    ops: list  # (op name, module, {output index: bytes of the storage it creates})
    drops: dict[int, list[tuple[int, int]]]  # op -> [(flattened output index, tensor id)]
    recipe_ops: set[int] | None  # ops to keep recipes for (None: all)
    spans: dict[str, tuple[int, int]]  # partitioned module -> its op span in this call
    inputs: list  # [name, shape, dtype] per tensor input (the input-signature guard)
    grads_alive: bool | None  # whether gradients existed when the recorded call started
    training: bool = True
    # tensor id -> the simulator's rebuild group (the op before which it is rebuilt): a group's
    # dropped tensors are rebuilt together, their gone inputs re-made once for all of them.
    group_of: dict[int, int] = field(default_factory=dict)
    # Heads partitioned over tokens (module -> chunks) and the counted ops of this call that
    # their lazy logits do not run (the head's matmul, the loss ops on the logits): skipped.
    tokens: dict[str, int] = field(default_factory=dict)
    skip: frozenset = frozenset()
    # Run under the mode and hooks although the plan changes nothing here: what calibration
    # (taichi_plan.runtime.calibrate) measures the runtime's own cost on.
    probe: bool = False
    # op -> [(flattened output index, group)]: storages whose last unpack in backward runs
    # that rebuild group (one rebuilt early, before any of its tensors is unpacked).
    triggers: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    # Modules checkpointed whole (one chunk) whose outputs the plan drops: their forward runs
    # the recorded ops, so they are counted and tracked as any other (recipes, drops), where a
    # module split into chunks runs ops of its pieces, which are not counted.
    whole: frozenset = frozenset()
    # Counted op at which a recorded submodule call starts -> [(first, last, module)]: where the
    # call may go on after a live forward skipped it, outermost first (runtime.calls.module_calls, _resync).
    module_calls: dict = field(default_factory=dict)
    # module name -> the counted ops at which its recorded calls start, in order (runtime.calls.module_calls, _entered)
    module_starts: dict = field(default_factory=dict)
    # Counted ops that made or read a tensor sized by values (trace v11 meta.data_sized.ops): a
    # loop over what a step routes (a mixture of experts' experts hit) runs as many times as the
    # data says, so a live call may run fewer of them (_resync).
    sized_ops: frozenset = frozenset()
    # [count, bytes] of the model's parameters requiring grad when the call was recorded (trace
    # v12; None: older traces and sharded ones, not checked)
    trainable: tuple | None = None
    # The recorded step ran some of the model under saved-tensor hooks of its own (its own
    # activation checkpointing: trace v8 meta.forward_in_backward). Otherwise an op whose output
    # the plan drops must run with the runtime's hooks innermost (PlanRuntime._foreign_hooks).
    own_hooks: bool = False
    # The autocast the recorded call ran under (trace v13: "bf16", "fp16", None); "unknown" for
    # older traces, which are not checked (_autocast_problem).
    autocast: str | None = "unknown"
    # Planned regions (taichi_plan.problem.partition.regions): module name -> {its k-th call in this model call:
    # (first, last) counted op}. Where whole_call is False, the mode and saved-tensor hooks run
    # inside these module calls only (entered when the module is called, the op count set to
    # the call's recorded first op); elsewhere the forward runs with nothing of the runtime.
    regions: dict = field(default_factory=dict)
    # Run the mode and hooks over the whole call (a plan that drops in the model's top-level
    # code, traces without meta.module_args, calibration's probes).
    whole_call: bool = True
    # The counted ops at which the recorded module calls start, sorted (not the model's own
    # call, not calls inside a partitioned module or a head over tokens, which run uncounted):
    # outside the regions, a live forward that passes one without calling its module skipped it.
    entries: tuple = ()
    # Offloads (plan v14, taichi_plan/runtime/copies.py): op -> [(flattened output index, tensor
    # id)] of the storages it makes that the plan offloads; counted op -> [tensor id] copied to
    # host right after it runs (their last forward use); op -> [(flattened output index, [tensor
    # ids])]: saved tensors whose last unpack issues those copies back (the plan's prefetch points).
    offloads: dict = field(default_factory=dict)
    copy_out_at: dict = field(default_factory=dict)
    prefetch_triggers: dict = field(default_factory=dict)

    @property
    def active(self) -> bool:
        """Whether this call needs the dispatch mode and hooks at all."""
        return bool(self.drops) or bool(self.spans) or bool(self.tokens) or self.probe or bool(self.offloads)

    @property
    def lazy_only(self) -> bool:
        """The plan changes nothing in this call but heads split over tokens: their lazy logits
        and the loss's chunked function run through the head's wrapped forward and
        ``__torch_function__``, and the call runs without the dispatch mode and saved-tensor
        hooks (nothing is dropped, no op is counted). Its guards are the ones before the call
        (inputs, trainable parameters, autocast) and the lazy logits' own (a use that needs the
        full logits). Checking every op of the call cost a 4-layer GPT-2 or Llama about 8 ms a
        step (their heads' own split: 3-17 ms)."""
        return bool(self.tokens) and not (self.drops or self.spans or self.triggers or self.whole or self.probe
                                          or self.offloads)

    @property
    def in_regions(self) -> bool:
        """The mode and hooks run in the planned regions only (:attr:`regions`), not over the
        whole call: none at all where the call has none (a call that only partitions). The drop
        probe's plan and its copy that drops nothing (calibration) run in the same regions."""
        return not self.whole_call
