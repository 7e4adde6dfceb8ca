"""ZeroKitFabricStrategy in Lightning Fabric equals one process in plain PyTorch.

One launch of tests/fabric_run.py (``python script.py``, ``fabric.launch()`` starting the
ranks) trains every level: ``fabric.backward``, ``fabric.no_backward_sync`` accumulation, a
binding ``fabric.clip_gradients(max_norm=...)``, ``fabric.save`` mid-run and ``fabric.load``
into a fresh model at another level. Tolerance 2e-5 (fp32; AdamW over 4 steps).
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("lightning")

import fabric_run as run
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TOL = 2e-5


def assert_close(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name in want:
        err = (got[name] - want[name]).abs().max().item()
        assert err <= TOL, f"{what}: {name} differs from one process by {err:.3g}"


def launch(tmp_path, devices: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, os.path.join(HERE, "fabric_run.py"), str(tmp_path)]
    cmd += ["--devices", str(devices)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-6000:]
    return torch.load(os.path.join(tmp_path, "results.pt"))


def check(results: dict) -> None:
    want, norms = run.train_one_process()
    # the clip binds: every step's norm is well over it (else the test proves nothing)
    assert min(norms) > 2 * run.CLIP
    for i, level in enumerate(run.LEVELS):
        got = results[level]
        assert_close(got["params"], want, f"{level}")
        for step, (n, m) in enumerate(zip(got["norms"], norms, strict=True)):
            assert abs(n.item() - m.item()) <= TOL * m.item(), f"{level} step {step} norm"
        # each step: the first micro-batch accumulates locally, the last reduces
        assert got["syncs"] == [False, True] * run.STEPS, f"{level}: {got['syncs']}"
        resumed_at = run.LEVELS[(i + 1) % len(run.LEVELS)]
        assert got["step"] == run.SAVE_AT and got["remainder"] == {}
        assert_close(got["resumed"], want, f"saved at {level}, resumed at {resumed_at}")
    # Muon beside AdamW: fabric.setup(model, muon, adamw), saved at 'p_g_os', resumed at 'os_g'
    want = run.two_one_process()
    assert_close(results["two"]["unbroken"], want, "Muon + AdamW")
    assert_close(results["two"]["resumed"], want, "Muon + AdamW resumed at 'os_g'")


def test_fabric_two_ranks_every_level(tmp_path):
    check(launch(tmp_path, 2))
    assert (tmp_path / "ckpt-os" / "index.json").is_file()  # a zerokit checkpoint directory


@pytest.mark.slow
def test_fabric_three_ranks_every_level(tmp_path):
    """Uneven shards: 130 parameters over 3 ranks (each of 6 rows per global batch: 2)."""
    check(launch(tmp_path, 3))


def test_fabric_names_and_refusals():
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    from zerokit.integrations.fabric import ZeroKitFabricStrategy

    for name, level in [("zerokit", "p_g_os"), ("zerokit_os", "os"), ("zerokit_os_g", "os_g"),
                        ("zerokit_p_g_os", "p_g_os")]:  # fmt: skip
        assert STRATEGY_REGISTRY[name]["strategy"] is ZeroKitFabricStrategy
        assert STRATEGY_REGISTRY[name]["init_params"] == {"level": level}
    with pytest.raises(ValueError, match="precision='bf16-true'"):
        Fabric(accelerator="cpu", devices=2, strategy="zerokit_os", precision="bf16-true")
    with pytest.raises(TypeError, match="find_unused_parameters"):
        ZeroKitFabricStrategy("os", find_unused_parameters=True)

    class MyIO(TorchCheckpointIO):
        pass

    with pytest.raises(ValueError, match=r"Fabric\(plugins=\[MyIO"):
        Fabric(accelerator="cpu", devices=2, strategy="zerokit_os", plugins=[MyIO()])


def test_level_given_only_in_config_is_the_level(tmp_path):
    """``ZeroKitFabricStrategy(config=ShardingConfig(level="os"))`` trains at 'os' (its own
    level argument is not given, so it does not compete with config's); one given both ways
    differently is refused naming both. One rank: the wrap, not the training, is under test."""
    import logging

    from lightning.fabric import Fabric
    from torch import nn

    from zerokit import ShardingConfig
    from zerokit.integrations.fabric import ZeroKitFabricStrategy

    environ = dict(os.environ)  # Fabric sets the rendezvous variables: none may leak
    logger = logging.getLogger("zerokit")  # nor the handler the wrap installs
    handlers, level = list(logger.handlers), logger.level
    try:
        fabric = Fabric(accelerator="cpu", devices=1,
                        strategy=ZeroKitFabricStrategy(config=ShardingConfig(level="os")))  # fmt: skip
        fabric.launch()
        model = nn.Linear(4, 4)
        model, _ = fabric.setup(model, torch.optim.AdamW(model.parameters()))
        assert model.module._zerokit.level == "os"
        both = ZeroKitFabricStrategy("os_g", config=ShardingConfig(level="os"))
        other = nn.Linear(4, 4)
        with pytest.raises(ValueError, match=r"level is given twice.*'os_g'.*'os'"):
            both.setup_module_and_optimizers(other, [torch.optim.SGD(other.parameters())])
    finally:  # the forked ranks of later tests start from this process
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
        logger.handlers[:] = handlers
        logger.setLevel(level)
