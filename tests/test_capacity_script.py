"""benchmarks/capacity.py in tiny configurations: one passing trial, one trial the cgroup's OOM
killer ends (reported as such, no rank left hanging), and --help. Where memory cgroups cannot be
used (not root, none mounted, not writable) the script says why and exits 0: those tests skip
with its reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "capacity.py"


def run_capacity(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stdout + out.stderr
    if "cannot run:" in out.stdout:
        pytest.skip(out.stdout.strip())
    return out


def test_help_shows_every_flag_with_its_default():
    out = run_capacity("--help")
    for flag in ("--cap-mib", "--nproc", "--runners", "--max-layers", "--malloc", "--json"):
        assert flag in out.stdout
    assert "(default: 1024)" in out.stdout and "(default: default)" in out.stdout


@pytest.mark.slow  # a real 2-rank trial: 12 s on an idle machine, 30 s on a busy one
def test_one_layer_fits_in_2_gib(tmp_path):
    # Model state of the 1-layer GPT (7.4M parameters) at 'os' on 2 ranks: 4 + 4 + 8/2 bytes
    # per parameter, 85 MiB, plus torch's own ~350 MiB: far below 2 GiB.
    report = tmp_path / "capacity.json"
    args = ("--max-layers", "1", "--runners", "os", "--cap-mib", "2048", "--json", str(report))
    out = run_capacity(*args)
    result = json.loads(report.read_text())["results"]["os"]
    assert result["n_layer"] == 1, out.stdout
    assert [t["status"] for t in result["trials"]] == ["pass"]
    assert 0 < result["peak_mib"] <= 2048
    assert "1+" in out.stdout  # the table marks a result at --max-layers


def test_oom_kill_is_a_clean_failure(tmp_path):
    # 160 MiB is less than importing torch takes: every rank is killed by the cgroup's OOM
    # killer (or its peer is killed by the script) and the trial is reported "oom".
    report = tmp_path / "capacity.json"
    args = ("--max-layers", "1", "--runners", "ddp", "--cap-mib", "160", "--json", str(report))
    run_capacity(*args, timeout=60)
    result = json.loads(report.read_text())["results"]["ddp"]
    assert result["n_layer"] == 0
    assert [t["status"] for t in result["trials"]] == ["oom"]
