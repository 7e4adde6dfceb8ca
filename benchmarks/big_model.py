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
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import re
import tempfile
import time

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import zerokit
from zerokit.checkpoint import pretrained
from zerokit.launch import _entry
from zerokit.models.gpt import GPT, GPTConfig

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
    args = parser.parse_args()
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
