"""Issue 22's "done when": nanoGPT's ``train.py`` loop with DDP swapped for one
``group_sharded_parallel`` call and nothing else changed trains equal to one process at every
level: ``raw_model = model.module``, learning rate set through ``optimizer.param_groups``,
``model.require_backward_grad_sync`` on accumulation steps, a disabled ``GradScaler``,
``scaler.unscale_`` then ``torch.nn.utils.clip_grad_norm_``, ``estimate_loss()`` on every rank
(at 'p_g_os' a forward is collective), ``zero_grad(set_to_none=True)``.

The model has nanoGPT's shape: a ``transformer`` ModuleDict (wte, wpe, h, ln_f), ``lm_head``
tied to ``wte``, ``forward(idx, targets) -> (logits, loss)``, and ``configure_optimizers`` with
decay / no-decay groups."""

import math

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed
from models import assert_same_params
from torch import nn
from torch.nn import functional as F

import zerokit

VOCAB, BLOCK, EMBD, HEADS = 37, 8, 16, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(EMBD)
        self.attn = nn.MultiheadAttention(EMBD, HEADS, batch_first=True)
        self.ln_2 = nn.LayerNorm(EMBD)
        self.mlp = nn.Sequential(nn.Linear(EMBD, 4 * EMBD), nn.GELU(), nn.Linear(4 * EMBD, EMBD))

    def forward(self, x):
        t = x.size(1)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, n_layer=2):
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(VOCAB, EMBD),
                "wpe": nn.Embedding(BLOCK, EMBD),
                "h": nn.ModuleList([Block() for _ in range(n_layer)]),
                "ln_f": nn.LayerNorm(EMBD),
            }
        )
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1))
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # [B, T, EMBD]
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # [B, T, VOCAB]
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        nodecay = [p for p in params if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": weight_decay},
            {"params": nodecay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, eps=1e-6)


def get_lr(it, warmup=2, max_iters=6, lr=3e-2, min_lr=3e-3):
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    ratio = (it - warmup) / (max_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def micro_batches(it: int, n: int, batch: int = 2):
    """The ``n`` micro-batches of iteration ``it`` (every rank can make all of them)."""
    g = torch.Generator().manual_seed(100 + it)
    data = torch.randint(0, VOCAB, (n, batch, BLOCK + 1), generator=g)
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def train(level, rank, world, iters=6, accumulation=4, grad_clip=0.05, compile_model=False):
    """nanoGPT's train.py, trimmed to its loop; ``level=None`` is the single-process run."""
    ddp = level is not None
    torch.manual_seed(1337)
    model = NanoGPT()
    optimizer = model.configure_optimizers(0.1, get_lr(0), (0.9, 0.95))
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # enabled=(dtype == 'float16')
    gradient_accumulation_steps = accumulation
    if ddp:
        gradient_accumulation_steps //= world
        model, optimizer, scaler = zerokit.group_sharded_parallel(
            model, optimizer, level, scaler=scaler
        )
    if compile_model:
        model = torch.compile(model)
    raw_model = model.module if ddp else model

    @torch.no_grad()
    def estimate_loss():
        model.eval()
        x, y = micro_batches(1000, 1)[0]
        _, loss = model(x, y)
        model.train()
        return loss.item()

    losses = []
    for iter_num in range(iters):
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % 3 == 0:
            losses.append(estimate_loss())
        batches = micro_batches(iter_num, accumulation)
        if ddp:  # each rank its own share of the iteration's micro-batches
            batches = batches[rank * gradient_accumulation_steps :][:gradient_accumulation_steps]
        for micro_step, (X, Y) in enumerate(batches):
            if ddp:
                model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            _, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
            scaler.scale(loss).backward()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return raw_model, losses


def _nanogpt(rank, world, levels, compile_model):
    ref_model, ref_losses = train(None, rank, world)
    for level in levels:
        model, losses = train(level, rank, world, compile_model=compile_model)
        what = f"nanoGPT loop level={level} world={world} compiled={compile_model}"
        torch.testing.assert_close(
            losses, ref_losses, atol=2e-5, rtol=0, msg=lambda m, what=what: what + m
        )
        assert_same_params(model, ref_model, 2e-5, what)
    dist.barrier()


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_nanogpt_train_loop_unchanged(world):
    run_distributed(_nanogpt, world, ("os", "os_g", "p_g_os"), False)


@pytest.mark.slow
def test_nanogpt_train_loop_compiled():
    """The same loop with nanoGPT's ``model = torch.compile(model)`` after wrapping (inductor
    on CPU: slow, so one world size and the two sharded levels)."""
    run_distributed(_nanogpt, 2, ("os_g", "p_g_os"), True)
