"""benchmarks/pipeline.py's measurement at p = 2, m = 4, small: 1F1B holds fewer activations on
stage 0 than F-then-B (the theory's 2/4), and the same measurement run with a 1F1B that does
every forward first (F-then-B's order) sees no difference, so the check can fail."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from dist_helpers import run_distributed

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "pipeline.py"
CFG = {"layers": 2, "width": 16, "batch": 16, "micro_batches": 4, "steps": 1}


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("pipeline_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _measure(rank, world_size, out):
    from zerokit.pipeline import schedules

    bench = _load_benchmark()
    cfg = {**CFG, "schedules": ["naive", "fthenb", "1f1b"]}
    rows = bench.measure(rank, world_size, cfg)
    # the control: a "1f1b" that runs every forward first
    real = schedules.SCHEDULES["1f1b"]
    schedules.SCHEDULES["1f1b"] = schedules.f_then_b
    try:
        control = bench.measure(rank, world_size, {**cfg, "schedules": ["fthenb", "1f1b"]})
    finally:
        schedules.SCHEDULES["1f1b"] = real
    if rank == 0:
        Path(out).write_text(json.dumps({"rows": rows, "control": control}))


def test_1f1b_holds_fewer_activations_than_f_then_b_on_stage_0(tmp_path):
    out = tmp_path / "rows.json"
    run_distributed(_measure, 2, str(out))
    got = json.loads(out.read_text())
    bench = _load_benchmark()
    peak = {(r["schedule"], r["stage"]): r["peak_bytes"] for r in got["rows"]}
    assert peak[("1f1b", 0)] < peak[("fthenb", 0)], peak
    assert bench.stage0_ratio(got["rows"]) == 2 / 4  # min(p, m) / m, exactly for these blocks
    assert peak[("fthenb", 0)] == peak[("naive", 0)]  # m micro-batches of 1/m: the whole batch
    for r in got["rows"]:
        assert r["peak_bytes"] == r["theory_bytes"], r
    # all forwards first: the measurement sees F-then-B's peak, and the check above would fail
    assert bench.stage0_ratio(got["control"]) == 1.0
