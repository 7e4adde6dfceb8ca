"""What ``zerokit compare`` shows: the report (a dict, also written as JSON) as a table, and as
a chart with ``--plot``.

The report: ``world_size``, ``backend``, ``model``, ``precision``, ``steps``, ``batch`` and one
row per level with ``measured`` (params, grads, optimizer, total, peak) and ``estimated``
(params, grads, optimizer, total) bytes per rank, the largest over ranks, ``step_time_s`` and
``final_loss``.
"""

from __future__ import annotations

from .memory import format_bytes

CATEGORIES = ("params", "grads", "optimizer")


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def describe_precision(report: dict) -> str:
    if report["precision"] == "fp32":
        return "fp32"
    return (
        f"{report['precision']} compute with fp32 master shards (ddp: fp32 parameters under "
        f"torch.autocast to {report['precision']})"
    )


def _hybrid(report: dict) -> str:
    shards = report.get("sharding_degree", 1)
    if shards <= 1:
        return ""
    return (
        f"; zerokit levels sharded over {shards} ranks, replicated "
        f"{report['world_size'] // shards}x (hybrid sharding)"
    )


def format_table(report: dict) -> str:
    """The report as a fixed-width table: measured / estimated bytes per rank."""
    head = f"{'level':<8}{'params':>24}{'grads':>24}{'optimizer':>24}{'total':>24}{'peak':>12}{'step s':>9}{'final loss':>12}"
    lines = [
        f"bytes per rank (largest over {_ranks(report['world_size'])}), measured / estimated; "
        f"{describe_precision(report)}; {report['steps']} steps, global batch {report['batch']}"
        + _hybrid(report),
        head,
    ]
    for row in report["rows"]:
        m, e = row["measured"], row["estimated"]
        cells = [f"{format_bytes(m[k])} / {format_bytes(e[k])}" for k in (*CATEGORIES, "total")]
        lines.append(
            f"{row['level']:<8}"
            + "".join(f"{c:>24}" for c in cells)
            + f"{format_bytes(m['peak']):>12}{row['step_time_s']:>9.3f}{row['final_loss']:>12.6f}"
        )
    if report.get("backend") == "nccl":
        lines.append("peak: torch's CUDA allocator peak while building and training.")
    else:
        lines.append(
            "peak: the most resident memory a rank used while building and training, above what "
            "it held before (the kernel's VmHWM on CPU)."
        )
    return "\n".join(lines)


def require_matplotlib() -> None:
    """Fail before training, not after it, when ``--plot`` cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ValueError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            "(or pip install -e '.[plot]'), or leave out --plot"
        ) from e


def _unit(largest: int) -> tuple[str, int]:
    """The unit an axis reaching ``largest`` bytes reads best in."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= scale:
            return unit, scale
    return "B", 1


def write_plot(report: dict, path: str) -> None:
    """Two panels per level: model state by category, measured (solid) beside estimated
    (hatched), each stack labelled with its total; and the measured peak, DDP's marked."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = report["rows"]
    xs = list(range(len(rows)))
    levels = [r["level"] for r in rows]
    fig, (state_ax, peak_ax) = plt.subplots(1, 2, figsize=(11, 4.5))

    unit, scale = _unit(max(max(r["measured"]["total"], r["estimated"]["total"]) for r in rows))
    colors = dict(zip(CATEGORIES, ("tab:blue", "tab:orange", "tab:green")))
    for offset, kind, style in ((-0.2, "measured", {}), (0.2, "estimated", {"hatch": "//"})):
        bottom = [0.0] * len(rows)
        for category in CATEGORIES:
            values = [r[kind][category] / scale for r in rows]
            label = category if kind == "measured" else None
            state_ax.bar(
                [x + offset for x in xs],
                values,
                0.38,
                bottom=bottom,
                label=label,
                color=colors[category],
                edgecolor="black",
                linewidth=0.5,
                alpha=1.0 if kind == "measured" else 0.5,
                **style,
            )
            bottom = [b + v for b, v in zip(bottom, values)]
        for x, row in zip(xs, rows):
            total = row[kind]["total"]
            state_ax.annotate(
                format_bytes(total),
                (x + offset, total / scale),
                ha="center",
                va="bottom",
                fontsize=7,
            )
    handles = state_ax.get_legend_handles_labels()[0] + [
        Patch(facecolor="white", edgecolor="black", label="solid: measured"),
        Patch(facecolor="white", edgecolor="black", hatch="//", label="hatched: estimated"),
    ]
    state_ax.set_xticks(xs, levels)
    state_ax.set_ylabel(f"{unit} per rank")
    state_ax.set_title("model state per rank, with totals")
    state_ax.legend(handles=handles, fontsize=7)

    peaks = [r["measured"]["peak"] for r in rows]
    unit, scale = _unit(max(peaks))
    peak_ax.bar(
        xs, [p / scale for p in peaks], 0.5, color="tab:gray", edgecolor="black", linewidth=0.5
    )
    for x, peak in zip(xs, peaks):
        peak_ax.annotate(
            format_bytes(peak), (x, peak / scale), ha="center", va="bottom", fontsize=7
        )
    if "ddp" in levels:
        peak_ax.axhline(
            peaks[levels.index("ddp")] / scale,
            color="black",
            linestyle="--",
            linewidth=0.8,
            label="ddp's peak",
        )
        peak_ax.legend(fontsize=7, loc="lower right")
    peak_ax.set_xticks(xs, levels)
    peak_ax.set_ylabel(f"{unit} per rank")
    peak_ax.set_title("peak while building and training (measured only)")
    fig.suptitle(
        f"zerokit compare: {report['model']}, {_ranks(report['world_size'])} "
        f"({report['backend']}), {report['precision']}, {report['steps']} steps; the largest "
        "rank's bytes",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
