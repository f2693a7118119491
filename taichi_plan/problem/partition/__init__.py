"""Tensor partition: run a module on ``k`` chunks of its input (MegTaiChi's second lever).

What the simulator models for a partitioned module ``m`` (called once per step, with a
contiguous forward span and a contiguous backward span in the trace):

* each chunk runs checkpointed (``runtime/partition.py``: the inputs ``split`` along dim 0,
  non-reentrant ``torch.utils.checkpoint`` per chunk, the outputs joined by ``cat``), so the
  module keeps only its inputs across the step;
* the span's own tensors are modelled event by event
  (:func:`taichi_plan.problem.partition.peaks.chunked_peaks`): each of its ops runs ``k``
  times on ``1/k`` pieces, the chunks' outputs wait for the ``cat``, the
  backward runs the chunks one after the other, each re-running its forward (early stop)
  before its first op that reads a saved tensor, holding the input-gradient pieces until
  ``split``'s backward joins them, and adding each later chunk's parameter gradients to the
  first chunk's out of place; the timeline gets, at each op of the span, the bytes of the
  span's own tensors at the worst of those moments, so measured == predicted to the byte
  (tests/test_partition_exact.py);
* the module's outputs and input gradients re-enter the timeline whole after the span,
  joined; chunk counts divide the batch, so every piece is exactly ``1/k``;
* extra compute: the module's forward once more, plus a launch overhead per op per chunk; on
  a real recording, what the runtime measured on the model's own modules instead
  (:func:`taichi_plan.problem.partition.cost.partition_cost`).

One chunk (``k = 1``) is the module checkpointed whole: the same model with nothing shrunk
and nothing joined (no concatenation, no gradient pieces, each parameter's gradient made
once); its outputs stay droppable (:func:`taichi_plan.problem.partition.tensors.whole_outputs`:
rebuilt through its insides from its held inputs, which the runtime does by re-running the
module's recorded ops). It needs
no batch dimension, only that no forward op of the module mixes samples or writes a
parameter or buffer (a re-run would update a running statistic twice); a module
that draws random numbers is an option at ``k = 1`` without the opt-in below, since the
re-run restores the RNG state its forward ran with and draws the same numbers.

A module qualifies along dim 0 (the batch) when none of its ops mixes samples (no batch
norm) and every tensor it makes has a leading size that is a multiple of the batch.
Imported graphs have no modules and are never partitioned; nor are traces without a workload
(hand-built ones), which have no model whose modules a replay could wrap.

A module whose forward draws random numbers (dropout) is a planner's option only when the
solve opts in (``Problem.partition_random``, ``solve --partition-random``): its chunks draw
their own numbers, so training changes, statistically. The plan records it per partition
(``Partition.random_draws``, :func:`taichi_plan.problem.partition.qualify.random_draws`):
``"as-unpartitioned"`` where the chunks provably draw what the whole batch would have (one
dropout in the module, a real CPU run: the CPU generator fills a Bernoulli mask element by
element, so chunk ``c`` draws the next slice of the same stream and leaves the generator where
the whole-batch op would), else ``"per-chunk"``. A plan naming a random module without that record is refused.

The modules, each importing only those listed before it: :mod:`.span` (what a span is),
:mod:`.qualify` (which modules qualify: mixing samples, random draws, state left behind, casts
of weights), :mod:`.position_span` and :mod:`.token_span` (spans over positions and over
tokens), :mod:`.tensors` (the tensors of a span), :mod:`.find` (the partitionable spans of a
problem and the planners' options), :mod:`.regions` and :mod:`.overhead` (what the runtime
costs a plan), :mod:`.cost` (a partition's cost), :mod:`.peaks` (the chunked peaks and the
backward's re-run), :mod:`.apply` (a problem with partitions applied) and :mod:`.floor` (the
least memory any plan needs).
"""
