"""``zerokit ckpt inspect|consolidate|convert``: the checkpoint commands of the ``zerokit`` CLI."""

from __future__ import annotations

import argparse
import os
import sys

from ..checkpoint.consolidate import consolidate, describe, parse_size
from ..checkpoint.convert import convert
from ..checkpoint.index import CheckpointError
from ..checkpoint.lightning_file import consolidate_lightning

_CHECKPOINT_HELP = "the checkpoint directory zerokit.checkpoint.save wrote"


def add_parser(commands) -> None:
    """Add ``ckpt`` to the ``zerokit`` command's subparsers."""
    ckpt = commands.add_parser("ckpt", help="inspect, consolidate or convert a zerokit checkpoint")
    ckpt_commands = ckpt.add_subparsers(dest="ckpt_command", required=True)
    inspect = ckpt_commands.add_parser(
        "inspect", help="layout, sizes, and whether it is complete and verified"
    )
    inspect.add_argument(
        "checkpoint", help=_CHECKPOINT_HELP + ", or a DCP directory (FSDP2, torchtitan)"
    )
    inspect.add_argument(
        "--tensors", action="store_true", help="also list every tensor (default: off)"
    )
    _add_consolidate(ckpt_commands)
    _add_convert(ckpt_commands)


def _add_consolidate(ckpt_commands) -> None:
    consolidate_cmd = ckpt_commands.add_parser(
        "consolidate",
        help="write the full model as one safetensors file (or a Hugging Face style set), "
        "or a Lightning checkpoint file",
        description=(
            "Write the full model with the plain model's names. Tied weights are stored once; "
            "zerokit.checkpoint.load_consolidated(path, model) loads it, tied names included. "
            "--lightning: a checkpoint ZeroKitStrategy saved, as Lightning's one file."
        ),
    )
    consolidate_cmd.add_argument("checkpoint", help=_CHECKPOINT_HELP)
    consolidate_cmd.add_argument(
        "output",
        nargs="?",
        help="a .safetensors file, or a directory with --max-shard-size (may be left out "
        "with --lightning)",
    )
    consolidate_cmd.add_argument(
        "--lightning",
        metavar="PATH",
        help="also write, for a checkpoint ZeroKitStrategy saved, the file Lightning reads on "
        "one process (LightningModule.load_from_checkpoint, Trainer.fit(ckpt_path=...)): the "
        "full state_dict, the optimizer state and Lightning's own state (default: none)",
    )
    consolidate_cmd.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        help="e.g. 5GB: write model-0000i-of-0000n.safetensors + index into the directory "
        "OUTPUT (default: none, one file)",
    )
    consolidate_cmd.add_argument(
        "--no-verify", action="store_true",
        help="trust the checkpoint's bytes: check sizes and headers but not the sha256s, which "
        "read the whole checkpoint (default: verified)",
    )  # fmt: skip
    _add_writers(consolidate_cmd)
    consolidate_cmd.add_argument(
        "--optimizer",
        metavar="PATH",
        help="also write the optimizer state (a .safetensors file) (default: none, the model only)",
    )


def _add_convert(ckpt_commands) -> None:
    convert_cmd = ckpt_commands.add_parser(
        "convert",
        help="a zerokit or DCP (torch.distributed.checkpoint) checkpoint in another format",
        description=(
            "Read a zerokit checkpoint or a DCP directory (FSDP2, torchtitan) and write it as "
            "--to dcp (dcp.load + set_state_dict read it at any world size), --to zerokit "
            "(zerokit.checkpoint.load reads it at any world size and level) or --to hf "
            "(DST/model.safetensors). One process; each tensor is read when it is written."
        ),
    )
    convert_cmd.add_argument("source", help="a zerokit checkpoint or a DCP directory")
    convert_cmd.add_argument("output", help="the checkpoint directory to write")
    convert_cmd.add_argument(
        "--to", required=True, choices=("dcp", "zerokit", "hf"),
        help="the format to write (default: none, it must be given)",
    )  # fmt: skip
    convert_cmd.add_argument(
        "--no-optimizer", action="store_true",
        help="leave the optimizer state out (default: converted too)",
    )  # fmt: skip
    _add_writers(convert_cmd)
    convert_cmd.add_argument(
        "--max-shard-size", metavar="SIZE",
        help="with --to hf: write model-0000i-of-0000n.safetensors + index into OUTPUT "
        "(default: none, one model.safetensors)",
    )  # fmt: skip


