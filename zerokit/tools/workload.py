"""The model contract of ``zerokit compare``, ``verify`` and ``plan`` (``--model
pkg.module:factory``; ``pkg.module`` may live in the current directory). ``factory()`` returns
either

- an ``nn.Module`` whose forward maps token ids ``[batch, seq]`` (int64) to logits
  ``[batch, seq, vocab]``, a tensor or an output with a ``.logits`` tensor (an unmodified
  Hugging Face causal LM: ``GPT2LMHeadModel(config)``, ``LlamaForCausalLM(config)``): it trains
  on a learnable synthetic token stream with next-token cross-entropy (the vocabulary size is
  read from one probe forward); or
- a tuple ``(model, make_batch)`` or ``(model, make_batch, loss_fn)`` for any other model:
  ``make_batch(step, batch)`` returns the global batch ``(inputs, targets)`` of that step, two
  tensors with ``batch`` rows, the same on every rank (seed it from ``step``); each rank trains
  on its slice of the rows. ``loss_fn(output, targets)`` defaults to mean squared error for
  floating-point targets and cross-entropy over the last dimension for integer targets; the
  default takes an output's ``.loss`` when the model computed one (a Hugging Face model whose
  inputs carry ``labels``), else its ``.logits``. A ``loss_fn`` of the factory's own gets the
  output as the model returns it.

Pipelines (``zerokit plan --pp``, ``zerokit verify --pp``): the factory returns a
``zerokit.models.gpt.GPT`` (the built-in one, a preset, any ``GPTConfig``), split into stages
as ``PipelineModule`` splits ``models.gpt.gpt_layers(model.cfg)``.

Tensor parallelism (``zerokit verify --tp T``): the factory must accept a ``layout`` keyword.
``factory(layout=None)`` returns the plain model as above; ``factory(layout=layout)`` (a
``zerokit.Layout`` with ``tp_degree`` T) the tensor-parallel one, built from the same seed, so
that its full parameters (``tensor_parallel.gather_full_state_dict``) equal the plain model's.
A token model built with a layout returns its rank's vocabulary slice of the logits and trains
with ``tensor_parallel.ParallelCrossEntropy``; a tuple's ``loss_fn`` must itself suit the
tensor-parallel output.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils._device
from torch import nn

from ..models.gpt import GPT, synthetic_batch


@contextmanager
def on_meta() -> Iterator[None]:
    """``torch.device("meta")`` for a job's factory, with torch's cached list of the factory
    functions it redirects made current first: transformers 5 swaps ``torch.linspace`` for a
    stand-in while ``from_pretrained`` runs, and a list first built then holds the stand-in,
    so the real ``linspace`` (a buffer's) would land on the CPU for the rest of the process."""
    constructors = getattr(torch.utils._device, "_device_constructors", None)
    if constructors is not None and torch.linspace not in constructors():
        constructors.cache_clear()
    with torch.device("meta"):
        yield


@dataclass(frozen=True)
class Workload:
    """What one level trains: the model, where each step's global batch comes from, the loss."""

    model: nn.Module
    make_batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def load_factory(spec: str | None) -> Callable:
    """The factory named by ``pkg.module:factory`` (the built-in GPT if None).

    The current directory is importable, as it is for ``python -m zerokit``.
    """
    if spec is None:
        return default_model
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model must look like pkg.module:factory, got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # the console script's sys.path lacks it
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--model: cannot import {module_name!r}: {e}") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        listed = ", ".join(factories_of(module)) or "none"
        raise ValueError(
            f"--model: {module_name!r} has no callable {attr!r}; its factories: {listed}"
        )
    return factory


def factories_of(module) -> list[str]:
    """The public functions a module defines itself (``zerokit.models.presets``: the presets)."""
    return sorted(
        name
        for name, value in vars(module).items()
        if inspect.isfunction(value) and not name.startswith("_")
        and value.__module__ == module.__name__
    )  # fmt: skip


def default_model(layout=None) -> nn.Module:
    """``zerokit compare``'s GPT; with a layout, its tensor-parallel twin (same seed, same
    full parameters)."""
    from ..models.gpt import GPTConfig

    cfg = GPTConfig(
        vocab_size=2048,
        block_size=64,
        n_layer=6,
        n_head=8,
        n_embd=256,
        tensor_parallel=layout is not None,
    )
    return GPT(cfg, layout)


def check_pipeline_model(model: nn.Module, what: str) -> None:
    """``--pp`` takes a ``zerokit.models.gpt.GPT``; anything else is a usage error."""
    if not isinstance(model, GPT):
        raise ValueError(
            f"--pp: pipelines are planned and verified for zerokit.models.gpt.GPT models (the "
            f"built-in GPT, zerokit.models.presets), split by models.gpt.gpt_layers; {what} "
            f"returned {type(model).__name__}"
        )


def accepts_layout(factory: Callable) -> bool:
    """Whether ``factory(layout=...)`` is a valid call (a ``layout`` keyword or ``**kwargs``)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.kind is p.VAR_KEYWORD
        or (p.name == "layout" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
        for p in params
    )


def tp_workload(factory: Callable, layout, plain: Workload) -> Workload:
    """The tensor-parallel workload: ``factory(layout=layout)``; a token model trains on the
    plain model's batches with ``ParallelCrossEntropy`` (its logits are a vocabulary slice)."""
    from ..tensor_parallel import ParallelCrossEntropy

    made = factory(layout=layout)
    if isinstance(made, nn.Module):
        return Workload(made, plain.make_batch, ParallelCrossEntropy(layout=layout))
    return as_workload(made, 0)


CONTRACT = (
    "a factory returns an nn.Module mapping token ids [batch, seq] to logits [batch, seq, vocab] "
    "(a tensor, or an output with .logits such as a Hugging Face CausalLMOutput), or a tuple "
    "(model, make_batch) or (model, make_batch, loss_fn) for any other model (see "
    "zerokit.tools.workload)"
)


def output_tensor(output) -> torch.Tensor:
    """What a forward returned, as the tensor the default loss reads: the tensor itself, or a
    Hugging Face output's ``.logits``."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise ValueError(f"--model: forward returned {type(output).__name__}; {CONTRACT}")


def default_loss(output, targets: torch.Tensor) -> torch.Tensor:
    """The model's own ``.loss`` when its output has one (labels were passed); else
    cross-entropy over the last dimension for integer targets, mean squared error for float."""
    own = getattr(output, "loss", None)
    if isinstance(own, torch.Tensor):
        return own
    output = output_tensor(output)
    if targets.is_floating_point():
        return F.mse_loss(output.float(), targets.float())
    return F.cross_entropy(output.float().reshape(-1, output.shape[-1]), targets.reshape(-1))


def build_workload(factory: Callable, *, batch: int, seq: int, per_rank: int) -> Workload:
    """Call the factory and check its result with one forward of a rank's batch."""
    made = factory()
    work = as_workload(made, seq)
    if not isinstance(made, nn.Module):  # the user's batches: one rank's slice must run
        probe_batch(work, batch, per_rank)
    return work


def as_workload(made, seq: int) -> Workload:
    """What a factory returned, as a ``Workload`` (a token model's vocabulary is read from one
    probe forward of ``seq`` tokens, on the device the model is on)."""
    if isinstance(made, nn.Module):  # a token language model
        vocab = probe_vocab(made, seq)

        def _tokens(step: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
            return synthetic_batch(vocab, b, seq, seed=step)

        return Workload(made, _tokens, default_loss)
    if not (
        isinstance(made, tuple)
        and len(made) in (2, 3)
        and isinstance(made[0], nn.Module)
        and all(callable(f) for f in made[1:])
    ):
        raise ValueError(f"--model factory returned {type(made).__name__}; {CONTRACT}")
    return Workload(made[0], made[1], made[2] if len(made) == 3 else default_loss)


def probe_vocab(model: nn.Module, seq: int) -> int:
    """The vocabulary size, from one forward of token ids [1, seq]; a clear error otherwise."""
    try:
        with torch.no_grad():
            device = next((p.device for p in model.parameters()), None)
            output = model(torch.zeros(1, seq, dtype=torch.long, device=device))
    except Exception as e:
        raise ValueError(
            f"--model: forward of token ids [1, {seq}] failed: {e} (a model that takes other "
            "inputs: return (model, make_batch) from the factory)"
        ) from e
    logits = getattr(output, "logits", output)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[:2] != (1, seq):
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(output).__name__
        raise ValueError(f"--model: forward of token ids [1, {seq}] returned {shape}; {CONTRACT}")
    return logits.shape[-1]


def probe_batch(work: Workload, batch: int, per_rank: int) -> None:
    """``make_batch(0, batch)`` gives two tensors of ``batch`` rows; a rank's slice runs."""
    try:
        made = work.make_batch(0, batch)
    except Exception as e:
        raise ValueError(f"--model: make_batch(0, {batch}) failed: {e}") from e
    if not isinstance(made, (tuple, list)) or len(made) != 2:
        raise ValueError(
            f"--model: make_batch(0, {batch}) must return (inputs, targets), got "
            f"{type(made).__name__}"
        )
    x, y = made
    for what, t in (("inputs", x), ("targets", y)):
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != batch:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"--model: make_batch(0, {batch}) must return (inputs, targets), tensors of "
                f"{batch} rows; {what} is {got}"
            )
    try:
        with torch.no_grad():
            work.loss_fn(work.model(x[:per_rank]), y[:per_rank])
    except Exception as e:
        raise ValueError(f"--model: forward and loss of {per_rank} rows failed: {e}") from e
