"""The ``zerokit`` command (also ``python -m zerokit``)."""

from __future__ import annotations

import argparse
import json
import sys

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
    ckpt = commands.add_parser("ckpt", help="inspect or consolidate a zerokit checkpoint")
    ckpt_commands = ckpt.add_subparsers(dest="ckpt_command", required=True)
    inspect = ckpt_commands.add_parser(
        "inspect", help="layout, tensors and sizes; whether it is complete and verified"
    )
    inspect.add_argument("checkpoint")
    consolidate = ckpt_commands.add_parser(
        "consolidate",
        help="write the full model as one safetensors file (or a Hugging Face style set)",
    )
    consolidate.add_argument("checkpoint")
    consolidate.add_argument(
        "output", help="a .safetensors file, or a directory with --max-shard-size"
    )
    consolidate.add_argument(
        "--max-shard-size", help="e.g. 5GB: write model-0000i-of-0000n.safetensors + index"
    )
    consolidate.add_argument("--optimizer", metavar="PATH", help="also write the optimizer state")
    args = parser.parse_args(argv)
    if args.command == "ckpt":
        return _ckpt(args)

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


def _ckpt(args) -> int:
    from .checkpoint import CheckpointError, consolidate, describe
    from .checkpoint.consolidate import parse_size

    try:
        if args.ckpt_command == "inspect":
            report, ok = describe(args.checkpoint)
            print(report)
            return 0 if ok else 1
        max_size = parse_size(args.max_shard_size) if args.max_shard_size else None
        for path in consolidate(args.checkpoint, args.output, max_size, args.optimizer):
            print(f"wrote {path}")
    except (CheckpointError, ValueError) as e:
        print(f"zerokit ckpt {args.ckpt_command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
