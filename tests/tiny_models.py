"""Tiny real Hugging Face models for tests that need a recorded trace of a given shape
(each records in seconds on CPU). Entries in the ``--entry module:function`` form."""

from __future__ import annotations


def swin(batch: int = 2, dtype: str = "fp32", **_):
    """A two-stage windowed-attention vision model (Swin): its backward ops are where
    PyTorch's ModTracker leaves ``relative_position_bias`` open (the recorder closes it:
    ``module_tracking.ModuleTracker``; tests/test_swin.py)."""
    import torch
    from transformers import SwinConfig, SwinForImageClassification

    torch.manual_seed(0)
    cfg = SwinConfig(image_size=32, patch_size=4, num_channels=3, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                     window_size=4, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     drop_path_rate=0.0)
    model = SwinForImageClassification(cfg)
    g = torch.Generator().manual_seed(0)
    batch_ = {"pixel_values": torch.randn(batch, 3, 32, 32, generator=g),
              "labels": torch.randint(0, 10, (batch,), generator=g)}
    return model, batch_, (lambda out, _b: out.loss), torch.optim.AdamW(model.parameters())


def sdpa_blocks(batch: int = 4, dtype: str = "fp32", dropout_p: float = 0.1, **_):
    """Two residual blocks whose attention draws its dropout inside SDPA (``dropout_p``): no op
    named after dropout, so only the recorded draws say the module is random."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Attn(nn.Module):
        def __init__(self, h: int, heads: int):
            super().__init__()
            self.qkv, self.proj, self.heads = nn.Linear(h, 3 * h), nn.Linear(h, h), heads

        def forward(self, x):
            b, s, h = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p if self.training else 0.0)
            return self.proj(y.transpose(1, 2).reshape(b, s, h))

    class Net(nn.Module):
        def __init__(self, h: int = 32, heads: int = 2, n: int = 2):
            super().__init__()
            self.attn = nn.ModuleList(Attn(h, heads) for _ in range(n))
            self.head = nn.Linear(h, 8)

        def forward(self, x):
            for a in self.attn:
                x = x + a(x)
            return self.head(x)

    torch.manual_seed(0)
    model = Net()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 16, 32, generator=g), torch.randint(0, 8, (batch, 16), generator=g)
    return model, x, (lambda out, _b: F.cross_entropy(out.flatten(0, 1), y.flatten())), \
        torch.optim.AdamW(model.parameters())


def sdpa_blocks_no_dropout(batch: int = 4, dtype: str = "fp32", **_):
    """:func:`sdpa_blocks` with ``dropout_p=0``: SDPA is tagged seeded but draws nothing."""
    return sdpa_blocks(batch, dtype, dropout_p=0.0)


def opt_decoder(batch: int = 4, seq: int = 64, dtype: str = "fp32", **_):
    """A two-layer OPT decoder (learned positions, tied head, dropout 0.1) with its loss in
    its forward (``labels=``), trained with AdamW: a family no other test names."""
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    cfg = OPTConfig(vocab_size=512, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=128, word_embed_proj_dim=64, dropout=0.1)
    model = OPTForCausalLM(cfg)
    ids = torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids.clone()}, (lambda out, _b: out.loss), \
        torch.optim.AdamW(model.parameters(), lr=1e-3)


def _one_linear(forward, batch: int):
    """A one-linear model whose forward is ``forward(module, x)``, on a batch of ones, SGD."""
    import torch
    from torch import nn

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return forward(self, x)

    model = Model()
    return model, torch.ones(batch, 8), (lambda out, _b: out.sum()), torch.optim.SGD(model.parameters(), lr=0.1)


def raises_in_forward(batch: int = 4, **_):
    """A model whose forward raises (a bug in the user's model): record says where, no traceback."""
    def forward(_module, x):
        raise ValueError("shapes (4, 8) and (7, 8) do not match")

    return _one_linear(forward, batch)


def reads_values(batch: int = 4, **_):
    """A model whose forward reads a tensor's value (.item()): impossible under --fake."""
    def forward(module, x):
        y = module.lin(x)
        return y * float(y.sum().item() > 0)

    return _one_linear(forward, batch)


def stacked_blocks(batch: int = 8, **_):
    """Residual MLP blocks in a ``ModuleList`` run back to back (the container is never called
    itself), then a head; no dropout, so every block can be split along the batch."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, h: int):
            super().__init__()
            self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    class Net(nn.Module):
        def __init__(self, h: int = 32, n: int = 3):
            super().__init__()
            self.blocks = nn.ModuleList(Block(h) for _ in range(n))
            self.head = nn.Linear(h, 4)

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    torch.manual_seed(0)
    model = Net()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 16, 32, generator=g)
    return model, x, (lambda out, _b: out.square().mean()), torch.optim.SGD(model.parameters(), lr=0.1)


def bn_cnn(batch: int = 8, **_):
    """Conv, batch norm, in-place ReLU and max pooling, four times, then a linear head: ops of
    several outputs (``native_batch_norm``'s output, mean and invstd; ``max_pool2d_with_indices``)
    whose outputs a rebuild may need together."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers, c = [], 3
    for w in (8, 16, 16, 32):
        layers += [nn.Conv2d(c, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU(inplace=True), nn.MaxPool2d(2)]
        c = w
    model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(32 * 2 * 2, 10))
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    return model, x, (lambda out, _b: nn.functional.cross_entropy(out, y)), torch.optim.SGD(model.parameters(), lr=0.1,
                                                                                               momentum=0.9)


def encoder_layer(batch: int = 4, seq: int = 32, **_):
    """Embeddings, one ``nn.TransformerEncoderLayer`` (batch first, dropout 0.1: PyTorch's own
    attention, its q, k and v views of one packed projection) and a head whose loss the model
    returns."""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self, vocab: int = 128, h: int = 32):
            super().__init__()
            self.emb = nn.Embedding(vocab, h)
            self.layer = nn.TransformerEncoderLayer(h, 4, 64, dropout=0.1, batch_first=True)
            self.head = nn.Linear(h, vocab)

        def forward(self, ids, labels):
            logits = self.head(self.layer(self.emb(ids)))
            return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    torch.manual_seed(0)
    model = Net()
    ids = torch.randint(0, 128, (batch, seq))
    return model, {"ids": ids, "labels": ids.clone()}, (lambda out, _b: out), torch.optim.AdamW(model.parameters())


def frozen_leaf_mlp(batch: int = 512, **_):
    """An MLP whose first layer is frozen (a partial fine-tune) and whose forward makes its
    hidden state a leaf that requires grad before the next layer (as wav2vec2's feature
    encoder does with its input): what PyTorch's MemTracker, replay's cross-check, tripped on."""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Linear(32, 64)
            self.body = nn.Sequential(nn.Linear(64, 128), nn.GELU(), *[m for _ in range(4) for m in (nn.Linear(128, 128),
                                                                                                   nn.GELU())])
            self.head = nn.Linear(128, 10)

        def forward(self, x):
            h = self.stem(x).detach()
            h.requires_grad = True
            return self.head(self.body(h))

    torch.manual_seed(0)
    model = Net()
    model.stem.requires_grad_(False)
    x, y = torch.randn(batch, 32), torch.randint(0, 10, (batch,))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    return model, x, (lambda out, _b: nn.functional.cross_entropy(out, y)), opt


def layerdrop_mlp(batch: int = 64, **_):
    """Residual MLP blocks that training skips at random (layerdrop, stochastic depth): the op
    sequence changes from step to step."""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self, h: int = 32, n: int = 6):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Dropout(0.1),
                                                      nn.Linear(4 * h, h))
                                        for _ in range(n))
            self.head = nn.Linear(h, 4)
            self.layerdrop = 0.5

        def forward(self, x):
            for b in self.blocks:
                if not self.training or torch.rand(()) >= self.layerdrop:
                    x = x + b(x)
            return self.head(x)

    torch.manual_seed(0)
    model = Net()
    x, y = torch.randn(batch, 32), torch.randint(0, 4, (batch,))
    return model, x, (lambda out, _b: nn.functional.cross_entropy(out, y)), torch.optim.AdamW(model.parameters())


