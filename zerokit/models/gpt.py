"""A small GPT (nanoGPT's shape), readable top to bottom. Token ids in, logits out."""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import tensor_parallel as tp
from ..layout import as_layout
from .moe import MoEMLP


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
    sequence_parallel: bool = False
    """With ``tensor_parallel``: the blocks run sequence-first, each tp rank holding its
    ``[T/tp, B, C]`` block of positions outside the column -> row pairs (LayerNorms, residuals,
    dropouts); the sequence length must be divisible by the tp degree. The LayerNorm parameters
    are marked ``sequence_parallel`` (see ``tensor_parallel.allreduce_sequence_parallel_grads``)."""
    recompute: str | None = None
    """``"selective"``: the attention core (scores, softmax, its dropout, the weighted values)
    is recomputed in backward instead of stored; ``"full"``: each block is (only its input
    is stored). Both by ``torch.utils.checkpoint`` (non-reentrant)."""
    explicit_attention: bool = False
    """The paper's layer (Korthikanti et al.): attention written out (the softmax stored, then
    dropout), so measured activations can be compared with ``memory.estimate_activations``."""
    n_experts: int = 0
    """With n > 0, each block's MLP is a mixture of n experts (``models/moe.py``): a router,
    then ``top_k`` experts per token, stored as Hugging Face's 3-D ``gate_up_proj`` /
    ``down_proj`` so ``zerokit.moe.apply_expert_parallel`` splits them across ep ranks."""
    top_k: int = 2
    """With ``n_experts``: the experts each token is sent to (weights renormalised over them,
    as Mixtral's: at 1 the weight is always 1 and the router learns nothing)."""
    expert_dim: int = 0
    """With ``n_experts``: each expert's intermediate width; 0 means ``2 * n_embd``."""
    dropout: float = 0.0
    """The paper's three dropouts (attention probabilities, after the projection, after the
    MLP); only with ``explicit_attention``. Under tp, split activations draw from the tracker's
    ``LOCAL_SEED`` and replicated ones from ``GLOBAL_SEED`` (``model_parallel_random_seed``)."""

    def __post_init__(self):
        if self.sequence_parallel and not self.tensor_parallel:
            raise ValueError("sequence_parallel=True needs tensor_parallel=True")
        if self.recompute not in (None, "selective", "full"):
            raise ValueError(
                f"recompute must be None, 'selective' or 'full', not {self.recompute!r}"
            )
        if self.dropout and not self.explicit_attention:
            raise ValueError(
                "dropout > 0 needs explicit_attention=True (the default block has none)"
            )
        if self.n_experts and self.tensor_parallel:
            raise ValueError(
                "n_experts > 0 with tensor_parallel=True is not supported: "
                "split the experts with zerokit.moe (ep) instead"
            )
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(
                f"top_k must be between 1 and n_experts ({self.n_experts}), not {self.top_k}"
            )


@contextlib.contextmanager
def _tracker_rewound(tracker, states: dict):
    """Run a recomputation with the RNG tracker's streams as they were in forward, then put
    back their current states (torch's checkpoint rewinds only the default generator)."""
    current, tracker._states = tracker._states, dict(states)
    try:
        yield
    finally:
        tracker._states = current


def _recompute_contexts(tracker):
    if tracker is None:  # no tensor parallelism: torch rewinds the default generator itself
        return contextlib.nullcontext(), contextlib.nullcontext()
    return contextlib.nullcontext(), _tracker_rewound(tracker, dict(tracker._states))


def _checkpointed(fn, *args, tracker=None):
    contexts = functools.partial(_recompute_contexts, tracker)
    return checkpoint(fn, *args, use_reentrant=False, context_fn=contexts)


