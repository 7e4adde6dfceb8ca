"""What ``zerokit compare`` shows: the report (a dict, also written as JSON) as a table, and as
a chart with ``--plot``.

The report: ``world_size``, ``backend``, ``model``, ``precision``, ``steps``, ``memory_steps``
(those each level's memory run trains), ``batch`` and one row per level with ``measured``
(params, grads, optimizer, total, peak) and ``estimated`` (params, grads, optimizer, total)
bytes per rank, the largest over ranks, ``step_time_s`` (the median over the interleaved
rounds), ``step_time_spread_s`` (their 25th and 75th percentiles), ``step_time_rounds`` and
``final_loss``.
"""

from __future__ import annotations

from ..memory import format_bytes

CATEGORIES = ("params", "grads", "optimizer")


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


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
    head = (
        f"{'level':<8}"
        + "".join(f"{c:>24}" for c in (*CATEGORIES, "total"))
        + f"{'peak':>12}{'step s [mid half]':>22}{'final loss':>12}"
    )
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
            + f"{format_bytes(m['peak']):>12}{_step_time(row):>22}{row['final_loss']:>12.6f}"
        )
    rounds = report["rows"][0]["step_time_rounds"]
    lines.append(
        f"step s: the median over {rounds} round{'s' if rounds != 1 else ''}, every level one "
        "step per round, taking turns in the same processes; [the middle half of the rounds]."
    )
    run = (
        f"building and training {_steps(report['memory_steps'])}, each level in processes of its "
        "own"
    )
    if report.get("backend") == "nccl":
        lines.append(f"peak: torch's CUDA allocator peak while {run}.")
    else:
        lines.append(
            f"peak: the most resident memory a rank used while {run}, above what it held before "
            "(the kernel's VmHWM on CPU)."
        )
    return "\n".join(lines)


