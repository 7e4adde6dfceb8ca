"""Expert parallelism by plan on an unmodified Hugging Face MoE model: each known experts
module is replaced by an ``ExpertParallelExperts`` holding this rank's experts; the router,
its top-k and normalisation, and everything else stay the model's own.

The plan is the set of experts classes whose forward is the one ``ExpertParallelExperts``
reproduces (transformers 5: 3-D ``gate_up_proj`` / ``down_proj``, ``act_fn(gate) * up``, the
routing weights applied to each expert's output). DeepSeek-V3's shared experts are a dense
MLP beside them: dense parameters, sharded with the rest.
"""

from __future__ import annotations

from torch import nn

from .aux_loss import AUX_LOSS_MODES, GlobalAuxLoss
from .experts import ExpertParallelExperts
from .groups import ExpertGroups

#: experts classes (by name, as transformers 5 defines them) -> the model family
EXPERTS_PLAN = {
    "MixtralExperts": "mixtral",
    "Qwen3MoeExperts": "qwen3_moe",
    "OlmoeExperts": "olmoe",
    "DeepseekV3Experts": "deepseek_v3",
    "GPTExperts": "zerokit_gpt",  # zerokit.models.GPT with n_experts > 0
}


def find_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts modules of ``model`` the plan knows; any other module that looks like one
    (a class named ``*Experts``, or 3-D ``gate_up_proj``) is refused by name."""
    known, unknown = [], []
    for name, module in model.named_modules():
        cls = type(module).__name__
        if isinstance(module, ExpertParallelExperts):
            raise ValueError(f"{name!r} is already split across ep ranks: apply the plan once")
        if cls in EXPERTS_PLAN:
            known.append((name, module))
        elif cls.endswith("Experts") or _has_3d(module, "gate_up_proj"):
            unknown.append(f"{name} ({cls})")
    if unknown:
        raise ValueError(
            f"no expert-parallel plan knows the MoE modules {unknown[:3]}; the plan covers "
            f"{sorted(EXPERTS_PLAN)} (transformers 5's 3-D experts). Train this model with "
            "ep = 1 (its experts sharded like dense parameters), or convert its experts module "
            "to one of these"
        )
    return known


def check_plan(model: nn.Module, ep: int) -> list[tuple[str, nn.Module]]:
    """The experts modules ``ep`` splits, every check passed (no communication): the plan
    knows each, and ep divides its number of experts."""
    found = find_experts(model)
    if not found:
        raise ValueError(
            f"ep = {ep} but {type(model).__name__} has no experts module the plan knows "
            f"({sorted(EXPERTS_PLAN)}); use ep = 1 for a dense model"
        )
    for name, module in found:
        if module.num_experts % ep:
            raise ValueError(
                f"{name} has {module.num_experts} experts, which ep = {ep} does not divide; "
                "choose an ep dividing the number of experts"
            )
    return found


def _has_3d(module: nn.Module, name: str) -> bool:
    p = getattr(module, name, None)
    return isinstance(p, nn.Parameter) and p.dim() == 3


def apply_expert_parallel(
    model: nn.Module, groups: ExpertGroups, *, aux_loss: str = "global"
) -> list[ExpertParallelExperts]:
    """Split every MoE layer's experts of ``model`` across ``groups.ep_group``, in place;
    returns the new experts modules. ``aux_loss``: ``"global"`` (the router's load-balancing
    loss, with ``output_router_logits=True``, computed from routing statistics over every
    data-parallel rank: what one process computes on the whole batch) or ``"per_rank"`` (the
    model's own, from this rank's tokens, as DDP runs it). Every check runs before anything
    changes."""
    if aux_loss not in AUX_LOSS_MODES:
        raise ValueError(f"aux_loss must be one of {AUX_LOSS_MODES}, got {aux_loss!r}")
    found = check_plan(model, groups.ep)
    modules = dict(model.named_modules())
    made = []
    for name, module in found:
        parent, _, attr = name.rpartition(".")
        split = ExpertParallelExperts(module, groups)
        setattr(modules[parent] if parent else model, attr, split)
        made.append(split)
    if aux_loss == "global":
        GlobalAuxLoss(model, groups.dense_group)
    return made


def expert_parts(model: nn.Module) -> dict[int, tuple[str, int, int]]:
    """``id(parameter)`` -> (its name, its element count, the unsplit [E, ...] parameter's),
    for each parameter of ``model``'s split experts: what a low-bit optimizer of one process
    is asked of (``core.with_whole_numel``)."""
    return {
        id(p): (f"{mname}.{pname}", p.numel(), p.numel() // m.num_local_experts * m.num_experts)
        for mname, m in model.named_modules()
        if isinstance(m, ExpertParallelExperts)
        for pname, p in m.named_parameters()
    }


def expert_groups_of(model: nn.Module) -> dict[nn.Module, object]:
    """Each split experts module of ``model`` -> its shard group (the expert-data-parallel
    ranks): the units ``group_sharded_parallel`` gives a group of their own."""
    return {
        m: m.groups.expert_dp_group for m in model.modules() if isinstance(m, ExpertParallelExperts)
    }
