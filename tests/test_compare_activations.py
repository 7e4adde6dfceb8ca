"""`zerokit compare --activations`, run as a user runs it (the console script): the five
settings of Korthikanti et al. with activation bytes per layer measured on the built-in GPT
beside the paper's estimate, which the test computes itself from each setting's options."""

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from zerokit.memory import estimate_activations
from zerokit.tools import cli

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1")
COMMAND = "zerokit compare --activations"
# the paper's five settings at the defaults (s 32, b 8, h 64, a 4, 2 layers, t 2), fp32 values
S, B, H, A, LAYERS, T = 32, 8, 64, 4, 2, 2
SETTINGS = {
    "none": {"tp": 1},
    "tp": {"tp": T},
    "tp+sp": {"tp": T, "sequence_parallel": True},
    "tp+sp+selective": {"tp": T, "sequence_parallel": True, "recompute": "selective"},
    "full": {"tp": T, "recompute": "full"},
}
UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def _rows(table: str) -> dict[str, tuple[float, float]]:
    """Per setting, its printed (measured, estimated) bytes per layer."""
    rows = {}
    for line in table.splitlines():
        cells = line.split()
        if cells[:1] and cells[0] in SETTINGS:
            m, mu, e, eu = cells[1:5]
            rows[cells[0]] = (float(m) * UNITS[mu], float(e) * UNITS[eu])
    return rows


def test_compare_activations_as_a_user_runs_it(tmp_path):
    script = shutil.which("zerokit")
    assert script, "the `zerokit` console script is not on PATH: pip install -e . (README)"
    out, chart = tmp_path / "activations.json", tmp_path / "activations.png"
    plot = importlib.util.find_spec("matplotlib") is not None
    cmd = [script, *COMMAND.split()[1:], "--json", str(out)]
    cmd += ["--plot", str(chart)] if plot else []
    done = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "measuring 5 settings on 2 gloo ranks" in done.stderr
    printed = _rows(done.stdout)
    assert list(printed) == list(SETTINGS), done.stdout  # all five, in the paper's order
    report = json.loads(out.read_text())
    assert [r["setting"] for r in report["rows"]] == list(SETTINGS)
    for row in report["rows"]:
        name = row["setting"]
        want = estimate_activations(S, B, H, A, LAYERS, bytes_per_value=4, **SETTINGS[name])
        assert row["estimated_per_layer"] == want.per_layer_bytes, name
        measured = row["measured_per_layer"]
        assert abs(measured - want.per_layer_bytes) <= 0.10 * want.per_layer_bytes, (
            f"{name}: measured {measured} B/layer, estimated {want.per_layer_bytes}"
        )
        m, e = printed[name]  # the table shows the same numbers (one decimal of KiB)
        assert abs(m - measured) <= 0.05 * 2**10 and abs(e - want.per_layer_bytes) <= 0.05 * 2**10
    measured = [r["measured_per_layer"] for r in report["rows"]]
    assert measured == sorted(measured, reverse=True), measured  # each setting saves more
    if plot:
        assert chart.read_bytes()[:4] == b"\x89PNG"

    # the user guide shows what the command prints (the bytes do not depend on the machine)
    guide = (ROOT / "docs" / "GUIDE.md").read_text()
    section = guide.split("### Sequence parallelism", 1)[1].split("\n## ", 1)[0]
    assert f"`{COMMAND}`" in section
    shown = section.split(f"`{COMMAND}`", 1)[1].split("```", 2)[1]
    assert _rows(shown) == printed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tp", "3"], "--tp 3 must divide --heads 4"),
        (["--tp", "1"], "--tp must be at least 2"),
        (["--seq", "31"], "--tp 2 must divide --seq 31"),
        (["--heads", "6"], "--heads 6 must divide --hidden 64"),
        (["--model", "m:f"], "leave out --model"),
    ],
)
def test_compare_activations_refuses_bad_settings_before_starting_ranks(argv, message, capsys):
    assert cli.main(["compare", "--activations", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerokit compare: error: ") and message in err, err
    assert "measuring" not in err
