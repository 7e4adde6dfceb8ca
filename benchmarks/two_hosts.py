"""Hybrid sharding on two "hosts": two network namespaces joined by a veth pair, torchrun in each.

Host 0 is 10.77.0.1, host 1 is 10.77.0.2; each runs ``torchrun --nnodes 2 --nproc-per-node 2
--rdzv-backend c10d --rdzv-endpoint 10.77.0.1:PORT`` with gloo bound to its veth
(``GLOO_SOCKET_IFNAME``), so ranks on one host talk over its loopback and only traffic between
hosts crosses the veth. The ranks run benchmarks/two_hosts_worker.py. Five checks:

* ``traffic``: per level, full sharding over the 4 ranks and hybrid sharding
  (``init_hybrid_parallel(2, 1, sharding_degree=2)``: shard inside a host, replicate across)
  each match one process (2e-5, final parameters); the bytes that crossed the veth per step
  (minus an idle window as long) are printed, and hybrid must send at most 1/2 (1 / sharding
  degree) of full sharding's.
* ``accumulation``: hybrid sharding at ``--accumulation`` K (4) micro-batches a step, three
  ways: every micro-batch reduced in full, the cross-host reduction deferred to the last
  (``model.defer_replica_sync()``), and ``no_sync()``; each matches one process; the bytes
  across the veth per step, the step time and the gradient bytes held between micro-batches
  are printed with their ratios. The deferral must send at most 0.3x of reducing every
  micro-batch, as much as ``no_sync()`` (within 10%), and hold at most 1/2 (1 / sharding
  degree) of ``no_sync()``'s gradient bytes at 'os_g' and 'p_g_os'.
* ``restart``: under ``--max-restarts 1``, hybrid training checkpoints (with step and RNG state)
  every 3 steps; host 1's ranks SIGKILL themselves at step 4 on the first attempt; torchrun
  restarts both hosts, the job resumes from step 3 and ends equal to one process.
* ``shrink``: host 0 alone (``--nnodes 1``, 2 ranks) resumes that step-3 checkpoint and ends
  equal to one process.
* ``optimizer`` (not in the default set): per level, hybrid sharding without and with the
  optimizer state sharded over the replicas (``shard_optimizer_over_replicas``), alternating
  step by step in one job: each must match one process; the optimizer bytes a rank holds with
  it must be at most 1/R (+2%) of without, the bytes across hosts per step equal (within 5%);
  the step-time ratio is printed.

    python benchmarks/two_hosts.py            # traffic, restart, shrink: about a minute
    python benchmarks/two_hosts.py --checks accumulation --accumulation 4
    python benchmarks/two_hosts.py --checks traffic --json two_hosts.json
    python benchmarks/two_hosts.py --checks optimizer --steps 8

Needs root and ``ip netns``; without them it prints "cannot run: <why>" and exits 0. Exits 1
if a check fails. Namespaces and veth are named after this process's pid and removed at exit,
whatever happened; nothing but loopback and the two namespaces' addresses is contacted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "two_hosts_worker.py"
ADDRS = ("10.77.0.1", "10.77.0.2")
NPROC = 2  # ranks per host: the sharding degree of the hybrid layout
ATOL = 2e-5
KILL_STEP, EVERY, TRAIN_STEPS = 4, 3, 8  # dies after the step-3 checkpoint, before step 6's
JOB_TIMEOUT = 300  # seconds for one torchrun job (a minute on an idle machine)


class TwoHosts:
    """Two network namespaces joined by a veth pair; removed (with anything still running in
    them, all started here) on exit."""

    def __init__(self, link_rate: str = "") -> None:
        self.link_rate = link_rate  # "": the veth as fast as the CPUs; else tc's rate, e.g. 200mbit
        pid = os.getpid()
        self.netns = (f"zk2h-{pid}-0", f"zk2h-{pid}-1")
        self.veth = (f"zk2h{pid}a", f"zk2h{pid}b")  # interface names: at most 15 characters
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> TwoHosts:
        try:
            for ns in self.netns:
                _ip("netns", "add", ns)
            _ip("link", "add", self.veth[0], "type", "veth", "peer", "name", self.veth[1])
            for ns, veth, addr in zip(self.netns, self.veth, ADDRS):
                _ip("link", "set", veth, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
                _ip("-n", ns, "link", "set", veth, "up")
                _ip("-n", ns, "link", "set", "lo", "up")  # a host's ranks talk over it
                if self.link_rate:  # a slow link between hosts: each direction shaped
                    _tc(ns, veth, self.link_rate)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, host: int, argv: list[str], env: dict[str, str], log: Path):
        """Run ``argv`` inside host ``host``'s namespace, in a session of its own."""
        env = {**os.environ, **env, "GLOO_SOCKET_IFNAME": self.veth[host], "ZK_HOST": str(host)}
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.netns[host], *argv],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:  # our torchruns still running, their sessions
            if proc.poll() is None:  # not reaped: the id is still ours
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for ns in self.netns:  # whatever they left (workers in sessions of their own)
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in pids.stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # takes the veth


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


