"""Tiny Hugging Face MoE models built from configs (no downloads) and the MoE tests' shared
loop: one process on the global batch beside zerokit's ranks on their slices."""

import copy

import torch
import torch.distributed as dist

VOCAB = 64


def tiny_moe(
    family: str = "mixtral", experts: int = 4, aux: bool = False, seed: int = 0, inner: int = 24
):
    """A 2-layer MoE causal LM, hidden 16, ``experts`` experts, top-2, fp32, eager; ``inner``:
    Mixtral's expert width."""
    import transformers as tf

    common = {
        "vocab_size": VOCAB, "hidden_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "num_experts_per_tok": 2,
        "output_router_logits": aux, "router_aux_loss_coef": 0.5,
        "max_position_embeddings": 32, "tie_word_embeddings": False,
    }  # fmt: skip
    if family == "mixtral":
        config = tf.MixtralConfig(num_local_experts=experts, intermediate_size=inner, **common)
        cls = tf.MixtralForCausalLM
    elif family == "qwen3_moe":
        config = tf.Qwen3MoeConfig(
            num_experts=experts, moe_intermediate_size=12, intermediate_size=24,
            norm_topk_prob=True, head_dim=8, **common,
        )  # fmt: skip
        cls = tf.Qwen3MoeForCausalLM
    elif family == "olmoe":
        config = tf.OlmoeConfig(num_experts=experts, intermediate_size=12, **common)
        cls = tf.OlmoeForCausalLM
    elif family == "deepseek_v3":  # its first layer dense, the second MoE with a shared expert
        common.update(num_key_value_heads=2)
        config = tf.DeepseekV3Config(
            n_routed_experts=experts, n_shared_experts=1, moe_intermediate_size=12,
            intermediate_size=24, first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=None,
            qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1,
            **common,
        )  # fmt: skip
        cls = tf.DeepseekV3ForCausalLM
    else:
        raise ValueError(family)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return cls(config).float()


def batches(
    steps: int, batch: int, seq: int = 6, seed: int = 1, constant_rows: int = 0, token=None
):
    """Token batches; the first ``constant_rows`` rows of each repeat one token, so every
    token of those rows routes alike (some experts receive none of them); ``token``: every
    row of every batch is that one token."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (batch, seq), generator=gen)
        tokens[:constant_rows] = tokens[:constant_rows, :1]
        out.append(tokens if token is None else torch.full_like(tokens, token))
    return out


def token_avoiding(experts: set[int], family: str = "mixtral") -> int:
    """A token whose repeated sequence the first layer routes to none of ``experts``."""
    model = tiny_moe(family, aux=True)
    for token in range(VOCAB):
        logits = model(input_ids=torch.full((1, 6), token)).router_logits[0]
        if not set(logits.topk(2, dim=-1).indices.flatten().tolist()) & experts:
            return token
    raise AssertionError(f"no token avoids experts {experts}")


def train_reference(model, tokens_list, lr=1e-2):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    losses = []
    for tokens in tokens_list:
        out = model(input_ids=tokens, labels=tokens)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    return losses


def train_ranks(model, opt, tokens_list, rank, world, clip=None, step=True):
    """Each rank its slice of every batch; the global loss (mean of the ranks')."""
    import zerokit

    losses = []
    for tokens in tokens_list:
        per = tokens.shape[0] // world
        mine = tokens[rank * per : (rank + 1) * per]
        out = model(input_ids=mine, labels=mine)
        out.loss.backward()
        if clip is not None:
            zerokit.clip_grad_norm_(model, clip)
        if step:
            opt.step()
            opt.zero_grad()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    return losses


def reference_copy(model):
    return copy.deepcopy(model)


def assert_same_as_reference(model, ref, atol, what):
    """Every parameter (a rank's experts against the same experts of the reference)."""
    from zerokit.moe import ExpertParallelExperts

    got = model.state_dict()
    want = ref.state_dict()
    assert got.keys() == want.keys(), what
    split = {name: m for name, m in model.named_modules() if isinstance(m, ExpertParallelExperts)}
    for name, value in want.items():
        owner, _, _ = name.rpartition(".")
        if owner in split:
            first = split[owner].first_expert
            value = value[first : first + split[owner].num_local_experts]
        torch.testing.assert_close(
            got[name], value, atol=atol, rtol=0, msg=lambda m, n=name: f"{what}: {n}: {m}"
        )


def low_bit_expert_pieces(model, opt) -> tuple[set[str], set[str]]:
    """(the expert parameters this rank steps a piece of, those of them whose pieces all
    have low-bit state: torchao's tensors carry ``codes``)."""
    from zerokit.core.state import state_of

    names = {id(p): n for n, p in model.named_parameters()}
    held, plain = set(), set()
    for bucket in state_of(model).buckets:
        for piece, view in zip(bucket.pieces, bucket.param_pieces):
            name = names.get(id(bucket.params[piece.slot]), "")
            if ".experts." in name and view.numel():
                held.add(name)
                if not hasattr(opt.state.get(view, {}).get("exp_avg"), "codes"):
                    plain.add(name)
    return held, held - plain
