"""The same tiny-Llama ``transformers.Trainer`` run under Trainer + DDP, Trainer + FSDP2
(accelerate's FSDP plugin, ``fsdp_version: 2``) and Trainer + zerokit at each level
(``zerokit.integrations.hf_trainer.ZeroTrainer``), side by side on gloo CPU ranks: step time
and the bytes each rank holds in parameters, gradients and optimizer state.

    python benchmarks/hf_trainer.py                 # 2 ranks, 12 steps, AdamW, 3 rounds
    python benchmarks/hf_trainer.py --steps 20 --hidden 256

Bytes are counted at the last step's ``on_pre_optimizer_step`` (gradients reduced, optimizer
state allocated): every distinct storage reachable from the model's parameters and their
gradients (a DTensor's local shard), the optimizer's parameters and its state.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

RUNNERS = ("ddp", "fsdp2", "os", "os_g", "p_g_os")


def _model(hidden: int, layers: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 32),
        num_key_value_heads=max(1, hidden // 64),
        vocab_size=vocab,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def held_bytes(model, optimizer) -> int:
    """Distinct storages of parameters, gradients, optimizer parameters and state."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}

    def add(t):
        if t is None or not torch.is_tensor(t):
            return
        t = t.to_local() if isinstance(t, DTensor) else t
        try:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        except RuntimeError:  # zerokit's gradient stand-in at 'os_g'/'p_g_os': no storage
            pass

    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    for p in model.parameters():
        add(p)
        add(p.grad)
    for group in optimizer.param_groups:
        for p in group["params"]:
            add(p)
            add(p.grad)
    for state in optimizer.state.values():
        for value in state.values():
            add(value)
    return sum(n for ptr, n in seen.items() if ptr)


def _rank(rank: int, world: int, runner: str, opts: dict, out: str) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from zerokit.integrations.hf_trainer import ZeroTrainer, ZeroTrainingArguments

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29511",
    )  # fmt: skip
    model = _model(opts["hidden"], opts["layers"], opts["vocab"])
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, opts["vocab"], (opts["steps"] * 8, opts["seq"]), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]
    common = {
        "output_dir": os.path.join(out, runner),
        "per_device_train_batch_size": 8 // world,
        "max_steps": opts["steps"],
        "learning_rate": 1e-3,
        "warmup_steps": 1,
        "logging_steps": 1000,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": 0,
    }
    if runner in ("os", "os_g", "p_g_os"):
        args, cls = ZeroTrainingArguments(**common, zerokit_level=runner), ZeroTrainer
    elif runner == "fsdp2":
        fsdp = {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
        args, cls = TrainingArguments(**common, fsdp="full_shard", fsdp_config=fsdp), Trainer
    else:
        args, cls = TrainingArguments(**common), Trainer

    record = {"times": [], "bytes": 0}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            record["times"].append(time.perf_counter() - self.start)

        def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
            if state.global_step == args.max_steps - 1:
                record["bytes"] = held_bytes(trainer.model_wrapped, trainer.optimizer)

    trainer = cls(model=model, args=args, train_dataset=data, callbacks=[Clock()])
    if runner == "fsdp2" and not trainer.is_fsdp_enabled:
        # accelerate 1.15 turns its FSDP plugin on for GPU-type devices only: on CPU ranks the
        # Trainer would run DDP under the FSDP2 name
        record["skipped"] = f"accelerate's FSDP plugin is off on {trainer.args.device.type}"
    else:
        trainer.train()
    with open(os.path.join(out, f"{runner}-{rank}.json"), "w") as f:
        json.dump(record, f)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the docstring's layout and shows every default."""


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--world", type=int, default=2, help="ranks to start")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--hidden", type=int, default=128, help="the Llama's hidden size")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument("--vocab", type=int, default=2048, help="vocabulary size")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sample")
    parser.add_argument("--runners", default=",".join(RUNNERS), help="runners, comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="rounds over the runners")
    a = parser.parse_args(argv)
    opts = {k: getattr(a, k) for k in ("steps", "hidden", "layers", "vocab", "seq")}
    from zerokit.tools.launch import spawn_local

    rows: dict[str, list | str] = {}
    with tempfile.TemporaryDirectory(prefix="hf-bench-") as out:
        for round_ in range(a.repeat):  # runners alternate: each sees the same machine state
            for runner in a.runners.split(","):
                print(f"round {round_ + 1}: Trainer + {runner} ...", file=sys.stderr, flush=True)
                spawn_local(_rank, a.world, runner, opts, out)
                ranks = []
                for r in range(a.world):
                    with open(os.path.join(out, f"{runner}-{r}.json")) as f:
                        ranks.append(json.load(f))
                if "skipped" in ranks[0]:
                    rows[runner] = ranks[0]["skipped"]
                    continue
                # the first two steps warm up (allocations, the first gather), left out
                times = [max(ts) for ts in zip(*(rk["times"] for rk in ranks))][2:]
                bytes_ = max(rk["bytes"] for rk in ranks)
                rows.setdefault(runner, []).append((statistics.median(times), bytes_))
    rows = {
        k: v
        if isinstance(v, str)
        else (
            statistics.median(t for t, _ in v),
            v[0][1],
            min(t for t, _ in v),
            max(t for t, _ in v),
        )
        for k, v in rows.items()
    }
    params = sum(p.numel() for p in _model(a.hidden, a.layers, a.vocab).parameters())
    base_t, base_b, _, _ = rows.get("ddp") or next(
        r for r in rows.values() if not isinstance(r, str)
    )
    print(
        f"tiny Llama {params / 1e6:.2f}M parameters, {a.world} gloo CPU ranks, AdamW fp32, "
        f"global batch 8 x {a.seq} tokens, median step of {a.steps - 2}, median of {a.repeat} runs"
    )
    print("| Trainer + | step (ms) | runs' range (ms) | vs DDP | bytes/rank (MiB) | vs DDP |")
    print("|---|---|---|---|---|---|")
    for runner, row in rows.items():
        name = {"ddp": "DDP", "fsdp2": "FSDP2 (accelerate)"}.get(runner, f"zerokit '{runner}'")
        if isinstance(row, str):
            print(f"| {name} | not run: {row} | | | | |")
            continue
        t, b, lo, hi = row
        print(
            f"| {name} | {t * 1e3:.1f} | {lo * 1e3:.0f}-{hi * 1e3:.0f} | {t / base_t:.2f}x | "
            f"{b / 2**20:.2f} | {b / base_b:.2f}x |"
        )


if __name__ == "__main__":
    sys.exit(main())
