"""A small GPT (nanoGPT's shape), readable top to bottom. Token ids in, logits out."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .. import tensor_parallel as tp


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    """Number of token ids."""
    block_size: int = 64
    """Longest sequence the position embedding covers."""
    n_layer: int = 2
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 64
    """Width of the residual stream."""
    tie_weights: bool = True
    """Share the token embedding with the output head (the weight appears once)."""
    tensor_parallel: bool = False
    """Split attention heads, the MLP and the vocabulary across the tp group of
    ``zerokit.init_hybrid_parallel``'s layout (Megatron style). The model then returns this
    rank's vocabulary slice of the logits: use ``tensor_parallel.ParallelCrossEntropy``."""


class Block(nn.Module):
    # No biases in the linear layers, as in most current GPTs. (A key bias would also have an
    # analytically zero gradient, softmax being shift-invariant, whose float noise Adam turns
    # into full-size steps that differ with summation order.)
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        C = cfg.n_embd
        self.head_dim = C // cfg.n_head
        self.ln_1 = nn.LayerNorm(C)
        self.ln_2 = nn.LayerNorm(C)
        if cfg.tensor_parallel:  # each tp rank: its heads, its quarter of the MLP
            tp_degree = tp.current_layout().tp_degree
            if cfg.n_head % tp_degree:
                raise ValueError(f"n_head {cfg.n_head} must be divisible by tp degree {tp_degree}")
            self.qkv = tp.ColumnParallelLinear(C, 3 * C, False, gather_output=False, stride=3)
            self.proj = tp.RowParallelLinear(C, C, False, input_is_parallel=True)
            self.fc = tp.ColumnParallelLinear(C, 4 * C, False, gather_output=False)
            self.fc_out = tp.RowParallelLinear(4 * C, C, False, input_is_parallel=True)
        else:
            self.qkv = nn.Linear(C, 3 * C, bias=False)
            self.proj = nn.Linear(C, C, bias=False)
            self.fc = nn.Linear(C, 4 * C, bias=False)
            self.fc_out = nn.Linear(4 * C, C, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(self.ln_1(x)).chunk(3, dim=2)  # each [B, T, C] (C/tp split)
        heads = q.shape[-1] // self.head_dim
        q, k, v = (t.view(B, T, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, nh, T, hs]
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, -1))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.cfg = cfg
        # A tp model holds its slices of the plain model drawn from the same random state.
        plain = GPT(replace(cfg, tensor_parallel=False)) if cfg.tensor_parallel else None
        if cfg.tensor_parallel:
            self.wte = tp.VocabParallelEmbedding(cfg.vocab_size, cfg.n_embd)
        else:
            self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        if cfg.tensor_parallel:  # vocabulary split like the embedding's
            self.lm_head = tp.ColumnParallelLinear(
                cfg.n_embd, cfg.vocab_size, False, gather_output=False
            )
        else:
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        if plain is not None:
            tp.load_full_state_dict(self, plain.state_dict())
            return
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = (
                    0.02 / math.sqrt(2 * cfg.n_layer)
                    if name.endswith(("proj.weight", "fc_out.weight"))
                    else 0.02
                )
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]  # idx: [B, T] token ids
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # [B, T, C]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # [B, T, vocab] (vocab/tp with tensor_parallel)


def synthetic_batch(
    vocab_size: int, batch: int, seq: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A reproducible, learnable (inputs, targets) pair of token ids, each [batch, seq].

    Each sequence starts at a random token and every next token is a fixed function of the
    previous one, so a model can learn it and the loss falls.
    """
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.empty(batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab_size, (batch,), generator=gen)
    for t in range(seq):
        tokens[:, t + 1] = (tokens[:, t] * 5 + 3) % vocab_size
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits [B, T, vocab] against targets [B, T]."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
