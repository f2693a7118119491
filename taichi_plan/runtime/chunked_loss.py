"""Cross-entropy over a linear head, chunked over tokens: the full logits never exist.

The vocabulary-sized logits of a language model and their gradient are often the largest
tensors of a training step. Two ways to avoid them, one mechanism underneath:

* :func:`chunked_cross_entropy` (``taichi_plan.chunked_cross_entropy``): the explicit API for
  code that computes its loss itself. ``hidden [..., H]``, a head (``nn.Linear`` or a
  ``[V, H]`` weight) and ``labels [...]`` give the loss that ``F.cross_entropy(head(hidden)
  .view(-1, V), labels.view(-1))`` gives, computed ``chunks`` rows at a time.
* :class:`LazyLogits`, what a planned head returns when a plan partitions it over tokens
  (``apply`` installs it, :func:`install_token_heads`). It records the head's input and
  weight instead of computing the logits. Through ``__torch_function__``, which runs above
  autograd, it stays lazy through the position-wise ops it understands (``.float()``,
  ``.to(dtype)``, ``view``/``reshape``/``flatten`` and slicing of the leading dims,
  ``contiguous``, ``log_softmax`` over the vocabulary) and turns ``F.cross_entropy`` /
  ``F.nll_loss`` with class-index targets into the chunked computation. So the loss may be
  computed inside the model's forward (``labels=``) or by the caller from the returned
  logits, by any code that uses those ops. Anything else (``argmax``, ``detach``, a
  class-weighted loss, ...) materializes the full logits, with autograd, and reports it: the
  plan's memory no longer holds (``on_mismatch``: raise or warn).

:class:`ChunkedLinearCrossEntropy` (an ``autograd.Function``) does the work. For a loss reduced
to one number (``mean``, ``sum``) with gradients wanted, forward runs one fused pass
(:func:`fused`, as Liger's fused linear cross-entropy): for each chunk of rows, the logits
(``F.linear``, cast to the compute dtype), turned into their softmax in place, which gives the
chunk's loss (log-sum-exp minus the label's logit, label smoothing as ``F.cross_entropy``
does it) and then, with the one-hot subtracted and the rows scaled (by the mean's divisor;
ignored rows by 0), the gradient of its logits; the chunk's rows of the hidden gradient are
written into one preallocated tensor (``mm(..., out=)``), the weight gradient accumulated in
place (``addmm_``), the bias gradient added. Backward scales those in place by the incoming
gradient (a loss divided for accumulation) and hands them on: no logits are made again. So
what it allocates is: forward, the count of rows, the gradients whole, and per chunk one
``[rows/k, V]`` buffer (two for a moment when a dtype cast is needed) and a few per-row
vectors; backward nothing. On a 2-core CPU the head and loss in 4 chunks so take about 0.95x
the time of the unsplit ones (508 x 256 -> 8192, forward and backward, 25 repetitions), and
less where the unsplit ones' ``[N, V]`` buffers are fresh pages (docs/benchmarks.md). The function saves its inputs, so a
second backward through a retained graph, and a per-row loss (``none``, whose gradient needs
each row's incoming gradient), compute the gradients in backward instead: per chunk the
logits again, ``softmax``, the one-hot subtracted in place, rows scaled, as above (two
``[rows/k, V]`` buffers). ``taichi_plan.problem.partition.token_span`` models exactly that for the planner.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

_Tensor = torch.Tensor


def row_bounds(rows: int, chunks: int) -> list[tuple[int, int]]:
    """Row ranges of ``chunks`` pieces of ``rows`` rows, as ``torch.tensor_split`` cuts them
    (the first ``rows % chunks`` pieces one row longer); empty pieces left out."""
    k = max(1, min(int(chunks), rows)) if rows else 1
    base, extra = divmod(rows, k)
    out, r0 = [], 0
    for c in range(k):
        r1 = r0 + base + (1 if c < extra else 0)
        if r1 > r0:
            out.append((r0, r1))
        r0 = r1
    return out


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype | None]:
    try:
        if torch.is_autocast_enabled(device_type):
            return True, torch.get_autocast_dtype(device_type)
    except (TypeError, RuntimeError):  # a device type autocast does not know
        pass
    return False, None


def _logits(h: _Tensor, weight: _Tensor, bias: _Tensor | None, cdtype: torch.dtype, autocast) -> _Tensor:
    enabled, dtype = autocast
    ctx = torch.autocast(h.device.type, dtype=dtype) if enabled else contextlib.nullcontext()
    with ctx:
        lg = F.linear(h, weight, bias)
    if lg.dtype != cdtype:
        lg = lg.to(cdtype)
    return lg


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``cross_entropy(linear(hidden, weight, bias).to(cdtype), labels)`` over ``[N, H]``
    hidden rows and ``[N]`` labels, ``chunks`` rows at a time; see the module docstring.
    ``grads``: whether the caller's grad mode was on (inside ``forward`` it is off), so the
    forward computes the gradients too (:func:`fused`)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunks, ignore_index, reduction, label_smoothing, cdtype,
                autocast, grads=False):
        count = (labels != ignore_index).sum() if reduction == "mean" else None
        ctx.save_for_backward(hidden, weight, bias, labels, count)
        ctx.conf = (chunks, ignore_index, reduction, label_smoothing, cdtype, autocast)
        ctx.handed = None
        if reduction == "none":
            return _rows_loss(hidden, weight, bias, labels, chunks, ignore_index, label_smoothing, cdtype, autocast)
        need = ctx.needs_input_grad[:3] if grads else (False, False, False)
        total, ctx.handed = fused(hidden, weight, bias, labels, chunks, ignore_index, label_smoothing, cdtype,
                                  autocast, None if count is None else 1.0 / count, need)
        return total / count if count is not None else total

    @staticmethod
    def backward(ctx, grad_out):
        handed, ctx.handed = ctx.handed, None
        if handed is not None:  # computed in forward (fused): scaled in place, handed on once
            for g in handed:
                if g is not None and not _is_one(grad_out):
                    g.mul_(grad_out.to(g.dtype))
            return (*handed, None, None, None, None, None, None, None, None)
        hidden, weight, bias, labels, count = ctx.saved_tensors
        chunks, ignore_index, reduction, eps, cdtype, autocast = ctx.conf
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b and bias is not None else None
        scale = grad_out / count if reduction == "mean" else grad_out
        vocab = weight.shape[0]
        for r0, r1 in row_bounds(hidden.shape[0], chunks):
            h, y = hidden[r0:r1], labels[r0:r1]
            lg = _logits(h, weight, bias, cdtype, autocast)
            p = torch.softmax(lg, -1)
            del lg
            valid = y != ignore_index
            if eps:
                p.sub_(eps / vocab)
            idx = torch.where(valid, y, 0).unsqueeze(1)
            p.scatter_add_(1, idx, valid.to(p.dtype).unsqueeze(1).mul_(-(1.0 - eps)))
            rows = valid.to(p.dtype).mul_(scale[r0:r1] if reduction == "none" else scale)
            p.mul_(rows.unsqueeze(1))
            _hand_on(p, h, weight, r0, r1, grad_h, grad_w, grad_b)
            del p, valid, idx, rows  # nothing of a chunk is held into the next one
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None, None


def _is_one(g: _Tensor) -> bool:
    """Whether the incoming gradient is exactly 1 (a loss not scaled), checked where that
    costs no device synchronization."""
    return g.device.type == "cpu" and g.numel() == 1 and bool(g == 1)


def _hand_on(p, h, weight, r0, r1, grad_h, grad_w, grad_b) -> None:
    """A chunk's rows of the hidden gradient, and its share of the weight's and the bias's,
    from ``p``, the gradient of its logits."""
    g = p if p.dtype == weight.dtype else p.to(weight.dtype)
    hw = h if h.dtype == weight.dtype else h.to(weight.dtype)
    if grad_h is not None:
        if grad_h.dtype == weight.dtype:
            torch.mm(g, weight, out=grad_h[r0:r1])
        else:
            grad_h[r0:r1] = torch.mm(g, weight)
    if grad_w is not None:
        grad_w.addmm_(g.t(), hw)
    if grad_b is not None:
        grad_b.add_(g.sum(0))


def _rows_loss(hidden, weight, bias, labels, chunks, ignore_index, eps, cdtype, autocast) -> _Tensor:
    """The per-row loss (``reduction="none"``): the gradient needs each row's incoming
    gradient, so backward computes the logits again."""
    per_row = torch.empty(hidden.shape[0], dtype=cdtype, device=hidden.device)
    for r0, r1 in row_bounds(hidden.shape[0], chunks):
        lg = _logits(hidden[r0:r1], weight, bias, cdtype, autocast)
        per_row[r0:r1] = F.cross_entropy(lg, labels[r0:r1], ignore_index=ignore_index, reduction="none",
                                         label_smoothing=eps)
        del lg
    return per_row


def fused(hidden, weight, bias, labels, chunks, ignore_index, eps, cdtype, autocast, scale, need):
    """The summed loss over ``chunks`` chunks of rows and, where ``need`` says (hidden,
    weight, bias), the gradients of ``loss * scale`` (``scale``: a tensor, ``1 / count`` for
    the mean, or None for 1), computed in the same pass: each chunk's logits are made once,
    turned into their softmax in place, which gives the loss and, with the label subtracted,
    the gradient of the logits, which goes into the hidden rows' gradient and the weight's
    (Liger's fused linear cross-entropy does the same). One ``[rows/k, V]`` buffer per chunk
    (two for a moment when the head's dtype is not the softmax's), and no second head pass
    in backward. Returns ``(total, (grad_h, grad_w, grad_b))``; ``total`` the sum of the
    counted rows' losses."""
    need_h, need_w, need_b = need
    grad_h = torch.empty_like(hidden) if need_h else None
    grad_w = torch.zeros_like(weight) if need_w else None
    grad_b = torch.zeros_like(bias) if need_b and bias is not None else None
    any_grad = grad_h is not None or grad_w is not None or grad_b is not None
    vocab = weight.shape[0]
    total = None
    for r0, r1 in row_bounds(hidden.shape[0], chunks):
        h, y = hidden[r0:r1], labels[r0:r1]
        lg = _logits(h, weight, bias, cdtype, autocast)
        valid = y != ignore_index
        idx = torch.where(valid, y, 0).unsqueeze(1)
        # loss per row: logsumexp - (1 - eps) * target logit - eps * mean logit (label smoothing)
        m = lg.amax(-1, keepdim=True)
        rows = lg.gather(1, idx).mul_(-(1.0 - eps))
        if eps:
            rows.sub_(lg.sum(-1, keepdim=True), alpha=eps / vocab)
        lg.sub_(m).exp_()
        s = lg.sum(-1, keepdim=True)
        rows.add_(s.log().add_(m)).mul_(valid.unsqueeze(1))
        del m
        part = rows.sum()
        total = part if total is None else total + part
        del part, rows
        if any_grad:
            p = lg.div_(s)
            if eps:
                p.sub_(eps / vocab)
            p.scatter_add_(1, idx, valid.to(p.dtype).unsqueeze(1).mul_(-(1.0 - eps)))
            w = valid.to(p.dtype) if scale is None else valid.to(p.dtype).mul_(scale)
            p.mul_(w.unsqueeze(1))
            del w
            _hand_on(p, h, weight, r0, r1, grad_h, grad_w, grad_b)
            del p
        del lg, s, valid, idx  # nothing of a chunk is held into the next one
    if total is None:  # no rows
        total = torch.zeros((), dtype=cdtype, device=hidden.device)
    return total, ((grad_h, grad_w, grad_b) if any_grad else None)


def _head_params(head) -> tuple[_Tensor, _Tensor | None]:
    if isinstance(head, torch.nn.Linear):
        return head.weight, head.bias
    if isinstance(head, _Tensor) and head.dim() == 2:
        return head, None
    raise TypeError(f"head must be an nn.Linear or a [vocab, hidden] weight tensor, not {type(head).__name__}.")


def chunked_cross_entropy(hidden: _Tensor, head, labels: _Tensor, chunks: int = 8, *, bias: _Tensor | None = None,
                          ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                          dtype: torch.dtype | None = None) -> _Tensor:
    """The loss ``F.cross_entropy(head(hidden).reshape(-1, V).to(dtype), labels.reshape(-1))``,
    computed ``chunks`` rows of tokens at a time, so that the ``[tokens, V]`` logits and their
    gradient never exist (at most two ``[tokens/chunks, V]`` buffers do).

    ``hidden``: ``[..., H]``; ``head``: an ``nn.Linear(H, V)`` or a ``[V, H]`` weight (then
    ``bias=`` optional); ``labels``: class indices with ``hidden``'s leading shape (shift them
    yourself for next-token prediction: ``hidden[:, :-1]``, ``labels[:, 1:]``). ``dtype``: the
    dtype the softmax runs in (default: the logits'; HF models use float32). Gradients reach
    ``hidden``, the weight and the bias; they equal the unchunked ones up to float rounding
    (the sums run in another order)."""
    weight, b = _head_params(head)
    if bias is None:
        bias = b
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', not {reduction!r}.")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels have shape {list(labels.shape)}; they must have hidden's leading shape "
                         f"{list(hidden.shape[:-1])} (one class index per token).")
    autocast = _autocast_state(hidden.device.type)
    cdtype = dtype or (autocast[1] if autocast[0] else torch.result_type(hidden, weight))
    lead = hidden.shape[:-1]
    out = ChunkedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, labels.reshape(-1),
                                          int(chunks), int(ignore_index), reduction, float(label_smoothing),
                                          cdtype, autocast, torch.is_grad_enabled())
    return out.view(lead) if reduction == "none" else out


