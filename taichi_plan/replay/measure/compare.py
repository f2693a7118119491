"""Whether the planned run trains as the unplanned one: the gradients and parameters of two
runs compared bitwise, or within tolerances where chunks sum in another order or in a low
precision (:func:`compare_training`, :func:`autocast_rounding`), or statistically against a
reseeded run where chunks draw their own dropout masks (:func:`statistical_check`)."""

from __future__ import annotations

from ...plan.format import Plan
from .config import ComparisonConfig

# Unit roundoff of the autocast dtypes (half an ulp at 1: 2^-8 for bfloat16's 8 significant
# bits, 2^-11 for float16's 11).
UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}


def autocast_rounding(plan: Plan, trace) -> tuple[str, int] | None:
    """(low-precision dtype, most chunks) when ``plan`` splits a module of a step recorded
    under autocast, or any span of a model whose parameters are bfloat16 or float16, else None.
    Under autocast the chunks' gradients w.r.t. a weight's cached cast are summed in the cast's
    dtype (one cast node for every chunk, docs/planner.md), so each differs from the unsplit
    gradient by up to about one rounding of that dtype per chunk, relative to the tensor's
    largest element (measured: up to 2.1 bfloat16 units at 4 chunks on a tiny GPT-2); a model
    in that dtype sums every chunk's gradient in it (a bf16 GPT-NeoX's head over 2 token
    chunks: 1.2e-4 apart, where float32's tolerance is 1e-6), and so does a sharded model whose
    FSDP2 MixedPrecisionPolicy gathers its parameters in that dtype (trace v16)."""
    if trace is None:
        return None
    from ...torch_common.fsdp import recorded_mixed_precision

    dtype = (trace.meta.get("loop") or {}).get("autocast")
    most = max((p.chunks for p in plan.partitions if p.over != "tokens"), default=1)
    sharded = {"bfloat16": "bf16", "float16": "fp16"}.get((recorded_mixed_precision(trace.meta) or {}).get("param_dtype"))
    model_dtype = trace.meta.get("dtype") if trace.meta.get("dtype") in UNIT_ROUNDOFF else sharded
    if dtype not in UNIT_ROUNDOFF and model_dtype is not None:
        dtype = model_dtype
        most = max((p.chunks for p in plan.partitions), default=1)
    return (dtype, most) if dtype in UNIT_ROUNDOFF and most > 1 else None


def compare_training(base: dict, planned: dict, exact: bool, in_backward: bool = False,
                     rounding: tuple[str, int] | None = None, config: ComparisonConfig | None = None) -> dict:
    """``grads_match``, ``grads_check`` (what was compared, in words) and ``grads_max_abs_diff``
    of two :func:`~.run.run_and_measure` results (or any two dicts of ``grads``, ``first_grads`` and
    ``params`` lists): every gradient and parameter after the last step bitwise (``exact``),
    else the first planned step's gradients within ``config.grad_rtol``/``grad_atol`` and the
    parameters after the last step within ``config.params_rel_tol`` relative L2 distance
    (``config``: :class:`~.config.ComparisonConfig`, its defaults when None). ``in_backward``: the
    planned run kept no gradients (the optimizer stepped in backward). ``matched`` holds the
    verdict for the gradients and the parameters apart. ``rounding`` (:func:`autocast_rounding`):
    each first-step gradient within ``chunks`` roundings of the autocast dtype of its largest
    element instead, and the parameters within that over their whole instead of
    ``config.params_rel_tol``."""
    import torch

    config = config or ComparisonConfig()

    worst = 0.0
    ok = {"grads": True, "params": True}

    def each(key: str, part: str):
        nonlocal worst
        for a, b in zip(base[key], planned[key], strict=True):
            if a is None or b is None:
                ok[part] &= a is None and b is None
                continue
            worst = max(worst, float(_diff(a, b).abs().max()) if a.numel() else 0.0)
            yield a, b

    if exact:
        for key in ("params",) if in_backward else ("grads", "params"):
            for a, b in each(key, key):
                ok[key] &= bool(torch.equal(a, b))
        check = "bitwise (torch.equal)"
    else:
        parts = []
        rel = None if rounding is None else rounding[1] * UNIT_ROUNDOFF[rounding[0]]
        if not in_backward and rel is None:
            for a, b in each("first_grads", "grads"):
                ok["grads"] &= bool(torch.allclose(a, b, rtol=config.grad_rtol, atol=config.grad_atol))
            parts.append(f"allclose(rtol={_sci(config.grad_rtol)}, atol={_sci(config.grad_atol)}) on the first "
                         "planned step's gradients")
        elif not in_backward:
            for a, b in each("first_grads", "grads"):
                if a.numel():
                    ok["grads"] &= float((a - b).abs().max()) <= rel * float(a.abs().max()) + config.grad_atol
            parts.append(f"the first planned step's gradients within {rounding[1]} {rounding[0]} roundings of each "
                         f"tensor's largest element (the chunks' gradients are summed in {rounding[0]})")
        list(each("params", "params"))
        params_tol = config.params_rel_tol if rel is None else max(config.params_rel_tol, rel)
        noise = None if in_backward else _rounding_level(base, planned, rel, config.noise_share)
        # Judged after the first planned step (both runs start it from the same parameters):
        # later steps compound each difference through the model, whatever made it.
        first = "first_params" if base.get("first_params") and planned.get("first_params") else "params"
        dist = _rel_distance(base[first], planned[first], noise)
        ok["params"] &= dist <= params_tol
        shown = _sci(params_tol) if rel is None else f"{params_tol:.3g}"
        left_out = sum(int(m.sum()) for m in noise or () if m is not None)
        last = _rel_distance(base["params"], planned["params"])
        parts.append(f"parameters after the {'first planned' if first == 'first_params' else 'last'} step within "
                     f"{shown} relative L2 distance ({dist:.2g}"
                     + (f"; {left_out} elements whose gradient is rounding noise left out: an optimizer that "
                        "normalizes its step, such as Adam or Adagrad, turns that noise into steps of its learning "
                        "rate" if left_out else "") + f"; after the last step {last:.2g})")
        check = ", ".join(parts)
    if in_backward:
        check += ", parameters only (gradients are freed in backward)"
    return {"grads_match": ok["grads"] and ok["params"], "grads_check": check, "grads_max_abs_diff": worst,
            "matched": ok}


