"""The caching-allocator model, rule by rule, each against numbers computed by hand from
PyTorch's CUDACachingAllocator.cpp (docs/allocator.md)."""

from __future__ import annotations

import pytest

from taichi_plan.simulate.allocator import (
    AllocatorConfig,
    CachingAllocator,
    replay_schedule,
    round_size,
    segment_size,
)

KIB, MIB = 1 << 10, 1 << 20


def test_rounding_to_512_bytes():
    assert round_size(1) == 512
    assert round_size(512) == 512
    assert round_size(513) == 1024
    assert round_size(600_000) == 600_064  # 1172 * 512
    al = CachingAllocator()
    assert al.malloc(0) is None  # zero bytes take nothing
    assert (al.allocated_bytes, al.reserved_bytes) == (0, 0)
    al.malloc(1)
    assert (al.allocated_bytes, al.reserved_bytes) == (512, 2 * MIB)


def test_segment_sizes_per_pool():
    assert segment_size(1 * MIB) == 2 * MIB  # small pool: 2 MiB segments
    assert segment_size(1 * MIB + 512) == 20 * MIB  # 1-10 MiB: a 20 MiB segment
    assert segment_size(10 * MIB - 512) == 20 * MIB
    assert segment_size(10 * MIB) == 10 * MIB  # from 10 MiB: rounded up to 2 MiB
    assert segment_size(10 * MIB + 512) == 12 * MIB
    al = CachingAllocator()
    a = al.malloc(1 * MIB)  # small pool
    b = al.malloc(1 * MIB + 1)  # large pool: 1 MiB + 512
    assert a.small and not b.small
    assert al.reserved_bytes == 22 * MIB
    assert al.allocated_bytes == 2 * MIB + 512


def test_small_pool_packs_and_splits_down_to_512():
    al = CachingAllocator()
    for _ in range(3):  # 3 x 600,064 = 1,800,192 <= 2 MiB: one segment
        al.malloc(600_000)
    assert al.reserved_bytes == 2 * MIB
    assert al.free_segments() == [(2 * MIB - 3 * 600_064, 3 * 600_064)]
    al.malloc(600_000)  # 296,960 bytes left: a second segment
    assert al.reserved_bytes == 4 * MIB
    assert al.allocated_bytes == 4 * 600_064


def test_large_pool_splits_only_above_1_mib():
    al = CachingAllocator()
    al.malloc(5 * MIB)  # 20 MiB segment, split: 15 MiB cached
    assert al.allocated_bytes == 5 * MIB
    assert al.free_segments() == [(15 * MIB, 5 * MIB)]
    b = al.malloc(14 * MIB + 512 * KIB)  # 0.5 MiB would remain: not split, the whole 15 MiB is handed out
    assert b.size == 15 * MIB
    assert al.allocated_bytes == 20 * MIB
    assert al.reserved_bytes == 20 * MIB


def test_freed_block_is_reused_best_fit():
    al = CachingAllocator()
    a = al.malloc(12 * MIB)  # own 12 MiB segment
    b = al.malloc(16 * MIB)  # own 16 MiB segment
    al.free(a)
    al.free(b)
    c = al.malloc(11 * MIB)  # best fit: the 12 MiB block (not split: 1 MiB left), no new segment
    assert (c.addr, c.size) == (a.addr, 12 * MIB)
    assert al.reserved_bytes == 28 * MIB
    assert al.allocated_bytes == 12 * MIB


def test_free_neighbours_merge():
    al = CachingAllocator()
    a, b, c = al.malloc(5 * MIB), al.malloc(5 * MIB), al.malloc(5 * MIB)  # one 20 MiB segment, 5 MiB left
    al.free(a)
    al.free(b)  # merges with a: one 10 MiB free block
    assert al.free_segments() == [(5 * MIB, 15 * MIB), (10 * MIB, 0)]
    d = al.malloc(9 * MIB)  # fits the merged block (1 MiB left: not split)
    assert (d.addr, d.size) == (0, 10 * MIB)
    assert al.reserved_bytes == 20 * MIB
    assert al.allocated_bytes == 15 * MIB
    al.free(c)
    al.free(d)  # everything merges back into the segment
    assert al.free_segments() == [(20 * MIB, 0)]


def test_fragmentation_needs_a_new_segment():
    al = CachingAllocator()
    a = al.malloc(8 * MIB)
    al.malloc(8 * MIB)  # same 20 MiB segment, 4 MiB left
    al.free(a)  # 12 MiB free in two pieces (8 + 4) that do not touch
    al.malloc(10 * MIB)  # no piece fits: a new 10 MiB segment
    assert al.reserved_bytes == 30 * MIB
    assert al.allocated_bytes == 18 * MIB
    assert al.reserved_bytes - al.allocated_bytes == 12 * MIB


def test_segments_are_never_released():
    al = CachingAllocator()
    a = al.malloc(100 * MIB)
    al.free(a)
    assert (al.allocated_bytes, al.reserved_bytes) == (0, 100 * MIB)
    assert al.reserved_peak_bytes == 100 * MIB and al.allocated_peak_bytes == 100 * MIB
    al.reset_peaks()
    assert (al.allocated_peak_bytes, al.reserved_peak_bytes) == (0, 100 * MIB)


