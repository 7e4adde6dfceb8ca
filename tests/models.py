"""Tiny models that exercise every awkward case, and the single-process reference run."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from zerokit.models.gpt import GPT, GPTConfig, lm_loss

VOCAB = 11
# Wrapping options that make the awkward cases bite. Stages 1-2: tiny buckets, so there are
# several and parameters larger than a bucket. Stage 3: a small segment_size makes units of the
# embeddings and the head too, besides the blocks, so a tied weight is shared between units.
SMALL = {
    "os": {"buffer_max_size": 40},
    "os_g": {"buffer_max_size": 40},
    "p_g_os": {"segment_size": 10},
}


class Awkward(nn.Module):
    """Uneven sizes, an embedding tied to the output head, a frozen layer, a parameter never
    used, one used only when the batch holds token 0 (so only on some ranks), a 1-element
    parameter (smaller than any world size > 1), a buffer, and a block called twice."""

    def __init__(self):
        super().__init__()
        dim = 6
        self.emb = nn.Embedding(VOCAB, dim)
        self.block = nn.Sequential(nn.Linear(dim, 7), nn.Tanh(), nn.Linear(7, dim))
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.tiny = nn.Parameter(torch.full((1,), 0.9))
        self.odd = nn.Parameter(torch.randn(3) * 0.1)
        self.unused = nn.Parameter(torch.randn(4))
        self.rare = nn.Parameter(torch.randn(dim) * 0.1)
        self.head = nn.Linear(dim, VOCAB)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) * self.scale  # [B, T, dim]
        x = x + self.block(x)
        x = x + self.block(x)  # the same block again
        x = self.frozen(x) * self.tiny
        x = torch.cat([x[..., :3] + self.odd, x[..., 3:]], dim=-1)
        is_zero = idx == 0
        if is_zero.any():  # per-token, so the function is the same with or without the branch
            x = x + self.rare * is_zero.unsqueeze(-1)
        return self.head(x)


def make_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "awkward":
        return Awkward()
    if kind == "gpt":
        return GPT(GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=2, n_head=2, n_embd=8))
    raise ValueError(kind)


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    """Two param groups (alternate parameters) with different lr and weight decay; every
    parameter is decayed, so a parameter wrongly given a zero gradient would change."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": params[0::2]}, {"params": params[1::2], "lr": 0.05, "weight_decay": 0.05}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=0.01)
    if kind == "adamw":
        # eps=1e-6, not 1e-8: attention's key bias has an analytically zero gradient, so its
        # gradient is float noise (~1e-10) that differs with summation order; with eps=1e-8
        # Adam divides that noise by sqrt(v) ~ |noise| and takes full lr-sized steps in random
        # directions, in any two runs that sum in different orders, one process or many.
        return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, eps=1e-6)
    raise ValueError(kind)


def global_batches(steps: int, batch: int, seq: int = 5, seed: int = 1, vocab: int = VOCAB):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


loss_fn = lm_loss  # mean next-token cross-entropy


def local_slice(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per_rank = tensor.shape[0] // world_size
    return tensor[rank * per_rank : (rank + 1) * per_rank]


PLANT = [False]  # set on one rank: the gradient through ``plant`` becomes inf in the next backward


def plant(x):
    """A pipeline layer (a function between layers): with PLANT set, the gradient flowing back
    here is inf, so the layers before it get inf gradients (a planted fp16 overflow)."""
    if PLANT[0] and x.requires_grad:
        x.register_hook(lambda g: g * float("inf"))
    return x


def pipeline_reference(layers, batches, loss=loss_fn, clip=None):
    """A pipeline's layers all in one process (``PipelineStage(layers, 0)``), SGD with
    momentum, optionally clipped to ``clip``: the initial state, the final state, the losses
    and the gradient norms (before clipping; empty without ``clip``)."""
    from zerokit.pipeline import PipelineStage

    torch.manual_seed(0)
    model = PipelineStage(layers, 0)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses, norms = [], []
    for x, y in batches:
        value = loss(model(x), y)
        value.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(value.item())
    return init, model.state_dict(), losses, norms


def train_reference(model: nn.Module, opt, batches) -> list[float]:
    """Single-process training on the global batches: the result every level must reproduce."""
    losses = []
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_sharded(
    model: nn.Module, opt, batches, rank: int, world_size: int, scaler=None
) -> list[float]:
    """Each rank trains on its slice; returns the global loss (mean of the ranks' losses).
    The loss is taken in fp32 (a no-op for fp32 logits), scaled when there is a ``scaler``."""
    losses = []
    for x, y in batches:
        x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        loss = loss_fn(model(x).float(), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world_size)
    return losses


def reference_pair(model_kind: str, opt_kind: str):
    """A model and optimizer for the reference, and an identical pair to be wrapped."""
    ref_model = make_model(model_kind)
    model = copy.deepcopy(ref_model)
    return (ref_model, make_optimizer(opt_kind, ref_model)), (
        model,
        make_optimizer(opt_kind, model),
    )


def assert_same_params(model: nn.Module, ref_model: nn.Module, atol: float, what: str) -> None:
    ref = ref_model.state_dict()
    got = model.state_dict()
    assert got.keys() == ref.keys(), f"{what}: state_dict keys differ"
    for name in ref:
        torch.testing.assert_close(
            got[name], ref[name], atol=atol, rtol=0, msg=lambda m, name=name: f"{what}: {name}: {m}"
        )


def tiny_gpt() -> nn.Module:
    """A factory for ``zerokit compare --model models:tiny_gpt`` in tests."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32))


def not_a_module():
    return {"weights": 1}


def wrong_output():
    return nn.Linear(4, 4)  # forward cannot take token ids


class MatrixNet(nn.Module):
    """For optimizers that read whole parameters: hidden matrices of uneven shapes (73 x 24 and
    24 x 73) in repeated blocks, an embedding tied to the output head, a frozen layer, a norm
    and biases (which Muon's users give to AdamW)."""

    def __init__(self, dim: int = 24, hidden: int = 73, blocks: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, dim))
            for _ in range(blocks)
        )
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)  # [B, T, dim]
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(self.frozen(x)))


def make_optimizers(kind: str, model: nn.Module) -> list[torch.optim.Optimizer]:
    """The optimizers people train with today. "muon": Muon for the blocks' matrices beside
    AdamW for the rest (Muon's documented use); "adafactor": Adafactor for everything;
    "adamw8bit": torchao's AdamW8bit (block 32 here, so tiny matrices are quantized too)."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if kind == "muon":
        matrices = [p for n, p in trainable if p.dim() == 2 and n.startswith("blocks.")]
        rest = [p for n, p in trainable if not (p.dim() == 2 and n.startswith("blocks."))]
        return [
            torch.optim.Muon(matrices, lr=0.02, momentum=0.9, weight_decay=0.01),
            torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.1, eps=1e-6),
        ]
    params = [p for _, p in trainable]
    if kind == "adafactor":
        return [torch.optim.Adafactor(params, lr=1e-2)]
    if kind == "adamw8bit":
        from torchao.optim import AdamW8bit

        return [AdamW8bit(params, lr=1e-2, eps=1e-6, block_size=32)]
    raise ValueError(kind)