def _step_time(row: dict) -> str:
    """'0.250 [0.240-0.310]': the median step time and the middle half of the rounds."""
    low, high = row["step_time_spread_s"]
    return f"{row['step_time_s']:.3f} [{low:.3f}-{high:.3f}]"


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

    rows = report["rows"]
    fig, (state_ax, peak_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    _state_panel(state_ax, rows)
    _peak_panel(peak_ax, rows)
    fig.suptitle(
        f"zerokit compare: {report['model']}, {_ranks(report['world_size'])} "
        f"({report['backend']}), {report['precision']}, {report['steps']} steps; the largest "
        "rank's bytes",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _state_panel(ax, rows: list[dict]) -> None:
    """Model state by category per level, measured (solid) beside estimated (hatched)."""
    from matplotlib.patches import Patch

    xs = list(range(len(rows)))
    unit, scale = _unit(max(max(r["measured"]["total"], r["estimated"]["total"]) for r in rows))
    colors = dict(zip(CATEGORIES, ("tab:blue", "tab:orange", "tab:green")))
    for offset, kind, style in ((-0.2, "measured", {}), (0.2, "estimated", {"hatch": "//"})):
        bottom = [0.0] * len(rows)
        for category in CATEGORIES:
            values = [r[kind][category] / scale for r in rows]
            label = category if kind == "measured" else None
            ax.bar(
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
            ax.annotate(
                format_bytes(total),
                (x + offset, total / scale),
                ha="center",
                va="bottom",
                fontsize=7,
            )
    handles = ax.get_legend_handles_labels()[0] + [
        Patch(facecolor="white", edgecolor="black", label="solid: measured"),
        Patch(facecolor="white", edgecolor="black", hatch="//", label="hatched: estimated"),
    ]
    ax.set_xticks(xs, [r["level"] for r in rows])
    ax.set_ylabel(f"{unit} per rank")
    ax.set_title("model state per rank, with totals")
    ax.legend(handles=handles, fontsize=7)


def _peak_panel(ax, rows: list[dict]) -> None:
    """The measured peak per level, DDP's marked across."""
    xs = list(range(len(rows)))
    levels = [r["level"] for r in rows]
    peaks = [r["measured"]["peak"] for r in rows]
    unit, scale = _unit(max(peaks))
    ax.bar(xs, [p / scale for p in peaks], 0.5, color="tab:gray", edgecolor="black", linewidth=0.5)
    for x, peak in zip(xs, peaks):
        ax.annotate(format_bytes(peak), (x, peak / scale), ha="center", va="bottom", fontsize=7)
    if "ddp" in levels:
        ax.axhline(
            peaks[levels.index("ddp")] / scale,
            color="black",
            linestyle="--",
            linewidth=0.8,
            label="ddp's peak",
        )
        ax.legend(fontsize=7, loc="lower right")
    ax.set_xticks(xs, levels)
    ax.set_ylabel(f"{unit} per rank")
    ax.set_title("peak while building and training (measured only)")


# -- zerokit compare --activations ------------------------------------------------------------
def activation_formula(estimate_options: dict, bytes_per_value: int) -> str:
    """The estimate's per-layer bytes as the paper writes them, for ``bytes_per_value``-byte
    values and 1-byte dropout masks (the paper's 2 bytes: sbh(34 + 5as/h) with no parallelism)."""
    p = bytes_per_value
    t, sp, recompute = (
        estimate_options["tp"],
        estimate_options["sequence_parallel"],
        estimate_options["recompute"],
    )
    if recompute == "full":
        return f"{p}sbh/t" if sp else f"{p}sbh"
    replicated, split, core = 4 * p + 2, 12 * p, 2 * p + 1
    if t == 1:
        terms = [f"{replicated + split}"]
    elif sp:
        terms = [f"{replicated + split}/t"]
    else:
        terms = [f"{replicated}", f"{split}/t"]
    if recompute != "selective":
        terms.append(f"{core}as/h" if t == 1 else f"{core}as/(ht)")
    return f"sbh({' + '.join(terms)})"


def format_activations_table(report: dict) -> str:
    """The activations report as a fixed-width table: bytes per layer per rank."""
    r = report
    rows = r["rows"]
    none = rows[0]["measured_per_layer"]
    largest = max(max(row["measured_per_layer"], row["estimated_per_layer"]) for row in rows)
    unit, scale = next(
        (u, k) for u, k, top in (("KiB", 2**10, 2**26), ("MiB", 2**20, 2**36), ("GiB", 2**30, None))
        if top is None or largest < top
    )  # fmt: skip
    lines = [
        "activation bytes per transformer layer per rank, measured / estimated; "
        f"{r['bytes_per_value']}-byte (fp32) values, 1-byte dropout masks",
        f"{r['model']} (explicit_attention=True, dropout {r['dropout']}): s={r['seq']} "
        f"b={r['batch']} h={r['hidden']} a={r['heads']}, {r['layers']} "
        f"layer{'s' if r['layers'] != 1 else ''}, t={r['tp']} "
        f"({r['tp']} {r['backend']} ranks, one tp group)",
        f"{'setting':<17}{'measured':>13}{'estimated':>13}{'measured/est':>14}"
        f"{'of none':>9}  estimate",
    ]
    for row in rows:
        m, e = row["measured_per_layer"], row["estimated_per_layer"]
        formula = activation_formula(row["estimate_options"], r["bytes_per_value"])
        lines.append(
            f"{row['setting']:<17}{f'{m / scale:.1f} {unit}':>13}{f'{e / scale:.1f} {unit}':>13}"
            f"{m / e:>14.3f}{m / none:>9.0%}  {formula}"
        )
    lines.append(
        "measured: memory.measure_activations (the bytes autograd saves in the blocks, each "
        "storage once), the largest over ranks;\nestimated: memory.estimate_activations; "
        "of none: measured, as a share of none's."
    )
    return "\n".join(lines)


def write_activations_plot(report: dict, path: str) -> None:
    """Per setting, bytes per layer per rank: measured (solid) beside estimated (hatched)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    xs = list(range(len(rows)))
    unit, scale = _unit(
        int(max(max(r["measured_per_layer"], r["estimated_per_layer"]) for r in rows))
    )
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for offset, key, label, style in (
        (-0.2, "measured_per_layer", "measured", {"color": "tab:blue"}),
        (
            0.2,
            "estimated_per_layer",
            "estimated",
            {"color": "tab:blue", "alpha": 0.4, "hatch": "//"},
        ),
    ):
        values = [r[key] for r in rows]
        ax.bar([x + offset for x in xs], [v / scale for v in values], 0.38, label=label,
               edgecolor="black", linewidth=0.5, **style)  # fmt: skip
        for x, v in zip(xs, values):
            ax.annotate(format_bytes(int(v)), (x + offset, v / scale), ha="center", va="bottom",
                        fontsize=7)  # fmt: skip
    ax.set_xticks(xs, [r["setting"] for r in rows])
    ax.set_ylabel(f"{unit} per layer per rank")
    ax.legend(fontsize=8)
    ax.set_title(
        f"activation memory: {report['model']}, s={report['seq']} b={report['batch']} "
        f"h={report['hidden']} a={report['heads']}, t={report['tp']}, fp32",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
