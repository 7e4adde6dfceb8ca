"""Models for `zerokit compare --model` in tests: a float-input regression model (factory
returns ``(model, make_batch)``) and a classifier with its own loss (``(model, make_batch,
loss_fn)``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FEATURES = 12


def regression_batch(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: float features [batch, 12] and targets [batch, 1]."""
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(batch, FEATURES, generator=gen)
    return x, x[:, :3].sum(dim=1, keepdim=True)


def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))
    return model, regression_batch


def classification_batch(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(batch, FEATURES, generator=gen)
    return x, (x[:, 0] > 0).long()


def label_smoothed(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.float(), targets, label_smoothing=0.1)


def classifier():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 2))
    return model, classification_batch, label_smoothed


def bad_batch():
    return nn.Linear(FEATURES, 1), lambda step, batch: torch.zeros(batch, FEATURES)
