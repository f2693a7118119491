"""Workloads: what the recorder trains for one step, built-in or the user's own.

A workload is four things, returned together as a tuple::

    (model, batch, loss_fn, optimizer)

- ``model``: a ``torch.nn.Module``;
- ``batch``: what is passed to the model: a tensor (``model(batch)``), a tuple or list
  (``model(*batch)``) or a dict (``model(**batch)``);
- ``loss_fn(output, batch) -> scalar tensor``: the loss of the model's output on that batch;
- ``optimizer``: a ``torch.optim.Optimizer`` over the model's parameters.

User workloads (``--entry mypkg.train:make_step``): ``make_step`` is a function importable as
``module:function`` that returns that tuple. It is called as ``make_step(**kwargs)`` with the
recorder's sizing flags that were given on the command line (``batch``, ``seq``, ``dtype``, ...)
when its signature accepts them, else with no arguments. For ``--fake`` it is called inside a
``FakeTensorMode``: it must create its tensors there (no ``.item()`` or data-dependent
branching on values, no pre-built real tensors, and no ``module.to(dtype)``: PyTorch cannot
convert fake parameters, so build modules in their dtype). See ``examples/my_workload.py``.

Built-in models (``--model``): ``mlp``, ``gpt2``, ``bert``, ``llama``, ``resnet50``, ``vit``.
The ``transformers`` ones are built from configs (no downloads), with ``attn_implementation
="sdpa"`` for real and fake runs alike. For fake runs every model is built on the ``meta``
device and materialized with ``to_empty`` inside the fake mode (ViT's init cannot run under
fake tensors), so no real memory is allocated whatever the size.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..base.errors import UsageError, WorkloadError
from ..trace.format import KV_CACHE_MODELS

DTYPES = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("sgd", "adamw")
ENTRY_CONTRACT = (
    "An --entry names a function as 'module.path:function' that returns "
    "(model, batch, loss_fn, optimizer): an nn.Module, the batch passed to it (tensor, tuple "
    "or dict), loss_fn(output, batch) -> scalar tensor, and a torch.optim.Optimizer."
)


@dataclass
class Workload:
    """A named, sized workload; ``build(fake)`` returns ``(model, batch, loss_fn, optimizer)``.

    ``args`` are the sizes it was built with (recorded in meta.json); ``dtype`` is
    ``fp32``/``bf16``/``fp16``.
    """

    name: str
    args: dict
    build: Callable[[bool], tuple]
    dtype: str = "fp32"
    kind: str = "builtin"  # builtin | entry | python
    defaults: dict = field(default_factory=dict)

    def default_output_name(self) -> str:
        base = self.name.split(":")[0].split(".")[-1] if self.kind == "entry" else self.name
        parts = [base]
        for key, tag in (("batch", "b"), ("seq", "s"), ("image_size", "i"), ("layers", "l"), ("hidden", "h")):
            if self.args.get(key) is not None:
                parts.append(f"{tag}{self.args[key]}")
        if self.dtype != "fp32":
            parts.append(self.dtype)
        if self.args.get("kv_cache") is False:
            parts.append("nokv")
        return "-".join(parts)


# ---------------------------------------------------------------------------------------------
# Built-in models
# ---------------------------------------------------------------------------------------------

_DEFAULTS = {
    "mlp": {"batch": 64, "hidden": 1024, "layers": 4},
    "gpt2": {"batch": 8, "seq": 1024, "layers": 12, "hidden": 768, "heads": 12, "vocab": 50257},
    "bert": {"batch": 8, "seq": 512, "layers": 12, "hidden": 768, "heads": 12, "vocab": 30522},
    "llama": {"batch": 4, "seq": 1024, "layers": 8, "hidden": 1024, "heads": 16, "vocab": 32000},
    "resnet50": {"batch": 32, "image_size": 224},
    "vit": {"batch": 32, "image_size": 224, "layers": 12, "hidden": 768, "heads": 12},
}
MODELS = tuple(_DEFAULTS)
SIZE_FLAGS = ("batch", "seq", "image_size", "layers", "hidden", "heads", "vocab")


def _torch_dtype(dtype: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]


def _make_optimizer(name: str, params):
    import torch

    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-4)


def _instantiate(make_model: Callable, fake: bool, dtype: str):
    """Build the model: normally for real runs; on meta then ``to_empty`` for fake ones."""
    import torch

    if fake:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily(), torch.device("meta"):  # init runs on meta, not fake
            model = make_model()
        _materialize(model, _torch_dtype(dtype))
    else:
        torch.manual_seed(0)
        model = make_model().to(_torch_dtype(dtype))
    model.train()
    return model


def _materialize(model, dtype) -> None:
    """Replace meta parameters and buffers by empty CPU ones (fake under FakeTensorMode),
    keeping tied parameters tied. ``Module.to_empty`` cannot: it swaps tensors, which fails on
    a tied fake parameter."""
    import torch

    new: dict[int, torch.Tensor] = {}

    def empty(t, requires_grad=None):
        if id(t) not in new:
            dt = dtype if t.is_floating_point() else t.dtype
            e = torch.empty(t.shape, dtype=dt, device="cpu")
            new[id(t)] = torch.nn.Parameter(e, requires_grad=requires_grad) if requires_grad is not None else e
        return new[id(t)]

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = empty(p, p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = empty(b)


def _hf_loss(output, batch):
    return output.loss


def _build_mlp(a: dict, fake: bool):
    import torch
    from torch import nn

    h, n = a["hidden"], a["layers"]

    def make():
        layers = []
        for _ in range(n):
            layers += [nn.Linear(h, h), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(h, 10))

    model = _instantiate(make, fake, a["dtype"])
    g = None if fake else torch.Generator().manual_seed(1)
    x = torch.randn(a["batch"], h, generator=g, dtype=_torch_dtype(a["dtype"]))
    y = torch.randint(0, 10, (a["batch"],), generator=g)
    return model, x, _TargetLoss(nn.CrossEntropyLoss(), y), _make_optimizer(a["optimizer"], model.parameters())


class _TargetLoss:
    """``loss_fn(output, batch)`` against a fixed target; ``inputs`` lists the target so the
    recorder registers it as an input."""

    def __init__(self, criterion, target):
        self.criterion = criterion
        self.inputs = (target,)

    def __call__(self, output, batch):
        return self.criterion(output, self.inputs[0])


def _text_batch(a: dict, fake: bool, vocab: int) -> dict:
    import torch

    g = None if fake else torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (a["batch"], a["seq"]), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _image_batch(a: dict, fake: bool, classes: int) -> dict:
    import torch

    g = None if fake else torch.Generator().manual_seed(1)
    s = a["image_size"]
    pixels = torch.randn(a["batch"], 3, s, s, generator=g, dtype=_torch_dtype(a["dtype"]))
    return {"pixel_values": pixels, "labels": torch.randint(0, classes, (a["batch"],), generator=g)}


def _build_hf(a: dict, fake: bool, make_model: Callable, batch: dict, loss_type: str | None = None):
    model = _instantiate(make_model, fake, a["dtype"])
    if a.get("kv_cache") is False:  # record --no-kv-cache
        model.config.use_cache = False
    if loss_type:  # transformers guesses it from the class name; GPT2LMHeadModel matches none
        model.loss_type = loss_type
    return model, batch, _hf_loss, _make_optimizer(a["optimizer"], model.parameters())


def _build_gpt2(a, fake):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=a["layers"], n_embd=a["hidden"], n_head=a["heads"], vocab_size=a["vocab"],
        n_positions=max(1024, a["seq"]), bos_token_id=a["vocab"] - 1, eos_token_id=a["vocab"] - 1,
        attn_implementation="sdpa",
    )
    return _build_hf(a, fake, lambda: GPT2LMHeadModel(cfg), _text_batch(a, fake, a["vocab"]), "ForCausalLM")


def _build_bert(a, fake):
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        num_hidden_layers=a["layers"], hidden_size=a["hidden"], num_attention_heads=a["heads"],
        intermediate_size=4 * a["hidden"], vocab_size=a["vocab"],
        max_position_embeddings=max(512, a["seq"]), attn_implementation="sdpa",
    )
    return _build_hf(a, fake, lambda: BertForMaskedLM(cfg), _text_batch(a, fake, a["vocab"]))


def _build_llama(a, fake):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=a["layers"], hidden_size=a["hidden"], num_attention_heads=a["heads"],
        num_key_value_heads=a["heads"], intermediate_size=int(a["hidden"] * 8 / 3 + 255) // 256 * 256,
        vocab_size=a["vocab"], max_position_embeddings=max(2048, a["seq"]), attn_implementation="sdpa",
    )
    return _build_hf(a, fake, lambda: LlamaForCausalLM(cfg), _text_batch(a, fake, a["vocab"]))


def _build_resnet50(a, fake):
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(num_labels=1000)  # the defaults are ResNet-50: bottleneck, depths 3-4-6-3
    return _build_hf(a, fake, lambda: ResNetForImageClassification(cfg), _image_batch(a, fake, 1000))


def _build_vit(a, fake):
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(
        num_hidden_layers=a["layers"], hidden_size=a["hidden"], num_attention_heads=a["heads"],
        intermediate_size=4 * a["hidden"], image_size=a["image_size"], num_labels=1000,
        attn_implementation="sdpa",
    )
    return _build_hf(a, fake, lambda: ViTForImageClassification(cfg), _image_batch(a, fake, 1000))


_BUILDERS = {
    "mlp": _build_mlp, "gpt2": _build_gpt2, "bert": _build_bert, "llama": _build_llama,
    "resnet50": _build_resnet50, "vit": _build_vit,
}


def builtin_workload(name: str, *, dtype: str = "fp32", optimizer: str | None = "adamw", kv_cache: bool = True,
                     **sizes) -> Workload:
    """A built-in model sized by ``sizes`` (``batch``, ``seq``, ``layers``, ...; None = default).
    ``kv_cache=False`` (``--no-kv-cache``) builds a decoder with ``config.use_cache = False``,
    as training runs it (``gradient_checkpointing_enable()`` sets it so); by default the model
    is as ``transformers`` configures it, whose forward keeps every layer's keys and values in
    its KV cache until the step lets go of the output."""
    optimizer = optimizer or "adamw"
    key = str(name).strip().lower()
    if key not in _DEFAULTS:
        raise WorkloadError(
            f"Unknown model {name!r}. Known models: {', '.join(MODELS)}. "
            "For your own model pass --entry module.path:function instead. " + ENTRY_CONTRACT
        )
    _check_common(dtype, optimizer)
    defaults = _DEFAULTS[key]
    unused = sorted(k for k, v in sizes.items() if v is not None and k not in defaults)
    if unused:
        flags = ", ".join("--" + k.replace("_", "-") for k in unused)
        raise UsageError(
            f"Model {key!r} does not take {flags}; it is sized by "
            + ", ".join("--" + k.replace("_", "-") for k in defaults) + "."
        )
    args = {k: (sizes.get(k) if sizes.get(k) is not None else v) for k, v in defaults.items()}
    for k, v in args.items():
        if not isinstance(v, int) or v <= 0:
            raise UsageError(f"--{k.replace('_', '-')} must be a positive integer, got {v!r}.")
    if key in ("gpt2", "bert", "llama", "vit") and args["hidden"] % args["heads"]:
        raise UsageError(f"--hidden ({args['hidden']}) must be a multiple of --heads ({args['heads']}).")
    args.update(dtype=dtype, optimizer=optimizer)
    if not kv_cache:
        if key not in KV_CACHE_MODELS:
            raise UsageError(f"--no-kv-cache applies to the decoders with a KV cache ({', '.join(KV_CACHE_MODELS)}); "
                             f"{key!r} keeps none: leave the flag out.")
        args["kv_cache"] = False  # only when off: traces recorded before the flag read as on
    return Workload(key, args, partial_builder(_BUILDERS[key], args), dtype, "builtin", defaults)


def partial_builder(fn, args):
    def build(fake: bool):
        return fn(dict(args), fake)

    return build


def _check_common(dtype: str, optimizer: str) -> None:
    if dtype not in DTYPES:
        raise UsageError(f"Unknown --dtype {dtype!r}; use one of {', '.join(DTYPES)}.")
    if optimizer not in OPTIMIZERS:
        raise UsageError(f"Unknown --optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}.")


# ---------------------------------------------------------------------------------------------
# User entries
# ---------------------------------------------------------------------------------------------


def load_entry(entry: str) -> Callable:
    """Import ``module.path:function`` (the current directory is importable) and return it."""
    if not isinstance(entry, str) or entry.count(":") != 1 or not all(entry.split(":")):
        raise WorkloadError(f"--entry {entry!r} is not of the form 'module.path:function'. {ENTRY_CONTRACT}")
    mod_name, fn_name = entry.split(":")
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:
        raise WorkloadError(
            f"--entry {entry!r}: cannot import module {mod_name!r} ({type(e).__name__}: {e}). "
            "Run from the directory that contains it or install it. " + ENTRY_CONTRACT
        ) from e
    fn = module
    for part in fn_name.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise WorkloadError(f"--entry {entry!r}: module {mod_name!r} has no attribute {fn_name!r}. {ENTRY_CONTRACT}")
    if not callable(fn):
        raise WorkloadError(f"--entry {entry!r}: {fn_name!r} is a {type(fn).__name__}, not a function. {ENTRY_CONTRACT}")
    return fn


def entry_workload(entry: str, *, dtype: str = "fp32", kv_cache: bool = True, **kwargs) -> Workload:
    """A user workload: ``entry`` = ``module.path:function`` (see the module docstring)."""
    if not kv_cache:
        raise UsageError("--no-kv-cache applies to built-in models; an --entry builds its own model: set "
                         "model.config.use_cache = False there (a transformers model) and leave the flag out.")
    if kwargs.pop("optimizer", None) is not None:
        raise UsageError("--optimizer applies to built-in models; an --entry builds its own optimizer.")
    _check_common(dtype, "adamw")
    fn = load_entry(entry)
    given = {k: v for k, v in kwargs.items() if v is not None}
    given["dtype"] = dtype
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    call_kwargs = {k: v for k, v in given.items() if takes_any or k in params}

    def build(fake: bool):
        try:
            result = fn(**call_kwargs)
        except Exception as e:
            hint = ""
            if fake:
                hint = " (under --fake it runs inside FakeTensorMode"
                if "swap" in str(e):
                    hint += "; build modules in their dtype instead of calling .to(dtype)"
                hint += ")"
            raise WorkloadError(f"--entry {entry!r} raised {type(e).__name__}: {e}{hint}") from e
        return check_parts(result, f"--entry {entry!r}")

    return Workload(entry, call_kwargs, build, dtype, "entry", {})


def torch_optimizer(optimizer):
    """The ``torch.optim.Optimizer`` that a training library's wrapper steps: accelerate's
    ``AcceleratedOptimizer`` (an ``Optimizer`` subclass that skips its ``__init__``, so it has
    no step hooks of its own, and steps the one it wraps only at the end of a gradient
    accumulation), Lightning's ``LightningOptimizer``; unwrapped through ``optimizer`` or
    ``_optimizer`` while that holds another ``Optimizer``. Anything else comes back as it is."""
    import torch

    for _ in range(8):
        inner = next((x for x in (getattr(optimizer, "optimizer", None), getattr(optimizer, "_optimizer", None))
                      if isinstance(x, torch.optim.Optimizer) and x is not optimizer), None)
        if inner is None:
            break
        optimizer = inner
    return optimizer


def check_parts(result, where: str) -> tuple:
    """Validate ``(model, batch, loss_fn, optimizer)``; a clear :class:`WorkloadError` if not."""
    import torch

    if not isinstance(result, (tuple, list)) or len(result) != 4:
        got = f"a {type(result).__name__}" + (f" of length {len(result)}" if isinstance(result, (tuple, list)) else "")
        raise WorkloadError(f"{where} returned {got}. {ENTRY_CONTRACT}")
    model, batch, loss_fn, optimizer = result
    problems = []
    if not isinstance(model, torch.nn.Module):
        problems.append(f"model is a {type(model).__name__}, not an nn.Module")
    if not isinstance(batch, (torch.Tensor, tuple, list, dict)):
        problems.append(f"batch is a {type(batch).__name__}, not a tensor, tuple or dict")
    if not callable(loss_fn):
        problems.append(f"loss_fn is a {type(loss_fn).__name__}, not callable")
    if not isinstance(torch_optimizer(optimizer), torch.optim.Optimizer):
        problems.append(f"optimizer is a {type(optimizer).__name__}, not a torch.optim.Optimizer")
    if problems:
        raise WorkloadError(f"{where} returned a wrong tuple: {'; '.join(problems)}. {ENTRY_CONTRACT}")
    return model, batch, loss_fn, torch_optimizer(optimizer)


def get_workload(model: str | None = None, entry: str | None = None, **kwargs) -> Workload:
    """``--model NAME`` or ``--entry MOD:FN`` (exactly one) with sizing flags."""
    if (model is None) == (entry is None):
        raise UsageError("Give exactly one of --model NAME or --entry module.path:function.")
    if model is not None:
        return builtin_workload(model, **kwargs)
    return entry_workload(entry, **kwargs)
