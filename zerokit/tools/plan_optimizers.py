"""The optimizers ``zerokit plan`` (and ``verify``) build by name, as a user would, and the
optimizer-step work each rank does with them.

``muon``: ``torch.optim.Muon`` for the 2-D matrices inside repeated blocks (the parameters of
an ``nn.ModuleList``) beside ``AdamW`` for the rest (embeddings, head, norms, biases): Muon's
documented use. ``adafactor``: ``torch.optim.Adafactor`` for everything. ``adamw8bit``:
torchao's ``AdamW8bit`` (the ``zerokit[lowbit]`` extra) for everything.

The work, in FLOPs (a multiply-add is two), counted on what each rank's wrapped optimizer
holds after ``group_sharded_parallel``:

* Muon: 5 Newton-Schulz iterations, each ~ m * n * min(m, n) multiply-adds, for every m x n
  matrix the rank owns: ``2 * 5 * m * n * min(m, n)`` (``core.optimizer_needs.muon_cost``,
  the cost that balances the owners);
* any other optimizer: ``ELEMENT_FLOPS`` per element of the rank's pieces (AdamW's update is
  about that many operations per element; Adafactor's, torchao's alike within a small factor).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..core import muon_cost

NEWTON_SCHULZ_STEPS = 5
ELEMENT_FLOPS = 10
FLOPS_RULE = (
    f"Muon: 2 x {NEWTON_SCHULZ_STEPS} Newton-Schulz iterations x m*n*min(m,n) per m x n matrix "
    f"owned; other optimizers: {ELEMENT_FLOPS} per element of the rank's pieces"
)


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def muon_and_adamw(model: nn.Module, lr: float = 0.02) -> list[torch.optim.Optimizer]:
    """Muon for the matrices of repeated blocks, AdamW for the rest (as Muon's docs say)."""
    in_blocks = {
        id(p) for m in model.modules() if isinstance(m, nn.ModuleList) for p in m.parameters()
    }
    trainable = [p for p in model.parameters() if p.requires_grad]
    matrices = [p for p in trainable if p.dim() == 2 and id(p) in in_blocks]
    rest = [p for p in trainable if not (p.dim() == 2 and id(p) in in_blocks)]
    if not matrices:
        raise ValueError(
            "--optimizer muon: the model has no 2-D matrices inside repeated blocks (the "
            "parameters of an nn.ModuleList), which is what Muon is given here; use adamw"
        )
    muon = torch.optim.Muon(matrices, lr=lr, momentum=0.95, weight_decay=0.01)
    return [muon, _adamw(rest)] if rest else [muon]


def newton_schulz_in_fp32() -> None:
    """From now on in this process, ``torch.optim.Muon`` orthogonalises in fp32 (the same
    iterations, the same coefficients) instead of bf16. For ``zerokit verify``'s ranks: in
    bf16 a last-bit difference in an averaged gradient (N ranks sum in another order than one
    process) can flip a rounding and move an element by up to ~lr, in DDP as in zerokit
    (tests/test_optimizers.py measured ~7e-4 after 4 steps); in fp32 it stays a last-bit
    difference, so a 2e-5 tolerance tells a sharding error from rounding."""
    import torch.optim._muon as muon

    muon._zeropower_via_newtonschulz = newton_schulz_fp32


def newton_schulz_fp32(grad, ns_coefficients, ns_steps: int, eps: float) -> torch.Tensor:
    """torch's Muon orthogonalisation (``torch.optim._muon._zeropower_via_newtonschulz``),
    step for step, in fp32 instead of bf16."""
    a, b, c = ns_coefficients
    tall = grad.size(0) > grad.size(1)
    x = grad.float().T if tall else grad.float()
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adamw8bit(model: nn.Module) -> torch.optim.Optimizer:
    try:
        from torchao.optim import AdamW8bit
    except ImportError as e:
        raise ValueError(
            "--optimizer adamw8bit is torchao's AdamW8bit, and torchao cannot be imported here "
            f"({e}); install the extra: pip install 'zerokit[lowbit]'"
        ) from e
    return AdamW8bit([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


# name -> model -> an optimizer, or a list of them
OPTIMIZERS: dict[str, Callable[[nn.Module], object]] = {
    "adam": lambda m: torch.optim.Adam(_trainable(m), lr=1e-3),
    "adamw": lambda m: _adamw(_trainable(m)),
    "sgd": lambda m: torch.optim.SGD(_trainable(m), lr=1e-3, momentum=0.9),
    "adagrad": lambda m: torch.optim.Adagrad(_trainable(m), lr=1e-3),
    "rmsprop": lambda m: torch.optim.RMSprop(_trainable(m), lr=1e-3),
    "none": lambda m: torch.optim.SGD(_trainable(m), lr=1e-3),
    "muon": muon_and_adamw,
    "adafactor": lambda m: torch.optim.Adafactor(_trainable(m), lr=1e-2),
    "adamw8bit": adamw8bit,
}


def as_list(optimizers) -> list[torch.optim.Optimizer]:
    return list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]


def _is_muon(optimizer: torch.optim.Optimizer) -> bool:
    muon = getattr(torch.optim, "Muon", None)
    return muon is not None and isinstance(optimizer, muon)


def step_flops(optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """The FLOPs of one step of ``optimizers`` over the tensors their groups hold (after
    wrapping: this rank's pieces; a Muon piece is a whole matrix), by ``FLOPS_RULE``."""
    total = 0
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if _is_muon(opt) and p.dim() == 2:
                    total += round(2 * NEWTON_SCHULZ_STEPS * muon_cost(tuple(p.shape)))
                else:
                    total += ELEMENT_FLOPS * p.numel()
    return total