def _activation_mlp(activation, batch: int):
    """Five Linear + ``activation`` layers and a classifier, AdamW."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers = [nn.Linear(32, 128), activation()]
    for _ in range(4):
        layers += [nn.Linear(128, 128), activation()]
    model = nn.Sequential(*layers, nn.Linear(128, 10))
    x, y = torch.randn(batch, 32), torch.randint(0, 10, (batch,))
    return model, x, (lambda out, _b: nn.functional.cross_entropy(out, y)), torch.optim.AdamW(model.parameters())


def relu_mlp(batch: int = 512, **_):
    """Linear + ReLU layers: ReLU saves its output, which the next layer's backward reads as
    its saved input after computing its input's gradient (the rebuild point that matters)."""
    from torch import nn

    return _activation_mlp(nn.ReLU, batch)


def leaf_batch_mlp(batch: int = 256, **_):
    """A batch made with ``requires_grad=True`` (input gradients, adversarial examples): its
    ``.grad`` stays on it and accumulates from step to step."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10))
    x, y = torch.randn(batch, 64, requires_grad=True), torch.randint(0, 10, (batch,))
    return model, x, (lambda out, _b: nn.functional.cross_entropy(out, y)), torch.optim.AdamW(model.parameters())


def passthrough_blocks(batch: int = 8, **_):
    """A downsampling layer, then residual blocks whose drop path is ``nn.Identity`` (a drop
    path turned off, as ConvNeXt's, Swin's and BEiT's are at rate 0): a module that returns
    its input as it got it. PyTorch's ``ModTracker`` opened such a module in backward and never
    closed it (``module_tracking.ModuleTracker._fw_post_hook``)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, h: int):
            super().__init__()
            self.up, self.down, self.drop_path = nn.Linear(h, 4 * h), nn.Linear(4 * h, h), nn.Identity()

        def forward(self, x):
            return x + self.drop_path(self.down(torch.nn.functional.gelu(self.up(x))))

    class Net(nn.Module):
        def __init__(self, h: int = 32, n: int = 2):
            super().__init__()
            self.downsample = nn.Sequential(nn.LayerNorm(2 * h), nn.Linear(2 * h, h))
            self.blocks = nn.ModuleList(Block(h) for _ in range(n))
            self.head = nn.Linear(h, 4)

        def forward(self, x):
            x = self.downsample(x)
            for b in self.blocks:
                x = b(x)
            return self.head(x.mean(1))

    torch.manual_seed(0)
    model = Net()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 16, 64, generator=g), torch.randint(0, 4, (batch,), generator=g)
    return model, x, (lambda out, _b: nn.functional.cross_entropy(out, y)), torch.optim.AdamW(model.parameters())


