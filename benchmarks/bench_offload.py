"""Max batch with offload allowed (issue 45): ours with and without offload beside the baselines.

``python -m benchmarks.bench_offload [INDEX ...]`` prints the markdown of :func:`section` (the
cases of :data:`CASES`, or those INDEXes): for each of the five models on each profile, the
``maxbatch`` table with the row ``heuristic+offload`` (ours with offload allowed, copies on the
profile's host link, stalls counted in the extra compute), each search's time and what it
recorded. Fake recordings, as the max-batch section of ``benchmarks/run.py``.
"""

from __future__ import annotations

import sys
import time

MODELS = [  # (label, record flags): the five models, as benchmarks/run.py's MAXBATCH has them
    ("GPT-2 small s1024", {"model": "gpt2", "seq": 1024}),
    ("BERT-base s512", {"model": "bert", "seq": 512}),
    ("ResNet-50 224", {"model": "resnet50"}),
    ("ViT-base 224", {"model": "vit"}),
    ("Llama 8L h1024 s1024", {"model": "llama"}),
]
PROFILES = [("v100-16gb", "16GB"), ("h100-80gb", "80GB")]
CASES = [(f"{label} on {budget} ({profile})", flags, budget, profile)
         for profile, budget in PROFILES for label, flags in MODELS]


def section(say=lambda msg: None, only: tuple[int, ...] | None = None) -> str:
    """The max-batch tables of :data:`CASES` (``only``: their indices) with offload allowed."""
    from taichi_plan.base.units import parse_budget
    from taichi_plan.explore.maxbatch import fake_recorder, max_batch, render_max_batch
    from taichi_plan.problem.offload import OffloadConfig
    from taichi_plan.trace.devices import get_profile

    parts = ["## Max batch with offload allowed (extra compute <= 33%, fake recordings)\n"]
    total = time.perf_counter()
    summary = []
    for i, (label, flags, budget, name) in enumerate(CASES):
        if only is not None and i not in only:
            continue
        t0 = time.perf_counter()
        flags = dict(flags)
        model = flags.pop("model")
        profile = get_profile(name)
        record = fake_recorder(model, None, device_profile=profile.name, progress=say, **flags)
        res = max_batch(record, parse_budget(budget), method="heuristic", max_overhead_pct=33.0, time_limit=20,
                        progress=say, offload=OffloadConfig(profile.host_link_bytes_per_s))
        by = {r["planner"]: r for r in res["planners"]}
        summary.append((label, by["none"]["max_batch"], by["heuristic"]["max_batch"],
                        by["heuristic+offload"]["max_batch"]))
        parts.append(f"### {label}\n\n```\n{render_max_batch(res)}\n```\n\n"
                     f"Search took {time.perf_counter() - t0:.0f} s.\n")
        say(f"{label}: {time.perf_counter() - t0:.0f} s")
    head = ["| case | none | ours | ours with offload | with offload / none |", "|---|---|---|---|---|"]
    head += [f"| {label} | {n} | {o} | {w} | {'-' if not n else f'{w / n:.2f}x'} |" for label, n, o, w in summary]
    parts.insert(1, "\n".join(head) + "\n")
    parts.append(f"All searches: {time.perf_counter() - total:.0f} s.\n")
    return "\n".join(parts)


if __name__ == "__main__":
    picked = tuple(int(a) for a in sys.argv[1:]) or None
    print(section(lambda msg: print(msg, file=sys.stderr, flush=True), picked))
