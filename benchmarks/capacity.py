"""Capacity: the largest GPT each runner can train with a fixed memory budget per rank.

Each rank runs in a memory cgroup of its own (v2 if writable, else v1; no swap), so the kernel
kills a rank that goes over the budget. Per runner, the number of GPT blocks is bisected: a
trial builds the model, wraps it and trains 3 AdamW steps, and passes if every rank finishes.
Runners are benchmarks/step_time.py's (torch DDP, ZeroRedundancyOptimizer, FSDP2 per block plus
the root, zerokit's levels, and 'os_g_sib' / 'p_g_os_sib': those levels with step_in_backward);
each builds the model once and converts it in place. The GPT has d_model 512, vocabulary 8192,
sequences of 128 tokens, global batch 4.

    python benchmarks/capacity.py                   # 2 ranks, 1024 MiB each
    python benchmarks/capacity.py --malloc mmap     # MALLOC_MMAP_THRESHOLD_=131072 in the ranks
    python benchmarks/capacity.py --trace 20 --runners fsdp2,p_g_os   # where the bytes go

Where memory cgroups are missing or not writable it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from step_time import STEP_IN_BACKWARD, build, train_step  # the step-time benchmark's runners

from zerokit.core import state_of
from zerokit.models.gpt import GPT, GPTConfig, lm_loss, synthetic_batch

RUNNERS = ("ddp", "zero_redundancy", "fsdp2", "os", "os_g", "p_g_os", *STEP_IN_BACKWARD)
MIB = 2**20


def gpt_config(n_layer: int) -> GPTConfig:
    return GPTConfig(vocab_size=8192, block_size=128, n_layer=n_layer, n_head=8, n_embd=512)


def count_params(n_layer: int) -> int:
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        return sum(p.numel() for p in GPT(gpt_config(n_layer)).parameters())


# -- memory cgroups ------------------------------------------------------------------------------
# per cgroup version: the limit, the swap limit, the OOM-kill counter, the peak charge
FILES = {
    2: "memory.max memory.swap.max memory.events memory.peak".split(),
    1: "memory.limit_in_bytes memory.memsw.limit_in_bytes memory.oom_control "
    "memory.max_usage_in_bytes".split(),
}


class Cgroups:
    """Child memory cgroups (one per rank of a trial) under a directory of our own."""

    def __init__(self, base: Path, version: int):
        self.base, self.version = base, version
        self.limit, self.swap, self.events, self.peak_file = FILES[version]

    @classmethod
    def find(cls) -> tuple[Cgroups | None, str]:
        """A writable memory hierarchy, or None and the reason."""
        if os.geteuid() != 0:
            return None, "memory cgroups need root, and this process is not root"
        if "memory" in _read(Path("/sys/fs/cgroup/cgroup.subtree_control")).split():
            parent, version = Path("/sys/fs/cgroup"), 2
        else:
            mounts = [ln.split() for ln in _read(Path("/proc/self/mounts")).splitlines()]
            v1 = [m[1] for m in mounts if m[2] == "cgroup" and "memory" in m[3].split(",")]
            if not v1:
                return None, "no memory cgroup controller is mounted (neither v2 nor v1)"
            own = re.search(r"^\d+:memory:(.*)$", _read(Path("/proc/self/cgroup")), re.M)
            parent = Path(v1[0] + own[1]) if own else Path(v1[0])  # nest under our own cgroup
            parent = parent if parent.is_dir() else Path(v1[0])
            version = 1
        cg = cls(parent / f"zerokit-capacity-{os.getpid()}", version)
        try:  # prove it works: a limited child can be made and removed
            cg.base.mkdir()
            cg.create("probe", 64 * MIB)
            cg.remove("probe")
        except OSError as e:
            cg.close()
            return None, f"cannot create a limited memory cgroup under {parent} (v{version}): {e}"
        return cg, f"cgroup v{version} under {parent}"

    def create(self, name: str, limit: int) -> Path:
        path = self.base / name
        path.mkdir()
        (path / self.limit).write_text(str(limit))
        with contextlib.suppress(OSError):  # absent where the kernel accounts no swap
            (path / self.swap).write_text("0" if self.version == 2 else str(limit))
        return path

    def oom_kills(self, name: str) -> int:
        fields = dict(ln.split() for ln in _read(self.base / name / self.events).splitlines())
        return int(fields.get("oom_kill", 0))

    def peak(self, name: str) -> int:
        return int(_read(self.base / name / self.peak_file) or 0)

    def remove(self, name: str) -> None:
        """Kill what is left in it (only ranks this script started), then remove it."""
        path = self.base / name
        for _ in range(50):
            pids = _read(path / "cgroup.procs").split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            with contextlib.suppress(OSError):
                if not pids:
                    path.rmdir()
            if not path.exists():
                return
            time.sleep(0.1)
        print(f"warning: could not remove {path}", file=sys.stderr)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.base.rmdir()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


# -- one trial: every rank in its own capped cgroup ----------------------------------------------
def run_trial(
    cg: Cgroups | None, args, runner: str, n_layer: int, trace: bool = False, script: str = __file__
) -> dict:
    """Start the ranks, wait for all of them, say what happened (cg None: no cap). Each rank is
    ``script --worker SPEC`` (another benchmark can run its own ranks under the same caps)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if args.malloc == "mmap":
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"  # freed blocks over 128 KiB go back to the OS
    names = [f"{runner}-{n_layer}-rank{r}" for r in range(args.nproc)] if cg else []
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zerokit-capacity-") as tmp:
        init = f"file://{tmp}/rendezvous"
        spec = {**vars(args), "runner": runner, "n_layer": n_layer, "trace": trace, "init": init}
        procs, logs = [], [Path(tmp, f"rank{r}.log") for r in range(args.nproc)]
        for rank, log in enumerate(logs):
            cmd = [sys.executable, script, "--worker", json.dumps({**spec, "rank": rank})]
            if cg is not None:  # the shell joins the cgroup, then becomes Python: all is charged
                procs_file = cg.create(names[rank], args.cap_mib * MIB) / "cgroup.procs"
                cmd = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs_file), *cmd]
            with log.open("w") as out:  # a session of its own: killpg() reaches all of it
                procs.append(
                    subprocess.Popen(cmd, env=env, stdout=out, stderr=out, start_new_session=True)
                )
        timed_out = _wait_all(procs, start + args.timeout)
        oom = sum(cg.oom_kills(n) for n in names) if cg else 0
        peak = max(cg.peak(n) for n in names) if cg else 0
        for name in names:
            cg.remove(name)
        output = [log.read_text() for log in logs]
    codes = [p.returncode for p in procs]
    ok = all(c == 0 for c in codes) and not oom and not timed_out
    status = "pass" if ok else "oom" if oom else "timeout" if timed_out else f"error {codes}"
    if trace or status.startswith("error"):  # rank 0's output whole, the others' ends
        others = [f"-- rank {r}:\n{out[-800:]}" for r, out in enumerate(output) if r and out]
        print(output[0] + "".join(others))
    seconds = round(time.monotonic() - start, 1)
    return {"n_layer": n_layer, "status": status, "peak_mib": peak / MIB, "seconds": seconds}


