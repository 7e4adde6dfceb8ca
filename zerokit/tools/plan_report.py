"""``zerokit plan``'s printout: memory per rank (alike ranks grouped) and one step's
collectives, beside the ZeRO paper's volume."""

from __future__ import annotations

from ..memory import format_bytes, paper_volume
from .plan import summarize
from .plan_links import format_links
from .plan_moe import format_moe

_MEMORY = ("params", "grads", "optimizer", "transient", "activations")


def format_plan(report: dict) -> str:
    groups = summarize(report)
    lines = [*_head(report), *_memory_rows(report, groups)]
    distinct: dict[str, tuple[list[int], dict]] = {}  # ranks sending alike share a table
    for ranks, body in groups:
        key = repr((body.get("stage"), body["collectives"]))
        distinct.setdefault(key, ([], body))[0].extend(ranks)
    for ranks, body in distinct.values():
        ranks.sort()
        who = "every rank alike" if len(distinct) == 1 else f"ranks {_span(ranks)}"
        if "stage" in body:
            who += f", stage {body['stage']}"
        lines += _collectives(report, body, who)
    lines += _host_memory(report)
    if "links" in report:  # --accumulation: bytes by link, each way to accumulate
        lines += format_links(report["links"], report["accumulation"])
    if "moe" in report:  # --ep: the all-to-alls and the experts' bytes beside the dense
        lines += format_moe(report["moe"], report["world"])
    return "\n".join(lines + _flops(report))


def _head(report: dict) -> list[str]:
    """The job in one line, then the memory table's header."""
    n, level = report["world"], report["level"]
    shards, tp = report["sharding_degree"], report.get("tp", 1)
    pp = report.get("pp", 1)
    dp = n // tp // pp
    where = (
        f"{n} ranks"
        + (f" (tp {tp} x dp {dp})" if tp > 1 else "")
        + (
            f" (pp {pp} x dp {dp}; {report['schedule']}, {report['micro_batches']} micro-batches)"
            if pp > 1
            else ""
        )
        + (f" (ZeRO sharded over {shards}, {dp // shards} replicas)" if shards < dp else "")
    )
    lines = [
        f"{report['model']}: {report['params']:,} parameters, level '{level}' on {where}, "
        f"{report['precision']}, batch {report['batch']} x seq {report['seq']}; "
        f"{report['units']} units, {report['buckets']} buckets (zerokit's own layout, "
        + _how(report)
        + ")",
        "",
        "memory per rank (ranks whose figures print alike share a row; params, grads, optimizer as zerokit.memory.measure counts them after "
        "a backward; transient: gathered units and staged gradients at once; activations: "
        "what autograd saves for a rank's micro-batch)",
        "".join(f"{k:>13}" for k in _MEMORY) + f"{'sum':>13}  ranks",
    ]
    if pp > 1:
        lines[2:2] = _stages(report)
    return lines


def _memory_rows(report: dict, groups: list) -> list[str]:
    """One row per set of ranks whose printed figures are equal; then each transient."""
    lines = []
    rows: dict[str, list[int]] = {}  # ranks whose printed figures are equal share a row
    for ranks, body in groups:
        memory = body["memory"]
        figures = "".join(f"{format_bytes(memory[k]):>13}" for k in _MEMORY)
        figures += f"{format_bytes(sum(memory[k] for k in _MEMORY)):>13}"
        rows.setdefault((body.get("stage"), figures), []).extend(ranks)
    for (stage, figures), ranks in rows.items():
        ranks.sort()
        label = f"rank {_span(ranks)}" if len(ranks) == 1 else f"ranks {_span(ranks)}"
        lines.append(f"{figures}  {label}" + (f" (stage {stage})" if stage is not None else ""))
    for stage in report.get("stages", [{"transient": report["transient"]}]):
        t = stage["transient"]
        lines.append(
            (f"stage {stage['stage']}: " if "stage" in stage else "")
            + f"transient = gathered parameters {format_bytes(t['gathered'])} + staged "
            f"gradients {format_bytes(t['staging'])}"
            + (
                f" + sent, held to the schedule's end {format_bytes(t['sent'])}"
                if "sent" in t
                else ""
            )
        )
    return lines