class Block(nn.Module):
    # No biases in the linear layers, as in most current GPTs. (A key bias would also have an
    # analytically zero gradient, softmax being shift-invariant, whose float noise Adam turns
    # into full-size steps that differ with summation order.)
    def __init__(self, cfg: GPTConfig, layout=None):
        super().__init__()
        C = cfg.n_embd
        self.head_dim = C // cfg.n_head
        self.cfg = cfg
        self._rng = None  # the layout's random streams, under tensor parallelism
        self.ln_1 = nn.LayerNorm(C)
        self.ln_2 = nn.LayerNorm(C)
        if cfg.tensor_parallel:  # each tp rank: its heads, its quarter of the MLP
            layout = as_layout(layout, "GPT(tensor_parallel=True)")
            self._rng, tp_degree = layout.rng, layout.tp_degree
            if cfg.n_head % tp_degree:
                raise ValueError(f"n_head {cfg.n_head} must be divisible by tp degree {tp_degree}")
            sp = {"sequence_parallel": cfg.sequence_parallel, "layout": layout}
            self.qkv = tp.ColumnParallelLinear(C, 3 * C, False, gather_output=False, stride=3, **sp)
            self.proj = tp.RowParallelLinear(C, C, False, input_is_parallel=True, **sp)
            self.fc = tp.ColumnParallelLinear(C, 4 * C, False, gather_output=False, **sp)
            self.fc_out = tp.RowParallelLinear(4 * C, C, False, input_is_parallel=True, **sp)
            for p in (*self.ln_1.parameters(), *self.ln_2.parameters()):
                if cfg.sequence_parallel:  # used on this rank's positions only
                    p.sequence_parallel = True
        else:
            self.qkv = nn.Linear(C, 3 * C, bias=False)
            self.proj = nn.Linear(C, C, bias=False)
            if cfg.n_experts:
                width = cfg.expert_dim or 2 * C
                self.moe = MoEMLP(C, cfg.n_experts, cfg.top_k, width, cfg.n_layer)
            else:
                self.fc = nn.Linear(C, 4 * C, bias=False)
                self.fc_out = nn.Linear(4 * C, C, bias=False)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.n_experts:
            return self.moe(x)
        return self.fc_out(F.gelu(self.fc(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.cfg.sequence_parallel or self.cfg.explicit_attention or self.cfg.recompute):
            return self._default_forward(x)
        # x: [B, T, C], or [T/tp, B, C] with sequence_parallel (this rank's positions)
        q, k, v = self.qkv(self.ln_1(x)).chunk(3, dim=-1)  # each [.., .., C/tp], T whole
        q, k, v = (self._heads(t) for t in (q, k, v))  # each [B, nh/tp, T, hs]
        core = self._explicit_core if self.cfg.explicit_attention else self._sdpa_core
        if self.cfg.recompute == "selective":
            y = _checkpointed(core, q, k, v, tracker=self._rng)
        else:
            y = core(q, k, v)
        y = y.permute(2, 0, 1, 3) if self.cfg.sequence_parallel else y.transpose(1, 2)
        x = x + self._dropout(self.proj(y.reshape(*y.shape[:2], -1)), self._split_residual)
        h = self._mlp(self.ln_2(x))
        return x + self._dropout(h, self._split_residual)

    def _default_forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(self.ln_1(x)).chunk(3, dim=2)  # each [B, T, C] (C/tp split)
        heads = q.shape[-1] // self.head_dim
        q, k, v = (t.view(B, T, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, nh, T, hs]
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, -1))
        return x + self._mlp(self.ln_2(x))

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """[B, T, nh*hs] (or [T, B, nh*hs] sequence-first) -> [B, nh, T, hs], a view."""
        a, b, _ = t.shape
        t = t.view(a, b, -1, self.head_dim)
        return t.permute(1, 2, 0, 3) if self.cfg.sequence_parallel else t.transpose(1, 2)

    @property
    def _split_residual(self) -> bool:
        return self.cfg.sequence_parallel  # else the residual stream is replicated across tp

    def _sdpa_core(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, nh, T, hs]

    def _explicit_core(self, q, k, v):
        B, nh, T, hs = q.shape
        q = (q * hs**-0.5).reshape(B * nh, T, hs)  # copies: bmm keeps q, k, v
        k, v = k.reshape(B * nh, T, hs), v.reshape(B * nh, T, hs)
        causal = torch.full((T, T), float("-inf"), device=q.device, dtype=q.dtype).triu(1)
        att = torch.softmax(torch.bmm(q, k.transpose(1, 2)) + causal, dim=-1)  # [B*nh, T, T]
        att = self._dropout(att, split=True)  # the heads are split across tp
        return torch.bmm(att, v).view(B, nh, T, hs)

    def _dropout(self, x: torch.Tensor, split: bool) -> torch.Tensor:
        if not self.training or not self.cfg.dropout:
            return x
        # native_dropout keeps a 1-byte mask for backward, as the paper counts (F.dropout on
        # CPU keeps a mask of x's dtype)
        if not self.cfg.tensor_parallel:
            return torch.native_dropout(x, self.cfg.dropout, True)[0]
        with self._rng.rng_state(tp.LOCAL_SEED if split else tp.GLOBAL_SEED):
            return torch.native_dropout(x, self.cfg.dropout, True)[0]


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPTConfig(), layout=None):
        """``layout``: the run's ``zerokit.Layout`` (or a DeviceMesh), needed with
        ``tensor_parallel=True``."""
        super().__init__()
        self.cfg = cfg
        if cfg.tensor_parallel:
            layout = as_layout(layout, "GPT(tensor_parallel=True)")
        self._rng = layout.rng if cfg.tensor_parallel else None
        # A tp model holds its slices of the plain model drawn from the same random state.
        plain = None
        if cfg.tensor_parallel:
            plain = GPT(replace(cfg, tensor_parallel=False, sequence_parallel=False))
        if cfg.tensor_parallel:
            self.wte = tp.VocabParallelEmbedding(cfg.vocab_size, cfg.n_embd, layout=layout)
        else:
            self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, layout) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        if cfg.tensor_parallel:  # vocabulary split like the embedding's
            self.lm_head = tp.ColumnParallelLinear(
                cfg.n_embd, cfg.vocab_size, False, gather_output=False,
                sequence_parallel=cfg.sequence_parallel, layout=layout,
            )  # fmt: skip
            if cfg.sequence_parallel:
                for p in self.ln_f.parameters():
                    p.sequence_parallel = True
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
        return self.head(self.run_blocks(self.embed(idx)))

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] -> [B, T, C]; with sequence_parallel this rank's [T/tp, B, C]."""
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # [B, T, C]
        if self.cfg.sequence_parallel:
            x = tp.scatter_to_sequence_parallel_region(x.transpose(0, 1), self.lm_head.tp_group)
        return x

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            full = self.cfg.recompute == "full"
            x = _checkpointed(block, x, tracker=self._rng) if full else block(x)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.ln_f(x))  # [B, T, vocab] (vocab/tp with tensor_parallel)
        return logits.transpose(0, 1) if self.cfg.sequence_parallel else logits  # from [T, B, ..]


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