def helper_module_blocks(batch: int = 8, **_):
    """Residual blocks that each call a module which is not one of the model's (a module-level
    object, never registered as a child): transformers 5.25 with ``kernels`` installed turns
    ``apply_rotary_pos_emb`` into such a module (``Func``) and calls it inside every attention,
    and it calls ``rotate_half``, another. ``ModTracker`` names them by their class alone and
    opens them in backward after the block; the recorder files their ops under the block that
    called them (``Recorder._module``)."""
    import torch
    from torch import nn

    class Func(nn.Module):  # a function as a module, as transformers' Func: no parameters
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def forward(self, *args):
            return self.fn(*args)

    half = Func(lambda b: b * 0.5)  # called inside the next one, as transformers' rotate_half
    scale = Func(lambda a, b: (a * torch.sigmoid(b), half(b)))

    class Block(nn.Module):
        def __init__(self, h: int):
            super().__init__()
            self.gate, self.up, self.down = nn.Linear(h, 2 * h), nn.Linear(h, 2 * h), nn.Linear(2 * h, h)

        def forward(self, x):
            a, b = scale(self.up(x), self.gate(x))
            return x + self.down(a + b)

    class Net(nn.Module):
        def __init__(self, h: int = 32, n: int = 2):
            super().__init__()
            self.blocks = nn.ModuleList(Block(h) for _ in range(n))
            self.head = nn.Linear(h, 4)

        def forward(self, x):
            for blk in self.blocks:
                x = blk(x)
            return self.head(x.mean(1))

    torch.manual_seed(0)
    model = Net()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 16, 32, generator=g), torch.randint(0, 4, (batch,), generator=g)
    return model, x, (lambda out, _b: nn.functional.cross_entropy(out, y)), torch.optim.AdamW(model.parameters())


