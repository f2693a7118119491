"""The plan runtime: what runs a plan inside a training step (the dispatch mode that drops, rebuilds
and offloads tensors, partitioned calls, the optimizer plan) and what it costs per op (calibrate).
Below ``record`` (which calibrates it) and ``replay`` (which applies and measures it)."""
