"""`zerokit plan / compare / verify --model` take an unmodified Hugging Face causal LM (its
output's `.logits`; its `.loss` when labels are passed), and a forward outside the contract is
refused with what a factory must return."""

import pytest
import torch

from zerokit.tools import cli
from zerokit.tools.workload import CONTRACT, default_loss, output_tensor

pytest.importorskip("transformers")


def _run(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_takes_an_unmodified_hf_gpt2(capsys):
    code, out, err = _run(
        capsys, "plan", "--model", "verify_models:tiny_hf_gpt2", "--world", "2", "--level",
        "p_g_os", "--seq", "16",
    )  # fmt: skip
    assert code == 0, err
    assert "reduce_scatter" in out and "sent per rank per step" in out


@pytest.mark.slow  # four levels, each in fresh processes: about a minute
def test_compare_takes_an_unmodified_hf_llama(capsys):
    code, out, err = _run(
        capsys, "compare", "--model", "verify_models:tiny_hf_llama", "--nproc", "2", "--steps",
        "2", "--batch", "4", "--seq", "16",
    )  # fmt: skip
    assert code == 0, err
    rows = {line.split()[0]: line.split()[-1] for line in out.splitlines()[2:6]}
    assert set(rows) == {"ddp", "os", "os_g", "p_g_os"}
    losses = [float(v) for v in rows.values()]  # every level trains the same model alike
    assert max(losses) - min(losses) <= 1e-4, out


def test_verify_takes_an_unmodified_hf_llama(capsys):
    code, out, err = _run(
        capsys, "verify", "--model", "verify_models:tiny_hf_llama", "--level", "os_g",
        "--seq", "8", "--steps", "2",
    )  # fmt: skip
    assert code == 0, out + err
    assert "PASS" in out


def test_a_forward_outside_the_contract_is_told_what_a_factory_returns(capsys):
    code, _, err = _run(capsys, "verify", "--model", "verify_models:no_logits", "--level", "os")
    assert code == 2
    assert "returned dict" in err and CONTRACT in err, err


class _Output:
    """What a Hugging Face model returns, reduced to the two fields read."""

    def __init__(self, logits, loss=None):
        self.logits, self.loss = logits, loss


def test_the_default_loss_reads_logits_and_the_models_own_loss():
    logits = torch.randn(2, 3, 5)
    targets = torch.randint(0, 5, (2, 3))
    assert output_tensor(_Output(logits)) is logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 5), targets.reshape(-1))
    assert torch.equal(default_loss(_Output(logits), targets), want)
    own = torch.tensor(0.25)  # labels were passed: the model's loss is the loss
    assert default_loss(_Output(logits, own), targets) is own
