"""The state of one planned model call as the runtime runs it (:class:`Frame`: storages seen,
recipes, drops, handles, rebuilt storages, regions, offloads), and a recipe's parts: an op to
re-run (:class:`Step`) and the storage each of its tensor arguments views (:class:`TRef`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .call_plan import CallPlan


@dataclass(frozen=True)
class TRef:
    """A tensor argument in a recipe: which storage it views, and how."""

    sid: int
    dtype: torch.dtype
    device: torch.device
    size: tuple
    stride: tuple
    offset: int


@dataclass
class Step:
    func: object
    spec: object  # how (args, kwargs) were flattened: a _FlatSpec, or pytree's spec
    leaves: list  # leaves with tensors replaced by TRef
    out_pos: int | None  # flattened output index that is this storage (None: in-place write)
    rng: tuple | None  # (cpu state, {device: cuda state}) for random ops
    op: int = 0  # the op's index in its model call (rebuild groups run in this order)
    # Grad mode when it ran: some kernels make outputs only with grad enabled (the CPU LSTM's
    # mkldnn_rnn_layer returns its workspace, which backward reads, only then), so a rebuild
    # runs with the same mode. Its inputs are new tensors on the storages, requiring no
    # grad, so no graph is recorded either way.
    grad: bool = True


@dataclass
class Frame:
    """The state of one planned model call: recipes and handles, alive as long as autograd
    holds a handle of it."""

    call: CallPlan
    enabled: bool = True
    n: int = 0  # counted ops so far
    model: object = None  # a weak reference to the model called (read only to explain a mismatch)
    partition_depth: int = 0
    # partitioned modules (whole ones too) being run now: inside, the hooks on top are the
    # torch.utils.checkpoint the plan itself installed, not a foreign one (_foreign_hooks)
    checkpointed: int = 0
    sid_of: dict = field(default_factory=dict)  # live storage cdata -> sid
    alive: dict = field(default_factory=dict)  # sid -> weakref to the storage
    recipes: dict = field(default_factory=dict)  # sid -> [Step]
    dropped: dict = field(default_factory=dict)  # sid -> tensor id
    pending: dict = field(default_factory=dict)  # sid -> handles not unpacked yet
    cache: dict = field(default_factory=dict)  # sid -> rebuilt storage held for later handles
    building: dict = field(default_factory=dict)
    depth: int = 0  # rebuilds in progress (a rebuild rebuilds its gone inputs first)
    shared: dict | None = None  # while a group is rebuilt: its transients, re-made once
    trigger_of: dict = field(default_factory=dict)  # sid -> the rebuild group its last unpack runs
    trigger_pending: dict = field(default_factory=dict)  # sid -> its saved copies not unpacked yet
    next_sid: int = 0
    smaller: bool = False  # inputs no larger than the recorded ones in any dimension, some smaller
    entered: set = field(default_factory=set)  # partitioned modules whose wrapper ran in this call
    skipped: list = field(default_factory=list)  # (module, counted op) of the recorded calls it skipped
    module_seen: dict = field(default_factory=dict)  # module name -> its calls so far in this call
    # The mode and hooks are on: over the whole call, or inside a planned region now (frame.n
    # is the recorded op count only then).
    counting: bool = False
    # (module, name, first and last counted op, hooks context) of the planned region running
    # now; module None: the rest of the call is counted (_enter_rest)
    region: tuple | None = None
    pos: int = -1  # the recorded first op of the last module call entered (calls run in regions: _jumped)
    offloaded: dict = field(default_factory=dict)  # sid -> tensor id the plan offloads
    off_sid: dict = field(default_factory=dict)  # tensor id -> sid
    host: dict = field(default_factory=dict)  # sid -> (host copy, its copy's event, device) after the copy out
    restored: dict = field(default_factory=dict)  # sid -> (storage copied back, its event), held for its handles
    prefetch_of: dict = field(default_factory=dict)  # sid -> tensor ids whose copies back its last unpack issues
