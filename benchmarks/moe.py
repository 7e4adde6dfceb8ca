"""Expert parallelism against dense ZeRO-3: bytes per step and memory per rank, side by side.

Two tiny MoE models (--models), each with --experts experts, top-2, --layers blocks, hidden
--hidden and experts' intermediate 2 x --hidden: zerokit's own GPT (``GPTConfig(n_experts=,
top_k=2)``, its experts 3-D as Hugging Face's) and a Hugging Face Mixtral built from a config.
At --nproc ranks (gloo, CPU), level 'p_g_os' for the dense parts in every run: "dense"
shards the experts like any parameter over all ranks (every rank gathers every expert of a
layer to run a few of them); "ep N" splits each layer's experts over N ranks (tokens
exchanged by all-to-all) and shards them over the nproc / N ranks holding the same experts.

Per rank, on the last of --steps AdamW steps (the first is a warm-up): the bytes this rank
sends, by kind (parameter all-gathers, gradient reduce-scatters and the tokens' all-to-all;
gloo's: a ring all-gather sends (N-1) chunks, the reduce-scatter one chunk to each peer, the
all-to-all every row bound elsewhere); the parameter, gradient and optimizer bytes it holds
between steps (zerokit.memory.measure: about the same at every ep, for ZeRO-3 already splits
every parameter over all ranks); the peak of the steps after the warm-up above what the rank
held before them (zerokit.memory.PeakMemory: the process's resident high-water mark on CPU,
so it counts allocator slack too); the largest unit it gathers at once (a dense run's MoE
layer holds all of its experts; with ep its experts are a unit of E / ep experts); and the
median step time. Ratios are against dense, same model, same run. Step times on a shared
CPU are noisy: the bytes and memory are the measurement.

    python benchmarks/moe.py                 # 4 ranks: GPT-MoE and Mixtral, dense, ep 2, ep 4
    python benchmarks/moe.py --models gpt --experts 16 --hidden 128
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import zerokit
from zerokit.memory import PeakMemory, measure
from zerokit.models import GPT, GPTConfig
from zerokit.models.gpt import lm_loss
from zerokit.moe import apply_expert_parallel, init_expert_groups
from zerokit.tools.launch import spawn_local

_KIND = {
    "all_gather": "gather",
    "all_gather_into_tensor": "gather",
    "broadcast": "gather",  # gloo's all-gather: each rank broadcasts its chunk
    "isend": "reduce",
    "all_reduce": "reduce",
    "all_to_all_single": "all-to-all",
}


class Counting:
    """``torch.distributed``'s entry points wrapped while ``on``: bytes sent, by kind."""

    def __init__(self):
        self.sent = collections.Counter()
        self.on = False
        for name in _KIND:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name, fn):
        def counted(first, *args, **kwargs):
            if self.on:
                self.sent[_KIND[name]] += _bytes_sent(name, first, args, kwargs)
            return fn(first, *args, **kwargs)

        return counted


def _bytes_sent(name, first, args, kwargs) -> int:
    group = kwargs.get("group") or dist.group.WORLD
    n = group.size()
    if name == "all_to_all_single":  # (out, in, out_splits, in_splits): rows bound elsewhere
        sent, splits = args[0], args[2]
        row = sent[0].numel() * sent.element_size() if sent.shape[0] else 0
        return row * (sum(splits) - splits[group.rank()])
    if name == "all_gather":  # (list, own chunk): the ring passes n - 1 chunks on
        chunk = args[0]
        return chunk.numel() * chunk.element_size() * (n - 1)
    if name == "all_gather_into_tensor":
        return args[0].numel() * args[0].element_size() * (n - 1)
    if name == "broadcast":  # counted at its source: sent to the n - 1 others
        if kwargs.get("group_src", 0) != group.rank():
            return 0
        return first.numel() * first.element_size() * (n - 1)
    if name == "all_reduce":
        return first.numel() * first.element_size() * 2 * (n - 1) // n
    return first.numel() * first.element_size()  # isend: one reduce-scatter chunk


def _gpt(args):
    config = GPTConfig(
        vocab_size=256, block_size=64, n_layer=args.layers, n_head=4, n_embd=args.hidden,
        n_experts=args.experts, top_k=2, expert_dim=2 * args.hidden,
    )  # fmt: skip
    torch.manual_seed(0)
    return GPT(config)


def _loss(name, model, tokens):
    if name == "gpt":
        return lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    return model(input_ids=tokens, labels=tokens).loss