# -- the lazy head -------------------------------------------------------------------------------------

def _getters(*names):
    return {getattr(_Tensor, n).__get__ for n in names}


# Metadata the wrapper answers itself (its shape, dtype and device are the logits').
_META = {_Tensor.size, _Tensor.dim, _Tensor.numel, _Tensor.__len__, _Tensor.is_floating_point,
         _Tensor.element_size, _Tensor.__hash__, _Tensor.stride, _Tensor.is_contiguous} | _getters(
    "shape", "dtype", "device", "requires_grad", "ndim", "is_leaf", "grad_fn", "layout", "is_cuda", "is_meta",
    "is_sparse", "is_quantized", "is_nested")


class LazyLogits(_Tensor):
    """Logits not computed: ``linear(hidden, weight, bias)``, then ``.to(cdtype)`` and
    ``log_softmax`` if asked, known only by the recipe. See the module docstring for what
    keeps it lazy; ``owner`` (the plan runtime) is told when it materializes."""

    @staticmethod
    def __new__(cls, hidden, weight, bias, chunks, owner=None, cdtype=None, log_probs=False, autocast=None):
        autocast = autocast if autocast is not None else _autocast_state(hidden.device.type)
        head_dtype = autocast[1] if autocast[0] else torch.result_type(hidden, weight)
        shape = (*hidden.shape[:-1], weight.shape[0])
        # requires_grad stays False: no gradient of the full logits ever exists, and hooks that
        # look for one (PyTorch's ModTracker on a loss module's inputs) must not try to find it.
        # The loss computed from them requires grad as the real one does.
        r = _Tensor._make_wrapper_subclass(cls, shape, dtype=cdtype or head_dtype, device=hidden.device)
        r._hidden, r._weight, r._bias = hidden, weight, bias
        r._chunks, r._owner, r._log_probs, r._autocast = int(chunks), owner, bool(log_probs), autocast
        r._cdtype = cdtype or head_dtype
        return r

    def _like(self, hidden=None, cdtype=None, log_probs=None) -> LazyLogits:
        return LazyLogits(self._hidden if hidden is None else hidden, self._weight, self._bias, self._chunks,
                          self._owner, cdtype or self._cdtype, self._log_probs if log_probs is None else log_probs,
                          self._autocast)

    def __repr__(self, *, tensor_contents=None):
        return (f"LazyLogits(shape={list(self.shape)}, dtype={self._cdtype}, chunks={self._chunks}"
                f"{', log_softmax' if self._log_probs else ''})")

    def quiet(self):
        """Ops the lazy path runs on the hidden states are not the trace's: the runtime does
        not count them."""
        return self._owner.quiet() if self._owner is not None else contextlib.nullcontext()

    def materialize(self, why: str) -> _Tensor:
        """The full logits (with autograd), after telling the owner."""
        if self._owner is not None:
            self._owner.materialized(why)
        with self.quiet():
            lg = _logits(self._hidden, self._weight, self._bias, self._cdtype, self._autocast)
            return torch.log_softmax(lg, -1) if self._log_probs else lg

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _META:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        self = next(a for a in (*args, *kwargs.values()) if isinstance(a, LazyLogits))
        handler = _HANDLERS.get(func)
        if handler is not None:
            with self.quiet():
                out = handler(*args, **kwargs)
            if out is not NotImplemented:
                return out
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
        args, kwargs = _replace_lazy((args, kwargs), self, name)
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from ..base.errors import MismatchError

        raise MismatchError(f"{func} reached the lazy logits below autograd, where they cannot be computed "
                            "with gradients. Compute the loss with F.cross_entropy / F.nll_loss on the logits, "
                            "or solve without partitioning the head over tokens.")


