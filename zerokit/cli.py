"""The ``zerokit`` command (also ``python -m zerokit``)."""

from __future__ import annotations

import argparse
import json
import sys

from .checkpoint.cli import add_parser as add_ckpt_parser
from .checkpoint.cli import run as run_ckpt
from .compare import (
    CompareConfig,
    format_table,
    in_torchrun,
    main_under_torchrun,
    run_compare,
    write_plot,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="zerokit", description="ZeRO sharded data parallelism for PyTorch"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    compare = commands.add_parser(
        "compare",
        help="train a model under DDP and every level; memory measured and estimated, side by side",
        description=(
            "Train a model under torch DDP and each zerokit level on local gloo ranks (or under "
            "torchrun) and print, per level, bytes per rank of parameters, gradients and optimizer "
            "state (measured / estimated), the peak, the step time and the final loss. --model "
            "takes pkg.module:factory; factory() returns an nn.Module mapping token ids "
            "[batch, seq] to logits [batch, seq, vocab]."
        ),
    )
    compare.add_argument("--model", help="pkg.module:factory (default: a small built-in GPT)")
    compare.add_argument(
        "--nproc",
        type=int,
        default=CompareConfig.nproc,
        help="ranks to start (default %(default)s)",
    )
    compare.add_argument(
        "--steps",
        type=int,
        default=CompareConfig.steps,
        help="training steps per level (default %(default)s)",
    )
    compare.add_argument(
        "--batch",
        type=int,
        default=CompareConfig.batch,
        help="global batch in sequences (default %(default)s)",
    )
    compare.add_argument(
        "--mixed-precision",
        choices=["bf16", "fp16"],
        help="compute in bf16/fp16 with fp32 master shards (DDP: torch.autocast)",
    )
    compare.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    compare.add_argument("--plot", metavar="PATH", help="also write a stacked bar chart PNG")
    add_ckpt_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "ckpt":
        return run_ckpt(args)

    cfg = CompareConfig(
        model=args.model,
        nproc=args.nproc,
        steps=args.steps,
        batch=args.batch,
        mixed_precision=args.mixed_precision,
    )
    try:
        if args.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {args.steps}")
        if in_torchrun():
            report = main_under_torchrun(cfg)
            if not report:  # ranks other than 0 print nothing
                return 0
        else:
            report = run_compare(
                cfg, progress=lambda line: print(line, file=sys.stderr, flush=True)
            )
        if args.plot:
            write_plot(report, args.plot)
    except ValueError as e:
        print(f"zerokit compare: error: {e}", file=sys.stderr)
        return 2
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
