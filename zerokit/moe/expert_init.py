"""Split experts built on meta, given the values one process gives the whole layer, while
a rank allocates only its own experts (E / ep of each layer) and one expert's scratch.

``zerokit.meta_init``'s walk runs ``init_fn`` module by module, children first; on a split
experts module it calls ``initialize_experts(init_fn)`` instead (the module's
``zerokit_init``). That runs ``init_fn`` on the original experts module, kept on meta (no
storage), under ``_ExpertWise``: each in-place fill of one of its 3-D parameters
(``normal_``, ``uniform_``, ``zero_``, ...) runs once per expert, in order, on one expert's
scratch tensor, and a rank keeps the experts it holds.

Note: random numbers are drawn in sequence, so a rank draws every expert's (compute, not
memory) to reach its own. Drawn expert by expert they are the whole tensor's draw when the
generator fills a tensor in independent blocks: torch's CPU generator fills ``normal_`` and
``uniform_`` in blocks of 16 values, so an expert of a multiple of 16 values ends on a block
(checked: refused otherwise). A CUDA generator's draw depends on the launch's shape: refused
by name there (materialise on the CPU, or build the model without meta).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

_RANDOM = {"normal_", "uniform_", "bernoulli_", "exponential_", "random_", "cauchy_",
           "log_normal_", "geometric_"}  # fmt: skip
_BLOCK = 16  # values torch's CPU generator fills as one block (normal_'s Box-Muller pairs)


class _ExpertWise(TorchDispatchMode):
    """In-place ops on the template's 3-D parameters, run one expert at a time on a scratch
    tensor; the rank's experts copied into its own parameters. Any other use of them is
    refused (the template has no values)."""

    def __init__(self, module: nn.Module, template: nn.Module, names: tuple[str, ...]):
        super().__init__()
        self.module = module  # an ``ExpertParallelExperts``
        self.targets = {id(getattr(template, n)): n for n in names}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        name = self.targets.get(id(target))
        if name is None:
            return func(*args, **kwargs)
        op = func.__name__.split(".")[0]
        if not op.endswith("_"):
            raise ValueError(
                f"init_fn used the experts' {name} with {func} on meta: split experts are "
                "initialised one expert at a time, so init_fn may only fill them in place "
                "(nn.init.normal_, uniform_, zeros_, ...)"
            )
        self._expert_by_expert(func, name, op, args, kwargs)
        return target

    def _expert_by_expert(self, func, name, op, args, kwargs):
        mine = getattr(self.module, name)  # [E / ep, ...]
        per_expert = mine[0].numel()
        if op in _RANDOM and (mine.device.type != "cpu" or per_expert % _BLOCK):
            raise ValueError(
                f"init_fn draws {op} for the split experts' {name}: drawn one expert at a time "
                f"it equals one process's draw only on the CPU generator with experts of a "
                f"multiple of {_BLOCK} values (here {mine.device.type}, {per_expert}); "
                "materialise on the CPU, or build the model without meta and split it"
            )
        first, local = self.module.first_expert, self.module.num_local_experts
        scratch = torch.empty_like(mine[0])  # one expert
        with torch.no_grad():
            for e in range(self.module.num_experts):
                func(scratch, *args[1:], **kwargs)
                if first <= e < first + local:
                    mine[e - first].copy_(scratch)


def initialize_experts(
    module: nn.Module, template: nn.Module, names: tuple[str, ...], init_fn
) -> None:
    """``init_fn(template)``, its fills of the parameters ``names`` landing expert by expert in
    ``module``'s (an ``ExpertParallelExperts``: this rank's experts) parameters."""
    with _ExpertWise(module, template, names):
        init_fn(template)