def _replace_lazy(tree, first: LazyLogits, name: str):
    from torch.utils._pytree import tree_map

    done: dict[int, _Tensor] = {}

    def sub(x):
        if isinstance(x, LazyLogits):
            if id(x) not in done:
                done[id(x)] = x.materialize(f"{name} on the logits")
            return done[id(x)]
        return x

    return tree_map(sub, tree)


def _shape_arg(args) -> list[int] | None:
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        args = tuple(args[0])
    if not all(isinstance(a, int) for a in args):
        return None
    return list(args)


def _reshape(self: LazyLogits, *shape, **kw):
    shape = _shape_arg(shape if shape else (kw.get("shape") or ()))
    vocab = self.shape[-1]
    if not shape:
        return NotImplemented
    if shape[-1] == -1 and -1 not in shape[:-1] and len(shape) >= 1:
        shape[-1] = vocab
    if shape[-1] != vocab:
        return NotImplemented  # splits or merges the vocabulary dimension: not position-wise
    h = self._hidden
    return self._like(hidden=h.reshape(*shape[:-1], h.shape[-1]))


def _view(self, *shape, **kw):
    return _reshape(self, *shape, **kw)


def _flatten(self, start_dim=0, end_dim=-1):
    nd = self.dim()
    s, e = start_dim % nd, end_dim % nd
    if e == nd - 1 and s < e:
        return NotImplemented  # merges the vocabulary into rows
    shape = [*self.shape[:s], -1 if e > s else self.shape[s], *self.shape[e + 1:]] if e > s else list(self.shape)
    return _reshape(self, *shape)