def test_max_split_size_keeps_oversize_blocks_whole():
    cfg = AllocatorConfig(max_split_size_bytes=32 * MIB)
    al = CachingAllocator(cfg)
    al.free(al.malloc(40 * MIB))
    al.malloc(12 * MIB)  # under the limit: the cached 40 MiB block is not offered
    assert al.reserved_bytes == 52 * MIB
    free = CachingAllocator()
    free.free(free.malloc(40 * MIB))
    free.malloc(12 * MIB)  # no limit: the 40 MiB block is split
    assert free.reserved_bytes == 40 * MIB
    assert free.allocated_bytes == 12 * MIB
    al = CachingAllocator(cfg)
    al.free(al.malloc(64 * MIB))
    al.malloc(40 * MIB)  # 64 >= 40 + 20: too much larger, a new segment
    assert al.reserved_bytes == 104 * MIB
    al = CachingAllocator(cfg)
    al.free(al.malloc(48 * MIB))
    b = al.malloc(40 * MIB)  # 48 < 40 + 20: taken whole (oversize blocks are never split)
    assert (b.size, al.reserved_bytes, al.allocated_bytes) == (48 * MIB, 48 * MIB, 48 * MIB)


def test_expandable_segments_grow_by_pages():
    al = CachingAllocator(AllocatorConfig(expandable_segments=True))
    a = al.malloc(8 * MIB)  # maps one 20 MiB page; 12 MiB left at the end
    al.malloc(8 * MIB)  # from the free end: 4 MiB left
    assert al.reserved_bytes == 20 * MIB
    al.free(a)
    al.malloc(10 * MIB)  # 8 MiB hole too small; the 4 MiB end grows by one page to 24 MiB
    assert al.reserved_bytes == 40 * MIB
    assert al.allocated_bytes == 18 * MIB
    assert al.segments == 1
    assert sorted(al.free_segments()) == [(8 * MIB, 0), (14 * MIB, 26 * MIB)]
    al.malloc(100)  # small pool: its own segment, 2 MiB pages
    assert al.reserved_bytes == 42 * MIB


def test_expandable_segments_prefer_a_hole_to_the_growing_end():
    al = CachingAllocator(AllocatorConfig(expandable_segments=True))
    a = al.malloc(6 * MIB)
    al.malloc(2 * MIB)  # 12 MiB free at the end
    al.free(a)  # a 6 MiB hole at the start
    c = al.malloc(5 * MIB)  # the end (12 MiB) is not the best fit: the hole is taken
    assert c.addr == 0
    assert al.allocated_bytes == 7 * MIB  # split even with 1 MiB left (expandable: >= 512 bytes)


def _schedule(initial, nbytes, events):
    return {"initial": initial, "nbytes": nbytes, "events": events}


def test_replay_schedule_allocates_initial_then_events():
    # a 4 MiB parameter, a 4 MiB gradient made in the step and kept, a 12 MiB activation
    sched = _schedule([1], {1: 4 * MIB, 2: 4 * MIB, 3: 12 * MIB},
                      [["run", 0, [3], []], ["run", 1, [2], [3]]])
    res = replay_schedule(sched, AllocatorConfig(passes=1))
    # param: 20 MiB segment (16 MiB left); activation: 12 MiB of it (4 MiB left, split);
    # gradient: the 4 MiB left (not split further), so nothing new is reserved
    assert res.reserved_peak_bytes == 20 * MIB
    assert res.allocated_peak_bytes == 20 * MIB
    assert res.allocated_bytes.tolist() == [16 * MIB, 20 * MIB]
    assert res.reserved_peak_event == -1  # the parameter reserved the segment before the step


def test_replay_schedule_wraps_the_step_between_passes():
    sched = _schedule([1], {1: 4 * MIB, 2: 4 * MIB, 3: 12 * MIB},
                      [["run", 0, [3], []], ["run", 1, [2], [3]]])
    res = replay_schedule(sched, AllocatorConfig(passes=2))
    # pass 2 starts with the gradient freed (set_to_none): the same blocks are reused
    assert res.reserved_peak_bytes == 20 * MIB
    assert res.allocated_bytes.tolist() == [16 * MIB, 20 * MIB]
    assert res.reserved_peak_event == -1  # nothing new reserved in the measured step


def test_replay_schedule_a_live_id_allocated_again_is_a_second_copy():
    # a re-run op allocates a copy of an output that is still live and frees it at once
    sched = _schedule([1], {1: 12 * MIB, 2: 12 * MIB},
                      [["run", 0, [2], []], ["recompute", 0, [2], [2]], ["run", 1, [], [2]]])
    res = replay_schedule(sched, AllocatorConfig(passes=1))
    assert res.allocated_bytes.tolist() == [24 * MIB, 36 * MIB, 24 * MIB]
    assert res.reserved_peak_bytes == 36 * MIB


def test_replay_schedule_refuses_inconsistent_streams():
    with pytest.raises(ValueError, match="not live"):
        replay_schedule(_schedule([], {1: 10}, [["run", 0, [], [1]]]))
