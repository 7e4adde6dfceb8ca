"""The ``zerokit`` command (also ``python -m zerokit``)."""

from __future__ import annotations

import argparse
import json
import sys

from .. import __version__
from ..api import LEVELS
from ..config import LEVEL_ALIASES
from ..mixed_precision import PRECISIONS
from ..pipeline.schedules import SCHEDULES
from .checkpoint_cli import add_parser as add_ckpt_parser
from .checkpoint_cli import run as run_ckpt
from .compare import (
    ActivationsConfig,
    CompareConfig,
    in_torchrun,
    run_activations,
    run_compare,
    run_under_torchrun,
)
from .compare_report import (
    format_activations_table,
    format_table,
    require_matplotlib,
    write_activations_plot,
    write_plot,
)
from .plan import PlanConfig
from .plan_optimizers import OPTIMIZERS as PLAN_OPTIMIZERS
from .plan_pp import make_plan
from .plan_report import format_plan
from .verify import VerifyConfig, format_report, judge, run_verify

COMPARE_DESCRIPTION = """\
Train a model under torch DDP and each zerokit level, each level in fresh processes (local
ranks it starts itself, or one process per torchrun rank), and print per level the bytes per
rank of parameters, gradients and optimizer state (measured / estimated), the peak, the step
time and the final loss. Progress goes to stderr, the table to stdout.

--model pkg.module:factory (pkg.module may be in the current directory): factory() returns an
nn.Module mapping token ids [batch, seq] to logits [batch, seq, vocab], or a tuple
(model, make_batch) or (model, make_batch, loss_fn) for any other model, where
make_batch(step, batch) returns that step's global (inputs, targets), tensors of `batch` rows,
and loss_fn(output, targets) defaults to MSE for float targets, cross-entropy for integer ones.

--activations instead prints activation bytes per transformer layer per rank for the built-in
GPT in the five settings of Korthikanti et al. (none, tp, tp+sp, tp+sp+selective, full
recompute): estimated (zerokit.memory.estimate_activations) beside measured
(zerokit.memory.measure_activations, the paper's layer: explicit attention, dropout 0.1) on
--tp local gloo ranks. It uses --seq, --batch (the micro-batch), --hidden, --heads, --layers,
--tp, --json and --plot.
"""


LEVEL_METAVAR = "{os,os_g,p_g_os,1,2,3}"


