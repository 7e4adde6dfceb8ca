"""zerokit.memory and `zerokit compare`: estimates follow the ZeRO paper, measurements agree
with estimates at every level, and the command refuses bad input clearly."""

import json

import pytest
from models import make_model

from zerokit.memory import MemoryEstimate, estimate
from zerokit.tools import cli
from zerokit.tools.compare import CompareConfig, run_compare


def test_estimate_reproduces_the_zero_paper():
    # ZeRO paper, Figure 1: 7.5B parameters, 64 GPUs, mixed-precision Adam (2 + 2 + 12 bytes)
    gb = {
        lvl: estimate(7_500_000_000, lvl, 64, mixed_precision=True, paper=True).total / 1e9
        for lvl in ("ddp", "os", "os_g", "p_g_os")
    }
    assert {k: round(v, 1) for k, v in gb.items()} == {
        "ddp": 120.0,
        "os": 31.4,
        "os_g": 16.6,
        "p_g_os": 1.9,
    }


def test_estimate_of_a_model_includes_real_padding_and_frozen_params():
    model = make_model("awkward")  # 1-element and 3-element parameters, a frozen layer
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    dp = estimate(model, "ddp", 3)
    assert dp == MemoryEstimate(
        4 * (trainable + frozen), 4 * (trainable + frozen), 8 * (trainable + frozen)
    )
    for level in ("os", "os_g", "p_g_os"):
        e = estimate(model, level, 3, optimizer="sgd")
        # shards: at least trainable / 3, padded by fewer than 3 elements per bucket
        assert 4 * trainable / 3 <= e.optimizer < 4 * (trainable / 3 + 3 * 8)
    with pytest.raises(ValueError, match="valid: ddp, os, os_g, p_g_os"):
        estimate(model, "zero3", 2)


@pytest.mark.slow  # fast subset: test_first_day's user run of compare; measure == estimate at
# every level in test_mixed_precision's bf16 test
def test_compare_measures_what_it_estimates_and_losses_agree(tmp_path):
    report = run_compare(
        CompareConfig(model="models:tiny_gpt", nproc=2, steps=3, batch=4), progress=lambda _: None
    )
    rows = {row["level"]: row for row in report["rows"]}
    assert list(rows) == ["ddp", "os", "os_g", "p_g_os"] and report["world_size"] == 2
    for level, row in rows.items():
        m, e = row["measured"], row["estimated"]
        for category in ("params", "grads", "optimizer"):
            assert abs(m[category] - e[category]) <= 0.05 * e[category], (level, category, m, e)
        assert m["peak"] > 0
    totals = [
        sum(rows[lvl]["measured"][c] for c in ("params", "grads", "optimizer")) for lvl in rows
    ]
    assert (
        totals == sorted(totals, reverse=True) and len(set(totals)) == 4
    )  # ddp > os > os_g > p_g_os
    losses = [row["final_loss"] for row in rows.values()]
    assert max(losses) - min(losses) < 1e-5  # the same training at every level


@pytest.mark.slow  # the fast subset writes JSON and a chart in test_first_day's user run
def test_cli_writes_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "report.json", tmp_path / "memory.png"
    argv = ["compare", "--model", "models:tiny_gpt", "--nproc", "1", "--steps", "2", "--batch", "2"]
    assert cli.main([*argv, "--json", str(out_json), "--plot", str(out_png)]) == 0
    report = json.loads(out_json.read_text())
    assert report["world_size"] == 1 and [r["level"] for r in report["rows"]] == [
        "ddp",
        "os",
        "os_g",
        "p_g_os",
    ]
    assert set(report["rows"][0]["measured"]) == {"params", "grads", "optimizer", "total", "peak"}
    assert set(report["rows"][0]["estimated"]) == {"params", "grads", "optimizer", "total"}
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "measured / estimated" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "no_such_module_zk:factory"], "cannot import 'no_such_module_zk'"),
        (["--model", "models"], "pkg.module:factory"),
        (["--model", "models:NOPE"], "no callable 'NOPE'"),
        (["--model", "models:not_a_module"], "a factory returns an nn.Module"),
        (["--model", "models:wrong_output"], "forward of token ids [1, 32] failed"),
        (["--nproc", "0"], "--nproc must be at least 1"),
        (["--batch", "3", "--nproc", "2"], "must divide evenly"),
        (["--steps", "0"], "--steps must be at least 1"),
    ],
)
def test_cli_refuses_bad_input_with_a_message(args, message, capsys):
    assert cli.main(["compare", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_estimate_matches_a_float32_adam_step():
    # fp32 Adam at 'p_g_os' on 4 ranks: 16 bytes per parameter / 4, plus padding
    e = estimate(1000, "p_g_os", 4)
    assert (e.params, e.grads, e.optimizer) == (1000, 1000, 2000)
    assert estimate(1001, "p_g_os", 4).params == 4 * 251  # padded to 1004 elements


@pytest.mark.slow
def test_compare_with_bf16_measures_what_it_estimates():
    report = run_compare(
        CompareConfig(model="models:tiny_gpt", nproc=2, steps=2, batch=4, mixed_precision="bf16"),
        progress=lambda _: None,
    )
    for row in report["rows"]:
        m, e = row["measured"], row["estimated"]
        for category in ("params", "grads", "optimizer"):  # Adam's step counts are extra
            assert abs(m[category] - e[category]) <= 0.05 * e[category], (row["level"], m, e)
    rows = {row["level"]: row for row in report["rows"]}
    # 'os' holds a bf16 compute copy (2 bytes) and a 1/2 fp32 master shard (2 bytes): as
    # many bytes as fp32 DDP's parameters; 'p_g_os' only the master shard
    assert rows["os"]["measured"]["params"] == rows["ddp"]["measured"]["params"]
    assert rows["p_g_os"]["measured"]["params"] == rows["ddp"]["measured"]["params"] // 2
