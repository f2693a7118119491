"""Tiny real Hugging Face models for tests that need a recorded trace of a given shape
(each records in seconds on CPU). Entries in the ``--entry module:function`` form."""

from __future__ import annotations


def swin(batch: int = 2, dtype: str = "fp32", **_):
    """A two-stage windowed-attention vision model (Swin): its backward ops are where
    ModTracker leaves ``relative_position_bias`` open."""
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
