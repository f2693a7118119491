"""--entry workloads for the tests: the tiny GPT-2 that test_partition_random.py,
test_checkpoint_whole.py and test_partition_exact.py record, with its KV cache off
(``config.use_cache = False``, as transformers' gradient_checkpointing_enable() sets it).

The built-in ``gpt2`` keeps transformers' default (the cache on): each attention then appends
its keys and values to the cache, which the model's output holds, so no attention or block is
partitioned (``taichi_plan.problem.partition.qualify.leaves_state``). The tests of partitioned attentions and
blocks use this entry instead. ``--entry tests.kv_cache:without_cache`` from the repository root."""

from __future__ import annotations

SIZES = dict(layers=2, hidden=64, heads=2, vocab=64, seq=16)
ENTRY = "tests.kv_cache:without_cache"


def without_cache(batch: int = 4):
    from taichi_plan.record.workloads import builtin_workload

    model, data, loss_fn, opt = builtin_workload("gpt2", batch=batch, **SIZES).build(False)
    model.config.use_cache = False
    return model, data, loss_fn, opt
