"""Stage adapters: how one family of Hugging Face causal language models runs as pipeline
stages (``zerokit.pipeline.split_model``).

A model's own ``forward`` runs the whole model: embeddings, position information, the
attention mask, every block, the final norm, the head, the loss. A stage runs a part of it, so
each family says here, once, what belongs where and how a part runs:

- ``first``: modules only the first stage holds (embeddings), run by ``embed``;
- ``blocks``: the ``ModuleList`` of blocks that split points cut;
- ``last``: modules only the last stage holds (final norm, head), run by ``head``;
- anything else (Llama's rotary embedding: buffers only) is kept by every stage.

Every parameter must lie under ``first``, ``blocks`` or ``last`` (``split_model`` checks), so
no weight is silently replicated across stages. Between stages only the hidden states travel:
positions (``arange(T)``) and the causal mask are made again on each stage from their shape.
So a split model takes ``input_ids`` alone, unpadded: no ``attention_mask``, no cache.

Another family: subclass ``StageAdapter`` and add it to ``ADAPTERS`` under the model's class
name (or pass ``adapter=`` to ``split_model``).
"""

from __future__ import annotations

import torch
from torch import nn


class StageAdapter:
    """One family's stage layout and forward pieces, for a model of that family."""

    first: tuple[str, ...] = ()
    blocks: str = ""
    last: tuple[str, ...] = ()

    def __init__(self, model: nn.Module):
        self.config = model.config
        self._loss = model.loss_function  # Hugging Face's own loss for the model

    def embed(self, stage: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def block_kwargs(self, stage: nn.Module, hidden: torch.Tensor) -> dict:
        """What every block of the stage is called with besides the hidden states (made once
        per stage forward, from the hidden states' shape)."""
        raise NotImplementedError

    def head(self, stage: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The model's ``forward(labels=...).loss``: next-token cross entropy, mean over the
        tokens whose label is not -100."""
        return self._loss(logits=logits, labels=labels, vocab_size=self.config.vocab_size)

    # -- shared by the families ----------------------------------------------------------------
    def positions(self, hidden: torch.Tensor) -> torch.Tensor:  # [1, T]
        return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)

    def causal_mask(self, hidden: torch.Tensor, positions: torch.Tensor):
        """The mask the model's forward makes with no padding mask (None where the attention
        implementation is causal by itself)."""
        from transformers.masking_utils import create_causal_mask  # only for a transformers model

        return create_causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=None,
            cache=None,
            position_ids=positions,
        )


class LlamaStages(StageAdapter):
    """``LlamaForCausalLM`` (``LlamaModel.forward`` and the head, taken apart)."""

    first = ("model.embed_tokens",)
    blocks = "model.layers"
    last = ("model.norm", "lm_head")

    def embed(self, stage, input_ids):  # [B, T] -> [B, T, H]
        return stage.model.embed_tokens(input_ids)

    def block_kwargs(self, stage, hidden):
        positions = self.positions(hidden)
        return {
            "attention_mask": self.causal_mask(hidden, positions),
            "position_ids": positions,
            "position_embeddings": stage.model.rotary_emb(hidden, position_ids=positions),
        }

    def head(self, stage, hidden):  # [B, T, H] -> [B, T, V]
        return stage.lm_head(stage.model.norm(hidden))


class GPT2Stages(StageAdapter):
    """``GPT2LMHeadModel`` (``GPT2Model.forward`` and the head, taken apart)."""

    first = ("transformer.wte", "transformer.wpe", "transformer.drop")
    blocks = "transformer.h"
    last = ("transformer.ln_f", "lm_head")

    def embed(self, stage, input_ids):  # [B, T] -> [B, T, H]
        t = stage.transformer
        return t.drop(t.wte(input_ids) + t.wpe(self.positions(input_ids)))

    def block_kwargs(self, stage, hidden):
        positions = self.positions(hidden)
        return {"attention_mask": self.causal_mask(hidden, positions), "position_ids": positions}

    def head(self, stage, hidden):  # [B, T, H] -> [B, T, V]
        return stage.lm_head(stage.transformer.ln_f(hidden))


ADAPTERS: dict[str, type[StageAdapter]] = {
    "LlamaForCausalLM": LlamaStages,
    "GPT2LMHeadModel": GPT2Stages,
}
"""Model class name -> its family's adapter. Add your own family here."""


def adapter_for(model: nn.Module) -> StageAdapter:
    """The adapter of ``model``'s family, built for it; ValueError if none is known."""
    name = type(model).__name__
    if name not in ADAPTERS:
        raise ValueError(
            f"no pipeline stage adapter for {name}: split points are supported for "
            f"{', '.join(sorted(ADAPTERS))}. For another family, subclass "
            "zerokit.plans.stages.StageAdapter (first, blocks, last; embed, block_kwargs, head) and "
            f"add it as zerokit.plans.stages.ADAPTERS[{name!r}], or pass "
            "split_model(..., adapter=YourAdapter)"
        )
    return ADAPTERS[name](model)
