"""Apply a tensor-parallel plan, ``{module name pattern: style}``, to an unmodified model: each
matched layer is swapped for zerokit's tensor-parallel layer of the same attribute name holding
this tp rank's slice of its weights, so state-dict names stay the model's own.

Patterns are dotted names where ``*`` matches one level (``model.layers.*.self_attn.q_proj``).
Styles: ``"colwise"`` (split the output features; the output stays split), ``"rowwise"``
(split the input features, all-reduce the output), ``"vocab"`` (an embedding or an output head
split by vocabulary; the head's logits come back whole on every tp rank), ``"vocab_loss"`` (an
output head split by vocabulary whose logits stay split, ``[..., V_local]``, for
``ParallelCrossEntropy``: the ``[N, V]`` logits never cross the wire), ``"replicate"`` (kept
whole) and ``"sequence"`` (norms and dropouts between the tensor-parallel regions run on this
tp rank's block of the sequence: ``sequence_plan.py``). Attention: a colwise projection's heads
are split with it (its module's ``head_dim`` says how wide a head is), fused q, k, v (GPT-2's
``c_attn``) are split per block, and the attention module's head counts (``num_heads``,
``split_size``) become this rank's.

Everything is checked before anything changes, without communication, so a bad plan fails with
the same ``ValueError`` on every rank.
"""

from __future__ import annotations

import difflib
import fnmatch

from torch import nn

from ..layout import Layout
from . import adopt
from .sequence_plan import SEQUENCE_DIM, apply_sequence, block_stack, sequence_applicable

STYLES = ("colwise", "rowwise", "vocab", "vocab_loss", "replicate", "sequence")
FUSED = {"c_attn": 3}  # GPT-2's attention input: q, k and v side by side in one layer
_HEAD_COUNTS = ("num_heads", "num_key_value_heads", "split_size")  # per-rank after the split


def resolve_plan(
    model: nn.Module, plan: dict[str, str], tp_degree: int, partial: bool = False
) -> dict[str, str]:
    """Module name -> style for every module the plan names; refuses (``ValueError``) a pattern
    matching nothing (unless ``partial``: one pipeline stage of the planned model), an unknown
    style, a style the matched module cannot take, two styles for one module, tied weights
    styled apart, a tp degree that does not divide the heads or features being split, and
    "sequence" modules outside one stack of blocks."""
    modules = dict(model.named_modules())
    resolved: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"plan[{pattern!r}]: unknown style {style!r}; use one of {STYLES}")
        matched = [name for name in modules if name and matches(pattern, name)]
        if partial:  # a module of another pipeline stage holds nothing here: not planned
            matched = [n for n in matched if next(modules[n].parameters(), None) is not None]
        if not matched and not partial:
            raise ValueError(no_such_module("plan", pattern, modules))
        for name in matched:
            if resolved.get(name, style) != style:
                raise ValueError(
                    f"{name} is given two styles by the plan: {resolved[name]!r} and {style!r}"
                )
            _check_applicable(name, modules[name], style)
            resolved[name] = style
    _check_degrees(modules, resolved, tp_degree)
    _check_ties(model, resolved)
    block_stack(modules, resolved)  # refuses a sequence region it cannot place
    return resolved


def matches(pattern: str, name: str) -> bool:
    """``*`` matches one level of a dotted name (shell-style inside a level)."""
    want, got = pattern.split("."), name.split(".")
    return len(want) == len(got) and all(fnmatch.fnmatchcase(g, w) for w, g in zip(want, got))


def no_such_module(what: str, name: str, modules) -> str:
    """The message for a name matching no module, with the closest real names."""
    names = [n for n in modules if n]
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    hint = f"; closest: {close}" if close else f"; the model has e.g. {names[:5]}"
    return f"{what}: {name!r} matches no module of the model{hint}"


def _check_applicable(name: str, module: nn.Module, style: str) -> None:
    linear = isinstance(module, nn.Linear) or adopt._is_conv1d(module)
    ok = {
        "colwise": linear,
        "rowwise": linear,
        "vocab": isinstance(module, (nn.Embedding, nn.Linear)),
        "vocab_loss": isinstance(module, nn.Linear),
        "replicate": True,
        "sequence": sequence_applicable(module),
    }[style]
    if not ok:
        kinds = {"colwise": "an nn.Linear or Conv1D", "rowwise": "an nn.Linear or Conv1D",
                 "vocab": "an nn.Embedding or an output nn.Linear",
                 "vocab_loss": "an output nn.Linear",
                 "sequence": "a norm or an nn.Dropout"}[style]  # fmt: skip
        raise ValueError(
            f"plan: style {style!r} cannot apply to {name} of type {type(module).__name__} "
            f"(it takes {kinds}); name its projections instead"
        )