def _tc(ns: str, dev: str, rate: str) -> None:
    argv = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
            "rate", rate, "burst", "256kb", "latency", "1s"]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip()}")


def cannot_run() -> str | None:
    """Why this machine cannot host the namespaces, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root, and this process is not root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"zk2h-probe-{os.getpid()}"
    out = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if out.returncode:
        return f"ip netns add fails: {out.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def torchrun(nnodes: int, port: int, host: int, max_restarts: int, worker_args: list[str]):
    return [
        sys.executable, "-m", "torch.distributed.run",  # torchrun, with this interpreter
        "--nnodes", str(nnodes), "--nproc-per-node", str(NPROC),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{ADDRS[0]}:{port}",
        "--rdzv-id", f"zk2h-{os.getpid()}-{port}",
        # host 0 serves the rendezvous store (torch cannot tell: the namespace's address is not
        # the machine's hostname); each host's address goes to its peers
        "--rdzv-conf", f"is_host={int(host == 0)},join_timeout=60",
        "--local-addr", ADDRS[host], "--max-restarts", str(max_restarts),
        "--monitor-interval", "0.5", str(WORKER), *worker_args,
    ]  # fmt: skip


def launch(hosts: TwoHosts, work: Path, name: str, host_ids, worker_args, max_restarts=0):
    """One job on ``host_ids``; waits for it. Returns (exit codes, each rank's result)."""
    out = work / name
    out.mkdir()
    port = 29400 + len(hosts.procs)  # a fresh port per job: no TIME_WAIT races
    env = {
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{HERE.parent}{os.pathsep}" + os.environ.get("PYTHONPATH", ""),
        # Workers must not share the agents' rendezvous store: it outlives a restart, and the
        # restarted ranks would read the dead ranks' gloo addresses from it (connection
        # refused; pytorch/pytorch#135712). With this, rank 0 hosts a fresh store per attempt.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    argv = [*worker_args, "--out", str(out)]
    procs = [
        hosts.start(h, torchrun(len(host_ids), port, h, max_restarts, argv), env,
                    out / f"host{h}.log")
        for h in host_ids
    ]  # fmt: skip
    deadline = time.monotonic() + JOB_TIMEOUT
    try:
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        codes = [p.wait() for p in procs]
        print(f"{name}: killed after {JOB_TIMEOUT} s")
    results = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    if any(codes):
        for h in host_ids:
            print(f"--- {name}: host {h} (exit {codes[host_ids.index(h)]}), last lines ---")
            print("\n".join((out / f"host{h}.log").read_text(errors="replace").splitlines()[-25:]))
    return codes, results


def check_traffic(hosts, work, args, failures) -> dict:
    worker_args = ["traffic", "--levels", args.levels, "--steps", str(args.steps)]
    codes, ranks = launch(hosts, work, "traffic", [0, 1], worker_args + args.plant)
    if any(codes) or len(ranks) != 2 * NPROC:
        failures.append(f"traffic: exit codes {codes}, {len(ranks)} rank results")
        return {}
    report = {"params": ranks[0]["params"], "hosts_of_ranks": ranks[0]["hosts"], "levels": {}}
    print(
        f"GPT of {report['params'] / 1e6:.2f}M parameters ({4 * report['params'] / 2**20:.2f}"
        f" MiB fp32 = P); 2 hosts x {NPROC} ranks, ranks on hosts {report['hosts_of_ranks']}"
    )
    print("level    layout   bytes across hosts/step      in P  step s  max |diff| vs 1 process")
    for level in args.levels.split(","):
        row = {}
        for layout in ("full", "hybrid"):
            r = ranks[0][f"{level}/{layout}"]
            diff = max(rank[f"{level}/{layout}"]["max_diff"] for rank in ranks)
            p_units = r["bytes_per_step"] / (4 * report["params"])
            print(
                f"{level:8} {layout:8} {r['bytes_per_step']:>20,.0f} {p_units:9.2f}"
                f" {r['step_s']:7.3f}  {diff:.1e}"
            )
            row[layout] = {**r, "max_diff_all_ranks": diff}
            if not diff <= ATOL:
                failures.append(f"traffic: {level} {layout} differs from one process by {diff}")
        ratio = row["hybrid"]["bytes_per_step"] / row["full"]["bytes_per_step"]
        row["ratio"] = ratio
        verdict = "ok" if ratio <= 1 / NPROC else "FAIL"
        print(f"{level:8} hybrid / full = {ratio:.3f} (target <= 1/{NPROC}): {verdict}")
        if ratio > 1 / NPROC:
            failures.append(f"traffic: {level}: hybrid sends {ratio:.3f} of full sharding's bytes")
        report["levels"][level] = row
    return report


DEFER_TARGET = 0.3  # the deferral's cross-host bytes per step, at most this of "every"'s


def check_accumulation(hosts, work, args, failures) -> dict:
    """Hybrid accumulation at ``--accumulation`` K: bytes across hosts per step and step time,
    the cross-host reduction deferred (``defer_replica_sync()``) beside reducing every
    micro-batch and beside ``no_sync()``, and the gradient bytes each holds between
    micro-batches."""
    worker_args = ["accumulation", "--levels", args.levels, "--steps", str(args.steps),
                   "--accumulation", str(args.accumulation)]  # fmt: skip
    codes, ranks = launch(hosts, work, "accumulation", [0, 1], worker_args + args.plant)
    if any(codes) or len(ranks) != 2 * NPROC:
        failures.append(f"accumulation: exit codes {codes}, {len(ranks)} rank results")
        return {}
    k = args.accumulation
    print(f"accumulation {k} micro-batches a step, hybrid 2 hosts x {NPROC} ranks")
    print("level    mode     bytes across hosts/step  step s  grads held B  max |diff|")
    report = {"accumulation": k, "levels": {}}
    for level in args.levels.split(","):
        row = {}
        for mode in ("every", "defer", "no_sync"):
            r = ranks[0][f"{level}/{mode}"]
            diff = max(rank[f"{level}/{mode}"]["max_diff"] for rank in ranks)
            held = r["grads_between_micro_batches"]
            print(
                f"{level:8} {mode:8} {r['bytes_per_step']:>23,.0f} {r['step_s']:7.3f}"
                f" {held:>13,}  {diff:.1e}"
            )
            row[mode] = {**r, "max_diff_all_ranks": diff}
            if not diff <= ATOL:
                failures.append(f"accumulation: {level} {mode} differs from one process by {diff}")
        row["ratios"] = _accumulation_ratios(level, row, failures)
        report["levels"][level] = row
    return report


def _accumulation_ratios(level: str, row: dict, failures: list[str]) -> dict:
    """defer / every and defer / no_sync, in bytes, time and gradient memory, checked."""
    ratio = {
        f"{what} defer/{other}": row["defer"][key] / row[other][key]
        for other in ("every", "no_sync")
        for what, key in (("bytes", "bytes_per_step"), ("time", "step_s"),
                          ("grads", "grads_between_micro_batches"))
    }  # fmt: skip
    print(f"{level:8} " + ", ".join(f"{name} = {v:.3f}" for name, v in ratio.items()))
    if ratio["bytes defer/every"] > DEFER_TARGET:
        failures.append(f"accumulation: {level}: defer sends {ratio['bytes defer/every']:.3f} "
                        f"of every micro-batch's bytes (target <= {DEFER_TARGET})")  # fmt: skip
    if not 0.9 <= ratio["bytes defer/no_sync"] <= 1.1:
        failures.append(f"accumulation: {level}: defer sends {ratio['bytes defer/no_sync']:.3f}"
                        " of no_sync's bytes across hosts (expected equal)")  # fmt: skip
    # stage 1 keeps its full gradient buffer by design; stages 2-3 hold 1/S of no_sync's
    if level != "os" and ratio["grads defer/no_sync"] > 1 / NPROC * 1.01:
        failures.append(f"accumulation: {level}: defer holds {ratio['grads defer/no_sync']:.3f}"
                        f" of no_sync's gradient bytes (expected <= 1/{NPROC})")  # fmt: skip
    return ratio


def check_optimizer(hosts, work, args, failures) -> dict:
    """Hybrid sharding with the optimizer state sharded over the replicas against without."""
    worker_args = ["optimizer", "--levels", args.levels, "--steps", str(args.steps)]
    codes, ranks = launch(hosts, work, "optimizer", [0, 1], worker_args)
    if any(codes) or len(ranks) != 2 * NPROC:
        failures.append(f"optimizer: exit codes {codes}, {len(ranks)} rank results")
        return {}
    replicas = len(ranks) // NPROC
    print(
        f"optimizer state sharded over the {replicas} replicas (on) against hybrid sharding (off)"
    )
    print("level    opt bytes/rank off -> on  ratio  cross-host bytes/step off -> on  ratio"
          "  step s off -> on  ratio  max |diff|")  # fmt: skip
    report = {"replicas": replicas, "levels": {}}
    for level in args.levels.split(","):
        off, on = (ranks[0][f"{level}/{k}"] for k in ("off", "on"))
        state = max(r[f"{level}/on"]["optimizer_bytes"] / r[f"{level}/off"]["optimizer_bytes"]
                    for r in ranks)  # fmt: skip
        moved = on["bytes_per_step"] / off["bytes_per_step"]
        slower = on["step_s"] / off["step_s"]
        diff = max(r[f"{level}/{k}"]["max_diff"] for r in ranks for k in ("off", "on"))
        print(
            f"{level:8} {off['optimizer_bytes']:>10,} -> {on['optimizer_bytes']:>10,} {state:5.3f}"
            f" {off['bytes_per_step']:>14,.0f} -> {on['bytes_per_step']:>14,.0f} {moved:5.3f}"
            f"  {off['step_s']:.4f} -> {on['step_s']:.4f} {slower:5.2f}  {diff:.1e}"
        )
        report["levels"][level] = {"off": off, "on": on, "state_ratio": state,
                                   "bytes_ratio": moved, "time_ratio": slower, "max_diff": diff}  # fmt: skip
        if not diff <= ATOL:
            failures.append(f"optimizer: {level} differs from one process by {diff}")
        if state > 1 / replicas * 1.02:
            failures.append(f"optimizer: {level}: a rank holds {state:.3f} of the state, not 1/R")
        if not 0.95 <= moved <= 1.05:
            failures.append(f"optimizer: {level}: {moved:.3f} of the cross-host bytes, not equal")
    return report


def check_restart(hosts, work, args, failures) -> dict:
    worker_args = ["train", "--levels", args.train_level, "--steps", str(TRAIN_STEPS),
                   "--every", str(EVERY), "--kill-step", str(KILL_STEP), "--kill-host", "1",
                   "--ckpt-dir", str(work / "ckpt")]  # fmt: skip
    start = time.perf_counter()
    codes, ranks = launch(hosts, work, "restart", [0, 1], worker_args + args.plant, 1)
    report = _train_report("restart", codes, ranks, 2 * NPROC, failures)
    report["seconds"] = time.perf_counter() - start
    # The killed host's ranks must be a second attempt. The other host's count may stay 0: its
    # agent restarts healthy workers for a re-rendezvous without counting a restart.
    killed = [r["attempt"] for r in ranks if r["host"] == 1]
    if ranks and killed != [1] * NPROC:
        failures.append(f"restart: host 1's ranks report attempts {killed}, expected 1 each")
    print(
        f"restart: host 1 killed at step {KILL_STEP} (after the step-{EVERY} checkpoint); "
        f"torchrun restarted, attempt {[r['attempt'] for r in ranks]}, resumed at step "
        f"{[r['start_step'] for r in ranks]}, max |diff| vs 1 process {report['max_diff']:.1e}"
        f" ({report['seconds']:.0f} s in all)"
    )
    return report


def check_shrink(hosts, work, args, failures) -> dict:
    resume = work / "ckpt" / f"step_{EVERY:05d}"
    if not resume.is_dir():
        failures.append(f"shrink: no checkpoint at {resume} (the restart check makes it)")
        return {}
    worker_args = ["train", "--levels", args.train_level, "--steps", str(TRAIN_STEPS),
                   "--every", str(EVERY), "--resume-from", str(resume),
                   "--ckpt-dir", str(work / "ckpt_shrunk")]  # fmt: skip
    codes, ranks = launch(hosts, work, "shrink", [0], worker_args + args.plant)
    report = _train_report("shrink", codes, ranks, NPROC, failures)
    print(
        f"shrink: host 0 alone ({len(ranks)} ranks) resumed {resume.name} at step "
        f"{[r['start_step'] for r in ranks]}, max |diff| vs 1 process {report['max_diff']:.1e}"
    )
    return report


def _train_report(name, codes, ranks, nranks, failures) -> dict:
    diff = max((r["max_diff"] for r in ranks), default=float("nan"))
    report = {"exit_codes": codes, "ranks": ranks, "max_diff": diff}
    if any(codes) or len(ranks) != nranks:
        failures.append(f"{name}: exit codes {codes}, {len(ranks)} of {nranks} rank results")
    elif {r["start_step"] for r in ranks} != {EVERY}:
        failures.append(f"{name}: resumed at steps {[r['start_step'] for r in ranks]}, not {EVERY}")
    if not diff <= ATOL:
        failures.append(f"{name}: final parameters differ from one process by {diff}")
    return report


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--checks",
        default="traffic,restart,shrink",
        help="comma-separated: traffic, accumulation, restart, shrink, optimizer",
    )
    p.add_argument(
        "--accumulation", type=int, default=4, help="micro-batches a step (accumulation check)"
    )
    p.add_argument("--levels", default="os,os_g,p_g_os", help="levels whose traffic is measured")
    p.add_argument(
        "--link-rate",
        default="",
        help="shape the link between the hosts to this rate (tc's units: 200mbit), each "
        "direction; empty: unshaped, as fast as the CPUs",
    )
    p.add_argument("--steps", type=int, default=4, help="timed steps per traffic measurement")
    p.add_argument("--train-level", default="p_g_os", help="level of the restart/shrink job")
    p.add_argument("--json", default="", help="write the measurements and results here")
    p.add_argument("--keep", action="store_true", help="keep the logs and checkpoints")
    p.add_argument(
        "--plant",
        default="",
        choices=("", "swap-groups", "no-replicas", "no-rng", "early-replicas"),
        help="plant a bug in the workers, to see a check fail: swap-groups (shard "
        "across hosts, replicate inside), no-replicas (hybrid without dp_group), "
        "no-rng (resume without the RNG state), early-replicas (defer_replica_sync "
        "defers nothing)",
    )
    args = p.parse_args()
    args.plant = ["--bug", args.plant] if args.plant else []
    checks = args.checks.split(",")
    if "shrink" in checks and "restart" not in checks:
        p.error("shrink resumes the restart check's checkpoint: add restart")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up on SIGTERM too
    reason = cannot_run()
    if reason:
        print(f"two_hosts: cannot run: {reason}")
        return 0
    failures: list[str] = []
    report: dict = {}
    work = Path(tempfile.mkdtemp(prefix="zerokit-two-hosts-"))
    try:
        with TwoHosts(args.link_rate) as hosts:
            for name, check in (("traffic", check_traffic), ("accumulation", check_accumulation),
                                ("restart", check_restart), ("shrink", check_shrink),
                                ("optimizer", check_optimizer)):  # fmt: skip
                if name in checks:
                    report[name] = check(hosts, work, args, failures)
    finally:
        if args.keep:
            print(f"logs and checkpoints kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    report["failures"] = failures
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    for f in failures:
        print(f"FAIL: {f}")
    print("two_hosts: " + ("FAILED" if failures else "all checks passed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