def gptj(batch: int = 4, seq: int = 32, dtype: str = "fp32", **_):
    """A two-layer GPT-J (no download): attention and MLP in parallel, both reading the block's
    norm, and its dropouts at rate 0 pass their inputs through."""
    import torch
    from transformers import GPTJConfig, GPTJForCausalLM

    torch.manual_seed(0)
    cfg = GPTJConfig(vocab_size=256, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64,
                     use_cache=False, bos_token_id=0, eos_token_id=0)
    model = GPTJForCausalLM(cfg)
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids.clone()}, (lambda out, _b: out.loss), \
        torch.optim.AdamW(model.parameters(), lr=1e-3)


def relative_scores(batch: int = 8, **_):
    """Attention-like scores in the pattern of DeBERTa's disentangled attention: a score matrix
    that a ``gather`` reads (its backward takes only the shape: autograd saves the matrix, no
    backward op reads it), and a score written in place later in forward with what is made
    after it (``scores.add_(c2p / scale)``)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, h: int = 32, s: int = 16):
            super().__init__()
            self.q, self.k, self.pos, self.out = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, s), nn.Linear(s, h)
            idx = torch.arange(s).view(1, s, 1) - torch.arange(s).view(1, 1, s)
            self.register_buffer("idx", idx.clamp(0, s - 1).expand(batch, s, s).contiguous(), persistent=False)

        def forward(self, x):
            scores = torch.bmm(self.q(x), self.k(x).transpose(1, 2)) * 0.5  # written in place below
            rel = self.pos(x)  # [b, s, s]
            c2p = torch.gather(torch.bmm(rel, rel.transpose(1, 2)), -1, self.idx)  # saved, never read
            scores.add_(c2p / 4)
            return x + self.out(torch.tanh(scores))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(Block(), Block())
            self.head = nn.Linear(32, 4)

        def forward(self, x):
            return self.head(self.blocks(x))

    torch.manual_seed(0)
    model = Net()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 16, 32, generator=g), torch.randint(0, 4, (batch, 16), generator=g)
    return model, x, (lambda out, _b: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())), \
        torch.optim.AdamW(model.parameters())


def shared_block(batch: int = 16, **_):
    """A block called twice in a row in one forward, its weights shared (ALBERT's layer group):
    its ops form one contiguous run per forward, as one call of a larger module would."""
    import torch
    from torch import nn

    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32))

        def forward(self, x):
            return self.block(self.block(x))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), Body(), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 16, generator=g), torch.randint(0, 4, (batch,), generator=g)
    return model, x, (lambda out, _b: nn.functional.cross_entropy(out, y)), torch.optim.AdamW(model.parameters())


def unused_arg_blocks(batch: int = 8, **_):
    """Blocks called with a tensor they never read (a decoder layer's position ids, made once
    in the model's forward and passed to every layer): a checkpoint of a block holds it until
    the block's backward all the same."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(32, 32)

        def forward(self, x, positions):
            return x + torch.tanh(self.lin(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(3))
            self.head = nn.Linear(32, 64)

        def forward(self, x):
            positions = torch.arange(x.shape[1]).expand(x.shape[0], -1) * 1  # made here, never read
            for b in self.blocks:
                x = b(x, positions)
            return self.head(x)

    torch.manual_seed(0)
    model = Net()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 64, 32, generator=g), torch.randint(0, 64, (batch, 64), generator=g)
    return model, x, (lambda out, _b: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())), \
        torch.optim.SGD(model.parameters(), lr=0.1)


def gelu_mlp(batch: int = 512, **_):
    """Linear + GELU layers: each GELU output is saved by the next linear layer alone, whose
    backward sums the bias gradient after the weight gradient's matmul, in the engine."""
    from torch import nn

    return _activation_mlp(nn.GELU, batch)


def pooled_mlp(batch: int = 2048, **_):
    """An MLP whose forward also returns a pooled output that the loss does not use, through a
    ``tanh`` (which autograd saves as its own output), as a BERT-style pooler next to an MLM
    head (FNet's ``FNetForMaskedLM``)."""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self, h: int = 64):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(32, h), nn.GELU(), nn.Linear(h, h), nn.GELU())
            self.head = nn.Linear(h, 4)
            self.pool = nn.Linear(h, h)

        def forward(self, x):
            h = self.body(x)
            return self.head(h), torch.tanh(self.pool(h[:8]))

    torch.manual_seed(0)
    model = Net()
    x, y = torch.randn(batch, 32), torch.randint(0, 4, (batch,))
    return model, x, (lambda out, _b: nn.functional.cross_entropy(out[0], y)), torch.optim.AdamW(model.parameters())