# -- the same GPT as pipeline layer descriptions -------------------------------------------------
class PositionEmbedding(nn.Module):
    """``x + wpe(positions)``: token embeddings [B, T, C] in, the residual stream out. The
    pipeline's second layer, so that only the first stage holds ``wpe``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        nn.init.normal_(self.wpe.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.wpe(torch.arange(x.shape[1], device=x.device))


def _pipeline_wte(cfg: GPTConfig) -> nn.Embedding:
    wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
    nn.init.normal_(wte.weight, std=0.02)
    return wte


def _pipeline_block(cfg: GPTConfig) -> Block:
    block = Block(cfg)
    for name, p in block.named_parameters():  # GPT's initialisation, block by block
        if p.dim() == 2:
            scaled = name.endswith(("proj.weight", "fc_out.weight"))
            nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer) if scaled else 0.02)
    return block


def _pipeline_lm_head(cfg: GPTConfig) -> nn.Linear:
    head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
    nn.init.normal_(head.weight, std=0.02)
    return head


def _tied_lm_head(wte: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, wte.weight)  # [B, T, C] -> [B, T, vocab]


def gpt_layers(cfg: GPTConfig) -> list:
    """``GPT(cfg)`` as layer descriptions for ``zerokit.pipeline.PipelineModule``:

    ``[wte, PositionEmbedding, Block x n_layer, ln_f, lm_head]`` (``3 + n_layer + 1`` layers).
    With ``tie_weights`` the token embedding and the head are one ``SharedLayerDesc("wte")``
    (the head uses its weight: ``x @ wte.weight.T``); across stages its copies start equal and
    their gradients are summed. Token ids in, logits out: ``loss_fn=lm_loss``. Each layer is
    initialised as ``GPT`` initialises it (its own random draws, so to reproduce a given
    ``GPT``, load ``gpt_pipeline_state_dict(gpt.state_dict(), cfg)``).

    >>> cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8)
    >>> [type(d).__name__ for d in gpt_layers(cfg)]
    ['SharedLayerDesc', 'LayerDesc', 'LayerDesc', 'LayerDesc', 'LayerDesc', 'SharedLayerDesc']

    Not with ``tensor_parallel`` (a vocabulary-parallel embedding and loss) or
    ``recompute="full"`` (``GPT.run_blocks``'s) yet.
    """
    from ..pipeline.describe import LayerDesc, SharedLayerDesc

    if cfg.tensor_parallel:
        raise ValueError("gpt_layers does not support tensor_parallel=True yet")
    if cfg.recompute == "full":
        raise ValueError('gpt_layers does not support recompute="full" yet')
    if cfg.tie_weights:
        first = SharedLayerDesc("wte", _pipeline_wte, None, "weight", cfg)
        last = SharedLayerDesc("wte", _pipeline_wte, _tied_lm_head, "weight", cfg)
    else:
        first, last = LayerDesc(_pipeline_wte, cfg), LayerDesc(_pipeline_lm_head, cfg)
    blocks = [LayerDesc(_pipeline_block, cfg) for _ in range(cfg.n_layer)]
    return [
        first,
        LayerDesc(PositionEmbedding, cfg),
        *blocks,
        LayerDesc(nn.LayerNorm, cfg.n_embd),
        last,
    ]


def gpt_pipeline_state_dict(state_dict: dict, cfg: GPTConfig) -> dict:
    """A ``GPT(cfg)`` state dict under the names of ``PipelineModule(gpt_layers(cfg), ...)``'s
    stages (each stage takes the keys it has: ``{k: sd[k] for k in pipe.stage.state_dict()}``).
    """
    n = cfg.n_layer
    out = {}
    for key, value in state_dict.items():
        if key == "wte.weight":
            out["shared.wte.weight" if cfg.tie_weights else "layers.0.weight"] = value
        elif key == "wpe.weight":
            out["layers.1.wpe.weight"] = value
        elif key.startswith("blocks."):
            i, rest = key[len("blocks.") :].split(".", 1)
            out[f"layers.{2 + int(i)}.{rest}"] = value
        elif key.startswith("ln_f."):
            out[f"layers.{2 + n}.{key[len('ln_f.') :]}"] = value
        elif key == "lm_head.weight":
            if not cfg.tie_weights:
                out[f"layers.{3 + n}.weight"] = value
        else:
            raise KeyError(f"unexpected GPT state dict key {key!r}")
    return out
