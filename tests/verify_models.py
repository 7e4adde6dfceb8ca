"""Models for `zerokit verify --model` in tests: one that trains alike on any number of ranks,
and two that cannot (a forward that reads the rank; dropout, which draws per row)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from compare_models import FEATURES, regression_batch
from torch import nn


class RankScaled(nn.Module):
    """The last layer's output is scaled by (rank + 1): only rank 0 computes what one process
    computes, so the gradient of ``head`` differs first."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = dist.get_rank() + 1 if dist.is_initialized() else 1
        return self.head(self.body(x)) * scale


def rank_scaled():
    torch.manual_seed(0)
    return RankScaled(), regression_batch


def with_dropout():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.Dropout(0.5), nn.Linear(32, 1))
    return model, regression_batch


def tiny_gpt():
    """The built-in GPT, tiny: a tied embedding in the root unit, two blocks as units."""
    from zerokit.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16))


def tiny_gpt_tp(layout=None):
    """``tiny_gpt`` for ``--tp``: the plain model without a layout, its tensor-parallel twin
    (same seed, same full parameters) with one."""
    from zerokit.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=64,
        block_size=16,
        n_layer=2,
        n_head=2,
        n_embd=16,
        tensor_parallel=layout is not None,
    )
    return GPT(cfg, layout)


def tiny_gpt_untied():
    """``tiny_gpt`` with its own output head (no weight shared by the first and last layer)."""
    from zerokit.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(
        GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16, tie_weights=False)
    )


class BatchStatistic(nn.Module):
    """Normalises by the batch mean over every rank: its forward makes a collective of its
    own (an all-reduce of ``FEATURES`` floats), as a synchronised batch norm does."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(FEATURES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=0)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(mean)
            mean = mean / dist.get_world_size()
        return self.body(x - mean)


def batch_statistic():
    torch.manual_seed(0)
    return BatchStatistic(), regression_batch


class ReadsValues(nn.Module):
    """A forward that branches on a tensor's value: it cannot run on ``meta``."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(FEATURES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) if x.sum() > 0 else -self.body(x)


def reads_values():
    torch.manual_seed(0)
    return ReadsValues(), regression_batch


class _Logits(nn.Module):
    """A Hugging Face causal LM as the token-model contract wants it: ids in, logits out."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids).logits


def tiny_llama():
    """Hugging Face's LlamaForCausalLM, tiny, untied, with grouped KV heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return _Logits(LlamaForCausalLM(config))


def tiny_hf_gpt2():
    """Hugging Face's GPT2LMHeadModel as it comes (returns a ``CausalLMOutputWithCrossAttentions``),
    tiny and dropout-free (GPT-2's configs default to dropout 0.1)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def tiny_hf_llama():
    """Hugging Face's LlamaForCausalLM as it comes (returns a ``CausalLMOutputWithPast``)."""
    return tiny_llama().lm


class _NoLogits(nn.Module):
    """A token model whose forward returns a dict without logits: outside the contract."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)

    def forward(self, ids: torch.Tensor) -> dict:
        return {"hidden": self.embed(ids)}


def no_logits():
    return _NoLogits()