def looped_moe(batch: int = 256, **_):
    """A mixture of experts that loops over its experts (top-2 routing): each expert gets the
    tokens routed to it (``torch.where`` of the routing mask, then ``x[token_idx]``) and adds its
    output back with ``index_add_``, as transformers' eager experts and SwitchTransformers do. The
    tokens per expert, and so the sizes of everything an expert computes, change with the data."""
    import torch
    from torch import nn

    class Experts(nn.Module):
        def __init__(self, h: int, n: int):
            super().__init__()
            self.router = nn.Linear(h, n, bias=False)
            self.experts = nn.ModuleList(nn.Sequential(nn.Linear(h, 2 * h), nn.GELU(), nn.Linear(2 * h, h))
                                         for _ in range(n))

        def forward(self, x):
            weights, chosen = torch.softmax(self.router(x), dim=-1).topk(2, dim=-1)
            out = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                token_idx, slot = torch.where(chosen == e)
                y = expert(x[token_idx]) * weights[token_idx, slot, None]
                out.index_add_(0, token_idx, y)
            return out

    return _moe_workload(Experts, batch)


def hit_moe(batch: int = 128, **_):
    """A mixture of experts as transformers writes its eager experts (Mixtral's): the experts'
    weights in one 3-D parameter, and a loop over the experts that got tokens
    (``for expert_idx in expert_hit``), so a step that routes no token to an expert runs one
    iteration less."""
    import torch
    from torch import nn

    class Experts(nn.Module):
        def __init__(self, h: int, n: int):
            super().__init__()
            self.n = n
            self.router = nn.Linear(h, n)
            self.up = nn.Parameter(torch.randn(n, 2 * h, h) / h**0.5)
            self.down = nn.Parameter(torch.randn(n, h, 2 * h) / (2 * h) ** 0.5)

        def forward(self, x):
            weights, chosen = torch.softmax(self.router(x), dim=-1).topk(2, dim=-1)
            out = torch.zeros_like(x)
            with torch.no_grad():
                mask = nn.functional.one_hot(chosen, self.n).permute(2, 1, 0)  # expert, slot, token
                expert_hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
            for expert_idx in expert_hit:
                e = expert_idx[0]
                slot, token_idx = torch.where(mask[e])
                y = nn.functional.linear(nn.functional.gelu(nn.functional.linear(x[token_idx], self.up[e])), self.down[e])
                out.index_add_(0, token_idx, y * weights[token_idx, slot, None])
            return out

    return _moe_workload(Experts, batch)