def _getitem(self, idx):
    idx = idx if isinstance(idx, tuple) else (idx,)
    if any(i is None or isinstance(i, (_Tensor, list, bool)) for i in idx):
        return NotImplemented
    nd = self.dim()
    if any(i is Ellipsis for i in idx):
        k = idx.index(Ellipsis)
        fill = nd - (len(idx) - 1)
        idx = idx[:k] + (slice(None),) * fill + idx[k + 1:]
    if len(idx) > nd:
        return NotImplemented
    idx = idx + (slice(None),) * (nd - len(idx))
    if idx[-1] != slice(None):
        return NotImplemented  # selects part of the vocabulary
    return self._like(hidden=self._hidden[idx])


def _to(self, *args, **kwargs):
    dtype = kwargs.get("dtype")
    other = {k: v for k, v in kwargs.items() if k not in ("dtype", "copy", "non_blocking", "device")}
    device = kwargs.get("device")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, (str, torch.device)):
            device = a
        else:
            return NotImplemented
    if other or (device is not None and torch.device(device) != self.device):
        return NotImplemented
    if dtype is None or dtype == self._cdtype:
        return self
    if self._log_probs:
        return NotImplemented
    return self._like(cdtype=dtype)


def _as(dtype):
    return lambda self, *a, **k: _to(self, dtype) if not a and not k else NotImplemented


