"""The record of one step as the recorder writes it (``StepRecord``): the op, tensor and
access columns as plain lists, and what the step's meta says beside them (model calls,
incarnations of resized storages, random, data-sized and re-run ops, module arguments,
backward node starts)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepRecord:
    """Column lists of one recorded step (plain Python lists, turned into frames later)."""

    ops: dict[str, list] = field(default_factory=dict)
    tensors: dict[str, list] = field(default_factory=dict)
    accesses: dict[str, list] = field(default_factory=dict)
    shapes: list = field(default_factory=list)
    producer_phase: list = field(default_factory=list)
    calls: list = field(default_factory=list)  # the model's forward calls (see Recorder.model_hooks)
    incarnations: dict = field(default_factory=dict)  # storage key -> its rows (tensor ids), when resized
    extras: dict = field(default_factory=dict)  # what add-ons (record.fsdp) note about the step
    random_ops: list = field(default_factory=list)  # op ids that drew random numbers (draws_random)
    # Tensor ids whose size depends on tensor values (trace v11 meta.data_sized): made by an op
    # whose output size does (``nonzero``, ``x[mask]``: sizes_by_data), or by any op reading such a
    # tensor (a mixture of experts' ``hidden[token_idx]`` and everything its expert computes);
    # an in-place write keeps its storage's size. ``data_sized_ops``: the ops that made or read
    # them; ``data_sized_sources``: the ops whose own outputs are sized by values.
    data_sized: set = field(default_factory=set)
    data_sized_ops: set = field(default_factory=set)
    data_sized_sources: list = field(default_factory=list)
    # Op ids of forward code re-run inside backward by torch.utils.checkpoint: the model's own
    # activation checkpointing (Recorder._note_rerun).
    rerun_ops: list = field(default_factory=list)
    # Names (relative to the model) of the modules whose forward was called in the step: a
    # ModuleList or ModuleDict runs ops only through its children and is never called itself.
    called_modules: set = field(default_factory=set)
    # Per module, per forward call outside backward: [op id the call started at, tensor ids of
    # its arguments] (trace v10 meta.module_args). A module checkpointed by a plan holds every
    # tensor argument until its backward, those its ops never read too (a decoder layer's
    # position ids): the trace's reads alone miss them. Its calls are counted too: one called
    # several times back to back (ALBERT's shared layer group) runs its ops in one contiguous
    # run per forward, which the ops alone cannot tell from a single call.
    module_args: dict = field(default_factory=dict)
    # Op ids where backward starts running another autograd node (trace v9 meta.backward_nodes):
    # a node unpacks its saved tensors before its first op, which is when replay rebuilds one.
    node_starts: list = field(default_factory=list)

    @property
    def num_ops(self) -> int:
        return len(self.ops["op"])
