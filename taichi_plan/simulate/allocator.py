"""A model of PyTorch's CUDA caching allocator: what a plan's step *reserves*, not only what it allocates.

A GPU runs out of memory on reserved bytes (the segments the caching allocator holds from the
driver), not on the tensor bytes the simulator counts. This module replays the simulator's
ordered stream of allocations and frees (a plan's ``schedule``, see docs/plan-format.md) through
the allocator's documented rules, taken from ``c10/cuda/CUDACachingAllocator.cpp`` (see
docs/allocator.md for each rule and what is left out):

* sizes are rounded up to a multiple of 512 bytes (``kMinBlockSize``); zero-byte tensors take
  nothing;
* requests up to 1 MiB (``kSmallSize``) go to the *small* pool, larger ones to the *large* pool;
* a request no free block fits gets a new segment: 2 MiB (``kSmallBuffer``) for a small request,
  20 MiB (``kLargeBuffer``) for one under 10 MiB (``kMinLargeAlloc``), else the request rounded up
  to 2 MiB (``kRoundLarge``);
* the free block chosen is the best fit in the request's pool (smallest size, then lowest address);
* a block is split when what remains is at least 512 bytes (small pool) or more than 1 MiB
  (large pool, and only for requests under ``max_split_size``); with ``max_split_size`` set, a
  request under it never takes a block at or above it, and a larger request takes a block at most
  20 MiB larger than itself;
* a freed block goes back to its pool and merges with free neighbours of the same segment;
  segments are never given back (no ``empty_cache``), so reserved bytes never go down;
* ``expandable_segments``: one segment per pool that grows at its end by pages of 2 MiB (small
  pool) or 20 MiB (large pool), a free block at the end counting toward the growth, and every
  split kept when at least 512 bytes remain.

``allocated`` is the sum of the blocks handed out (PyTorch's ``allocated_bytes``, what
``torch.cuda.max_memory_allocated`` reads: a request's rounded size, or the whole block when it
is not split), ``reserved`` the sum of the segments (``torch.cuda.max_memory_reserved``).
No torch here.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import asdict, dataclass, replace

import numpy as np

MIB = 1 << 20
MIN_BLOCK_BYTES = 512  # kMinBlockSize
SMALL_SIZE_BYTES = 1 * MIB  # kSmallSize: largest request of the small pool
SMALL_BUFFER_BYTES = 2 * MIB  # kSmallBuffer: segment size of the small pool
LARGE_BUFFER_BYTES = 20 * MIB  # kLargeBuffer: segment for requests of 1-10 MiB
MIN_LARGE_ALLOC_BYTES = 10 * MIB  # kMinLargeAlloc: from here a request gets its own segment
ROUND_LARGE_BYTES = 2 * MIB  # kRoundLarge: own segments are rounded up to this
_EXPANDABLE_SPAN = 1 << 48  # address space of one expandable segment (only orders addresses)


@dataclass(frozen=True)
class AllocatorConfig:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` settings the model follows (PyTorch's defaults here)."""

    expandable_segments: bool = False
    """``expandable_segments:True``: one growing segment per pool instead of one per cudaMalloc."""
    max_split_size_bytes: int | None = None
    """``max_split_size_mb`` in bytes; None: unlimited (PyTorch's default), any block may be split."""
    passes: int = 2
    """Steps replayed back to back; the last one is reported (the steady state a measured step
    sees: the cache the earlier steps left behind)."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def parse(cls, text: str | None, strict: bool = True) -> AllocatorConfig:
        """The settings of a ``PYTORCH_CUDA_ALLOC_CONF`` string (``expandable_segments:True,
        max_split_size_mb:128``); options the model does not follow are refused by name, or
        passed over when not ``strict`` (the environment of a training run may hold any)."""
        out = cls()
        for item in filter(None, (part.strip() for part in (text or "").split(","))):
            key, sep, value = item.partition(":")
            key, value = key.strip(), value.strip()
            if not sep:
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF entry {item!r} is not of the form key:value")
            if key == "expandable_segments":
                if value not in ("True", "False"):
                    raise ValueError(f"expandable_segments must be True or False, not {value!r}")
                out = replace(out, expandable_segments=value == "True")
            elif key == "max_split_size_mb":
                if not value.isdigit() or int(value) <= 20:
                    raise ValueError(f"max_split_size_mb must be an integer above 20 (MiB), not {value!r}")
                out = replace(out, max_split_size_bytes=int(value) * MIB)
            elif strict:
                raise ValueError(f"the allocator model does not follow PYTORCH_CUDA_ALLOC_CONF option {key!r}; "
                                 "it follows expandable_segments and max_split_size_mb")
        return out


def round_size(nbytes: int) -> int:
    """A request's block size: at least 512 bytes, rounded up to a multiple of 512."""
    if nbytes < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    return MIN_BLOCK_BYTES * ((nbytes + MIN_BLOCK_BYTES - 1) // MIN_BLOCK_BYTES)


def is_small(size: int) -> bool:
    """Whether a rounded request goes to the small pool (at most 1 MiB)."""
    return size <= SMALL_SIZE_BYTES


def segment_size(size: int) -> int:
    """The segment a rounded request that no cached block fits gets from the driver."""
    if size <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return ROUND_LARGE_BYTES * ((size + ROUND_LARGE_BYTES - 1) // ROUND_LARGE_BYTES)


class Block:
    """A piece of a segment: handed out (``free`` False) or cached in its pool."""

    __slots__ = ("addr", "size", "free", "small", "prev", "next")

    def __init__(self, addr: int, size: int, small: bool):
        self.addr, self.size, self.small = addr, size, small
        self.free = True
        self.prev: Block | None = None
        self.next: Block | None = None

    def __repr__(self) -> str:
        return f"Block(addr={self.addr}, size={self.size}, free={self.free}, small={self.small})"


class _Pool:
    """Free blocks of one pool, ordered by (size, address) as PyTorch's ``BlockComparatorSize``."""

    def __init__(self):
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[tuple[int, int], Block] = {}

    def add(self, b: Block) -> None:
        key = (b.size, b.addr)
        insort(self.keys, key)
        self.blocks[key] = b

    def remove(self, b: Block) -> None:
        key = (b.size, b.addr)
        del self.keys[bisect_left(self.keys, key)]
        del self.blocks[key]

    def best_fit(self, size: int, skip: Block | None = None) -> Block | None:
        """The smallest free block of at least ``size`` (lowest address among equals), passing
        over ``skip`` when another block fits."""
        i = bisect_left(self.keys, (size, -1))
        if i == len(self.keys):
            return None
        b = self.blocks[self.keys[i]]
        if b is skip and i + 1 < len(self.keys):
            return self.blocks[self.keys[i + 1]]
        return b


class CachingAllocator:
    """PyTorch's CUDA caching allocator, one device and one stream, no memory limit.

    ``malloc(nbytes)`` returns the :class:`Block` handed out (None for zero bytes), ``free(block)``
    gives it back. ``allocated_bytes``/``reserved_bytes`` are the current totals and
    ``*_peak_bytes`` their maxima since :meth:`reset_peaks`.
    """

    def __init__(self, config: AllocatorConfig | None = None):
        self.config = config or AllocatorConfig()
        self.pools = {True: _Pool(), False: _Pool()}
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.allocated_peak_bytes = 0
        self.reserved_peak_bytes = 0
        self.segments = 0
        self._next_addr = 0
        # expandable segments: per pool, the block at the mapped end and where the mapping ends
        self._tail: dict[bool, Block | None] = {True: None, False: None}
        self._mapped_end: dict[bool, int] = {}

    def reset_peaks(self) -> None:
        """As ``torch.cuda.reset_peak_memory_stats``: peaks restart from the current totals."""
        self.allocated_peak_bytes = self.allocated_bytes
        self.reserved_peak_bytes = self.reserved_bytes

    # -- malloc ---------------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> Block | None:
        if nbytes <= 0:
            return None
        size = round_size(int(nbytes))
        small = is_small(size)
        block = self._free_block(size, small)
        if block is None:
            block = self._grow(size, small) if self.config.expandable_segments else self._new_segment(size, small)
        else:
            self.pools[small].remove(block)
        if self._should_split(block, size):
            rest = Block(block.addr + size, block.size - size, small)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self.pools[small].add(rest)
            if self._tail[small] is block:
                self._tail[small] = rest
        block.free = False
        self.allocated_bytes += block.size
        self.allocated_peak_bytes = max(self.allocated_peak_bytes, self.allocated_bytes)
        return block

    def _free_block(self, size: int, small: bool) -> Block | None:
        """PyTorch's ``get_free_block``: best fit in the pool, with the ``max_split_size`` rules.
        With expandable segments the free block at a segment's mapped end counts as as large as
        the segment can grow, so any other block that fits is taken first."""
        tail = self._tail[small] if self.config.expandable_segments else None
        b = self.pools[small].best_fit(size, skip=tail if tail is not None and tail.free else None)
        if b is None:
            return None
        limit = self.config.max_split_size_bytes
        if limit is not None:
            if size < limit <= b.size:
                return None  # do not hand an oversize block to a smaller request
            if size >= limit and b.size >= size + LARGE_BUFFER_BYTES:
                return None  # an oversize block may exceed its request by under 20 MiB
        return b

    def _should_split(self, b: Block, size: int) -> bool:
        remaining = b.size - size
        if b.small or self.config.expandable_segments:
            return remaining >= MIN_BLOCK_BYTES
        limit = self.config.max_split_size_bytes
        return (limit is None or size < limit) and remaining > SMALL_SIZE_BYTES

    def _new_segment(self, size: int, small: bool) -> Block:
        nbytes = segment_size(size)
        b = Block(self._next_addr, nbytes, small)
        self._next_addr += nbytes
        self._reserve(nbytes)
        self.segments += 1
        return b

    def _grow(self, size: int, small: bool) -> Block:
        """Expandable segments: map pages at the pool's segment end until a block of ``size``
        fits there (a free block at the end counts); returns that block, out of the pool."""
        page = SMALL_BUFFER_BYTES if small else LARGE_BUFFER_BYTES
        if small not in self._mapped_end:
            self._mapped_end[small] = self._next_addr
            self._next_addr += _EXPANDABLE_SPAN
            self.segments += 1
        tail = self._tail[small]
        have = tail.size if tail is not None and tail.free else 0
        mapped = page * ((size - have + page - 1) // page)
        self._reserve(mapped)
        if have:
            self.pools[small].remove(tail)
            tail.size += mapped
            b = tail
        else:
            b = Block(self._mapped_end[small], mapped, small)
            b.prev = tail
            if tail is not None:
                tail.next = b
        self._mapped_end[small] += mapped
        self._tail[small] = b
        return b

    def _reserve(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes
        self.reserved_peak_bytes = max(self.reserved_peak_bytes, self.reserved_bytes)

    # -- free -----------------------------------------------------------------------------------
    def free(self, block: Block | None) -> None:
        """Give ``block`` back: it merges with free neighbours of its segment and is cached."""
        if block is None:
            return
        if block.free:
            raise ValueError(f"{block!r} is freed twice")
        self.allocated_bytes -= block.size
        block.free = True
        pool = self.pools[block.small]
        for other in (block.prev, block.next):
            if other is not None and other.free:
                pool.remove(other)
                self._merge(block, other)
        pool.add(block)

    def _merge(self, dst: Block, src: Block) -> None:
        if src is dst.prev:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        if self._tail[dst.small] is src:
            self._tail[dst.small] = dst

    def free_segments(self) -> list[tuple[int, int]]:
        """(size, address) of every cached free block, small pool first (for tests and reports)."""
        return [*self.pools[True].keys, *self.pools[False].keys]


@dataclass
class AllocatorResult:
    """What the allocator model predicts for a schedule's step (the last pass replayed)."""

    allocated_peak_bytes: int  # blocks handed out, at most (torch.cuda.max_memory_allocated)
    reserved_peak_bytes: int  # segments held, at most (torch.cuda.max_memory_reserved)
    reserved_peak_event: int  # first event of the last pass where the reserved peak is reached, -1: at its start
    allocated_bytes: np.ndarray  # per event of the last pass, after its allocations
    reserved_bytes: np.ndarray  # per event of the last pass, after its allocations
    segments: int
    config: AllocatorConfig

    def summary(self) -> dict:
        return {"allocated_peak_bytes": int(self.allocated_peak_bytes),
                "reserved_peak_bytes": int(self.reserved_peak_bytes),
                "segments": int(self.segments), **self.config.to_dict()}


def replay_schedule(schedule: dict, config: AllocatorConfig | None = None) -> AllocatorResult:
    """Run a schedule (``{"initial", "nbytes", "events"}``, as ``simulate.build_schedule`` and
    plan files hold it) through the allocator model.

    The tensors in ``initial`` are allocated first, in order (parameters, buffers, optimizer
    state, inputs), then each event allocates its tensors in order and frees its freed ones.
    Between passes the step wraps as a training loop does: tensors made in the step that
    outlive it (gradients, which ``zero_grad(set_to_none=True)`` drops before the next step) are
    freed, and tensors of ``initial`` that the step freed are allocated again.
    """
    config = config or AllocatorConfig()
    if config.passes < 1:
        raise ValueError(f"passes must be at least 1, not {config.passes}")
    nbytes = {int(k): int(v) for k, v in schedule["nbytes"].items()}
    events = schedule["events"]
    initial = [int(t) for t in schedule["initial"]]
    al = CachingAllocator(config)
    # A re-run op allocates all its outputs, also a copy of one still live (freed at once):
    # so an id may be live more than once; a free gives back its latest copy.
    live: dict[int, list[Block | None]] = {}

    def alloc(t: int) -> None:
        live.setdefault(t, []).append(al.malloc(nbytes[t]))

    def free(t: int, i: int) -> None:
        copies = live.get(t)
        if not copies:
            raise ValueError(f"tensor {t} is freed at event {i} but is not live")
        al.free(copies.pop())
        if not copies:
            del live[t]

    for t in initial:
        alloc(t)
    alloc_trace = np.zeros(len(events), dtype=np.int64)
    reserved_trace = np.zeros(len(events), dtype=np.int64)
    initial_set = set(initial)
    start_reserved = 0
    for k in range(config.passes):
        if k:
            for t in sorted(set(live) - initial_set):
                while t in live:
                    free(t, -1)
            for t in initial:
                if t not in live:
                    alloc(t)
        al.reset_peaks()
        start_reserved = al.reserved_bytes
        for i, (_kind, _op, allocs, frees) in enumerate(events):
            for t in allocs:
                alloc(t)
            alloc_trace[i] = al.allocated_bytes
            reserved_trace[i] = al.reserved_bytes
            for t in frees:
                free(t, i)
    peak = al.reserved_peak_bytes
    peak_event = int(np.argmax(reserved_trace >= peak)) if peak > start_reserved else -1
    return AllocatorResult(
        allocated_peak_bytes=al.allocated_peak_bytes,
        reserved_peak_bytes=al.reserved_peak_bytes,
        reserved_peak_event=peak_event,
        allocated_bytes=alloc_trace,
        reserved_bytes=reserved_trace,
        segments=al.segments,
        config=config,
    )