def _moe_workload(experts, batch: int):
    """(model, batch, loss, optimizer) of residual blocks of ``experts(h, n)`` (a mixture of
    experts layer) between an input projection and a head."""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self, h: int = 32, layers: int = 2, n: int = 4):
            super().__init__()
            self.inp = nn.Linear(16, h)
            self.blocks = nn.ModuleList(experts(h, n) for _ in range(layers))
            self.head = nn.Linear(h, 4)

        def forward(self, x):
            h = self.inp(x)
            for block in self.blocks:
                h = h + block(h)
            return self.head(h)

    torch.manual_seed(0)
    model = Net()
    x = torch.randn(batch, 16)
    return model, x, (lambda out, _b: out.float().pow(2).mean()), torch.optim.AdamW(model.parameters())


def lstm_lm(batch: int = 8, **_):
    """A two-layer LSTM language model: on CPU each layer runs ``mkldnn_rnn_layer``, whose
    fourth output, the workspace its backward reads, is made only with grad enabled."""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self, vocab: int = 64, h: int = 64):
            super().__init__()
            self.emb = nn.Embedding(vocab, h)
            self.rnn = nn.LSTM(h, 2 * h, num_layers=2, batch_first=True)
            self.head = nn.Linear(2 * h, vocab)

        def forward(self, ids):
            return self.head(self.rnn(self.emb(ids))[0])

    torch.manual_seed(0)
    model = Net()
    ids = torch.randint(0, 64, (batch, 32))
    return model, ids, (lambda out, b: nn.functional.cross_entropy(out.flatten(0, 1), b.flatten())), \
        torch.optim.AdamW(model.parameters())


def pooling_blocks(batch: int = 64, **_):
    """Residual blocks over a sequence, each followed by a pooling that halves it (Informer's
    distilling convolution); ``model.skip`` names blocks the forward skips with their pooling,
    as Informer's layerdrop does: what follows then runs on a longer sequence."""
    import torch
    from torch import nn

    class Pool(nn.Module):
        def forward(self, x):
            b, s, h = x.shape
            return x.view(b, s // 2, 2, h).mean(2)

    class Net(nn.Module):
        def __init__(self, h: int = 32, layers: int = 3):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(h, 2 * h), nn.GELU(), nn.Linear(2 * h, h))
                                        for _ in range(layers))
            self.pools = nn.ModuleList(Pool() for _ in range(layers))
            self.head = nn.Linear(h, 4)
            self.skip: set = set()

        def forward(self, x):
            for i, (block, pool) in enumerate(zip(self.blocks, self.pools, strict=True)):
                if i not in self.skip:
                    x = pool(x + block(x))
            return self.head(x).mean(1)

    torch.manual_seed(0)
    model = Net()
    x = torch.randn(batch, 16, 32)
    return model, x, (lambda out, _b: out.pow(2).mean()), torch.optim.AdamW(model.parameters())