def _log_softmax(self, dim=None, _stacklevel=3, dtype=None, **kw):
    x = self
    if dim is None or dim not in (-1, x.dim() - 1) or x._log_probs or kw:
        return NotImplemented
    if dtype is not None:
        x = _to(x, dtype)
        if x is NotImplemented:
            return x
    return x._like(log_probs=True)


def _loss(log_probs: bool):
    def run(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean",
            label_smoothing=0.0):
        if (not isinstance(input, LazyLogits) or input._log_probs != log_probs or weight is not None
                or size_average is not None or reduce is not None or input.dim() != 2
                or not isinstance(target, _Tensor) or target.dim() != 1 or target.dtype.is_floating_point
                or reduction not in ("mean", "sum", "none") or (log_probs and label_smoothing)):
            return NotImplemented
        return ChunkedLinearCrossEntropy.apply(input._hidden, input._weight, input._bias, target, input._chunks,
                                               int(ignore_index), reduction, float(label_smoothing),
                                               input._cdtype, input._autocast, torch.is_grad_enabled())

    return run


def _identity(self, *a, **k):
    return self if not a and not k else NotImplemented


class _NoHook:
    def remove(self) -> None:
        pass


def _no_storage(self):
    """Lazy logits hold no memory (memory trackers ask every module output for its storage)."""
    return torch.UntypedStorage(0, device=self.device)