def _add_writers(command) -> None:
    command.add_argument(
        "--writers", type=int, default=1, metavar="N",
        help="with --max-shard-size: N local processes write the set, each whole files "
        "of its own (the same bytes as one writer's). Under torchrun every rank is a "
        "writer instead (default: 1)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``ckpt`` command: 0 done, 1 the checkpoint is not usable, 2 an error."""
    try:
        group, made_here = (None, False) if args.ckpt_command == "inspect" else _torchrun_group()
    except (ValueError, RuntimeError) as e:  # torchrun's environment incomplete
        return _failed(args, e)
    try:
        return _run(args, group)
    finally:
        if made_here:  # torn down, not its threads killed at exit ("terminate called", seen)
            import torch.distributed as dist

            dist.destroy_process_group()


def _run(args: argparse.Namespace, group) -> int:
    try:
        if args.ckpt_command == "inspect":
            report, ok = describe(args.checkpoint, tensors=args.tensors)
            _print(report)
            return 0 if ok else 1
        if args.writers < 1:
            raise ValueError(f"--writers must be at least 1, got {args.writers}")
        max_size = parse_size(args.max_shard_size) if args.max_shard_size else None
        if args.ckpt_command == "convert":
            written = convert(
                args.source, args.output, args.to, not args.no_optimizer, max_size,
                args.writers, group,
            )  # fmt: skip
            if not _rank_zero(group):
                return 0
            _print("\n".join(f"wrote {path}" for path in written))
            if args.to == "hf":
                _note_without_config(args.output, written)
            return 0
        if args.output is None and args.lightning is None:
            raise ValueError("give an output file (or --lightning PATH)")
        written = []
        if args.output is not None:
            written += consolidate(
                args.checkpoint, args.output, max_size, args.optimizer, not args.no_verify,
                args.writers, group,
            )  # fmt: skip
        elif args.max_shard_size or args.optimizer:
            raise ValueError("--max-shard-size and --optimizer need an output")
        if args.lightning is not None:
            written += consolidate_lightning(args.checkpoint, args.lightning)
        if not _rank_zero(group):  # one report for the set, not one per rank
            return 0
        _print("\n".join(f"wrote {path}" for path in written))
        if args.max_shard_size and args.output:
            _note_without_config(args.output, written)
    except BrokenPipeError:  # `zerokit ckpt inspect ... | head`: the reader has gone
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # and the interpreter's final flush must not fail
        return 0
    except (CheckpointError, ValueError, OSError) as e:
        return _failed(args, e)
    return 0


def _failed(args: argparse.Namespace, e: Exception) -> int:
    print(f"zerokit ckpt {args.ckpt_command}: error: {e}", file=sys.stderr)
    return 2


def _torchrun_group():
    """Under torchrun (``WORLD_SIZE`` > 1) every rank is a writer: the world's gloo group,
    and whether it was made here (then this command tears it down)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None, False
    import torch.distributed as dist

    made_here = not dist.is_initialized()
    if made_here:
        dist.init_process_group("gloo")
    return dist.group.WORLD, made_here


def _rank_zero(group) -> bool:
    import torch.distributed as dist

    return group is None or dist.get_rank(group) == 0


def _note_without_config(output: str, written: list[str]) -> None:
    """A Hugging Face set written without ``config.json`` (the saved model had none) is not
    loadable by ``from_pretrained`` yet: say so (GUIDE, "Hugging Face sets")."""
    if not any(os.path.basename(w) == "config.json" for w in written):
        _print(
            f"note: {output} has no config.json (the saved model had no Hugging Face "
            "config): copy the model's config.json there before from_pretrained"
        )


def _print(text: str) -> None:
    print(text)
    sys.stdout.flush()
