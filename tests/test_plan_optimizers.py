"""`zerokit plan --optimizer muon|adafactor|adamw8bit`: each rank's optimizer-step FLOPs and
their imbalance, from the real wrapping (the owner layout); and the bytes a step sends with
Muon beside AdamW equal those with AdamW alone (the owner layout moves no parameter for the
step: issue 31, item 5)."""

import json
import math
import sys

import pytest
import torch
from torch import nn

from zerokit import LEVELS
from zerokit.models import presets
from zerokit.tools import cli
from zerokit.tools.plan import PlanConfig, make_plan
from zerokit.tools.plan_optimizers import ELEMENT_FLOPS, NEWTON_SCHULZ_STEPS

SMALL = "verify_models:tiny_gpt"


def _plan(model, world, level, optimizer, **kw):
    return make_plan(
        PlanConfig(world=world, level=level, model=model, optimizer=optimizer, seq=8, **kw)
    )


def _expected_total_flops(model: nn.Module) -> int:
    """By the rule, on the unwrapped model: Muon's matrices (2-D, in an nn.ModuleList) each
    once, 10 per element of everything else (AdamW's)."""
    in_blocks = {
        id(p) for m in model.modules() if isinstance(m, nn.ModuleList) for p in m.parameters()
    }
    total = 0
    for p in model.parameters():
        if p.dim() == 2 and id(p) in in_blocks:
            m, n = p.shape
            total += 2 * NEWTON_SCHULZ_STEPS * m * n * min(m, n)
        else:
            total += ELEMENT_FLOPS * p.numel()
    return total


def _bytes_equal(muon: dict, adamw: dict, what: str) -> None:
    for a, b in zip(muon["ranks"], adamw["ranks"]):
        got, want = a["bytes_per_step"], b["bytes_per_step"]
        assert abs(got - want) <= 0.05 * want, f"{what} rank {a['rank']}: {got} vs {want}"


def test_muon_on_a_24_layer_d1024_gpt_at_world_8_is_balanced_and_sends_what_adamw_sends():
    """GPT-2 medium's shape (presets.gpt_medium: 24 layers, d 1024; q,k,v fused 3072 x 1024,
    proj, fc, fc_out), 8 ranks, 'p_g_os' (the level where the owner's shard is the whole
    matrix): each matrix owned by one rank, Newton-Schulz FLOPs at most 1.15 x the mean."""
    model = "zerokit.models.presets:gpt_medium"
    muon = _plan(model, 8, "p_g_os", "muon")
    flops = [r["optimizer_flops"] for r in muon["ranks"]]
    assert muon["optimizer_flops_imbalance"] <= 1.15, flops
    assert muon["optimizer_flops_imbalance"] == pytest.approx(max(flops) / (sum(flops) / 8), 1e-3)
    with torch.device("meta"):
        plain = presets.gpt_medium()
    # every matrix stepped by exactly one rank: the sum over ranks is one process's work
    assert sum(flops) == _expected_total_flops(plain)
    _bytes_equal(muon, _plan(model, 8, "p_g_os", "adamw"), "gpt_medium p_g_os world 8")


@pytest.mark.parametrize("world", [3, 8])
def test_muon_sends_what_adamw_sends_at_every_level(world):
    for level in LEVELS:
        muon, adamw = _plan(SMALL, world, level, "muon"), _plan(SMALL, world, level, "adamw")
        _bytes_equal(muon, adamw, f"{level} world {world}")
        assert muon["optimizer_flops_imbalance"] >= 1.0


def test_the_printout_and_json_carry_each_ranks_flops(capsys, tmp_path):
    path = tmp_path / "plan.json"
    argv = ["plan", "--model", SMALL, "--world", "3", "--level", "os_g", "--seq", "8"]
    assert cli.main([*argv, "--optimizer", "muon", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    report = json.loads(path.read_text())
    flops = [r["optimizer_flops"] for r in report["ranks"]]
    assert report["optimizer"] == "muon" and all(f > 0 for f in flops)
    assert "Newton-Schulz" in report["optimizer_flops_rule"]
    assert f"imbalance (max / mean over ranks): {report['optimizer_flops_imbalance']:.3f}" in out
    # the printed row: "0,2-3: 3.76e+11  1: 3.97e+11", ranks whose figures print alike together
    row = out.split("FLOPs per rank", 1)[1].splitlines()[1].split()
    printed = {}
    for ranks, value in zip(row[0::2], row[1::2]):
        for run in ranks.rstrip(":").split(","):
            lo, _, hi = run.partition("-")
            printed.update(dict.fromkeys(range(int(lo), int(hi or lo) + 1), value))
    assert printed == {r: f"{f:.3g}" for r, f in enumerate(flops)}, out
    # AdamW alone: every element stepped once over the ranks, 10 FLOPs each
    assert cli.main([*argv, "--json", str(path)]) == 0
    adamw = json.loads(path.read_text())
    assert sum(r["optimizer_flops"] for r in adamw["ranks"]) == ELEMENT_FLOPS * adamw["params"]


def test_adafactor_and_adamw8bit_are_planned(capsys):
    pytest.importorskip("torchao")
    for optimizer in ("adafactor", "adamw8bit"):
        report = _plan(SMALL, 2, "os", optimizer)
        total = sum(r["optimizer_flops"] for r in report["ranks"])
        assert total == ELEMENT_FLOPS * report["params"], optimizer
        assert math.isfinite(report["optimizer_flops_imbalance"])


def test_adamw8bit_without_torchao_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # import fails as if absent
    argv = ["plan", "--model", SMALL, "--world", "2", "--level", "os", "--optimizer", "adamw8bit"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "torchao cannot be imported" in err and "zerokit[lowbit]" in err, err


def test_pipelines_refuse_an_optimizer_they_cannot_plan(capsys):
    argv = ["plan", "--world", "4", "--level", "os", "--pp", "2", "--optimizer", "muon"]
    assert cli.main(argv) == 2
    assert "--optimizer muon is planned by the dry run, without --pp" in capsys.readouterr().err