def _wait_all(procs: list[subprocess.Popen], deadline: float) -> bool:
    """Wait for every rank. Once one fails or time is up, kill every rank's process group: a rank
    blocked in a collective with a dead peer would otherwise wait for gloo's timeout."""
    while any(p.poll() is None for p in procs):
        timed_out = time.monotonic() > deadline
        if timed_out or any(p.returncode not in (None, 0) for p in procs):
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            return timed_out
        time.sleep(0.2)
    return False


def bisect(cg: Cgroups, args, runner: str, script: str = __file__) -> dict:
    """The largest n_layer in [--min-layers, --max-layers] that passes (passing is taken as
    monotonic; below --min-layers nothing is tried, and a runner that fails there reports 0)."""
    lo, hi, trials = args.min_layers - 1, args.max_layers + 1, []  # lo passed or untried
    while hi - lo > 1:
        trial = run_trial(cg, args, runner, (lo + hi) // 2, script=script)
        trials.append(trial)
        print(
            f"  {runner:<16} n_layer {trial['n_layer']:>3}: {trial['status']:<7} peak "
            f"{trial['peak_mib']:7.1f} MiB {trial['seconds']:7.1f} s",
            flush=True,
        )
        if trial["status"].startswith("error"):  # not the limit: a bug, not a bisection step
            return {"n_layer": None, "trials": trials}
        lo, hi = (trial["n_layer"], hi) if trial["status"] == "pass" else (lo, trial["n_layer"])
    if lo == args.min_layers - 1:  # not even --min-layers passed: nothing is known to train
        lo = 0
    peak = next((t["peak_mib"] for t in trials if t["n_layer"] == lo), None)
    params = count_params(lo) if lo else 0
    return {"n_layer": lo, "params": params, "peak_mib": peak, "trials": trials}


def print_table(results: dict, max_layers: int) -> None:
    def ratio(r: str, ref: str) -> str:
        a, b = results[r].get("params"), results.get(ref, {}).get("params")
        return f"{a / b:.2f}x" if a and b else "-"

    print(
        f"{'runner':<16}{'n_layer':>8}{'params M':>10}{'vs ddp':>8}{'vs fsdp2':>9}{'peak MiB':>10}"
    )
    for r, res in results.items():
        if res["n_layer"] is None:
            print(f"{r:<16}{'error':>8}")
            continue
        layers = f"{res['n_layer']}{'+' if res['n_layer'] == max_layers else ''}"
        peak = f"{res['peak_mib']:.1f}" if res["peak_mib"] else "-"
        print(
            f"{r:<16}{layers:>8}{res['params'] / 1e6:>10.1f}{ratio(r, 'ddp'):>8}"
            f"{ratio(r, 'fsdp2'):>9}{peak:>10}"
        )
    print(
        "peak MiB: the most a rank's cgroup was charged in the largest passing trial; "
        "n_layer+: passed at --max-layers"
    )


# -- inside a rank -------------------------------------------------------------------------------
def worker(spec: dict) -> None:
    def make(spec: dict):
        cfg = gpt_config(spec["n_layer"])
        # built once and converted in place, as a user builds the model they wrap: a second
        # copy (the step-time benchmark's deep copy) would make the build, not training, the limit
        model, opt = build(spec["runner"], GPT(cfg), 1e-4, spec["bucket_elems"], copy_model=False)
        return model, opt, cfg, cfg.block_size

    train_trial(spec, make)


def train_trial(spec: dict, make) -> None:
    """One rank of a trial: join the group, seed, ``make(spec) -> (model, optimizer, cfg,
    seq)``, train ``spec["steps"]`` steps (rank 0 tracing them with ``--trace``), and print the
    final loss on rank 0. benchmarks/big_model.py's capacity mode runs its trials here too."""
    rank, n = spec["rank"], spec["nproc"]
    torch.set_num_threads(1)
    wait = timedelta(seconds=spec["timeout"])
    dist.init_process_group("gloo", init_method=spec["init"], rank=rank, world_size=n, timeout=wait)
    torch.manual_seed(0)
    model, opt, cfg, seq = make(spec)
    x, y = synthetic_batch(cfg.vocab_size, spec["batch"] // n, seq, rank)
    trace = Trace(model, opt) if spec["trace"] and rank == 0 else None
    for step in range(1, spec["steps"] + 1):
        loss = trace.train_step(step, x, y) if trace else train_step(model, opt, x, y)
    if rank == 0:
        print(f"{spec['runner']} n_layer {cfg.n_layer}: final loss {loss:.4f}", flush=True)
    dist.destroy_process_group()


class Trace:
    """--trace: rank 0 prints its memory (MiB) at each phase of a step. rss: resident now; anon:
    the part of it that is not file-backed (what a memory cgroup is charged for, once the
    libraries' pages are cached); hwm: the most resident since the line before (VmHWM, reset at
    every line); params, grads, optim:
    what the runner holds, each storage once (zerokit: held_tensors(); FSDP2: local shards);
    activ: what autograd saved for backward, parameters excluded; staging: zerokit's staging
    pool now, then its peak in this backward; gathered: stage 3 full parameters now."""

    def __init__(self, model, opt):
        self.model, self.opt, self.step, self.saved = model, opt, 0, {}
        print(
            f"{'step':>4} {'phase':<16}{'rss':>7}{'anon':>7}{'hwm':>7}{'params':>7}{'grads':>7}"
            f"{'optim':>7}{'activ':>7}{'staging':>8}{'(peak)':>7}{'gathered':>9}"
        )
        for k, block in enumerate(getattr(model, "module", model).blocks):
            block.register_forward_hook(lambda m, a, out, k=k: self._at_backward(out, k))
        self.line("built")

    def _at_backward(self, out: torch.Tensor, k: int) -> None:
        if out.requires_grad:  # its gradient arrives as the block's backward starts
            out.register_hook(lambda grad: self.line(f"backward blk {k}"))

    def train_step(self, step: int, x: torch.Tensor, y: torch.Tensor) -> float:
        self.step, self.saved = step, {}
        with torch.autograd.graph.saved_tensors_hooks(self._saved, lambda t: t):
            loss = lm_loss(self.model(x), y)
        self.line("after forward")
        loss.backward()
        self.saved = {}
        self.line("after backward")
        self.opt.step()
        self.line("after step")
        self.opt.zero_grad(set_to_none=True)
        self.line("after zero_grad")
        return loss.item()

    def _saved(self, t: torch.Tensor) -> torch.Tensor:
        params = {_local(p).untyped_storage().data_ptr() for p in self.model.parameters()}
        if t.untyped_storage().data_ptr() not in params:
            self.saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def line(self, phase: str) -> None:
        status = dict(ln.split(":", 1) for ln in Path("/proc/self/status").read_text().splitlines())
        rss, anon, hwm = (int(status[k].split()[0]) * 1024 for k in ("VmRSS", "RssAnon", "VmHWM"))
        Path("/proc/self/clear_refs").write_text("5")  # the next hwm: this interval's peak
        state = state_of(self.model)
        if state is not None:
            held = state.held_tensors()
            params, grads, staging = held["params"], held["grads"], held["staging"]
        else:
            params, staging = list(self.model.parameters()), []
            grads = [p.grad for p in params if p.grad is not None]
        inner = getattr(self.opt, "optim", self.opt)  # ZeroRedundancyOptimizer: its shard's
        optim = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
        held = [_bytes(params), _bytes(grads), _bytes(optim), sum(self.saved.values())]
        core = (
            [_bytes(staging), state.staging.peak_bytes, state.gathered_numel() * 4] if state else []
        )
        values = [rss, anon, hwm, *held, *(core or [0, 0, 0])]  # gathered: fp32 elements here
        print(
            f"{self.step:>4} {phase:<16}" + "".join(f"{v / MIB:7.1f}" for v in values), flush=True
        )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # FSDP2's DTensor: this rank's shard


def _bytes(tensors) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in map(_local, tensors)}
    return sum(s.nbytes() for s in storages.values())


# -- the command ---------------------------------------------------------------------------------
MALLOC_HELP = "mmap: MALLOC_MMAP_THRESHOLD_=131072 in the ranks (freed memory goes to the OS)"
TRACE_HELP = "instead of bisecting, one trial per runner at N_LAYER, rank 0 printing its memory "
TRACE_HELP += "at each phase of a step (with --cap-mib 0: uncapped)"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the docstring's layout and shows every default."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--cap-mib", type=int, default=1024, help="memory limit per rank, MiB")
    p.add_argument("--nproc", type=int, default=2, help="ranks (each in a cgroup of its own)")
    p.add_argument("--runners", default=",".join(RUNNERS), help="comma-separated runners")
    p.add_argument("--min-layers", type=int, default=1, help="smallest n_layer tried")
    p.add_argument("--max-layers", type=int, default=48, help="largest n_layer tried")
    p.add_argument("--malloc", choices=["default", "mmap"], default="default", help=MALLOC_HELP)
    p.add_argument("--json", metavar="PATH", help="also write every trial to this JSON file")
    p.add_argument("--batch", type=int, default=4, help="global batch, sequences of 128 tokens")
    p.add_argument("--steps", type=int, default=3, help="training steps a trial must finish")
    p.add_argument("--bucket-elems", type=int, default=2**21, help="zerokit buffer_max_size")
    p.add_argument("--timeout", type=int, default=600, help="seconds before a trial is killed")
    p.add_argument("--trace", type=int, metavar="N_LAYER", help=TRACE_HELP)
    p.add_argument("--worker", metavar="JSON", help="internal: run one rank of a trial")
    args = p.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    if not 1 <= args.min_layers <= args.max_layers:
        p.error("need 1 <= --min-layers <= --max-layers")
    runners = args.runners.split(",")
    if set(runners) - set(RUNNERS):
        p.error(f"unknown runners in {args.runners!r}; choose from {', '.join(RUNNERS)}")
    cg, reason = Cgroups.find() if args.cap_mib or args.trace is None else (None, "uncapped")
    if cg is None and args.cap_mib:
        print(f"capacity: cannot run: {reason}")
        return None
    print(f"GPT d_model 512, vocab 8192, seq 128, global batch {args.batch}, AdamW fp32; ", end="")
    print(
        f"{args.nproc} ranks, {args.cap_mib} MiB each ({reason}), malloc {args.malloc}", flush=True
    )
    if args.trace is not None:
        try:
            for r in runners:
                trial = run_trial(cg, args, r, args.trace, trace=True)
                print(
                    f"{r}: {trial['status']}, cgroup peak {trial['peak_mib']:.1f} MiB\n", flush=True
                )
        finally:
            if cg is not None:
                cg.close()
        return None
    try:
        results = {r: bisect(cg, args, r) for r in runners}
    finally:
        cg.close()
    print_table(results, args.max_layers)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return None


if __name__ == "__main__":
    main()
