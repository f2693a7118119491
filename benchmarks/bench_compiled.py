"""Compiled training (issue 44): our compiled plans against PyTorch's ``activation_memory_budget``.

For each model (the replay benchmark's configs, CPU, inductor, 1 thread): the step compiled
plainly and under ``torch._functorch.config.activation_memory_budget`` in {0.7, 0.5, 0.3, 0.1},
each measured (peak: the profiler's memory events, :func:`taichi_plan.compiled.compiled_peak`;
step: wall time); then our plan of the compiled trace solved at each of those measured peaks
and at the least budget ``solve`` knows it meets, applied to ``torch.compile(model)`` and
measured the same way. Every variant is compiled once, up front (each with a backend object
of its own, so dynamo keeps one cache entry per variant), then the steps are timed
interleaved, one step of each variant per round, ``REPS`` rounds; medians.

``python -m benchmarks.bench_compiled [MODEL ...]`` prints JSON rows; ``--markdown FILE...``
turns saved rows into the docs table.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

BUDGETS = (0.7, 0.5, 0.3, 0.1)
REPS = 7
# Seconds for finding the least budget solve meets: its bisection's local searches share them (a
# compiled Phi's bisection: given 5 s it named 146.1 MB, given 10 s 134.5 MB, used 2.2 s of them;
# it stops when done, so the margin costs nothing).
LEAST_S = 60
SIZES = {"layers": 4, "hidden": 256, "heads": 4, "vocab": 8192, "seq": 128, "batch": 4}
MODELS = {
    "GPT-2 4L h256 b4 s128": ("gpt2", SIZES),
    "BERT 4L h256 b4 s128": ("bert", SIZES),
    "Llama 4L h256 b4 s128": ("llama", SIZES),
    "ViT 4L h256 b8 128px": ("vit", {"layers": 4, "hidden": 256, "heads": 4, "image_size": 128, "batch": 8}),
    # a model no test builds: Phi's parallel attention + MLP blocks, partial rotary embeddings
    "Phi 4L h256 b4 s128": ("benchmarks.bench_compiled:phi", SIZES),
}


def phi(batch: int, seq: int, layers: int, hidden: int, heads: int, vocab: int, dtype: str = "fp32"):
    """An entry workload (``--entry benchmarks.bench_compiled:phi``): a Phi causal LM from its
    config, next-token loss, AdamW."""
    import torch
    from transformers import PhiConfig, PhiForCausalLM

    if dtype != "fp32":
        raise ValueError(f"the Phi benchmark workload is fp32 only, not {dtype}")
    cfg = PhiConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                    intermediate_size=4 * hidden, vocab_size=vocab, max_position_embeddings=max(2048, seq),
                    attn_implementation="sdpa")
    model = PhiForCausalLM(cfg)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    return (model, {"input_ids": ids, "labels": ids.clone()}, lambda out, b: out.loss,
            torch.optim.AdamW(model.parameters(), lr=1e-4))


def _amb_backend(budget: float):
    """Inductor with ``activation_memory_budget=budget`` while it compiles (a new object each call)."""
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        with functorch_config.patch(activation_memory_budget=budget):
            return compile_fx(gm, example_inputs)

    return backend


def run_model(label: str, progress=lambda msg: None) -> dict:
    import torch

    import taichi_plan
    from taichi_plan.base.errors import InfeasibleBudgetError
    from taichi_plan.compiled import compiled_peak, record_compiled
    from taichi_plan.record import get_workload
    from taichi_plan.record.api import make_step_fn
    from taichi_plan.solve import solve
    from taichi_plan.trace.format import write_trace

    torch.set_num_threads(1)
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.accumulated_cache_size_limit = 512
    name, sizes = MODELS[label]
    workload = get_workload(entry=name, **sizes) if ":" in name else get_workload(model=name, **sizes)

    def build():
        torch.manual_seed(0)
        return workload.build(False)

    model, batch, loss_fn, opt = build()
    state = copy.deepcopy(model.state_dict())
    t0 = time.perf_counter()
    trace = record_compiled(model, batch, loss_fn, opt, backend="inductor", name=name, steps=1)
    record_s = time.perf_counter() - t0
    tmp = Path(tempfile.mkdtemp()) / "trace"
    write_trace(trace, tmp)
    progress(f"{label}: recorded in {record_s:.0f} s")

    def fresh():
        m, b, lf, o = build()
        m.load_state_dict(state)
        return m, b, lf, o

    variants: dict[str, dict] = {}  # name -> {"step", "model", "opt", "batch", and what the table shows}

    def add(key, compiled, parts, **info):
        m, b, lf, o = parts
        variants[key] = {"step": make_step_fn(compiled, b, lf, o), "model": compiled, "opt": o, "batch": b, **info}

    p = fresh()
    add("plain", torch.compile(p[0]), p)
    p = fresh()  # the same program again: its step / plain is the A/A margin of the timings
    add("plain A/A", torch.compile(p[0]), p)
    for budget in BUDGETS:
        p = fresh()
        add(f"amb {budget}", torch.compile(p[0], backend=_amb_backend(budget)), p, budget=budget)

    def measure(key):
        v = variants[key]
        for _ in range(2):  # compiles (twice where the first step changes what compile guards on: ViT's loss)
            v["opt"].zero_grad(set_to_none=True)
            v["step"]()
        v["opt"].zero_grad(set_to_none=True)
        torch.manual_seed(1)
        v["peak"] = compiled_peak(v["step"], v["model"], v["opt"], list(v["batch"].values()))["peak_bytes"]

    for key in list(variants):
        measure(key)
        progress(f"{label}: {key} peak {variants[key]['peak']:,}")

    plans = {}
    for budget in BUDGETS:
        try:
            plans[f"ours @ amb {budget}"] = solve(trace, int(variants[f"amb {budget}"]["peak"]), time_limit=20)
        except InfeasibleBudgetError as e:
            plans[f"ours @ amb {budget}"] = f"no plan: least budget {e.min_budget_bytes}"
    try:  # solve's infeasible path finds the least budget it is known to meet
        solve(trace, 1, time_limit=LEAST_S)
    except InfeasibleBudgetError as e:
        plans["ours least"] = solve(trace, int(e.min_budget_bytes), time_limit=20)
    ours = []
    for key, plan in plans.items():
        if isinstance(plan, str):
            variants[key] = {"failed": plan}
            continue
        plan.trace["path"] = plan.trace["path_absolute"] = str(tmp)
        p = fresh()
        torch._dynamo.reset()
        planned = taichi_plan.apply(torch.compile(p[0]), plan)
        add(key, planned, p, predicted=int(plan.predicted["planned_peak_bytes"]), budget_bytes=int(plan.budget_bytes))
        ours.append(key)
    for key in ours:  # compiled after every apply (apply resets dynamo's caches)
        measure(key)
        progress(f"{label}: {key} peak {variants[key]['peak']:,} predicted {variants[key]['predicted']:,}")
    for key in variants:  # the plain ones were compiled before the resets: compile them again, untimed
        if "step" in variants[key] and key not in ours:
            variants[key]["opt"].zero_grad(set_to_none=True)
            variants[key]["step"]()

    times: dict[str, list[float]] = {k: [] for k, v in variants.items() if "step" in v}
    for _ in range(REPS):
        for key in times:
            v = variants[key]
            v["opt"].zero_grad(set_to_none=True)
            t = time.perf_counter()
            v["step"]()
            times[key].append(time.perf_counter() - t)
    rows = []
    for key, v in variants.items():
        row = {"variant": key, **{k: v[k] for k in ("peak", "predicted", "budget", "budget_bytes", "failed") if k in v}}
        if key in times:
            row["step_ms"] = 1e3 * statistics.median(times[key])
            row["step_ms_all"] = [round(1e3 * t, 2) for t in times[key]]
        rows.append(row)
    return {"model": label, "record_s": record_s, "num_ops": trace.num_ops, "rows": rows, "torch": torch.__version__}


def section() -> str:
    """The docs section, each model measured in a process of its own (1 thread, fresh dynamo)."""
    import subprocess

    results = []
    for _label, (name, _sizes) in MODELS.items():
        done = subprocess.run([sys.executable, "-m", "benchmarks.bench_compiled", name], check=True,
                              capture_output=True, text=True)
        results.extend(json.loads(done.stdout))
    return markdown(results, "python -m benchmarks.bench_compiled MODEL (each model in a process of its own)")


def markdown(results: list[dict], command: str) -> str:
    out = [
        "## Compiled training\n\nCPU, inductor, 1 thread; per model every variant compiled once, then its steps timed interleaved "
        f"({REPS} rounds, medians). Peaks are the profiler's memory events (`compiled_peak`). `amb X`: "
        "`torch._functorch.config.activation_memory_budget = X`; `ours @ amb X`: our compiled plan solved "
        "with that variant's measured peak as its budget; `ours least`: at the least budget `solve` meets. "
        f"Measured by `{command}`.\n",
    ]
    for res in results:
        rows = {r["variant"]: r for r in res["rows"]}
        plain = rows["plain"]
        out.append(f"\n**{res['model']}** ({res['num_ops']} recorded ops; plain peak {plain['peak']:,} B, "
                   f"step {plain['step_ms']:.1f} ms)\n")
        out.append("| variant | peak / plain | step / plain | measured / predicted | vs its amb: peak, step |")
        out.append("|---|---|---|---|---|")
        for key, r in rows.items():
            if "failed" in r:
                out.append(f"| {key} | {r['failed']} | | | |")
                continue
            pred = f"{r['peak'] / r['predicted']:.3f}" if r.get("predicted") else ""
            vs = ""
            if key.startswith("ours @ "):
                amb = rows[key[len("ours @ "):]]
                vs = f"{r['peak'] / amb['peak']:.3f}, {r['step_ms'] / amb['step_ms']:.3f}"
            out.append(f"| {key} | {r['peak'] / plain['peak']:.3f} | {r['step_ms'] / plain['step_ms']:.3f} | "
                       f"{pred} | {vs} |")
        ours = sorted((r["budget_bytes"], r["peak"]) for r in rows.values() if "budget_bytes" in r)
        amb_least = min(r["peak"] for k, r in rows.items() if k.startswith("amb ") and "peak" in r)
        ours_least = min((p for _b, p in ours), default=None)
        monotonic = all(a[1] <= b[1] for a, b in zip(ours, ours[1:], strict=False))
        margin = abs(rows["plain A/A"]["step_ms"] / plain["step_ms"] - 1) if "plain A/A" in rows else None
        asked = [k for k in rows if k.startswith("ours @ ")]
        wins = [k for k in asked if "peak" in rows[k]]
        fails = [k for k in asked if "failed" in rows[k]]  # no plan at that peak
        fails += [k for k in wins if rows[k]["peak"] > rows[k[len("ours @ "):]]["peak"]
                  or (margin is not None and rows[k]["step_ms"] > rows[k[len("ours @ "):]]["step_ms"] * (1 + margin))]
        if margin is not None:
            out.append(f"\nA/A margin (plain A/A against plain): {100 * margin:.1f}% of the step. Ours at an amb peak, "
                       f"peak <= its and step <= its within the margin: {len(asked) - len(fails)} of {len(asked)} budgets"
                       f"{' (not: ' + ', '.join(fails) + ')' if fails else ''}.")
        out.append(f"\nLeast peak: ours {ours_least:,} B, the least `activation_memory_budget` setting "
                   f"{amb_least:,} B ({'ours below' if ours_least is not None and ours_least < amb_least else 'ours NOT below'}); "
                   f"ours {'monotonic' if monotonic else 'NOT monotonic'} in its budget.\n")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--markdown":
        results = [r for f in argv[1:] for r in json.loads(Path(f).read_text())]
        print(markdown(results, "python -m benchmarks.bench_compiled"))
        return
    labels = [lab for lab, (name, _sizes) in MODELS.items() if not argv or name in argv or name.split(":")[-1] in argv]
    results = []
    for label in labels:
        results.append(run_model(label, progress=lambda msg: print(msg, file=sys.stderr, flush=True)))
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
