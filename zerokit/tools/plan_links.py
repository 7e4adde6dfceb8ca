"""``zerokit plan --accumulation K`` under hybrid sharding: the bytes each rank sends per
micro-batch and per step, by link: within a host (the shard group, and any other group that
is not the replicas') and across hosts (the replica group).

Three ways to reduce K micro-batches are played side by side, each by the dry run
(``zerokit.tools.dry_run.run_accumulation``: the real code against recording stand-in groups):

* ``every``: each micro-batch reduces in full (reduce-scatter in the host, the shard
  all-reduced across hosts): the slow link K times a step.
* ``defer``: ``model.defer_replica_sync()`` on all but the last: each micro-batch
  reduce-scatters in the host into the sharded gradient; the last crosses hosts once.
* ``no_sync``: ``model.no_sync()`` on all but the last: nothing is sent until the last
  micro-batch, but every rank holds full gradients in between.

Bytes are what a ring sends per rank (``zerokit.tools.plan.Collective.sent``); the
optimizer step's own collectives (the updated shards' all-gather) count once, in the step.
"""

from __future__ import annotations

from collections.abc import Callable

from ..memory import format_bytes
from .dry_run import ACCUMULATION_MODES, Job, run_accumulation

ACROSS = "replicas"  # the replica group's role: the link between hosts


def link_bytes(job: Job, factory: Callable, k: int, sent: Callable) -> dict:
    """Per mode: bytes per micro-batch (``inner``: the first K-1; ``last``) and per step,
    ``within`` and ``across`` hosts, and the gradient bytes held between micro-batches.
    ``sent(call)``: the bytes a rank sends for a recorded call. Rank 0's (every rank of a
    hybrid layout sends as much, ranks holding uneven shards aside)."""
    report = {}
    # defer_replica_sync() is refused with the optimizer state sharded over the replicas
    modes = [m for m in ACCUMULATION_MODES if not (job.over_replicas and m == "defer")]
    for mode in modes:
        played = run_accumulation(job, 0, factory, k, mode)
        inner = _by_link(played.micro_batches[0], sent) if k > 1 else _by_link([], sent)
        last = _by_link(played.micro_batches[-1], sent)
        step = _by_link(played.step, sent)
        total = {
            link: sum(_by_link(m, sent)[link] for m in played.micro_batches) + step[link]
            for link in ("within", "across")
        }
        report[mode] = {
            "inner_micro_batch": inner,
            "last_micro_batch": last,
            "optimizer_step": step,
            "per_step": total,
            "grads_between_micro_batches": played.grads_between,
        }
    return report


def _by_link(calls, sent: Callable) -> dict[str, int]:
    out = {"within": 0, "across": 0}
    for role, call in calls:
        out["across" if role == ACROSS else "within"] += round(sent(call))
    return out


def format_links(links: dict, k: int) -> list[str]:
    """The printout's table: one row per mode."""
    lines = [
        "",
        f"bytes per rank by link, {k} micro-batches a step (within a host: the shard group; "
        "across hosts: the replica group; each micro-batch but the last, the last, the step)",
        f"{'':>10}{'within/mb':>12}{'across/mb':>12}{'within/last':>13}{'across/last':>13}"
        f"{'within/step':>13}{'across/step':>13}{'grads held':>12}",
    ]
    for mode, row in links.items():
        inner, last, step = row["inner_micro_batch"], row["last_micro_batch"], row["per_step"]
        figures = (inner["within"], inner["across"], last["within"], last["across"])
        lines.append(
            f"{mode:>10}"
            + "".join(f"{format_bytes(b):>12}" for b in figures[:2])
            + "".join(f"{format_bytes(b):>13}" for b in (*figures[2:], step["within"]))
            + f"{format_bytes(step['across']):>13}"
            + f"{format_bytes(row['grads_between_micro_batches']):>12}"
        )
    return lines
