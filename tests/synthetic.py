"""Small hand-built training-like traces for planner and simulator tests (no torch)."""

from __future__ import annotations

import random

from taichi_plan.trace.format import Trace, frame, op_signature


class TraceBuilder:
    """Append ops one by one; tensors are freed after their last access unless kept."""

    def __init__(self):
        self.ops, self.tensors, self.acc = [], [], []
        self.last_use: dict[int, int] = {}
        self.keep: set[int] = set()

    def tensor(self, nbytes: int, kind: str, producer: int = -1, keep: bool = False) -> int:
        tid = len(self.tensors)
        alloc = producer
        self.tensors.append(dict(tensor_id=tid, nbytes=nbytes, dtype="float32", shape=[nbytes // 4],
                                 kind=kind, producer_op=producer, alloc_op=alloc, free_op=-1))
        if keep or producer < 0:
            self.keep.add(tid)
        return tid

    def op(self, name: str, reads: list[int], out_bytes: list[int], phase: str = "forward",
           cost: float = 1.0, module: str = "", kind: str = "activation", recomputable: bool = True) -> list[int]:
        oid = len(self.ops)
        self.ops.append(dict(op_id=oid, step=0, phase=phase, op=name, module=module, duration_s=cost,
                             flops=int(cost * 1000), cost_source="measured",
                             recomputable=recomputable and phase != "optimizer", mutates=False))
        for k, t in enumerate(reads):
            self.acc.append(dict(op_id=oid, tensor_id=t, role="read", arg_index=k))
            self.last_use[t] = oid
        outs = []
        for k, nb in enumerate(out_bytes):
            t = self.tensor(nb, kind, producer=oid)
            self.acc.append(dict(op_id=oid, tensor_id=t, role="write", arg_index=k))
            self.last_use[t] = oid
            outs.append(t)
        return outs

    def build(self, name: str = "synthetic") -> Trace:
        for t in self.tensors:
            tid = t["tensor_id"]
            if tid not in self.keep:
                t["free_op"] = self.last_use.get(tid, t["alloc_op"])
        names = [o["op"] for o in self.ops]
        meta = {"name": name, "mode": "synthetic", "cost_unit": "s", "steps_match": True,
                "signature": op_signature(names)}
        return Trace(frame("ops", {k: [o[k] for o in self.ops] for k in self.ops[0]}),
                     frame("tensors", {k: [t[k] for t in self.tensors] for k in self.tensors[0]}),
                     frame("accesses", {k: [a[k] for a in self.acc] for k in self.acc[0]}),
                     meta)


def chain_trace(sizes: list[int], costs: list[float] | None = None, temp_bytes: int = 0,
                param_bytes: int = 8) -> Trace:
    """An L-layer chain: forward a_i = f_i(a_{i-1}), a loss, backward in reverse.

    Each layer's output is saved for its backward op; with ``temp_bytes`` each layer first
    makes a temporary that only the forward uses. Gradients are freed one op after use.
    """
    costs = costs or [1.0] * len(sizes)
    b = TraceBuilder()
    x = b.tensor(sizes[0], "input")
    params = [b.tensor(param_bytes, "parameter") for _ in sizes]
    acts = [x]
    for i, nb in enumerate(sizes):
        inp = acts[-1]
        if temp_bytes:
            (tmp,) = b.op("aten.mm.default", [inp, params[i]], [temp_bytes], cost=costs[i] / 2,
                          module=f"layers.{i}", kind="temporary")
            (a,) = b.op("aten.relu.default", [tmp], [nb], cost=costs[i] / 2, module=f"layers.{i}")
        else:
            (a,) = b.op("aten.mm.default", [inp, params[i]], [nb], cost=costs[i], module=f"layers.{i}")
        acts.append(a)
    (loss,) = b.op("aten.sum.default", [acts[-1]], [4], cost=0.1, kind="temporary")
    (g,) = b.op("aten.ones_like.default", [loss], [sizes[-1]], phase="backward", cost=0.1, kind="temporary")
    for i in reversed(range(len(sizes))):
        (g,) = b.op("aten.mm_backward", [g, acts[i + 1], acts[i], params[i]], [max(sizes[i - 1] if i else sizes[0], 4)],
                    phase="backward", cost=costs[i], module=f"layers.{i}", kind="temporary")
        b.tensor(param_bytes, "gradient", producer=len(b.ops) - 1, keep=True)
        b.acc.append(dict(op_id=len(b.ops) - 1, tensor_id=len(b.tensors) - 1, role="write", arg_index=1))
    for p in params:
        b.op("aten.add_.Tensor", [p], [], phase="optimizer", cost=0.01, module="")
        b.acc.append(dict(op_id=len(b.ops) - 1, tensor_id=p, role="write", arg_index=0))
    return b.build("chain")


def random_training_trace(rng: random.Random, layers: int | None = None) -> Trace:
    """A random layered forward (with skip connections and temporaries) and its backward."""
    L = layers or rng.randint(2, 9)
    b = TraceBuilder()
    x = b.tensor(rng.choice([16, 32, 64]), "input")
    acts = [x]
    for i in range(L):
        reads = [acts[-1]]
        if len(acts) > 2 and rng.random() < 0.3:
            reads.append(rng.choice(acts[:-1]))
        if rng.random() < 0.4:
            (tmp,) = b.op("aten.mm.default", reads, [rng.choice([8, 16, 48, 96])], cost=rng.choice([0.5, 1, 2]),
                          module=f"h.{i}", kind="temporary")
            reads = [tmp]
        (a,) = b.op(rng.choice(["aten.relu.default", "aten.gelu.default", "aten.mm.default"]), reads,
                    [rng.choice([8, 16, 32, 64, 128])], cost=rng.choice([0.5, 1, 2, 4]), module=f"h.{i}")
        acts.append(a)
    (loss,) = b.op("aten.sum.default", [acts[-1]], [4], cost=0.1, kind="temporary")
    (g,) = b.op("aten.ones_like.default", [loss], [16], phase="backward", cost=0.1, kind="temporary")
    for i in reversed(range(L)):
        reads = [g, acts[i + 1]] + ([acts[i]] if rng.random() < 0.6 else [])
        (g,) = b.op("aten.backward_op", reads, [rng.choice([8, 16, 32, 64])], phase="backward",
                    cost=rng.choice([0.5, 1, 2]), module=f"h.{i}", kind="temporary")
    return b.build("random")


def many_use_graph(rng: random.Random) -> Trace:
    """A small random forward-only graph (imported mode) whose tensors have many uses, as in
    ``random_layered`` (../shared/graphs): each op reads the one before it and up to two
    earlier tensors, so dropped tensors are rebuilt from dead inputs, kept or revived."""
    b = TraceBuilder()
    acts = [b.tensor(rng.choice([16, 32]), "input")]
    for i in range(rng.randint(5, 8)):
        reads = [acts[-1], *rng.sample(acts[:-1], min(len(acts) - 1, rng.choice([0, 1, 1, 2])))]
        (a,) = b.op(rng.choice(["aten.relu.default", "aten.mm.default", "aten.add.Tensor"]), reads,
                    [rng.choice([8, 16, 32, 64, 128])], cost=rng.choice([0.5, 1, 2, 4]), module=f"h.{i}")
        acts.append(a)
    b.op("aten.sum.default", [acts[-1]], [4], cost=0.1, kind="temporary")
    trace = b.build("many-use")
    trace.meta["mode"] = "imported"
    trace.ops["phase"] = "forward"
    return trace
