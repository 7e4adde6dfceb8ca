"""Expert parallelism through the doors users come in by: a tiny Mixtral, its experts split
over ep = 2 of 2 ranks (``zerokit.moe.apply_expert_parallel`` before the model is handed
in), trained by Hugging Face's Trainer, Lightning's Trainer and Fabric, equals the same door
on one process holding the whole model, on the same global batch (tests/moe_doors_run.py).

Tolerances: 2e-5 on losses and parameters, tests/test_moe.py's (fp32, AdamW, a few steps;
the distance measured is given at each test).
"""

import os
import sys

import pytest
import torch

pytest.importorskip("accelerate")
sys.path.insert(0, os.path.dirname(__file__))

import hf_trainer_run as R
import moe_doors_run as D
from dist_helpers import run_distributed
from moe_models import assert_same_as_reference

from zerokit.moe import ExpertParallelExperts

TOL = 2e-5
HF_TOL = 5e-6  # tests/test_hf_trainer.py's: ten times Trainer + DDP's distance there


def _hf_distance(ref: str, got: str, skip=()) -> float:
    """The largest difference in the logged losses and the exported weights, each directory
    read by ``from_pretrained`` (the plain Trainer's ``save_pretrained`` writes one tensor per
    expert, zerokit's export the 3-D parameters: both load as the model's)."""
    (logs_a, _), (logs_b, _) = R.results(ref), R.results(got)
    w_a, w_b = (_exported(run) for run in (ref, got))
    assert len(logs_a) == len(logs_b) and sorted(w_a) == sorted(w_b)
    losses = [abs(a[k] - b[k]) for a, b in zip(logs_a, logs_b) for k in a
              if k.endswith("loss") and k not in skip]  # fmt: skip
    assert any(k == "eval_loss" for a in logs_a for k in a)  # the eval loop ran
    weights = [(w_a[k] - w_b[k]).abs().max().item() for k in w_a]
    return max(losses + weights)


def _exported(run: str) -> dict[str, torch.Tensor]:
    from transformers import MixtralForCausalLM

    return MixtralForCausalLM.from_pretrained(os.path.join(run, "model")).state_dict()


@pytest.mark.parametrize(
    "opts",
    [{"level": "p_g_os"}, {"level": "os_g", "checkpointing": True}],
    ids=["p_g_os", "os_g-gradient_checkpointing"],
)
def test_hf_trainer_ep2_equals_one_process(tmp_path, opts):
    """ZeroTrainer at world 2, ep 2: the logged losses and the exported (whole) experts.
    Gradient checkpointing runs each layer's all-to-alls again in backward, on every rank
    alike. Measured: 4.8e-7 both."""
    D.hf_reference(str(tmp_path / "ref"))
    run_distributed(D.hf_rank, 2, {"ep": 2, **opts}, str(tmp_path / "zk"))
    dist = _hf_distance(str(tmp_path / "ref"), str(tmp_path / "zk"))
    assert dist <= HF_TOL, dist


def _equal(got: dict, want: dict, what: str) -> None:
    """Losses, clip norms (the clip binds) and every parameter, a rank's experts against the
    same experts of the whole model."""
    assert min(want["norms"]) > D.CLIP, f"{what}: the clip does not bind"
    assert any(isinstance(m, ExpertParallelExperts) for m in got["model"].modules()), what
    for key in ("losses", "norms"):
        for step, (g, w) in enumerate(zip(got[key], want[key], strict=True)):
            assert abs(g - w) <= TOL, f"{what}: step {step}: {key} {g} != {w}"
    assert_same_as_reference(got["model"], want["model"], TOL, what)


def _fabric(rank, world, level, ckpt, resume_level):
    got, want = D.fabric_rank(rank, world, level, ckpt, resume_level), D.reference(world)
    _equal(got, want, f"Fabric {level}")
    what = f"Fabric saved at {level}, resumed at {resume_level}"
    assert_same_as_reference(got["resumed"], want["model"], TOL, what)


def test_fabric_ep2_equals_one_process(tmp_path):
    """Trained at 'p_g_os'; saved after 2 steps, a fresh split model loads it at 'os' and
    trains the third step: both equal one process."""
    pytest.importorskip("lightning")
    run_distributed(_fabric, 2, "p_g_os", str(tmp_path / "ckpt"), "os")


def _lightning(rank, world, level):
    got, want = D.lightning_rank(rank, world, level), D.reference(world)
    _equal(got, want, f"Lightning {level}")
    # strategy.full_state_dict(): the LightningModule's names (its ``model.``), every expert
    whole = {f"model.{k}": v for k, v in want["model"].state_dict().items()}
    assert got["whole"].keys() == whole.keys()
    for name, value in whole.items():
        torch.testing.assert_close(got["whole"][name], value, atol=TOL, rtol=0, msg=name)


