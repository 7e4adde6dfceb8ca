"""One tiny-Llama ``transformers.Trainer`` run, plain or under zerokit, for the HF Trainer tests
and benchmarks/hf_trainer.py: a model built in-process (no downloads), a fixed token dataset,
and what a Trainer user turns on (accumulation, clipping, warmup, eval loop).

``run(rank, world, opts, out)`` is one rank's part: forked ranks (``run_distributed``) with the
process group already up; the env vars accelerate reads are set here. ``reference(opts, out)``
is the one-process Trainer in this process. Rank 0 writes ``out/logs.json`` (the Trainer's
log history) and ``out/model`` (``save_model``).
"""

from __future__ import annotations

import json
import os

import torch

SEQ, VOCAB, SAMPLES, EVAL_SAMPLES = 16, 96, 48, 12


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def token_dataset(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def training_arguments(opts: dict, world: int, out: str):
    """The same global batch at every world size: per-device batch = global / (world * accum)."""
    from zerokit.integrations.hf_trainer import ZeroTrainingArguments

    accum = opts.get("accum", 2)
    per_device = opts.get("global_batch", 12) // (world * accum)
    kwargs = {
        "output_dir": out,
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": accum,
        "max_steps": opts.get("steps", 4),
        "learning_rate": 3e-3,
        "warmup_steps": 2,
        "lr_scheduler_type": "linear",
        "max_grad_norm": opts.get("max_grad_norm", 0.3),
        "logging_steps": 1,
        "eval_strategy": "steps",
        "eval_steps": 2,
        "per_device_eval_batch_size": 2,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "bf16": opts.get("bf16", False),
        "optim": opts.get("optim", "adamw_torch"),
        "gradient_checkpointing": opts.get("checkpointing", False),
        **(
            {"save_strategy": "steps", "save_steps": opts["save_steps"]}
            if opts.get("save_steps")
            else {}
        ),
        **(
            {
                "save_strategy": "steps",
                "save_steps": 2,
                "load_best_model_at_end": True,
                "metric_for_best_model": "eval_loss",
                "greater_is_better": opts["best"] == "max",
            }
            if opts.get("best")
            else {}
        ),
        **opts.get("extra", {}),
    }
    if opts.get("level"):
        kwargs["zerokit_level"] = opts["level"]
        return ZeroTrainingArguments(**kwargs)
    from transformers import TrainingArguments

    return TrainingArguments(**kwargs)


def train(world: int, opts: dict, out: str) -> None:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # forked: the parent's singletons
    from transformers import Trainer

    from zerokit.integrations.hf_trainer import ZeroTrainer

    args = training_arguments(opts, world, out)
    model = tiny_llama()
    if opts.get("lora"):  # base frozen, LoRA adapters on the attention projections
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        model = get_peft_model(model, lora)
    trainer_cls = ZeroTrainer if opts.get("level") else Trainer
    kwargs = {}
    if opts.get("own_optimizers"):
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        kwargs["optimizers"] = (opt, sched)
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=token_dataset(SAMPLES, 1),
        eval_dataset=token_dataset(EVAL_SAMPLES, 2),
        **kwargs,
    )
    seen = []  # the dtype the first decoder layer computes in (bf16=True: bfloat16)
    layer = model.get_base_model() if hasattr(model, "get_base_model") else model
    layer.model.layers[0].mlp.register_forward_pre_hook(
        lambda mod, _: seen.append(str(mod.up_proj.weight.dtype))
    )
    if opts.get("plant") == "no_clip":  # the planted bug: clipping skipped
        trainer._clip_grad_norm = lambda model: torch.tensor(0.0)
    trainer.train(resume_from_checkpoint=opts.get("resume"))
    trainer.save_model(opts.get("export_to") or os.path.join(out, "model"))
    if trainer.args.process_index == 0:
        with open(os.path.join(out, "logs.json"), "w") as f:
            json.dump(trainer.state.log_history, f)
        with open(os.path.join(out, "compute_dtype.txt"), "w") as f:
            f.write(seen[0])
        with open(os.path.join(out, "best.txt"), "w") as f:
            f.write(os.path.basename(trainer.state.best_model_checkpoint or ""))


def write_logs(trainer, out: str) -> None:
    """Rank 0: the Trainer's log history, for the comparison."""
    if trainer.args.process_index == 0:
        with open(os.path.join(out, "logs.json"), "w") as f:
            json.dump(trainer.state.log_history, f)


def rank_env(rank: int, world: int) -> None:
    """What a launcher sets: accelerate reads the rank from it."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
    )  # fmt: skip


def run(rank: int, world: int, opts: dict, out: str) -> None:
    """One forked rank (``run_distributed``): accelerate reads its rank from the env."""
    rank_env(rank, world)
    train(world, opts, out)


def reference(opts: dict, out: str) -> None:
    """The one-process Trainer, in this process (no distributed env)."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    try:
        train(1, {k: v for k, v in opts.items() if k not in ("level", "plant")}, out)
    finally:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)


def results(out: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """What rank 0 wrote: the log history and the saved model's weights."""
    from safetensors.torch import load_file

    with open(os.path.join(out, "logs.json")) as f:
        logs = json.load(f)
    model_dir = os.path.join(out, "model")
    weights = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            weights.update(load_file(os.path.join(model_dir, name)))
    return logs, weights


# ---- TRL's SFTTrainer on a tiny chat dataset, with a tokenizer built here ----

WORDS = "hello hi how are you fine thanks what is two plus three four five six yes no ok".split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


def tiny_tokenizer():
    """A word-level tokenizer with a chat template: no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<eos>", "<user>", "<assistant>", "<system>"]
    vocab = {w: i for i, w in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<eos>",
        chat_template=CHAT_TEMPLATE,
    )


def chat_dataset(n: int, seed: int):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        q, a = (torch.randint(0, len(WORDS), (k,), generator=g).tolist() for k in (4, 3))
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": " ".join(WORDS[i] for i in q)},
                    {"role": "assistant", "content": " ".join(WORDS[i] for i in a)},
                ]
            }
        )
    return Dataset.from_list(rows)


def sft(world: int, opts: dict, out: str) -> None:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    from trl import SFTConfig, SFTTrainer

    from zerokit import ShardingConfig
    from zerokit.integrations.hf_trainer import zero_trainer_class

    accum = 2
    args = SFTConfig(
        output_dir=out,
        per_device_train_batch_size=12 // (world * accum),
        gradient_accumulation_steps=accum,
        max_steps=4,
        learning_rate=3e-3,
        warmup_steps=1,
        max_grad_norm=0.3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        max_length=32,
        dataset_num_proc=None,
        bf16=False,
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=2,
    )
    kwargs = {}
    cls = SFTTrainer
    if opts.get("level"):
        cls = zero_trainer_class(SFTTrainer)
        kwargs["sharding"] = ShardingConfig(level=opts["level"])
    trainer = cls(
        model=tiny_llama(),
        args=args,
        train_dataset=chat_dataset(48, 1),
        eval_dataset=chat_dataset(12, 2),
        processing_class=tiny_tokenizer(),
        **kwargs,
    )
    trainer.train()
    trainer.save_model(opts.get("export_to") or os.path.join(out, "model"))
    write_logs(trainer, out)


def sft_rank(rank: int, world: int, opts: dict, out: str) -> None:
    rank_env(rank, world)
    sft(world, opts, out)


def sft_reference(out: str) -> None:
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    try:
        sft(1, {}, out)
    finally:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
