"""``split_model``: an unmodified model (a Hugging Face ``LlamaForCausalLM`` or
``GPT2LMHeadModel``) cut into pipeline stages at named blocks, run by ``PipelineModule``'s
schedules. The model's own ``forward`` is not stage-aware; a family's ``StageAdapter``
(``zerokit/plans/stages.py``) says what the first stage adds before its blocks (embeddings)
and the last after them (final norm, head, loss).

A rank keeps only its stage: every module of another stage is replaced by a ``Dropped``
placeholder (its memory freed), and the stage's parameters keep the model's own names
(``model.layers.3.self_attn.q_proj.weight``), so a plan names them as in the model and a
checkpoint is written under them. A weight used on several stages (the tied embedding and
head) is one copy per stage, started equal and its gradients summed after the schedule, as
``PipelineModule`` does for a ``SharedLayerDesc``.

>>> import torch, transformers
>>> from zerokit.pipeline.split import split_model
>>> cfg = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=2, n_head=2)
>>> pipe = split_model(transformers.GPT2LMHeadModel(cfg), [])  # one process: one stage
>>> opt = torch.optim.SGD(pipe.stage.parameters(), lr=0.1)
>>> ids = torch.randint(0, 32, (4, 8))
>>> loss = pipe.train_batch((ids, ids), opt)  # labels = ids, shifted inside as in HF's loss
>>> sorted(pipe.stage.state_dict())[:2]
['lm_head.weight', 'transformer.h.0.attn.c_attn.bias']
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..grad_scope import GradScope
from ..layout import Layout, as_layout
from ..plans.stages import StageAdapter, adapter_for
from .module import PipelineModule, tie_across_stages
from .p2p import Mailbox


class Dropped(nn.Module):
    """Stands where a module of another pipeline stage was; holds nothing."""

    def __init__(self, name: str, stages: Sequence[int]):
        super().__init__()
        self.name, self.stages = name, list(stages)

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            f"{self.name} is held by pipeline stage(s) {self.stages}, not this rank's: run the "
            "split model through forward_backward / train_batch / eval_batch"
        )

    def extra_repr(self) -> str:
        return f"{self.name!r} on stage(s) {self.stages}"


# -- where things go (pure) --------------------------------------------------------------------
def stage_bounds(
    model: nn.Module, adapter: StageAdapter, split_points: Sequence[str], num_stages: int
) -> list[int]:
    """``[0, b1, ..., n]``: stage ``s`` holds blocks ``b[s]:b[s+1]``. ValueError, the same on
    every rank and before any collective, for a wrong count, an unknown name (with the closest
    real ones), a name that is not a block, or points out of order."""
    split_points = list(split_points)
    if len(split_points) != num_stages - 1:
        raise ValueError(
            f"{len(split_points)} split point(s) make {len(split_points) + 1} stage(s), but the "
            f"pipeline has pp={num_stages}: give pp - 1 = {num_stages - 1} name(s) of the "
            f"blocks where a stage begins, e.g. '{adapter.blocks}.<i>'"
        )
    blocks = model.get_submodule(adapter.blocks)
    assert isinstance(blocks, (nn.ModuleList, nn.Sequential)), adapter.blocks
    names = [name for name, _ in model.named_modules() if name]
    starts = []
    for point in split_points:
        if point not in names:
            close = difflib.get_close_matches(point, names, n=3, cutoff=0.6)
            raise ValueError(
                f"split point {point!r}: {type(model).__name__} has no module of that name"
                + (f"; closest: {', '.join(close)}" if close else "")
            )
        index = point.removeprefix(adapter.blocks + ".")
        if not index.isdigit():
            raise ValueError(
                f"split point {point!r} is not a block of {adapter.blocks}: a stage begins at "
                f"a block, {adapter.blocks}.0 ... {adapter.blocks}.{len(blocks) - 1}"
            )
        starts.append(int(index))
    bounds = [0, *starts, len(blocks)]
    if any(a >= b for a, b in itertools.pairwise(bounds[1:])):
        raise ValueError(
            f"split points {split_points} must name blocks in increasing order, each stage "
            "after the first holding at least one block"
        )
    return bounds


def stages_of(name: str, adapter: StageAdapter, bounds: list[int]) -> list[int] | None:
    """The stage holding the module or tensor ``name``; None: the adapter does not place it,
    every stage keeps it (Llama's rotary embedding)."""
    n = len(bounds) - 1

    def under(prefix: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")

    if any(under(p) for p in adapter.first):
        return [0]
    if any(under(p) for p in adapter.last):
        return [n - 1]
    if under(adapter.blocks) and name != adapter.blocks:
        i = int(name[len(adapter.blocks) + 1 :].split(".")[0])
        return [next(s for s in range(n) if i < bounds[s + 1])]
    return None


def _placements(
    model: nn.Module, adapter: StageAdapter, bounds: list[int]
) -> dict[int, tuple[list[str], list[int]]]:
    """Each parameter (by id) -> (its names, the stages holding it). Refuses a parameter the
    adapter leaves on every stage: its gradients would never be summed."""
    placed: dict[int, tuple[list[str], list[int]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names, where = placed.setdefault(id(p), ([], []))
        names.append(name)
        if stages_of(name, adapter, bounds) is None:
            raise ValueError(
                f"{type(adapter).__name__} places no parameter {name!r}: name the module "
                "holding it in the adapter's first, blocks or last"
            )
        where[:] = sorted({*where, *stages_of(name, adapter, bounds)})
    return placed


# -- the stage ---------------------------------------------------------------------------------
class SplitStage(nn.Module):
    """One stage of a split model: the model's own top-level modules (so parameters keep the
    model's names), those of other stages ``Dropped``; runs embeddings (first stage), its
    blocks, and the head (last stage) through the family's adapter."""

    def __init__(
        self,
        model: nn.Module,
        adapter: StageAdapter,
        bounds: list[int],
        stage_id: int,
        group: dist.ProcessGroup | None,
        copies: Sequence[str],
    ):
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        self.adapter, self.bounds, self.stage_id = adapter, bounds, stage_id
        self.is_first, self.is_last = stage_id == 0, stage_id == len(bounds) - 2
        self._across = (group,) if group is not None else ()
        self._copies = list(copies)  # names of this stage's later copies of tied weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # first: [B, T] token ids -> [B, T, H]; then [B, T, H]; last: -> logits [B, T, V]
        hidden = self.adapter.embed(self, x) if self.is_first else x
        blocks = self.get_submodule(self.adapter.blocks)
        start, end = self.bounds[self.stage_id], self.bounds[self.stage_id + 1]
        if start < end:
            kwargs = self.adapter.block_kwargs(self, hidden)
            for i in range(start, end):
                hidden = blocks[i](hidden, **kwargs)
        return self.adapter.head(self, hidden) if self.is_last else hidden

    def grad_scope(self) -> GradScope:
        """A part of the pipeline's gradients; a later copy of a tied weight is not counted
        again (looked up by name now: a wrapper may have replaced the tensor objects)."""
        left_out = frozenset(id(self.get_parameter(name)) for name in self._copies)
        return GradScope(self, self._across, left_out)


class SplitPipeline(PipelineModule):
    """A model split by ``split_model``: ``PipelineModule``'s schedules, ``forward_backward``,
    ``train_batch`` and ``eval_batch`` over a ``SplitStage``. ``batch`` is ``(input_ids,
    labels)`` (labels as for the model's ``forward(labels=...)``, shifted inside); the loss,
    computed on the last stage, is broadcast and returned on every rank."""

    def __init__(
        self,
        model: nn.Module,
        split_points: Sequence[str],
        layout: Layout | None = None,
        schedule: str = "1f1b",
        micro_batches: int = 1,
        adapter: type[StageAdapter] | None = None,
    ):
        nn.Module.__init__(self)  # PipelineModule's own __init__ builds from layer lists
        adapter_obj = adapter(model) if adapter is not None else adapter_for(model)
        self.layout = as_layout(layout, "split_model") if layout is not None else None
        self.loss_fn = adapter_obj.loss
        self.schedule, self.micro_batches = schedule, micro_batches
        # Everything that can be wrong is checked before the first collective (_tie_copies).
        self.bounds = stage_bounds(model, adapter_obj, split_points, self._pipeline_size())
        self.group, self.stage_id, self.num_stages = self._place(len(self.bounds) - 1)
        placed = _placements(model, adapter_obj, self.bounds)
        tied = {names[0]: where for names, where in placed.values() if len(where) > 1}
        self._drop_other_stages(model, adapter_obj)
        mine = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        self._aliases = {  # this stage's name of a tied weight -> the weight's key (first name)
            name: names[0]
            for names, where in placed.values()
            if len(where) > 1
            for name in names
            if name in mine
        }
        self._holders = tied  # key -> the stages holding a copy, in order
        copies = [n for n, key in self._aliases.items() if tied[key][0] != self.stage_id]
        across = self.group if self.num_stages > 1 else None
        self.stage = SplitStage(model, adapter_obj, self.bounds, self.stage_id, across, copies)
        self.mailbox = Mailbox(self.group, self.stage_id, self.num_stages)
        weights = {key: self.stage.get_parameter(name) for name, key in self._aliases.items()}
        self.shared_groups = self._tie_copies(tied, weights)
        self._tied = {key: weights[key] for key in self.shared_groups}  # this stage's copies

    def _pipeline_size(self) -> int:
        if self.layout is not None:
            return self.layout.pp_degree
        return dist.get_world_size() if dist.is_initialized() else 1

    def _drop_other_stages(self, model: nn.Module, adapter: StageAdapter) -> None:
        """Every module of another stage replaced by a ``Dropped``: its tensors are freed
        (unless the caller still holds them: build the optimizer after the split)."""
        blocks = model.get_submodule(adapter.blocks)
        names = [
            *adapter.first,
            *adapter.last,
            *(f"{adapter.blocks}.{i}" for i in range(len(blocks))),
        ]
        for name in names:
            where = stages_of(name, adapter, self.bounds)
            if self.stage_id not in where:  # every name here is placed
                parent, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(parent), leaf, Dropped(name, where))

    def _tie_copies(
        self, tied: dict[str, list[int]], weights: dict[str, nn.Parameter]
    ) -> dict[str, tuple[dist.ProcessGroup, bool]]:
        if not tied:
            return {}
        if any(w.is_meta for w in weights.values()):
            raise ValueError(
                f"{sorted(tied)} are tied across pipeline stages, whose copies start equal by a "
                "broadcast, which a model on meta cannot do: split a model with values"
            )
        return tie_across_stages(tied, weights, self.stage_id, self.num_stages)

    # -- running: the split's schedule and micro-batches by default -----------------------------
    def forward_backward(self, batch, schedule=None, micro_batches=None, scaler=None):
        # this stage's tied copies by name: a tp plan may have swapped their modules since
        names = {key: name for name, key in self._aliases.items()}
        self._tied = {key: self.stage.get_parameter(names[key]) for key in self.shared_groups}
        return super().forward_backward(
            batch, schedule or self.schedule, micro_batches or self.micro_batches, scaler=scaler
        )

    def train_batch(
        self, batch, optimizer, schedule=None, micro_batches=None, clip_norm=None, scaler=None
    ):
        return super().train_batch(
            batch, optimizer, schedule or self.schedule, micro_batches or self.micro_batches,
            clip_norm=clip_norm, scaler=scaler,
        )  # fmt: skip

    def eval_batch(self, batch, micro_batches=None):
        return super().eval_batch(batch, micro_batches or self.micro_batches)

    def checkpoint_names(self) -> dict[str, tuple[str, bool]]:
        """Each of the stage's tensors -> (its name in the model, whether this stage writes
        it). A tied weight is written under its first name (``model.embed_tokens.weight``,
        ``transformer.wte.weight``) by the first stage holding it; ``from_pretrained`` ties
        the head to it again. A buffer kept by every stage is written by the first."""
        out = {}
        for name, _ in self.stage.named_parameters(remove_duplicate=False):
            key = self._aliases.get(name)
            out[name] = (
                (name, True) if key is None else (key, self._holders[key][0] == self.stage_id)
            )
        for name, _ in self.stage.named_buffers(remove_duplicate=False):
            every = stages_of(name, self.stage.adapter, self.bounds) is None
            out[name] = (name, not every or self.stage_id == 0)
        return out


def split_model(
    model: nn.Module,
    split_points: Sequence[str],
    layout: Layout | None = None,
    schedule: str = "1f1b",
    micro_batches: int = 1,
    adapter: type[StageAdapter] | None = None,
) -> SplitPipeline:
    """Cut ``model`` into ``len(split_points) + 1`` pipeline stages: ``split_points`` name the
    blocks where a new stage begins (``["model.layers.2"]``). The stages are
    ``layout.pp_group`` (a ``zerokit.Layout`` or a DeviceMesh with a "pp" dim), else the whole
    world, one stage per rank. Collective (tied weights) after every check.

    Returns a ``SplitPipeline``: ``pipe.stage`` is this rank's stage, under the model's names
    (tp-plan it by those names, then ``zerokit.group_sharded_parallel(pipe, opt, level,
    shard_group=layout.shard_group)`` over the stage's data-parallel ranks); ``pipe.train_batch((ids,
    labels), opt)`` or ``pipe.forward_backward((ids, labels))`` runs ``schedule`` over
    ``micro_batches`` and returns the mean loss on every rank. Build the optimizer over
    ``pipe.stage.parameters()`` after the split. ``adapter``: a ``StageAdapter`` class for a
    family ``zerokit.plans.stages.ADAPTERS`` does not know."""
    return SplitPipeline(model, split_points, layout, schedule, micro_batches, adapter)
