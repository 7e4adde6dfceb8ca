"""How an error or a doubt reaches every rank: the collective steps the checkpoint protocol
ends each of its phases with (``protocol``), and the fingerprints the ranks agree on.

Every helper here is one all-gather (or none at world size 1) that raises the same
``CheckpointError`` on every rank, so no rank goes on while another has failed.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from torch import nn

from ..core import agree_all, gather, state_of
from ..runtime import presence
from ..runtime.timeouts import AgreementError, CollectiveTimeout
from .holdings import Holdings
from .index import CheckpointError, dtype_name, split_to_json


def world_group():
    return dist.group.WORLD if dist.is_initialized() else None


def mark_call(call: str, model: nn.Module, group) -> None:
    """Tell the other ranks this one is in ``call`` (the world and the model's own group), so
    a rank that waits for it elsewhere names the call."""
    state = state_of(model)
    if state is not None:
        state.presence.mark(call)
    if group is not None and (state is None or group is not state.process_group):
        presence.Presence(group).mark(call)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def gather_json(what: str, value: Any, group, timeout: float | None) -> list[Any]:
    with _as_checkpoint_error():
        return [json.loads(r) for r in gather(what, json.dumps(value).encode(), group, timeout)]


@contextmanager
def _as_checkpoint_error():
    """A disagreement the core reports is a ``CheckpointError`` here (a timeout stays one)."""
    try:
        yield
    except CollectiveTimeout:
        raise
    except AgreementError as e:
        raise CheckpointError(str(e)) from None


def model_fingerprint(h: Holdings) -> bytes:
    """The model's tensors as every rank sees them: names, full shapes, dtypes, tp splits."""
    tensors = {
        n: [list(m.shape), dtype_name(m.dtype), split_to_json(m.split)]
        for n, m in h.metas.items()
        if not n.startswith("optim.")
    }
    text = json.dumps([tensors, h.aliases], sort_keys=True).encode()
    return hashlib.sha256(text).hexdigest().encode()


def _grouped(values: list, members: list[int]) -> str:
    held: dict[str, list[int]] = {}
    for value, rank in zip(values, members):
        held.setdefault(json.dumps(value, sort_keys=True), []).append(rank)
    return "; ".join(f"ranks {r}: {v:.200}" for v, r in held.items())


def world_view(h: Holdings, what: str, group, timeout: float | None) -> dict | None:
    """For a pipelined model, what the whole world holds (None otherwise: every rank holds the
    same model). One gather over every rank of every stage; the same ``CheckpointError`` on
    every rank if the ranks of one stage hold different tensors or the ranks see different
    pipelines. Returns ``fingerprint`` (of every stage's tensors, to agree on), ``names`` (the
    model tensors of all stages) and ``groups`` (each optimizer param group's parameters on
    all stages)."""
    if h.pipeline is None:
        return None
    mine = {
        "pipeline": h.pipeline | {"stage": None},
        "stage": h.pipeline["stage"],
        "fingerprint": model_fingerprint(h).decode(),
        "names": h.param_names,
        "groups": [g["params"] for g in h.groups],
    }
    replies = gather_json(f"{what}: the pipeline's stages", mine, group, timeout)
    pipelines = [r["pipeline"] for r in replies]
    if any(p != pipelines[0] for p in pipelines):
        shown = _grouped(pipelines, list(range(len(replies))))
        raise CheckpointError(f"{what}: the ranks see different pipelines ({shown})")
    stages: dict[int, set[str]] = {}
    for r in replies:
        stages.setdefault(r["stage"], set()).add(r["fingerprint"])
    for stage, prints in sorted(stages.items()):
        if len(prints) > 1:
            ranks = [m for m, r in enumerate(replies) if r["stage"] == stage]
            shown = _grouped([replies[m]["fingerprint"][:12] for m in ranks], ranks)
            raise CheckpointError(
                f"{what}: the ranks of pipeline stage {stage} hold different tensors ({shown})"
            )
    if sorted(stages) != list(range(pipelines[0]["stages"])):
        raise CheckpointError(f"{what}: stages {sorted(stages)} take part, not all of them")
    names = {n for r in replies for n in r["names"]}
    ngroups = {len(r["groups"]) for r in replies}
    if len(ngroups) > 1:
        raise CheckpointError(f"{what}: the stages' optimizers hold different numbers of groups")
    groups: list[list[str]] = [[] for _ in range(ngroups.pop())]
    seen: list[set[str]] = [set() for _ in groups]
    for r in replies:  # stage order (pp is the outermost axis): each name once
        for merged, known, params in zip(groups, seen, r["groups"]):
            merged.extend(p for p in params if p not in known)
            known.update(params)
    text = json.dumps([pipelines[0], sorted(s.pop() for s in stages.values())]).encode()
    fingerprint = hashlib.sha256(text).hexdigest().encode()
    return {"fingerprint": fingerprint, "names": names, "groups": groups}


def optimizer_fingerprint(h: Holdings) -> bytes:
    """The optimizer's class, groups and hyperparameters (a pipeline stage's own parameters:
    those of all stages are checked by ``world_view``)."""
    if h.pipeline is None:
        desc = [h.optimizer_class, h.group_optimizer, h.groups]
    else:
        desc = [h.optimizer_class, h.group_optimizer, [g["hyperparameters"] for g in h.groups]]
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest().encode()


def agree_on(what: str, fields: dict[str, bytes], group, timeout: float | None) -> None:
    with _as_checkpoint_error():
        agree_all(what, fields, group, timeout)


def raise_any(replies: list, alike: bool = False) -> list:
    """Raise the same ``CheckpointError`` on every rank if any rank's ``[error, ...]`` reply
    holds an error, each failing rank named (``alike``: one message when every failing rank
    failed alike, as DCP's load tells it); else return the replies."""
    failed = [(r, e) for r, (e, _) in enumerate(replies) if e is not None]
    if failed and (len(replies) == 1 or (alike and len({e for _, e in failed}) == 1)):
        raise CheckpointError(failed[0][1])
    if failed:
        raise CheckpointError("; ".join(f"rank {r}: {e}" for r, e in failed))
    return replies


def attempt(work, errors: tuple = (), prefix: str = ""):
    """``(work(), None)``, or ``(None, why)`` to tell every rank: a ``CheckpointError``'s
    message as it is, one of ``errors`` named after ``prefix``."""
    try:
        return work(), None
    except CheckpointError as e:
        return None, str(e)
    except errors as e:
        return None, f"{prefix}{named(e)}"


def named(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"
