"""PEFT LoRA under the Trainer and TRL's SFTTrainer, under zerokit (hf_trainer.py), each equal
to the same trainer on one process (same global batch of 12, accumulation 2, clipping that
bites, warmup, eval loop; tests/hf_trainer_run.py). Tolerance 5e-6 as in test_hf_trainer.py
(Trainer + DDP on these ranks: 4.8e-7 loss, 1.8e-7 weights; zerokit measured the same)."""

import os
import sys

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("trl")
sys.path.insert(0, os.path.dirname(__file__))

import hf_trainer_run as R
from dist_helpers import run_distributed
from test_hf_trainer import LOSS_TOL, WEIGHT_TOL, _distances


@pytest.mark.parametrize(
    "level,world", [("p_g_os", 3), pytest.param("os_g", 2, marks=pytest.mark.slow)]
)
def test_lora_equal_to_one_process(tmp_path, level, world):
    """Base frozen and sharded, adapters trained; save_model writes the adapter as PEFT does."""
    opts = {"level": level, "lora": True, "max_grad_norm": 0.03}  # LoRA's norms are ~0.07
    R.reference(opts, str(tmp_path / "ref"))
    run_distributed(R.run, world, opts, str(tmp_path / "zk"))
    loss, weight = _distances(str(tmp_path / "ref"), str(tmp_path / "zk"))
    assert loss <= LOSS_TOL and weight <= WEIGHT_TOL, (loss, weight)
    model_dir = tmp_path / "zk" / "model"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(model_dir))
    _, adapter = R.results(str(tmp_path / "zk"))
    assert adapter and all("lora_" in name for name in adapter)  # the adapter only
    assert any(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k)  # trained
    # PEFT loads it back onto a fresh base
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(R.tiny_llama(), model_dir)
    state = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert len(state) == len(adapter)
    for name, value in adapter.items():
        got = [v for k, v in state.items() if k.replace(".default", "") == name]
        torch.testing.assert_close(got[0], value, rtol=0, atol=0)


@pytest.mark.parametrize(
    "level,world", [("p_g_os", 3), pytest.param("os", 2, marks=pytest.mark.slow)]
)
def test_sft_trainer_equal_to_one_process(tmp_path, level, world):
    """TRL's SFTTrainer (zero_trainer_class(SFTTrainer)) on a tiny chat dataset, a tokenizer
    built here with a chat template; padded batches of uneven lengths."""
    R.sft_reference(str(tmp_path / "ref"))
    run_distributed(R.sft_rank, world, {"level": level}, str(tmp_path / "zk"))
    loss, weight = _distances(str(tmp_path / "ref"), str(tmp_path / "zk"))
    assert loss <= LOSS_TOL and weight <= WEIGHT_TOL, (loss, weight)
