"""Plans for ``zerokit.parallelize``: how an unmodified model is split and placed. Here the
built-in tensor-parallel plans, plain dicts ``{module name pattern: style}`` to copy and edit
(``*`` matches one level of a name); ``stages.py``: how a family's model is cut into pipeline
stages (``zerokit.pipeline.split``).

>>> from zerokit import plans
>>> plans.llama()["model.layers.*.self_attn.q_proj"]
'colwise'
"""

from __future__ import annotations


def llama(parallel_loss: bool = False) -> dict[str, str]:
    """Hugging Face ``LlamaForCausalLM`` (and models shaped like it: Mistral, Qwen2): attention
    and MLP Megatron-style, embedding and head split by vocabulary (logits whole on every rank;
    with ``parallel_loss`` each rank keeps its vocabulary part, for ``ParallelCrossEntropy``).
    The tp degree must divide the attention heads and the KV heads."""
    return {
        "model.embed_tokens": "vocab",
        "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.k_proj": "colwise",
        "model.layers.*.self_attn.v_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.gate_proj": "colwise",
        "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise",
        "lm_head": "vocab_loss" if parallel_loss else "vocab",
    }


def gpt2(parallel_loss: bool = False) -> dict[str, str]:
    """Hugging Face ``GPT2LMHeadModel``: ``Conv1D`` layers (weights stored transposed) split
    in place, the fused q, k, v of ``c_attn`` split per head; the tied embedding and head split
    by vocabulary together (``parallel_loss``: as for ``llama``). The tp degree must divide the
    heads."""
    return {
        "transformer.wte": "vocab",
        "transformer.h.*.attn.c_attn": "colwise",
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
        "lm_head": "vocab_loss" if parallel_loss else "vocab",
    }


BUILT_IN = {"llama": llama, "gpt2": gpt2}
