"""``zerokit compare``'s step-time column: a median over interleaved rounds, with its spread.

One sample per level on a shared machine says little (the levels' order changed between two
runs); each level's time is taken over many rounds in which every level runs one step, in an
order that rotates, and the column prints the median and the middle half of the rounds.
"""

import statistics

import pytest

from zerokit.tools.compare import LEVELS, CompareConfig, rotated, run_compare, step_time_summary
from zerokit.tools.compare_report import format_table


def test_a_round_order_gives_every_level_every_place_equally():
    orders = [rotated(LEVELS, r) for r in range(2 * len(LEVELS))]
    for order in orders:
        assert sorted(order) == sorted(LEVELS)  # every level once per round
    for place in range(len(LEVELS)):
        seen = [order[place] for order in orders]
        assert all(seen.count(level) == 2 for level in LEVELS), (place, seen)
    assert orders[0] == list(LEVELS) and orders[1][-1] == LEVELS[0]  # the first goes last


def test_the_step_time_is_the_median_of_the_rounds_after_the_first():
    # a warm-up round first, then rounds with one slow outlier (a neighbour's burst)
    times = [5.0, 0.30, 0.20, 0.25, 0.90, 0.22, 0.24, 0.26, 0.28]
    got = step_time_summary(times)
    rest = times[1:]
    assert got["rounds"] == len(rest) == 8
    assert got["median"] == statistics.median(rest) == pytest.approx(0.255)
    # the middle half: the 25th and 75th percentiles of the 8 rounds (inclusive method)
    assert got["low"] == pytest.approx(0.235) and got["high"] == pytest.approx(0.285)
    assert got["low"] <= got["median"] <= got["high"] < 0.9  # the outlier moves neither
    one = step_time_summary([0.4])
    assert one == {"median": 0.4, "low": 0.4, "high": 0.4, "rounds": 1}


def _report(rows):
    return {"world_size": 2, "backend": "gloo", "model": "m", "precision": "fp32", "steps": 9,
            "memory_steps": 3, "batch": 4, "rows": rows}  # fmt: skip


def test_the_table_prints_the_median_and_the_middle_half():
    sizes = {"params": 1, "grads": 1, "optimizer": 2, "total": 4}
    rows = [
        {"level": level, "measured": {**sizes, "peak": 2**20}, "estimated": sizes,
         "step_time_s": 0.25 + i, "step_time_spread_s": [0.24 + i, 0.31 + i],
         "step_time_rounds": 8, "final_loss": 1.5}
        for i, level in enumerate(LEVELS)
    ]  # fmt: skip
    lines = format_table(_report(rows)).splitlines()
    assert "step s [mid half]" in lines[1]
    for i, line in enumerate(lines[2 : 2 + len(LEVELS)]):
        tokens = line.split()
        assert tokens[-3:] == [f"{0.25 + i:.3f}", f"[{0.24 + i:.3f}-{0.31 + i:.3f}]", "1.500000"]
    assert "the median over 8 rounds" in lines[2 + len(LEVELS)]


@pytest.mark.slow  # the fast subset: test_first_day's user run of compare prints the column
def test_compare_times_every_level_over_its_rounds():
    report = run_compare(
        CompareConfig(model="models:tiny_gpt", nproc=2, steps=5, batch=4), progress=lambda _: None
    )
    for row in report["rows"]:
        low, high = row["step_time_spread_s"]
        assert row["step_time_rounds"] == 4  # the rounds after the first
        assert 0 < low <= row["step_time_s"] <= high, row
    losses = [row["final_loss"] for row in report["rows"]]
    assert max(losses) - min(losses) < 1e-5  # the levels trained side by side agree
