"""Plans for ``zerokit.parallelize``: how an unmodified model is split and placed. Here the
built-in tensor-parallel plans, plain dicts ``{module name pattern: style}`` to copy and edit
(``*`` matches one level of a name); ``stages.py``: how a family's model is cut into pipeline
stages (``zerokit.pipeline.split``).

>>> from zerokit import plans
>>> plans.llama()["model.layers.*.self_attn.q_proj"]
'colwise'
"""

from __future__ import annotations


def llama(sequence_parallel: bool = False, parallel_loss: bool = False) -> dict[str, str]:
    """Hugging Face ``LlamaForCausalLM`` (and models shaped like it: Mistral, Qwen2): attention
    and MLP Megatron-style, embedding and head split by vocabulary (logits whole on every rank).
    The tp degree must divide the attention heads and the KV heads. ``sequence_parallel``: the
    norms run on this tp rank's block of the sequence (which the tp degree must divide).
    ``parallel_loss``: each rank keeps its vocabulary part of the logits, for
    ``ParallelCrossEntropy``."""
    plan = {
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
    if sequence_parallel:
        for norm in ("model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm",
                     "model.norm"):  # fmt: skip
            plan[norm] = "sequence"
    return plan


def gpt2(sequence_parallel: bool = False, parallel_loss: bool = False) -> dict[str, str]:
    """Hugging Face ``GPT2LMHeadModel``: ``Conv1D`` layers (weights stored transposed) split
    in place, the fused q, k, v of ``c_attn`` split per head; the tied embedding and head split
    by vocabulary together. The tp degree must divide the heads. ``sequence_parallel``: the
    LayerNorms and the dropouts after the row layers run on this tp rank's block of the
    sequence (which the tp degree must divide). ``parallel_loss``: as for ``llama``."""
    plan = {
        "transformer.wte": "vocab",
        "transformer.h.*.attn.c_attn": "colwise",
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
        "lm_head": "vocab_loss" if parallel_loss else "vocab",
    }
    if sequence_parallel:
        for name in ("transformer.h.*.ln_1", "transformer.h.*.attn.resid_dropout",
                     "transformer.h.*.ln_2", "transformer.h.*.mlp.dropout",
                     "transformer.ln_f"):  # fmt: skip
            plan[name] = "sequence"
    return plan


BUILT_IN = {"llama": llama, "gpt2": gpt2}
