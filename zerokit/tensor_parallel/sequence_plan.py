"""A plan's ``"sequence"`` style: sequence parallelism of a batch-first model (Hugging Face's
``[b, s, h]``) by hooks at the boundaries of its tensor-parallel regions, no module rewritten.

The modules a plan styles ``"sequence"`` (norms, and dropouts after a row layer) run on this
tp rank's block of the sequence, ``[b, s/t, h]``. The region spans the model's stack of blocks
(the ``nn.ModuleList`` holding those norms) and ends after the last ``"sequence"`` module
outside it (the final norm), or after the last block:

- the first block's input ``hidden_states`` is split along the sequence (every tp rank keeps
  its block; backward all-gathers). Not the embedding's output: Hugging Face models derive
  position ids and the causal mask from the embedding's sequence length;
- a module holding colwise layers (attention, MLP) gets the whole sequence gathered at its
  entry, so its reshapes and attention see ``[b, s, h]``; the gather's backward
  reduce-scatters the colwise layers' partial input gradients (they skip their own all-reduce);
- rowwise layers reduce-scatter their output along the sequence instead of all-reducing it,
  and add their bias on the block (its gradient is then a partial sum per tp rank);
- the region's last module's output is all-gathered (backward keeps this rank's block), so the
  head and the logits see the whole sequence.

A ``"sequence"`` norm's weight and bias, and a row layer's bias, are used on this rank's
positions only: they are marked ``param.sequence_parallel = True`` and ZeRO sums their
gradients over the tp group. A ``"sequence"`` dropout draws from the layout's tp-rank-distinct
stream (``layout.rng``, seeded by ``model_parallel_random_seed``), so blocks of the sequence get
independent masks. Needs the sequence length divisible by the tp degree at run time.
"""

from __future__ import annotations

from torch import nn

from ..layout import Layout
from .mappings import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region

SEQUENCE_DIM = 1  # batch-first [b, s, h]


def sequence_applicable(module: nn.Module) -> bool:
    """A norm (by type name: Hugging Face's own ``LlamaRMSNorm`` is no ``nn.RMSNorm``) or a
    dropout: modules that act on each position alone."""
    return isinstance(module, nn.Dropout) or "Norm" in type(module).__name__


def block_stack(modules: dict[str, nn.Module], resolved: dict[str, str]) -> str | None:
    """The name of the ``nn.ModuleList`` of blocks holding the ``"sequence"`` modules (None if
    the plan has none); refuses a plan whose sequence region cannot be found."""
    names = [n for n, s in resolved.items() if s == "sequence"]
    if not names:
        return None
    stacks = {_stack_of(modules, n) for n in names} - {None}
    if len(stacks) != 1:
        raise ValueError(
            f"plan: the 'sequence' modules {names} must lie in one nn.ModuleList of blocks (found "
            f"{sorted(stacks) or 'none'}); style the norms inside the blocks 'sequence'"
        )
    stack = stacks.pop()
    outside = [n for n, s in resolved.items() if s in ("colwise", "rowwise")
               and not n.startswith(stack + ".")]  # fmt: skip
    if outside:
        raise ValueError(
            f"plan: with 'sequence' styles, colwise and rowwise layers must lie in the blocks "
            f"of {stack}; {outside} do not"
        )
    return stack


def _stack_of(modules: dict[str, nn.Module], name: str) -> str | None:
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:i])
        if isinstance(modules.get(parent), nn.ModuleList):
            return parent
    return None


def apply_sequence(model: nn.Module, resolved: dict[str, str], stack: str, layout: Layout):
    """Mark the ``"sequence"`` parameters, swap the dropouts and hook the region's boundaries
    (the colwise and rowwise layers are already built in their sequence mode)."""
    modules = dict(model.named_modules())
    group = layout.tp_group
    for name, style in resolved.items():
        if style != "sequence":
            continue
        module = modules[name]
        if isinstance(module, nn.Dropout):
            parent, leaf = _parent(model, modules, name)
            setattr(parent, leaf, SequenceParallelDropout(module, layout))
        for p in module.parameters():
            p.sequence_parallel = True  # used on this rank's positions: summed over tp by ZeRO
    blocks = modules[stack]
    first = next(iter(blocks))
    first.register_forward_pre_hook(_on_input(_scatter, group), with_kwargs=True)
    after = [n for n, s in resolved.items() if s == "sequence" and not n.startswith(stack + ".")]
    last = modules[max(after, key=list(modules).index)] if after else blocks[len(blocks) - 1]
    last.register_forward_hook(_gather_output(group))
    parents = {n.rsplit(".", 1)[0] for n, s in resolved.items() if s == "colwise"}
    for name in parents:
        gather = _on_input(_gather_for_columns, group)
        modules[name].register_forward_pre_hook(gather, with_kwargs=True)


def _parent(model: nn.Module, modules: dict, name: str) -> tuple[nn.Module, str]:
    if "." not in name:
        return model, name
    parent, leaf = name.rsplit(".", 1)
    return modules[parent], leaf


def _scatter(x, group):
    return scatter_to_sequence_parallel_region(x, group, SEQUENCE_DIM)


def _gather_for_columns(x, group):
    # backward reduce-scatters: the colwise layers' input gradients are partial sums per rank
    return gather_from_sequence_parallel_region(x, group, True, SEQUENCE_DIM)


def _on_input(fn, group):
    """A forward pre-hook applying ``fn(x, group)`` to the module's ``hidden_states`` (its
    first positional argument, or that keyword)."""

    def hook(module, args, kwargs):
        if args:
            return (fn(args[0], group), *args[1:]), kwargs
        if "hidden_states" not in kwargs:
            raise RuntimeError(
                f"{type(module).__name__} was called without a positional input or "
                "hidden_states=: the 'sequence' style cannot find the activations to split"
            )
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"], group)}

    return hook


def _gather_output(group):
    """A forward hook making the region's last output whole again; its backward keeps this
    rank's block (what follows is replicated over tp: its gradient is whole on every rank)."""

    def gather(x):
        return gather_from_sequence_parallel_region(x, group, False, SEQUENCE_DIM)

    def hook(module, args, output):
        if isinstance(output, tuple):  # a block returning (hidden_states, ...)
            return (gather(output[0]), *output[1:])
        return gather(output)

    return hook


class SequenceParallelDropout(nn.Dropout):
    """``nn.Dropout`` drawing from the layout's tp-rank-distinct stream: each tp rank holds a
    different block of the sequence, whose mask must not repeat its neighbours'."""

    def __init__(self, dropout: nn.Dropout, layout: Layout):
        super().__init__(dropout.p, dropout.inplace)
        self.training = dropout.training
        self.layout = layout

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        try:
            with self.layout.rng.rng_state():  # KeyError: the stream was never seeded
                return super().forward(x)
        except KeyError as e:
            raise RuntimeError(
                "a 'sequence' dropout needs the tp-rank-distinct random stream: call "
                "zerokit.tensor_parallel.model_parallel_random_seed(seed, mesh) before training"
            ) from e
