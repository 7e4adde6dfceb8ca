"""benchmarks/gpu_check.py on the CPU (so the script a GPU session runs is never broken), and
its counting stand-in for host syncs (benchmarks/sync_points.py): a step at any level makes no
host read from zerokit's code, and the stand-in sees one when zerokit makes it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from dist_helpers import run_distributed
from models import global_batches, local_slice, loss_fn

import zerokit
from zerokit.models.gpt import GPT, GPTConfig

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from sync_points import SyncPoints  # noqa: E402

LEVELS = ("os", "os_g", "p_g_os")


def test_every_check_runs_on_cpu_and_passes_or_says_it_needs_cuda(tmp_path):
    # about 35 s on a loaded 2-core machine, most of it `zerokit compare`'s 4 fresh processes
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_check.py"), "--device", "cpu", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {r["verdict"] for r in rows} <= {"PASS", "info", "skipped: needs CUDA"}, done.stdout
    checks = {(r["check"], r["level"]): r for r in rows}
    for level in LEVELS:  # every level, every check that has levels
        for check in (
            "equal to plain torch (fp32)",
            "equal to the bf16 policy in plain torch",
            "no host sync in a step (counted in zerokit)",
            "offload=True equal to no offload",
            "step time / plain torch (target 1.05x)",
        ):
            assert (check, level) in checks, (check, level)
    for case in (*LEVELS, *(f"{level} bf16" for level in LEVELS)):
        counted = checks[("no host sync in a step (counted in zerokit)", case)]
        assert counted["verdict"] == "PASS", counted  # a sync point added to the step fails here
        cuda = checks[("no host sync in a step (CUDA sync debug mode)", case)]
        assert cuda["verdict"] == "skipped: needs CUDA"
    for check in (
        "meta init + load_pretrained: the saved values",
        "torch.compile (eager, each block): graph breaks",
    ):
        assert checks[(check, "p_g_os")]["verdict"] == "PASS"
    compare = [r for r in rows if r["check"].startswith("zerokit compare (gloo)")]
    assert [r["level"] for r in compare] == ["ddp", *LEVELS]
    assert "skipped: needs CUDA" in done.stdout  # the table says what the CPU could not check


def test_the_stand_in_counts_a_host_read_zerokit_makes_and_only_those():
    from zerokit.scaler import agree_found_inf

    flags = torch.zeros(3, dtype=torch.bool)
    with SyncPoints() as syncs:
        torch.ones(2).sum().item()  # the caller's own read: not zerokit's
        assert agree_found_inf([torch.ones(2)], [], torch.device("cpu")) is False  # bool(.item())
        bool(flags[0])  # a host bool flag
    assert len(syncs.seen) == 1 and "zerokit/scaler.py" in syncs.seen[0], syncs.seen
    assert "Tensor.item" in syncs.seen[0]
    agree_found_inf([torch.ones(2)], [], torch.device("cpu"))  # after the with: not counted
    assert len(syncs.seen) == 1


def _steady_steps_make_no_host_read(rank, world_size):
    batches = global_batches(3, batch=2 * world_size)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, "p_g_os")
    for k, (x, y) in enumerate(batches):
        xs, ys = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        with SyncPoints() as syncs:
            loss_fn(model(xs), ys).backward()
            zerokit.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()
        if k > 0:  # the first step agrees on the units' order (wrap-time work, once)
            assert not syncs.seen, syncs.seen


def test_steady_p_g_os_steps_on_two_ranks_make_no_host_read():
    run_distributed(_steady_steps_make_no_host_read, 2)