def _host_memory(report: dict) -> list[str]:
    """The host memory of checkpoint I/O (``zerokit.tools.plan_host_memory``); alike ranks
    share a row."""
    hosts = [e.get("host_memory") for e in report["ranks"]]
    if not all(hosts):  # not planned here (pipelines)
        return []
    rows: dict[str, list[int]] = {}  # ranks whose figures print alike share a row
    for r, host in enumerate(hosts):
        figures = f"{format_bytes(host['async_save']):>13}{format_bytes(host['load']):>13}"
        rows.setdefault(figures, []).append(r)
    lines = [
        "",
        "host memory of checkpoint I/O per rank, allocated (zerokit/tools/plan_host_memory.py)",
        f"{'async save':>13}{'load':>13}",
    ]
    for figures, ranks in rows.items():
        who = f"rank {_span(ranks)}" if len(ranks) == 1 else f"ranks {_span(ranks)}"
        lines.append(f"{figures}    for {who}")
    notes = [
        "  async save: the host copy of what the rank writes (its shards and their optimizer "
        "state), made by the first save, held between saves",
        "  load: every chunk the rank holds, read and checked before anything is applied, and "
        "one chunk's read in flight",
        f"  consolidate (one process): {format_bytes(max(h['consolidate'] for h in hosts))} "
        "into one file (tensors without a tp split go from the mapped shards to the file "
        "without a copy; a tp-split one is assembled, 3x its bytes, beside the one before it; "
        "--max-shard-size: at most this)",
    ]
    return [*lines, *notes]


def _collectives(report: dict, body: dict, who: str) -> list[str]:
    """One table of a step's collectives (of the ranks ``who``), and the volume beside the
    ZeRO paper's."""
    tp, pp = report.get("tp", 1), report.get("pp", 1)
    dp = report["world"] // tp // pp
    if "stage" in body:
        paper = report["stages"][body["stage"]]["paper_bytes_per_step"]
    else:
        paper = report["paper_bytes_per_step"]
    lines = ["", f"collectives of one training step ({who}):"]
    lines.append(f"  {'op':<15}{'group':>6}{'calls':>7}{'bytes':>12}  purpose")
    for c in body["collectives"]:
        lines.append(
            f"  {c['op']:<15}{c['group_size']:>6}{c['calls']:>7}"
            f"{format_bytes(c['bytes']):>12}  {c['what']}"
        )
    k = paper_volume(report["level"])
    psi = "Ψ/tp" if tp > 1 else "Ψ"
    lines.append(
        f"  sent per rank per step: {format_bytes(body['bytes_per_step'])} (ring algorithm); "
        f"ZeRO paper {k}{psi}(N-1)/N over the {dp} data-parallel ranks: "
        f"{format_bytes(report['paper_bytes_per_step'])}"
        if tp > 1
        else f"  sent per rank per step: {format_bytes(body['bytes_per_step'])} (ring "
        f"algorithm); ZeRO paper {k}Ψ(N-1)/N"
        + (" (Ψ the stage's, N its ranks)" if pp > 1 else "")
        + f": {format_bytes(paper)}"
    )
    return lines


def _flops(report: dict) -> list[str]:
    """Each rank's optimizer-step FLOPs and the imbalance (absent from pipeline reports)."""
    if "optimizer_flops_imbalance" not in report:
        return []
    alike: dict[str, list[int]] = {}  # ranks whose figures print alike share an entry
    for r, rank in enumerate(report["ranks"]):
        alike.setdefault(f"{rank['optimizer_flops']:.3g}", []).append(r)
    return [
        "",
        f"optimizer step ({report['optimizer']}) FLOPs per rank ({report['optimizer_flops_rule']}):",
        "  " + "  ".join(f"{_span(ranks)}: {value}" for value, ranks in alike.items()),
        f"  imbalance (max / mean over ranks): {report['optimizer_flops_imbalance']:.3f}",
    ]


def _how(report: dict) -> str:
    played = report["played_ranks"]
    return (
        f"wrapped and stepped for real on meta tensors, nothing allocated, by "
        f"{'rank' if len(played) == 1 else 'ranks'} {_span(played)} against stand-in process "
        "groups; the others are alike"
        if len(played) < report["world"]
        else "wrapped and stepped for real on meta tensors against stand-in process groups: "
        "nothing allocated"
    )


def _span(ranks: list[int]) -> str:
    """Runs of ranks: '0-62', '0-3,5,7-9'."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def _stages(report: dict) -> list[str]:
    """The split: each stage's layers, parameters and activations held."""
    lines = ["stages (PipelineModule's split by parameters of models.gpt.gpt_layers):"]
    for st in report["stages"]:
        a, b = st["layers"]
        lines.append(
            f"  stage {st['stage']}: layers {a}-{b - 1}, {st['params']:,} parameters, ranks "
            f"{st['ranks'][0]}-{st['ranks'][1]}; activations {format_bytes(st['activations_per_micro_batch'])}"
            f" per micro-batch x {st['micro_batches_in_flight']} in flight"
        )
    return [*lines, ""]