def _mixtral(args):
    import transformers as tf

    config = tf.MixtralConfig(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=args.experts, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return tf.MixtralForCausalLM(config)


def _run(rank, world, name, ep, args, counting):
    """One (model, ep) run in fresh processes: the peak is then this run's alone."""
    model = _gpt(args) if name == "gpt" else _mixtral(args)
    if ep > 1:
        apply_expert_parallel(model, init_expert_groups(ep))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, "p_g_os")
    gen = torch.Generator().manual_seed(rank)
    times, last = [], args.steps - 1
    peak = PeakMemory()
    peak.start()  # after wrapping: what the steps add (activations, gathers, state, slack)
    for step in range(args.steps):
        tokens = torch.randint(0, 256, (args.batch, args.seq), generator=gen)
        counting.sent.clear()
        counting.on = step == last
        dist.barrier()
        start = time.perf_counter()
        _loss(name, model, tokens).backward()
        seconds = time.perf_counter() - start
        counting.on = False
        if step == last:  # gradients and optimizer state held as the step uses them
            held = measure(model, opt)
        start = time.perf_counter()
        opt.step()
        opt.zero_grad()
        times.append(seconds + time.perf_counter() - start)
    state = zerokit.core.state_of(model)
    largest = max(sum(b.layout.padded_numel * 4 for b in g.buckets) for g in state.groups)
    return {
        "sent": dict(counting.sent), "params": held.params, "grads": held.grads,
        "optimizer": held.optimizer, "peak": peak.read(), "unit": largest,
        "seconds": statistics.median(times[1:] or times),
    }  # fmt: skip


def worker(rank, world, name, ep, args, out):
    result = _run(rank, world, name, ep, args, Counting())
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def _print(name, rows, world, args):
    mib = 2**20
    title = {"gpt": "zerokit GPT-MoE", "mixtral": "HF Mixtral"}[name]
    print(
        f"\n{title}: hidden {args.hidden}, {args.experts} experts (top-2), {args.layers} "
        f"layers, {world} ranks, batch {args.batch} x {args.seq} per rank; rank 0, last step"
    )
    head = f"{'run':<7}{'gather':>8}{'reduce':>8}{'all2all':>8}{'sent MiB':>9}{'x dense':>8}"
    head += f"{'params':>8}{'grads':>8}{'optim':>8}{'peak MiB':>9}{'x dense':>8}"
    head += f"{'unit MiB':>9}{'x dense':>8}{'step ms':>8}{'x dense':>8}"
    print(head)
    base = None
    for label, r in rows:
        sent = r["sent"]
        total = sum(sent.values()) / mib
        peak, unit, seconds = max(r["peak"], 1), r["unit"], r["seconds"]
        base = base or (total, peak, unit, seconds)
        print(
            f"{label:<7}{sent.get('gather', 0) / mib:>8.3f}{sent.get('reduce', 0) / mib:>8.3f}"
            f"{sent.get('all-to-all', 0) / mib:>8.3f}{total:>9.3f}{total / base[0]:>8.2f}"
            f"{r['params'] / mib:>8.3f}{r['grads'] / mib:>8.3f}{r['optimizer'] / mib:>8.3f}"
            f"{peak / mib:>9.2f}{peak / base[1]:>8.2f}"
            f"{unit / mib:>9.3f}{unit / base[2]:>8.2f}"
            f"{seconds * 1e3:>8.1f}{seconds / base[3]:>8.2f}"
        )
    print(
        "params/grads/optim: MiB held per rank after the last backward; peak: the resident "
        "high-water mark of the steps above the wrapped model's (allocator slack included)"
    )


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the docstring's layout and shows every default."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--nproc", type=int, default=4, help="ranks to start")
    p.add_argument(
        "--models", default="gpt,mixtral", help="comma-separated: gpt (zerokit's), mixtral (HF)"
    )
    p.add_argument("--hidden", type=int, default=64, help="hidden size (experts' is twice)")
    p.add_argument("--experts", type=int, default=8, help="experts per MoE layer")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=4, help="steps per run (the first warms up)")
    args = p.parse_args()
    unknown = set(args.models.split(",")) - {"gpt", "mixtral"}
    if unknown:
        p.error(f"--models takes gpt and/or mixtral, comma-separated; not {sorted(unknown)}")
    with tempfile.TemporaryDirectory(prefix="zerokit-moe-") as tmp:
        out = os.path.join(tmp, "rank0.json")
        for name in args.models.split(","):
            rows = []
            for ep in [1] + [e for e in (2, 4) if args.nproc % e == 0 and e <= args.nproc]:
                if ep > 1 and args.experts % ep:
                    continue
                spawn_local(worker, args.nproc, name, ep, args, out)  # fresh ranks per run
                with open(out) as f:
                    rows.append(("dense" if ep == 1 else f"ep {ep}", json.load(f)))
            _print(name, rows, args.nproc, args)


if __name__ == "__main__":
    main()
