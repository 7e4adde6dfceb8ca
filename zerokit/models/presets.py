"""GPT sizes for ``zerokit plan --model zerokit.models.presets:NAME`` (and ``compare``/``verify``
where they fit): the shapes of published models, built with ``zerokit.models.gpt.GPT``."""

from __future__ import annotations

from .gpt import GPT, GPTConfig


def gpt_6_7b(layout=None) -> GPT:
    """GPT-3 6.7B's shape (32 layers, d 4096, 32 heads) with a 32000-token vocabulary, tied
    embedding, 2048 positions: 6.58e9 parameters. Plan it; it does not fit this CPU's memory.
    With a layout: tensor-parallel (``zerokit plan --tp``)."""
    cfg = GPTConfig(vocab_size=32000, block_size=2048, n_layer=32, n_head=32, n_embd=4096)
    return _built(cfg, layout)


def gpt_1_3b(layout=None) -> GPT:
    """GPT-3 XL's shape (24 layers, d 2048, 16 heads), vocabulary 32000, 2048 positions."""
    cfg = GPTConfig(vocab_size=32000, block_size=2048, n_layer=24, n_head=16, n_embd=2048)
    return _built(cfg, layout)


def gpt_medium(layout=None) -> GPT:
    """GPT-2 medium's shape (24 layers, d 1024, 16 heads), vocabulary 32000, 1024 positions:
    335e6 parameters."""
    cfg = GPTConfig(vocab_size=32000, block_size=1024, n_layer=24, n_head=16, n_embd=1024)
    return _built(cfg, layout)


def _built(cfg: GPTConfig, layout) -> GPT:
    if layout is None:
        return GPT(cfg)
    return GPT(GPTConfig(**{**cfg.__dict__, "tensor_parallel": True}), layout)