def swish_mlp(batch: int = 128, **_):
    """Linear layers joined by a custom ``torch.autograd.Function`` (a learned swish): its
    forward saves its input and weight with ``ctx.save_for_backward``; its backward computes
    the weight's gradient with a sum of its own (``.sum(0)``), while it still holds what it
    unpacked."""
    import torch
    from torch import nn

    class Swish(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x * torch.sigmoid(x * w)

        @staticmethod
        def backward(ctx, gy):
            x, w = ctx.saved_tensors
            s = torch.sigmoid(x * w)
            dydx = s + x * s * (1 - s) * w
            dydw = x * x * s * (1 - s)
            return gy * dydx, (gy * dydw).sum(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = nn.Linear(64, 128), nn.Linear(128, 64)
            self.l3, self.l4 = nn.Linear(64, 128), nn.Linear(128, 10)
            self.w = nn.Parameter(torch.ones(128))

        def forward(self, x):
            h = self.l2(Swish.apply(self.l1(x), self.w))
            return self.l4(Swish.apply(self.l3(h), self.w))

    torch.manual_seed(0)
    model = Net()
    x = torch.randn(batch, 64, generator=torch.Generator().manual_seed(1))
    return model, x, (lambda out, b: out.square().mean()), torch.optim.AdamW(model.parameters(), lr=1e-3)


def reseeding_mlp(batch: int = 64, **_):
    """An MLP with dropout whose forward reseeds torch's generator from the clock first
    (``torch.seed()``, as transformers' Reformer does for its attention): two unplanned runs
    from the same seed already train differently."""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2, self.l3 = nn.Linear(32, 128), nn.Linear(128, 128), nn.Linear(128, 4)

        def forward(self, x):
            torch.seed()
            h = nn.functional.dropout(torch.relu(self.l1(x)), 0.2, self.training)
            return self.l3(torch.relu(self.l2(h)))

    torch.manual_seed(0)
    model = Net()
    x = torch.randn(batch, 32, generator=torch.Generator().manual_seed(1))
    return model, x, (lambda out, b: out.square().mean()), torch.optim.SGD(model.parameters(), lr=1e-2)


def lazy_mask_lm(batch: int = 4, **_):
    """A one-block language model that builds its causal mask buffer on its first call (as
    models with lazily made mask or rotary caches do): the first step runs ops the recorded,
    steady-state step does not."""
    import math

    import torch
    from torch import nn
    from torch.nn import functional as F

    v, h, s = 64, 32, 16

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(v, h)
            self.register_buffer("mask", None, persistent=False)
            self.l1, self.l2, self.head = nn.Linear(h, 64), nn.Linear(64, h), nn.Linear(h, v)

        def forward(self, ids):
            n = ids.shape[1]
            if self.mask is None or self.mask.shape[0] < n:
                self.mask = torch.full((n, n), float("-inf")).triu(1)
            x = self.emb(ids)
            x = x + ((x @ x.transpose(1, 2)) / math.sqrt(h) + self.mask[:n, :n]).softmax(-1) @ x
            return self.head(x + self.l2(F.gelu(self.l1(x))))

    torch.manual_seed(0)
    model = Net()
    ids = torch.randint(0, v, (batch, s), generator=torch.Generator().manual_seed(1))
    return model, ids, (lambda out, b: F.cross_entropy(out.reshape(-1, v), b.reshape(-1))), \
        torch.optim.AdamW(model.parameters(), lr=1e-3)


def borrowed_module_blocks(batch: int = 1024, **_):
    """Residual blocks that each call a module registered elsewhere in the model (one GELU on the
    model itself, passed to every block, as models that share an activation or a norm do), with
    dropout inside: the GELU's ops run inside each block's call but are filed under the GELU, not
    the block. A plan's planned regions (taichi_plan.problem.partition.regions) must still hold them where they
    read what the block drops."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, h: int):
            super().__init__()
            self.up, self.down, self.drop = nn.Linear(h, 4 * h), nn.Linear(4 * h, h), nn.Dropout(0.1)

        def forward(self, x, act):
            return x + self.drop(self.down(act(self.up(x))))

    class Net(nn.Module):
        def __init__(self, h: int = 32, n: int = 3):
            super().__init__()
            self.inp = nn.Linear(16, h)
            self.act = nn.GELU()
            self.blocks = nn.ModuleList(Block(h) for _ in range(n))
            self.head = nn.Linear(h, 4)

        def forward(self, x):
            x = torch.tanh(self.inp(x))  # the model's own top-level code
            for blk in self.blocks:
                x = blk(x, self.act)
            return self.head(x)

    torch.manual_seed(0)
    model = Net()
    x, y = torch.randn(batch, 16), torch.randint(0, 4, (batch,))
    return model, x, (lambda out, _b: nn.functional.cross_entropy(out, y)), torch.optim.AdamW(model.parameters())


def chained_blocks(batch: int = 256, **_):
    """Blocks that are containers with no op of their own (``nn.Sequential``: Linear, GELU,
    Linear), one after the other, no residual: checkpointed whole, a block's output (its last
    Linear's) is read by the next block's first Linear, and rebuilt through the block's insides."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    h = 64
    model = nn.Sequential(*[nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)) for _ in range(4)],
                          nn.Linear(h, 4))
    x, y = torch.randn(batch, h), torch.randint(0, 4, (batch,))
    return model, x, (lambda out, _b: nn.functional.cross_entropy(out, y)), torch.optim.AdamW(model.parameters())


