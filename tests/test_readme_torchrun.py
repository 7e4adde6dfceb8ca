"""The README's first example, as a user runs it: `torchrun --nproc-per-node 2 train.py` with
`dist.init_process_group()` and no backend (torch names that group 'undefined': gloo for CPU
tensors, NCCL for CUDA ones), training every level and saving and loading a checkpoint."""

import textwrap

import pytest
from dist_helpers import run_torchrun

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch, torch.distributed as dist, zerokit
    from zerokit.models.gpt import GPT, GPTConfig, lm_loss, synthetic_batch

    dist.init_process_group()  # as the README writes it: no backend
    assert dist.get_backend() != "gloo"  # the case this test is about
    path = sys.argv[1]
    for level in ("os", "os_g", "p_g_os"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        model, opt, _ = zerokit.group_sharded_parallel(model, opt, level=level)
        for step in range(2):
            x, y = synthetic_batch(64, 2, 16, seed=step * 10 + dist.get_rank())
            lm_loss(model(x), y).backward()
            zerokit.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()
        zerokit.checkpoint.save(f"{path}/{level}", model, opt)
        zerokit.checkpoint.load(f"{path}/{level}", model, opt)
    rank = dist.get_rank()
    dist.destroy_process_group()
    print(f"rank {rank} done, still initialized: {dist.is_initialized()}", flush=True)
    """
)


@pytest.mark.slow
def test_readme_example_under_torchrun_without_a_backend(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = run_torchrun(script, 2, str(tmp_path / "ckpt"))
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):  # one line each (the ranks share stdout: whole lines only)
        assert f"rank {rank} done, still initialized: False" in done.stdout, done.stdout
