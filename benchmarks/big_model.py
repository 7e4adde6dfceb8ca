"""Models that do not fit one rank: build + wrap memory, meta vs eager; and load_pretrained.

Per rank, in one table: the peak RSS growth while building the GPT and wrapping it at
'p_g_os' (``/proc/self/status`` VmHWM, reset with ``clear_refs`` just before the build), built
eagerly or on ``meta`` (``init_fn=None``: each module's ``reset_parameters``); then the time
and bytes one ``load_pretrained`` reads per rank from a plain safetensors file of the same
model, against every rank reading the whole file (what a load that does not know its shards
does). The GPT
has d_model 512 and vocabulary 8192, as in benchmarks/capacity.py, whose cap is 1024 MiB per
rank: the default 80 layers (about 1000 MiB of fp32 parameters) cannot be built eagerly
under it.

    python benchmarks/big_model.py                        # 2 and 4 ranks, 80 layers
    python benchmarks/big_model.py --ranks 2 --layers 20  # quicker

The file is written once to a temporary directory (so it is in the page cache: the times are
those of memory copies, the bytes are what a rank asks the file for).

``--capacity``: the largest GPT that builds from ``meta`` and trains when model states are the
limit. Every block is recomputed in backward (``GPTConfig(recompute="full")``:
``torch.utils.checkpoint``, non-reentrant), so activations are small; each rank runs in a memory
cgroup of its own (benchmarks/capacity.py's); the number of blocks (d_model 512 fixed) is
bisected per runner and per malloc setting, a trial passing if every rank builds on meta,
wraps, initialises (each module's ``reset_parameters``) and trains ``--steps`` AdamW steps.
Runners: FSDP2 (``fully_shard`` per block and the root on the meta model, ``to_empty``, the same
initialisation), zerokit ``'p_g_os'`` (``init_fn=None``) and ``'p_g_os_sib'`` (with
``step_in_backward``).

    python benchmarks/big_model.py --capacity          # 4 ranks, 1024 MiB each, both mallocs
    python benchmarks/big_model.py --capacity --malloc mmap --trace 70   # where the bytes go
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import re
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from capacity import Cgroups, bisect, run_trial, train_trial  # benchmarks/ siblings
from safetensors.torch import save_file
from torch.distributed.fsdp import fully_shard

import zerokit
from zerokit.checkpoint import pretrained
from zerokit.meta_init import reset_parameters
from zerokit.models.gpt import GPT, GPTConfig
from zerokit.tools.launch import _entry

MIB = 2**20


def config(n_layer: int) -> GPTConfig:
    return GPTConfig(vocab_size=8192, block_size=128, n_layer=n_layer, n_head=8, n_embd=512)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024


def _build_and_wrap(rank: int, world_size: int, n_layer: int, how: str, path: str, out) -> None:
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # freed blocks go back to the OS
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM starts again from here
    torch.manual_seed(0)
    if how == "eager":
        model = GPT(config(n_layer))
    else:
        with torch.device("meta"):
            model = GPT(config(n_layer))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    start = time.perf_counter()
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, "p_g_os")
    wrap_s = time.perf_counter() - start
    row = {"peak": _status("VmHWM") - before, "wrap_s": wrap_s}
    if how == "meta":
        read = []
        original = pretrained._Sources.read

        def counting(self, name, lo, hi):
            values = original(self, name, lo, hi)
            read.append(values.numel() * values.element_size())
            return values

        pretrained._Sources.read = counting
        dist.barrier()
        before = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        start = time.perf_counter()
        zerokit.checkpoint.load_pretrained(model, path)
        row.update(
            load_s=time.perf_counter() - start,
            read=sum(read),
            load_peak=_status("VmHWM") - before,
        )
        dist.barrier()  # the naive way, for comparison: every rank reads the whole file
        start = time.perf_counter()
        with open(path, "rb") as f:
            while f.read(64 * MIB):
                pass
        row["whole_s"] = time.perf_counter() - start
    rows = [None] * world_size
    dist.all_gather_object(rows, row)
    if rank == 0:
        out.put(rows)


def run(n_ranks: int, n_layer: int, how: str, path: str) -> list[dict]:
    out = mp.get_context("fork").SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "rendezvous")
        torch.multiprocessing.start_processes(
            _entry,
            args=(n_ranks, init, "gloo", _build_and_wrap, (n_layer, how, path, out)),
            nprocs=n_ranks,
            start_method="fork",
        )
    return out.get()


# -- --capacity: the largest GPT that builds from meta and trains under a cap --------------------
CAPACITY_RUNNERS = ("fsdp2", "p_g_os", "p_g_os_sib", "p_g_os_adamw8bit", "p_g_os_adamw4bit")
# "p_g_os_adamw8bit" / "_adamw4bit": 'p_g_os' with torchao's low-bit AdamW (benchmarks/optimizers.py);
# asked for by name only: their first step compiles torchao's update inside each capped rank
DEFAULT_RUNNERS = ("fsdp2", "p_g_os", "p_g_os_sib")


def build_from_meta(runner: str, model: GPT, bucket_elems: int):
    """``runner``'s model and AdamW from a GPT whose parameters are all on meta, initialised by
    each module's ``reset_parameters`` (zerokit's ``init_fn=None``) without ever holding it
    whole."""
    if runner == "fsdp2":  # as torchtitan: shard on meta, then storage for the shards only
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.apply(reset_parameters)
        if model.cfg.tie_weights and model.lm_head.weight is not model.wte.weight:
            raise RuntimeError("to_empty untied the embedding and the head")
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if runner in ("p_g_os_adamw8bit", "p_g_os_adamw4bit"):
        from torchao.optim import AdamW4bit, AdamW8bit

        low_bit = AdamW8bit if runner.endswith("8bit") else AdamW4bit
        opt = low_bit(model.parameters(), lr=1e-4)
    sib = runner == "p_g_os_sib"
    model, opt, _ = zerokit.group_sharded_parallel(
        model, opt, "p_g_os", buffer_max_size=bucket_elems, step_in_backward=sib
    )
    return model, opt


def capacity_worker(spec: dict) -> None:
    """One rank of a --capacity trial (started by capacity.run_trial in its own cgroup)."""

    def make(spec: dict):
        cfg = replace(config(spec["n_layer"]), recompute="full")
        with torch.device("meta"):
            model = GPT(cfg)
        model, opt = build_from_meta(spec["runner"], model, spec["bucket_elems"])
        return model, opt, cfg, spec["seq"]

    train_trial(spec, make)


def capacity(args) -> None:
    runners, mallocs = args.runners.split(","), args.malloc.split(",")
    if set(runners) - set(CAPACITY_RUNNERS) or set(mallocs) - {"default", "mmap"}:
        sys.exit(f"--runners: choose from {', '.join(CAPACITY_RUNNERS)}; --malloc: default,mmap")
    cg, reason = Cgroups.find() if args.cap_mib else (None, "uncapped")
    if cg is None and args.cap_mib:
        print(f"capacity: cannot run: {reason}")
        return
    print(
        f"GPT d_model 512, vocab 8192, every block recomputed in backward, built on meta; seq "
        f"{args.seq}, global batch {args.batch}, AdamW fp32, {args.steps} steps; {args.nproc} "
        f"ranks, {args.cap_mib} MiB each ({reason})",
        flush=True,
    )
    script, results = str(Path(__file__).resolve()), {}
    try:
        for malloc in mallocs:
            trial_args = argparse.Namespace(**{**vars(args), "malloc": malloc})
            if args.trace is not None:  # one trial per runner, rank 0 printing its memory
                for r in runners:
                    t = run_trial(cg, trial_args, r, args.trace, trace=True, script=script)
                    print(f"{r} malloc {malloc}: {t['status']}, peak {t['peak_mib']:.1f} MiB\n")
                continue
            print(f"malloc {malloc}:", flush=True)
            results[malloc] = {r: bisect(cg, trial_args, r, script) for r in runners}
    finally:
        if cg is not None:
            cg.close()
    if results:
        print_capacity(results, args.max_layers)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


def print_capacity(results: dict, max_layers: int) -> None:
    """One row per runner, each malloc setting's columns side by side."""
    mallocs = list(results)
    head = "".join(
        f"{'n_layer':>9}{'params M':>10}{'vs fsdp2':>9}{'peak MiB':>10}" for _ in mallocs
    )
    print(f"{'':<12}" + "".join(f"{'malloc ' + m:^38}" for m in mallocs))
    print(f"{'runner':<12}{head}")
    for r in next(iter(results.values())):
        line = f"{r:<12}"
        for m in mallocs:
            res, ref = results[m][r], results[m].get("fsdp2", {})
            if res["n_layer"] is None:
                line += f"{'error':>9}{'':>29}"
                continue
            ratio = "-"
            if res["params"] and ref.get("params"):
                ratio = f"{res['params'] / ref['params']:.2f}x"
            layers = f"{res['n_layer']}{'+' if res['n_layer'] == max_layers else ''}"
            peak = f"{res['peak_mib']:.1f}" if res["peak_mib"] else "-"
            line += f"{layers:>9}{res['params'] / 1e6:>10.1f}{ratio:>9}{peak:>10}"
        print(line)
    print("peak MiB: the most a rank's cgroup was charged in the largest passing trial; "
          "n_layer+: passed at --max-layers")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=type(
            "HelpFormatter",
            (argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter),
            {},
        ),
    )
    parser.add_argument("--ranks", default="2,4", help="world sizes to measure, comma-separated")
    parser.add_argument("--layers", type=int, default=80, help="GPT blocks (d_model 512)")
    cap = parser.add_argument_group("--capacity (see above)")
    cap.add_argument("--capacity", action="store_true", help="the capacity mode, not the above")
    cap.add_argument("--cap-mib", type=int, default=1024, help="memory limit per rank, MiB")
    cap.add_argument("--nproc", type=int, default=4, help="ranks (each in a cgroup of its own)")
    cap.add_argument(
        "--runners",
        default=",".join(DEFAULT_RUNNERS),
        help=f"comma-separated, of {', '.join(CAPACITY_RUNNERS)}",
    )
    cap.add_argument("--malloc", default="default,mmap", help="glibc default and/or mmap: "
                     "MALLOC_MMAP_THRESHOLD_=131072 (freed memory goes back to the OS)")  # fmt: skip
    cap.add_argument("--min-layers", type=int, default=40, help="smallest n_layer tried")
    cap.add_argument("--max-layers", type=int, default=120, help="largest n_layer tried")
    cap.add_argument("--seq", type=int, default=32, help="tokens per sequence (at most 128)")
    cap.add_argument("--batch", type=int, default=4, help="global batch, sequences")
    cap.add_argument("--steps", type=int, default=2, help="training steps a trial must finish")
    cap.add_argument("--bucket-elems", type=int, default=2**21, help="zerokit buffer_max_size")
    cap.add_argument("--timeout", type=int, default=300, help="seconds before a trial is killed")
    cap.add_argument("--trace", type=int, metavar="N_LAYER", help="one trial per runner, rank 0 "
                     "printing its memory at each phase (with --cap-mib 0: uncapped)")  # fmt: skip
    cap.add_argument("--json", metavar="PATH", help="also write every trial to this JSON file")
    cap.add_argument("--worker", metavar="JSON", help="internal: run one rank of a trial")
    args = parser.parse_args()
    if args.worker:
        return capacity_worker(json.loads(args.worker))
    if args.capacity:
        if not 1 <= args.min_layers <= args.max_layers:
            parser.error("need 1 <= --min-layers <= --max-layers")
        return capacity(args)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in GPT(config(args.layers)).parameters())
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        torch.manual_seed(0)
        plain = GPT(config(args.layers))
        tensors = dict(plain.named_parameters()) | dict(plain.named_buffers())  # ties once
        save_file({k: v.detach() for k, v in tensors.items()}, path)
        del plain, tensors
        size = os.path.getsize(path)
        print(
            f"GPT {args.layers} layers, {n_params / 1e6:.0f}M parameters "
            f"({n_params * 4 / MIB:.0f} MiB fp32); file {size / MIB:.0f} MiB"
        )
        print(f"{'ranks':>5} {'build':>5} {'peak MiB/rank':>13} {'wrap s':>7} {'load s':>7} "
              f"{'read MiB/rank':>13} {'load peak MiB':>13} {'whole file s':>12}")  # fmt: skip
        for n in [int(r) for r in args.ranks.split(",")]:
            for how in ("eager", "meta"):
                rows = run(n, args.layers, how, path)
                peak = max(r["peak"] for r in rows) / MIB
                wrap = max(r["wrap_s"] for r in rows)
                load = f"{max(r['load_s'] for r in rows):7.2f}" if how == "meta" else f"{'-':>7}"
                read = lpeak = f"{'-':>13}"
                whole = f"{'-':>12}"
                if how == "meta":
                    read = f"{max(r['read'] for r in rows) / MIB:13.1f}"
                    lpeak = f"{max(r['load_peak'] for r in rows) / MIB:13.0f}"
                    whole = f"{max(r['whole_s'] for r in rows):12.2f}"
                line = f"{n:>5} {how:>5} {peak:13.0f} {wrap:7.2f} {load} {read} {lpeak} {whole}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