def shared_act_layerdrop(batch: int = 1024, **_):
    """``layerdrop_mlp`` whose blocks call one GELU registered on the model (a shared module,
    called once per block): a skipped block shifts which of its calls the next block makes."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, h: int):
            super().__init__()
            self.up, self.down, self.drop = nn.Linear(h, 4 * h), nn.Linear(4 * h, h), nn.Dropout(0.1)

        def forward(self, x, act):
            return self.down(self.drop(act(self.up(x))))

    class Net(nn.Module):
        def __init__(self, h: int = 32, n: int = 6):
            super().__init__()
            self.act = nn.GELU()
            self.blocks = nn.ModuleList(Block(h) for _ in range(n))
            self.head = nn.Linear(h, 4)
            self.layerdrop = 0.5

        def forward(self, x):
            for b in self.blocks:
                if not self.training or torch.rand(()) >= self.layerdrop:
                    x = x + b(x, self.act)
            return self.head(x)

    torch.manual_seed(0)
    model = Net()
    x, y = torch.randn(batch, 32), torch.randint(0, 4, (batch,))
    return model, x, (lambda out, _b: nn.functional.cross_entropy(out, y)), torch.optim.AdamW(model.parameters())


def funnel(batch: int = 2, seq: int = 16, **_):
    """A 2-block ``transformers`` Funnel Transformer (masked LM, dropout 0.1): between blocks it
    pools the hidden states (``cat`` of slices of them, then ``avg_pool2d``), and the next
    block's first attention reads the pooled states as its queries and the unpooled ones as its
    keys and values."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.FunnelConfig(vocab_size=64, d_model=32, n_head=2, d_head=16, d_inner=64, block_sizes=[1, 1],
                                    num_decoder_layers=1)
    model = transformers.FunnelForMaskedLM(cfg)
    ids = torch.randint(0, 64, (batch, seq))
    return model, {"input_ids": ids, "labels": ids.clone()}, (lambda out, _b: out.loss), \
        torch.optim.AdamW(model.parameters(), lr=1e-3)


def xlnet(batch: int = 2, seq: int = 16, **_):
    """A 2-layer ``transformers`` XLNet language model (relative attention with its position and
    segment terms, dropout 0.1): late in each layer's forward its attention makes transient
    score tensors as large as what the layer saves."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.XLNetConfig(vocab_size=64, d_model=32, n_layer=2, n_head=2, d_inner=64)
    model = transformers.XLNetLMHeadModel(cfg)
    ids = torch.randint(0, 64, (batch, seq))
    return model, {"input_ids": ids, "labels": ids.clone()}, (lambda out, _b: out.loss), \
        torch.optim.AdamW(model.parameters(), lr=1e-3)