def _check_degrees(modules: dict, resolved: dict[str, str], tp: int) -> None:
    for name, style in resolved.items():
        if style not in ("colwise", "rowwise"):
            continue
        n_in, n_out = adopt._features(modules[name])
        size = n_out // FUSED.get(name.rsplit(".", 1)[-1], 1) if style == "colwise" else n_in
        parent = modules[name.rsplit(".", 1)[0]] if "." in name else None
        head_dim = getattr(parent, "head_dim", None)
        if isinstance(head_dim, int) and size % head_dim == 0:
            heads = size // head_dim
            if heads % tp:
                raise ValueError(
                    f"{name}: {heads} heads ({size} features / head_dim {head_dim}) cannot be "
                    f"split across tp degree {tp}; use a tp degree dividing {heads}"
                )
        elif size % tp:
            raise ValueError(
                f"{name}: {size} {'output' if style == 'colwise' else 'input'} features cannot "
                f"be split evenly across tp degree {tp}"
            )


def _ties(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of (module name, parameter name) sharing one parameter."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(p), []).append((mname, pname))
    return [o for o in owners.values() if len(o) > 1]


def _check_ties(model: nn.Module, resolved: dict[str, str]) -> None:
    for group in _ties(model):
        # a head whose logits stay split is split as its embedding is
        styles = {resolved.get(m, "replicate").replace("vocab_loss", "vocab") for m, _ in group}
        if len(styles) > 1 or styles - {"vocab", "replicate"}:
            where = ", ".join(f"{m}.{p} ({resolved.get(m, 'not in the plan')})" for m, p in group)
            raise ValueError(
                f"tied weights must be split alike: {where}; give them the same style "
                "('vocab' for a tied embedding and head)"
            )


def apply_plan(model: nn.Module, resolved: dict[str, str], layout: Layout) -> dict:
    """Swap the resolved modules in place (no communication); returns old parameter -> new
    parameter for every parameter replaced, for carrying an optimizer over."""
    ties = _ties(model)
    modules = dict(model.named_modules())
    stack = block_stack(modules, resolved)  # a sequence region: its layers in sequence mode
    replaced, split_heads = {}, set()
    for name, style in resolved.items():
        if style in ("replicate", "sequence"):
            continue
        old = modules[name]
        leaf = name.rsplit(".", 1)[-1]
        if style == "colwise":
            new = adopt.column(old, layout, FUSED.get(leaf, 1), sequence_gathered=bool(stack))
        elif style == "rowwise":
            new = adopt.row(old, layout, SEQUENCE_DIM if stack else None)
        else:
            new = adopt.vocab(old, layout, gather=style == "vocab")
        parent = modules[name.rsplit(".", 1)[0]] if "." in name else model
        setattr(parent, leaf, new)
        if style == "colwise" and id(parent) not in split_heads:
            split_heads.add(id(parent))  # once, however many of its projections are split
            _split_head_counts(parent, layout.tp_degree)
        for pname, p in old.named_parameters(recurse=False):
            replaced[p] = getattr(new, pname)
    _retie(model, ties, replaced)
    if stack:
        apply_sequence(model, resolved, stack, layout)
    return replaced


def _split_head_counts(attention: nn.Module, tp: int) -> None:
    """This rank's head counts on the attention module."""
    for attr in _HEAD_COUNTS:
        value = getattr(attention, attr, None)
        if isinstance(value, int):
            setattr(attention, attr, value // tp)


def _retie(model: nn.Module, ties, replaced: dict) -> None:
    """Tied parameters stay one parameter: every owner gets the first owner's new one."""
    modules = dict(model.named_modules(remove_duplicate=False))
    dropped = {}
    for group in ties:
        (m0, p0), rest = group[0], group[1:]
        shared = getattr(modules[m0], p0)
        for m, p in rest:
            if getattr(modules[m], p) is not shared:
                dropped[getattr(modules[m], p)] = shared
                setattr(modules[m], p, shared)
    for old, new in replaced.items():
        replaced[old] = dropped.get(new, new)