def _sci(v: float) -> str:
    """1e-4, not 0.0001."""
    return f"{v:.0e}".replace("e-0", "e-")


def _rounding_level(base: dict, planned: dict, rel: float | None, noise_share: float) -> list | None:
    """Per parameter, the elements whose first planned step's gradient is rounding noise: the
    two runs disagree on it by more than ``noise_share`` of its value (the gradient check
    already bounds their disagreement by its tolerance, so these are the elements near zero),
    or None without first-step gradients. A gradient that is mathematically zero (a key
    projection's bias under softmax) comes out as rounding noise that the runs round
    differently; Adam's and Adagrad's normalized steps turn it into parameter differences of
    up to their learning rate per step (an OPT decoder with Adagrad: 8e-4 relative distance
    after 2 steps, from gradients 1.5e-8 apart)."""
    a_all, b_all = base.get("first_grads"), planned.get("first_grads")
    if not a_all or not b_all:
        return None
    out = []
    for a, b in zip(a_all, b_all, strict=True):
        if a is None or b is None or not a.numel():
            out.append(None)
            continue
        out.append((a.double() - b.double()).abs() > noise_share * a.double().abs())
    return out


def _diff(a, b):
    """``a - b`` in float64, 0 where the two are equal: a buffer holding -inf (a causal mask)
    in both runs differs by nothing, not by nan."""
    import torch

    x, y = a.double(), b.double()
    return torch.where(x == y, torch.zeros_like(x), x - y)


def _rel_distance(a: list, b: list, skip: list | None = None) -> float:
    """||a - b|| / ||a|| over every tensor of the two lists (None entries skipped; ``skip``:
    per tensor, a mask of elements left out of the difference; elements equal in both, -inf
    included, differ by 0, and the norm of ``a`` is over its finite elements)."""
    import torch

    num = den = 0.0
    for k, (x, y) in enumerate(zip(a, b, strict=True)):
        if x is None or y is None:
            continue
        diff = _diff(x, y)
        mask = skip[k] if skip is not None and k < len(skip) else None
        if mask is not None and mask.shape == diff.shape:
            diff = torch.where(mask, torch.zeros_like(diff), diff)
        num += float(torch.sum(diff ** 2))
        xd = x.double()
        den += float(torch.sum(torch.where(torch.isfinite(xd), xd, torch.zeros_like(xd)) ** 2))
    return (num / den) ** 0.5 if den > 0 else 0.0


def statistical_check(base: dict, planned: dict, other: dict, keys=("grads", "params"),
                      other_what: str = "an unplanned run with other dropout masks",
                      config: ComparisonConfig | None = None) -> dict:
    """Planned vs unplanned against ``other`` (a reseeded unplanned run, see the module
    docstring, or a second one where the model is not deterministic by itself) vs unplanned:
    at most ``config.stat_factor`` times as far (:class:`~.config.ComparisonConfig`, its
    defaults when None)."""
    config = config or ComparisonConfig()
    out = {"grads_match": True, "grads_distance": {}, "grads_max_abs_diff": 0.0}
    for key in keys:
        d_plan, d_seed = _rel_distance(base[key], planned[key]), _rel_distance(base[key], other[key])
        out["grads_distance"][key] = {"planned": d_plan, "reseeded": d_seed}
        out["grads_match"] &= d_plan <= config.stat_factor * d_seed
        for a, b in zip(base[key], planned[key], strict=True):
            if a is not None and b is not None and a.numel():
                out["grads_max_abs_diff"] = max(out["grads_max_abs_diff"], float(_diff(a, b).abs().max()))
    g = out["grads_distance"]
    names = {"grads": "gradients", "params": "parameters"}
    planned_d = ", ".join(f"{names[k]} {g[k]['planned']:.3g}" for k in keys)
    other_d = ", ".join(f"{g[k]['reseeded']:.3g}" for k in keys)
    out["grads_check"] = (f"statistical: planned vs unplanned relative L2 distance ({planned_d}) at most "
                          f"{config.stat_factor:g}x that of {other_what} ({other_d})")
    return out