def _lightning_resumed(rank, world, ckpt):
    got, want = D.lightning_resumed(rank, world, ckpt), D.reference(world, epochs=2)
    for step, (g, w) in enumerate(zip(got["losses"], want["losses"][D.STEPS :], strict=True)):
        assert abs(g - w) <= TOL, f"resumed: step {step}: loss {g} != {w}"
    assert_same_as_reference(got["model"], want["model"], TOL, "Lightning resumed at 'os_g'")


def test_lightning_ep2_resumes_as_the_unbroken_run(tmp_path):
    """An epoch at 'p_g_os' saved (``trainer.save_checkpoint``), a fresh module resumed at
    'os_g' for the second (``fit(ckpt_path=)``): one process's 2 epochs."""
    pytest.importorskip("lightning")
    run_distributed(_lightning_resumed, 2, str(tmp_path / "ckpt"))


def _lightning_validate(rank, world):
    got = D.lightning_rank(rank, world, "p_g_os", validate=True)["losses"]
    model = D.tiny_moe("mixtral")
    with torch.no_grad():
        want = [model(input_ids=b, labels=b).loss.item() for b in D.batches(D.STEPS, 2 * world)]
    assert len(got) == len(want) and max(abs(g - w) for g, w in zip(got, want)) <= TOL, got


def test_lightning_ep2_equals_one_process():
    pytest.importorskip("lightning")
    run_distributed(_lightning, 2, "os_g")


def test_hf_trainer_ep2_aux_loss(tmp_path):
    """``output_router_logits=True``: the load-balancing loss from the whole batch's routing
    (zerokit.moe's "global"), with ``average_tokens_across_devices=False``. The Trainer's
    default (True) multiplies the model's loss by the world size to undo its division by the
    global token count, the aux term too, under DDP as here (2.0 off in the loss, measured):
    see docs/GUIDE.md. The eval loss is left out: a rank's eval batch is
    ``per_device_eval_batch_size``, so the global one (and its aux loss) grows with the world.
    Measured: 4.8e-7."""
    opts = {"aux": True, "extra": {"average_tokens_across_devices": False}}
    D.hf_reference(str(tmp_path / "ref"), opts)
    run_distributed(D.hf_rank, 2, {"level": "os_g", "ep": 2, **opts}, str(tmp_path / "zk"))
    dist = _hf_distance(str(tmp_path / "ref"), str(tmp_path / "zk"), skip=("eval_loss",))
    assert dist <= HF_TOL, dist


def test_hf_trainer_ep2_resumes_as_the_unbroken_run(tmp_path):
    """checkpoint-2 written at 'os_g' with ep 2 (the experts saved as the whole model's
    [E, ...] tensors beside the Trainer's own files), resumed at 'p_g_os' with ep 2: equal
    to the uninterrupted one-process run."""
    D.hf_reference(str(tmp_path / "ref"))
    run_distributed(D.hf_rank, 2, {"level": "os_g", "ep": 2, "save_steps": 2}, str(tmp_path / "a"))
    ckpt = str(tmp_path / "a" / "checkpoint-2")
    assert {"zerokit", "scheduler.pt", "trainer_state.json"} <= set(os.listdir(ckpt))
    resumed = {"level": "p_g_os", "ep": 2, "resume": ckpt}
    run_distributed(D.hf_rank, 2, resumed, str(tmp_path / "b"))
    # train_loss is the mean over this train() call's steps, 3-4 here: the Trainer's own way
    dist = _hf_distance(str(tmp_path / "ref"), str(tmp_path / "b"), skip=("train_loss",))
    assert dist <= HF_TOL, dist


def _fabric_eval(rank, world):
    batch = D.batches(1, 2 * world)[0]
    with torch.no_grad():
        want = D.tiny_moe("mixtral")(input_ids=batch, labels=batch).loss.item()
    got = D.fabric_eval(rank, world)
    assert abs(got - want) <= TOL, (got, want)


def test_fabric_ep2_setup_without_optimizer_keeps_each_ranks_experts():
    """``fabric.setup(model)`` (evaluation: nothing sharded) starts every rank from rank 0's
    dense weights, and each rank's experts from its own (they are other experts than rank
    0's): the loss one process computes."""
    pytest.importorskip("lightning")
    run_distributed(_fabric_eval, 2)


def test_lightning_ep2_validate_alone():
    """``trainer.validate`` with no fit (nothing sharded): each rank keeps its own experts
    (rank 0 holds others), the losses one process computes."""
    pytest.importorskip("lightning")
    run_distributed(_lightning_validate, 2)


def test_hf_trainer_refusals_with_split_experts(tmp_path):
    """``optim="adafactor"`` (whole parameters, and a rank holds E / ep experts of each) when
    the Trainer builds it; ``save_model`` before training (rank 0 holds only its experts)."""
    run_distributed(D.hf_refusals, 2, str(tmp_path))