def _level(text: str) -> str:
    """A level's name, or its stage number as group_sharded_parallel takes it."""
    level = LEVEL_ALIASES.get(text, text)
    if level not in LEVELS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is no level: use 'os', 'os_g', 'p_g_os' or the stage numbers 1, 2, 3"
        )
    return level


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="zerokit", description="ZeRO sharded data parallelism for PyTorch"
    )
    parser.add_argument("--version", action="version", version=f"zerokit {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_compare_parser(commands)
    add_ckpt_parser(commands)
    _add_verify_parser(commands)
    _add_plan_parser(commands)
    _add_launch_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "launch":
        return _launch(args)
    if args.command == "ckpt":
        return run_ckpt(args)
    if args.command == "verify":
        return _verify(args)
    if args.command == "plan":
        return _plan(args)

    if args.activations:
        return _activations(args)
    return _compare(args)


def _add_compare_parser(commands) -> None:
    compare = commands.add_parser(
        "compare",
        help="train a model under DDP and every level; memory measured and estimated, side by side",
        description=COMPARE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    compare.add_argument(
        "--model",
        metavar="PKG.MODULE:FACTORY",
        help="the model to compare (default: a built-in GPT of 5.3M parameters)",
    )
    compare.add_argument(
        "--nproc",
        type=int,
        default=CompareConfig.nproc,
        help="ranks to start; under torchrun its world size instead (default %(default)s)",
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
        help="global batch in rows (sequences), split evenly across ranks; with --activations "
        "the micro-batch b every tp rank runs (default %(default)s)",
    )
    compare.add_argument(
        "--seq",
        type=int,
        default=CompareConfig.seq,
        help="tokens per sequence, for token models; with --activations the sequence length s "
        "(default %(default)s)",
    )
    compare.add_argument(
        "--mixed-precision",
        choices=list(PRECISIONS),
        help="compute in bf16/fp16 with fp32 master shards; DDP under torch.autocast "
        "(default: fp32)",
    )
    compare.add_argument(
        "--sharding-degree",
        type=int,
        default=CompareConfig.sharding_degree,
        help="hybrid sharding: zerokit levels shard over groups of this many ranks and "
        "replicate across the groups (default %(default)s: shard over every rank)",
    )
    compare.add_argument(
        "--shard-optimizer-over-replicas",
        action="store_true",
        help="with --sharding-degree: the zerokit levels shard the optimizer state over the "
        "replicas too (default: off)",
    )
    compare.add_argument(
        "--json", metavar="PATH", help="also write the report as JSON (default: none)"
    )
    compare.add_argument(
        "--plot",
        metavar="PATH",
        help="also write a chart (PNG): model state measured beside estimated with totals, and "
        "the peak (with --activations: activation bytes per layer, measured beside estimated); "
        "needs matplotlib (default: none)",
    )
    _add_activation_flags(compare)


def _add_activation_flags(compare) -> None:
    activations = compare.add_argument_group(
        "activation memory (--activations)",
    )
    activations.add_argument(
        "--activations",
        action="store_true",
        help="instead of training under each level, print activation bytes per layer per rank "
        "of the built-in GPT in the five settings (none, tp, tp+sp, tp+sp+selective, full), "
        "measured beside estimated (default: off)",
    )
    for flag, field, what in (
        ("--hidden", "hidden", "hidden size h"),
        ("--heads", "heads", "attention heads a (divisible by --tp)"),
        ("--layers", "layers", "transformer layers"),
        ("--tp", "tp", "tensor-parallel degree t: the local gloo ranks started (at least 2)"),
    ):
        activations.add_argument(
            flag,
            type=int,
            default=getattr(ActivationsConfig, field),
            help=f"with --activations: {what} (default %(default)s)",
        )


def _activations(args) -> int:
    cfg = ActivationsConfig(
        seq=args.seq,
        batch=args.batch,
        hidden=args.hidden,
        heads=args.heads,
        layers=args.layers,
        tp=args.tp,
    )
    try:
        if args.model or args.mixed_precision:
            raise ValueError(
                "--activations measures the built-in GPT in fp32; leave out --model and "
                "--mixed-precision"
            )
        if in_torchrun():
            raise ValueError(
                "--activations starts its own --tp local ranks: run it without torchrun"
            )
        if args.plot:
            require_matplotlib()  # before measuring, not after it
        report = run_activations(cfg, lambda line: print(line, file=sys.stderr, flush=True))
    except ValueError as e:
        print(f"zerokit compare: error: {e}", file=sys.stderr)
        return 2
    return _emit(report, args, format_activations_table, write_activations_plot)


def _emit(report: dict, args, format_fn, plot_fn) -> int:
    """The table on stdout, then --json, then --plot (a failing plot keeps the rest)."""
    print(format_fn(report), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        try:
            plot_fn(report, args.plot)
        except Exception as e:  # what was measured is printed (and written) already
            print(f"zerokit compare: error: --plot {args.plot}: {e}", file=sys.stderr)
            return 1
    return 0


def _compare(args) -> int:
    cfg = CompareConfig(
        model=args.model,
        nproc=args.nproc,
        steps=args.steps,
        batch=args.batch,
        seq=args.seq,
        mixed_precision=args.mixed_precision,
        sharding_degree=args.sharding_degree,
        shard_optimizer_over_replicas=args.shard_optimizer_over_replicas,
    )

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        if args.plot:
            require_matplotlib()  # before training, not after it
        if in_torchrun():
            report = run_under_torchrun(cfg, progress)
            if not report:  # ranks other than 0 print nothing
                return 0
        else:
            report = run_compare(cfg, progress)
    except ValueError as e:
        print(f"zerokit compare: error: {e}", file=sys.stderr)
        return 2
    return _emit(report, args, format_table, write_plot)


VERIFY_DESCRIPTION = """\
Train the model on one process on the global batch, and on --nproc ranks at --level and under
torch DDP on the same ranks (each rank on its slice), and print per step the loss of both, their
difference, zerokit's and DDP's parameter distance from one process, the distance allowed and the
worst tensor. fp32: max |element difference| <= --tolerance (default 2e-5) or <= 2x DDP's (an
optimizer such as AdamW amplifies the last bit of rounding, DDP's as much). Mixed precision: the
RMS distance of all parameters from exact fp32 training within --tolerance times (default 4)
that of the same policy on one process, or 2x DDP's under torch.autocast. A forward that
computes differently on the ranks' slices (it reads the rank or draws per row: dropout) is
judged by the tolerance alone and blamed. --tp/--pp: no DDP, the tolerance alone. Exit 0 within,
1 beyond (naming the tensor that diverged first), 2 on a usage error.

--model pkg.module:factory: as for `zerokit compare` (see `zerokit compare --help`).
"""


def _add_pipeline_flags(parser, *, schedule: str) -> None:
    """The pipeline's step, as verify and plan take it."""
    parser.add_argument(
        "--micro-batches", type=int, help="micro-batches of a pipeline step (default: --pp)"
    )
    parser.add_argument(
        "--schedule", choices=sorted(SCHEDULES), default=schedule,
        help="the pipeline's schedule (default %(default)s)",
    )  # fmt: skip


def _add_verify_parser(commands) -> None:
    verify = commands.add_parser(
        "verify",
        help="prove a model trains at a level on N ranks as on one process (exit 0/1)",
        description=VERIFY_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verify.add_argument("--model", metavar="PKG.MODULE:FACTORY", help="default: built-in GPT")
    verify.add_argument("--level", required=True, type=_level, metavar=LEVEL_METAVAR)
    verify.add_argument("--nproc", type=int, default=VerifyConfig.nproc, help="default %(default)s")
    verify.add_argument("--steps", type=int, default=VerifyConfig.steps, help="default %(default)s")
    verify.add_argument(
        "--tp",
        type=int,
        default=VerifyConfig.tp,
        help="tensor-parallel degree: --nproc/--tp replicas, ZeRO over each dp group; a --model "
        "factory must take a 'layout' keyword (default %(default)s)",
    )
    verify.add_argument(
        "--pp",
        type=int,
        default=VerifyConfig.pp,
        help="pipeline stages: a zerokit.models.gpt.GPT as a PipelineModule of gpt_layers, ZeRO "
        "over each stage's --nproc/--pp ranks (default %(default)s)",
    )
    _add_pipeline_flags(verify, schedule=VerifyConfig.schedule)
    verify.add_argument(
        "--batch", type=int, default=VerifyConfig.batch, help="global rows (default %(default)s)"
    )
    verify.add_argument(
        "--seq", type=int, default=VerifyConfig.seq, help="token models (default %(default)s)"
    )
    verify.add_argument("--mixed-precision", choices=list(PRECISIONS), help="default: fp32")
    verify.add_argument(
        "--optimizer",
        choices=["sgd", "adamw", "muon"],
        default=VerifyConfig.optimizer,
        help="sgd: momentum 0.9; Adam's update hides a gradient's scale; muon: Muon (--lr) for "
        "the 2-D matrices of repeated blocks beside AdamW (lr 1e-3) for the rest (default "
        "%(default)s)",
    )
    verify.add_argument("--lr", type=float, default=VerifyConfig.lr, help="default %(default)s")
    verify.add_argument(
        "--tolerance",
        type=float,
        help="fp32: largest element difference (default 2e-5); mixed precision: factor over "
        "the one-process run's distance from exact training (default 4)",
    )


def _verify(args) -> int:
    cfg = VerifyConfig(
        level=args.level,
        model=args.model,
        nproc=args.nproc,
        tp=args.tp,
        pp=args.pp,
        micro_batches=args.micro_batches,
        schedule=args.schedule,
        steps=args.steps,
        batch=args.batch,
        seq=args.seq,
        mixed_precision=args.mixed_precision,
        tolerance=args.tolerance,
        optimizer=args.optimizer,
        lr=args.lr,
    )
    try:
        if in_torchrun():
            raise ValueError("verify starts its own --nproc local ranks: run it without torchrun")
        report = run_verify(cfg, lambda line: print(line, file=sys.stderr, flush=True))
    except ValueError as e:
        print(f"zerokit verify: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a rank raised: the model does not train alike on N ranks
        print(f"zerokit verify: FAIL: the {cfg.nproc}-rank run raised: {e}", file=sys.stderr)
        return 1
    verdict = judge(report)
    print(format_report(report, verdict), flush=True)
    return 0 if verdict["passed"] else 1


PLAN_DESCRIPTION = """\
Dry run of an N-rank job on this CPU: this process plays the job's ranks (those that differ)
one after another with the model on the meta device (no bytes) against stand-in process groups
that record every collective, through zerokit's real wrapping and two training steps. It
prints per rank (alike ranks grouped) the memory by category, as `zerokit compare` measures it
(params, grads, optimizer), beside the largest transient (gathered units, staged gradients)
and the activations of a rank's micro-batch; then every collective of one training step (op,
group size, calls, bytes), the model's own included, and the bytes each rank sends, beside the
ZeRO paper's volume. Run it where no process group is initialised. --pp plans pipelines from
zerokit's rules on fake tensors.

--model pkg.module:factory: as for `zerokit compare` (see `zerokit compare --help`); the
factory runs under torch.device("meta") (and once under FakeTensorMode for the activations),
so a 7B model costs no memory.
--json PATH: {"params", "world", "level", "ranks": [{"rank", "memory": {"params", "grads",
"optimizer", "transient", "activations"}, "collectives": [{"op", "group_size", "calls",
"bytes"}], "bytes_per_step", "optimizer_flops"}], "optimizer_flops_imbalance"} (bytes per
entry summed over its calls); with --ep also "moe": {"ep", "imbalance", "experts",
"experts_per_rank", "all_to_all": {"counts", "dispatch_forward", "combine_forward",
"combine_backward", "dispatch_backward"}, "memory_by_ranks": [[ranks, {"experts", "dense"}]]}.
--ep N: the routing is assumed (the dry run has no values): each rank sends its tokens evenly
over the ep ranks and receives --moe-imbalance x the mean, as the busiest rank would.
--optimizer: the optimizer-step FLOPs of each rank are printed, with the imbalance (max / mean
over ranks). Muon: 2 x 5 Newton-Schulz iterations x m*n*min(m,n) per m x n matrix a rank owns
(Muon's parameters are owned whole, balanced by that cost); other optimizers: 10 per element
of the rank's pieces.
"""


def _add_plan_parser(commands) -> None:
    plan = commands.add_parser(
        "plan",
        help="dry run of an N-rank job on this CPU: memory per rank and every collective",
        description=PLAN_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument("--model", metavar="PKG.MODULE:FACTORY", help="default: built-in GPT")
    plan.add_argument("--world", type=int, required=True, help="ranks of the job")
    plan.add_argument("--level", required=True, type=_level, metavar=LEVEL_METAVAR)
    plan.add_argument(
        "--sharding-degree", type=int, help="hybrid sharding: shard over groups of this many"
    )
    plan.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel degree; ZeRO over --world/--tp ranks (a --model factory must take "
        "a 'layout' keyword)",
    )
    plan.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline stages (the built-in GPT or a preset, split as PipelineModule splits "
        "models.gpt.gpt_layers); ZeRO over each stage's --world/--pp ranks",
    )
    _add_pipeline_flags(plan, schedule=PlanConfig.schedule)
    plan.add_argument(
        "--batch", type=int, help="global rows, split across ranks (default: one per rank)"
    )
    plan.add_argument(
        "--seq", type=int, default=PlanConfig.seq, help="token models (default %(default)s)"
    )
    plan.add_argument("--mixed-precision", choices=list(PRECISIONS), help="default: fp32")
    plan.add_argument(
        "--optimizer", choices=list(PLAN_OPTIMIZERS), default=PlanConfig.optimizer,
        help="muon: Muon for the 2-D matrices of repeated blocks (an nn.ModuleList's), AdamW "
        "for the rest; adafactor; adamw8bit (torchao). Default %(default)s",
    )  # fmt: skip
    plan.add_argument(
        "--whole-grads", action="store_true",
        help="--level os: all-reduce whole gradients (every rank's .grad whole, 3Ψ(N-1)/N a "
        "step) instead of the default reduce-scatter (DDP's 2Ψ(N-1)/N)",
    )  # fmt: skip
    plan.add_argument(
        "--accumulation", type=int, default=PlanConfig.accumulation, metavar="K",
        help="micro-batches per step: also print the bytes per micro-batch and per step within "
        "a host and across hosts, reducing every micro-batch, under defer_replica_sync() and "
        "under no_sync() (default %(default)s)",
    )  # fmt: skip
    plan.add_argument(
        "--shard-optimizer-over-replicas", action="store_true",
        help="with --sharding-degree: the optimizer state sharded over the replicas too "
        "(1/R of it per rank, the same bytes across replicas)",
    )  # fmt: skip
    _add_moe_flags(plan)
    plan.add_argument("--json", metavar="PATH", help="also write the report as JSON")


def _add_moe_flags(plan) -> None:
    moe = plan.add_argument_group("expert parallelism (zerokit.moe)")
    moe.add_argument(
        "--ep", type=int, default=PlanConfig.ep,
        help="split each MoE layer's experts over this many ranks and print the dispatch and "
        "combine all-to-all bytes per rank, and the experts' bytes beside the dense; --model a "
        "Hugging Face MoE model, or a built-in tiny Mixtral (default %(default)s: no split)",
    )  # fmt: skip
    moe.add_argument(
        "--moe-imbalance", type=float, default=PlanConfig.moe_imbalance,
        help="the routing assumed: max / mean tokens a rank receives, between 1 (uniform) and "
        "--ep (default %(default)s)",
    )  # fmt: skip
    for flag, field, what in (("--experts", "experts", "experts per layer"),
                              ("--top-k", "top_k", "experts per token")):  # fmt: skip
        moe.add_argument(
            flag, type=int, default=getattr(PlanConfig, field),
            help=f"the built-in Mixtral's {what} (default %(default)s)",
        )  # fmt: skip


def _plan(args) -> int:
    try:
        report = make_plan(
            PlanConfig(
                world=args.world,
                level=args.level,
                model=args.model,
                sharding_degree=args.sharding_degree,
                tp=args.tp,
                pp=args.pp,
                micro_batches=args.micro_batches,
                schedule=args.schedule,
                batch=args.batch,
                seq=args.seq,
                mixed_precision=args.mixed_precision,
                optimizer=args.optimizer,
                whole_grads=args.whole_grads,
                accumulation=args.accumulation,
                shard_optimizer_over_replicas=args.shard_optimizer_over_replicas,
                ep=args.ep,
                moe_imbalance=args.moe_imbalance,
                experts=args.experts,
                top_k=args.top_k,
            )
        )
    except ValueError as e:
        print(f"zerokit plan: error: {e}", file=sys.stderr)
        return 2
    print(format_plan(report), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _add_launch_parser(commands) -> None:
    launch = commands.add_parser(
        "launch",
        help="torchrun a training script with a strategy file (dp, tp, pp, level, plan)",
        description="Start dp * tp * pp local ranks of SCRIPT under torchrun; each finds the "
        "strategy file in $ZEROKIT_STRATEGY, which zerokit.parallelize(model, optimizer) reads "
        "when given no mesh (and zerokit.Strategy.from_env() returns).",
    )
    launch.add_argument(
        "--strategy",
        required=True,
        metavar="FILE",
        help="a .toml, .json or .yaml strategy (zerokit.Strategy's fields)",
    )
    launch.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="ranks to start (default: the strategy's dp * tp * pp)",
    )
    launch.add_argument("script")
    launch.add_argument("script_args", nargs=argparse.REMAINDER)  # fmt: skip


def _launch(args) -> int:
    from .launch import launch_script

    try:
        return launch_script(args.strategy, args.script, args.script_args, args.nproc)
    except (ValueError, ImportError, OSError) as e:
        print(f"zerokit launch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