def _register_hook(self, hook):
    """A gradient hook on the logits never fires: no gradient of the full logits ever exists."""
    return _NoHook()


_HANDLERS = {
    _Tensor.view: _view, _Tensor.reshape: _reshape, torch.reshape: _reshape, _Tensor.flatten: _flatten,
    torch.flatten: _flatten, _Tensor.__getitem__: _getitem, _Tensor.contiguous: _identity,
    _Tensor.to: _to, _Tensor.float: _as(torch.float32), _Tensor.double: _as(torch.float64),
    _Tensor.half: _as(torch.float16), _Tensor.bfloat16: _as(torch.bfloat16),
    _Tensor.log_softmax: _log_softmax, torch.log_softmax: _log_softmax, F.log_softmax: _log_softmax,
    F.cross_entropy: _loss(False), F.nll_loss: _loss(True), _Tensor.register_hook: _register_hook,
    _Tensor.untyped_storage: _no_storage,
}


# -- installing lazy heads under a plan ----------------------------------------------------------------

def install_token_heads(model, heads: dict[str, int], rt) -> callable:
    """Make each planned head (module FQN -> chunks) return :class:`LazyLogits` in the calls
    ``rt`` runs planned; returns a function that undoes it."""
    from ..base.errors import PlanError
    from .forward import wrap_forward

    undo = []
    for name, chunks in heads.items():
        try:
            module = model.get_submodule(name)
        except AttributeError as e:
            raise PlanError(f"The plan partitions the head {name!r} over tokens, but this model has no such "
                            "module: the plan was made for another model.") from e
        if not isinstance(module, torch.nn.Linear):
            raise PlanError(f"The plan partitions {name!r} over tokens, but it is a {type(module).__name__}, "
                            "not an nn.Linear: the plan was made for another model.")
        undo.append(wrap_forward(module, lambda f, m=module, c=int(chunks), n=name: _lazy_forward(m, f, c, rt, n)))

    def restore():
        for fn in undo:
            fn()

    return restore


def _lazy_forward(module, original, chunks: int, rt, name: str):
    def run(x, *args, **kwargs):
        owner = rt.token_head(name) if rt is not None else None
        if owner is None or args or kwargs:
            return original(x, *args, **kwargs)
        return LazyLogits(x, module.weight, module.bias, chunks, owner)

    return run


__all__ = ["ChunkedLinearCrossEntropy", "LazyLogits", "chunked_cross_entropy", "install_token_heads", "row_bounds"]
