"""ZeroKitStrategy in Lightning's Trainer equals one process with Lightning's default strategy.

One launch of tests/lightning_run.py (``python script.py``, Lightning's own launcher starting
the ranks) trains every level; the references train here, in one process, on the same global
batches. Tolerance 2e-5 (fp32; AdamW over 4 steps).
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("lightning")

import lightning_run as run
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
LEVELS = ("os", "os_g", "p_g_os")
TOL = 2e-5


def launch(tmp_path, devices: int, levels=LEVELS, *flags: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, os.path.join(HERE, "lightning_run.py"), str(tmp_path)]
    cmd += ["--devices", str(devices), "--levels", ",".join(levels), *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-6000:]
    return torch.load(os.path.join(tmp_path, "results.pt"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The scenarios in this process: Lightning's default single-device strategy."""
    ckpts = str(tmp_path_factory.mktemp("ref-ckpt"))
    return {
        "clip_accum": run.run_clip_accum("auto", 1),
        "unclipped": run.run_clip_accum("auto", 1, clip=None)[0],
        "resume": run.run_resume("auto", 1, ckpts)[0],
        "fp32": run.run_short("auto", 1, "32-true")[0],
        "manual": run.run_manual("auto", 1),
        "two_optimizers": run.run_two_optimizers("auto", 1, ckpts + "-two")[0],
        "epoch0": os.path.join(ckpts, "epoch=0-step=2.ckpt"),  # Lightning's own file
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple:
    """(the results of one 2-rank launch at every level, its output directory)."""
    out = tmp_path_factory.mktemp("two-ranks")
    return launch(out, 2), out


def assert_close(got: dict, want: dict, what: str, tol: float = TOL) -> None:
    assert got.keys() == want.keys(), what
    for name in want:
        err = (got[name].float() - want[name].float()).abs().max().item()
        assert err <= tol, f"{what}: {name} differs from one process by {err:.3g}"


def check(results: dict, reference: dict, levels) -> None:
    for level in levels:
        got, syncs = results[("clip_accum", level)]
        assert_close(got, reference["clip_accum"][0], f"{level} clip+accumulate")
        # 2 micro-batches per step: the first accumulates locally, the second reduces
        assert syncs == [False, True] * 4, f"{level}: sync per backward {syncs}"
        unbroken, resumed = results[("resume", level)]
        assert_close(unbroken, reference["resume"], f"{level} 2 epochs")
        assert_close(resumed, reference["resume"], f"{level} resumed from epoch 0")
    assert_close(results["cross"], reference["resume"], f"{levels[0]} resumed at {levels[-1]}")
    assert_close(results["manual"], reference["manual"], f"{levels[-1]} manual optimization")
    unbroken, resumed = results["two_optimizers"]
    assert_close(unbroken, reference["two_optimizers"], f"{levels[-1]} Muon beside AdamW")
    assert_close(resumed, reference["two_optimizers"], f"{levels[-1]} Muon + AdamW resumed")


def test_trainer_two_ranks_every_level(two_ranks, reference):
    results, out = two_ranks
    check(results, reference, LEVELS)
    # the clip bound: without it one process ends elsewhere (else the test proves nothing)
    clipped, unclipped = reference["clip_accum"][0], reference["unclipped"]
    assert max((clipped[k] - unclipped[k]).abs().max().item() for k in clipped) > 1e-3
    # bf16-mixed: computed in bf16 copies (no autocast), fp32 master weights, which moved
    # from the start as the fp32 run's did, up to bf16's rounding (AdamW's early steps are
    # nearly lr * sign(grad), so compare the mean change, not each element)
    bf16, dtypes = results["bf16"]
    assert dtypes == ["torch.bfloat16"]
    start, fp32 = run.fresh(2).state_dict(), reference["fp32"]
    for name in fp32:
        assert bf16[name].dtype == torch.float32, name
        moved = (fp32[name] - start[name]).abs().mean()
        assert (bf16[name] - fp32[name]).abs().mean() <= 0.2 * moved, name
    # ModelCheckpoint wrote zerokit checkpoints: directories of shards and an index
    ckpt = out / "ckpt-os" / "epoch=0-step=2.ckpt"
    assert (ckpt / "index.json").is_file()


def test_consolidated_for_one_process(two_ranks, reference, tmp_path):
    """`zerokit ckpt consolidate DIR --lightning OUT` of a checkpoint ModelCheckpoint wrote at
    2 ranks, level 'p_g_os': Lightning's one-file format, read by load_from_checkpoint and by
    a one-process Trainer's fit(ckpt_path=...), as Lightning's own file from one process is."""
    from zerokit.tools.cli import main as cli

    one = str(tmp_path / "one.ckpt")
    saved = two_ranks[1] / "ckpt-p_g_os" / "epoch=0-step=2.ckpt"
    assert cli(["ckpt", "consolidate", str(saved), "--lightning", one]) == 0
    got = torch.load(one, weights_only=True)
    want = torch.load(reference["epoch0"], weights_only=False)  # Lightning pickles hparams
    assert got.keys() == want.keys()
    for key in ("epoch", "global_step", "loops", "lr_schedulers", "hyper_parameters"):
        assert got[key] == want[key], key
    assert_close(got["state_dict"], want["state_dict"], "state_dict")
    (got_opt,), (want_opt,) = got["optimizer_states"], want["optimizer_states"]
    assert got_opt["param_groups"][0]["params"] == want_opt["param_groups"][0]["params"]
    assert got_opt["param_groups"][0]["lr"] == want_opt["param_groups"][0]["lr"]
    for i, state in want_opt["state"].items():
        assert_close(got_opt["state"][i], state, f"optimizer state of parameter {i}")

    model = run.Net.load_from_checkpoint(one)
    assert model.hparams.lr == run.LR != run.Net().hparams.lr
    assert_close(model.state_dict(), want["state_dict"], "load_from_checkpoint")
    # a one-process Trainer resumes from it and ends where the unbroken run ends
    model = run.fresh(2)
    torch.nn.init.zeros_(model.gain)  # resuming must not depend on the module's weights
    t = run.trainer("auto", 1, max_epochs=2)
    t.fit(model, ckpt_path=one)
    assert_close(run.params(t, model), reference["resume"], "resumed on one process")


def test_the_modules_own_state_dict_is_full(tmp_path):
    """At 'p_g_os' the LightningModule's parameters are empty between steps; its own
    ``state_dict()`` (in ``on_train_end``, after ``fit``) gathers, collectively, what one
    process's holds, as ``trainer.strategy.full_state_dict()`` does."""
    at_end, after = launch(tmp_path, 2, ("p_g_os",), "--own-state-dict")["p_g_os"]
    want_end, want_after = run.run_own_state_dict("auto", 1)
    assert_close(at_end, want_end, "state_dict() in on_train_end")
    assert_close(after, want_after, "state_dict() after fit")


@pytest.mark.slow
def test_trainer_three_ranks(tmp_path, reference):
    """Uneven shards: 132 parameters over 3 ranks, at one level (every level: test_fabric)."""
    check(launch(tmp_path, 3, ("p_g_os",)), reference, ("p_g_os",))


@pytest.mark.slow
def test_trainer_under_torchrun(tmp_path, reference):
    """torchrun starts the ranks (Lightning launches none): the same results."""
    from dist_helpers import run_torchrun

    script = os.path.join(HERE, "lightning_run.py")
    done = run_torchrun(
        script, 2, str(tmp_path), "--levels", "os,p_g_os", cwd=tmp_path, timeout=600
    )
    assert done.returncode == 0, done.stderr[-6000:]
    check(torch.load(os.path.join(tmp_path, "results.pt")), reference, ("os", "p_g_os"))


def test_import_zerokit_imports_no_lightning():
    code = (
        "import sys, zerokit, zerokit.integrations, zerokit.tools.cli, zerokit.checkpoint.lightning_file; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(HERE))


def test_names_need_the_import():
    """Lightning finds no third-party strategy by itself: a name is known once
    ``zerokit.integrations.lightning`` is imported, in the Trainer's and Fabric's registries."""
    code = """
import lightning.pytorch as pl
from lightning.fabric import Fabric
kw = dict(accelerator="cpu", devices=2, logger=False)
try:
    pl.Trainer(strategy="zerokit_os_g", **kw)
    raise SystemExit("known before the import")
except ValueError as e:
    assert "zerokit_os_g" in str(e), e
import zerokit.integrations.lightning as zl
for name, level in [("zerokit", "p_g_os"), ("zerokit_os", "os"), ("zerokit_os_g", "os_g"),
                    ("zerokit_p_g_os", "p_g_os")]:
    strategy = pl.Trainer(strategy=name, **kw).strategy
    assert type(strategy) is zl.ZeroKitStrategy and strategy.level == level, (name, strategy)
    strategy = Fabric(strategy=name, accelerator="cpu", devices=2).strategy
    assert type(strategy) is zl.ZeroKitFabricStrategy and strategy.level == level, name
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=os.path.dirname(HERE), timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def test_refused_options_named():
    from lightning.pytorch import Trainer
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
    from lightning.pytorch.strategies import StrategyRegistry

    class MyIO(TorchCheckpointIO):
        pass

    from zerokit.integrations.lightning import ZeroKitStrategy

    for name, level in [("zerokit", "p_g_os"), ("zerokit_os", "os"), ("zerokit_os_g", "os_g"),
                        ("zerokit_p_g_os", "p_g_os")]:  # fmt: skip
        assert StrategyRegistry[name]["init_params"] == {"level": level}
    kw = {"accelerator": "cpu", "devices": 2, "logger": False}
    with pytest.raises(ValueError, match="sync_batchnorm"):
        Trainer(strategy=ZeroKitStrategy("os"), sync_batchnorm=True, **kw)
    for precision in ("bf16-true", "16-true", "64-true"):
        with pytest.raises(ValueError, match=f"precision='{precision}'"):
            Trainer(strategy=ZeroKitStrategy("os"), precision=precision, **kw)
    with pytest.raises(ValueError, match=r"plugins=\[AsyncCheckpointIO"):
        Trainer(strategy="zerokit_os", plugins=[AsyncCheckpointIO()], **kw)
    with pytest.raises(ValueError, match=r"plugins=\[MyIO"):
        Trainer(strategy=ZeroKitStrategy("os", checkpoint_io=MyIO()), **kw)
    Trainer(strategy="zerokit_os", plugins=[TorchCheckpointIO()], **kw)  # the default: unused
    with pytest.raises(TypeError, match="find_unused_parameters"):
        ZeroKitStrategy("os", find_unused_parameters=True)
    with pytest.raises(ValueError, match="unknown level"):
        ZeroKitStrategy("zero3")


def test_resuming_from_a_one_file_checkpoint_is_refused(tmp_path):
    from zerokit.integrations.lightning import ZeroKitStrategy

    (tmp_path / "ddp.ckpt").write_bytes(b"a Lightning file")
    with pytest.raises(ValueError, match="load_from_checkpoint"):
        ZeroKitStrategy("os").load_checkpoint(tmp_path / "ddp.ckpt")
