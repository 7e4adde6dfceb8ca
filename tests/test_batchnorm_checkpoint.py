"""A checkpoint keeps rank 0's BatchNorm statistics (docs/GUIDE.md, "BatchNorm and other batch
statistics"): with the default sync_buffers=False each rank's running statistics are its own;
`zerokit.checkpoint.save` stores rank 0's and `load` gives every rank those."""

import torch
import torch.distributed as dist
from dist_helpers import run_distributed
from torch import nn

import zerokit
from zerokit import checkpoint

LEVELS = ("os", "p_g_os")
BUFFERS = ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 2)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.lin(x))))


def _wrapped(level: str, seed: int):
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, level)  # sync_buffers=False
    return model, opt


def _train(model, opt, steps: int, seed: int, shift: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=gen) + shift
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _buffers(model) -> dict[str, torch.Tensor]:
    named = dict(model.named_buffers())
    return {name: named[name].clone() for name in BUFFERS}


def _from_rank0(buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {name: t.clone() for name, t in buffers.items()}
    for t in out.values():
        dist.broadcast(t, src=0)
    return out


def _save_and_load(rank, world_size, root):
    for level in LEVELS:
        path = f"{root}/{level}"
        model, opt = _wrapped(level, seed=0)
        # each rank sees its own data, shifted by its rank: its running statistics differ
        _train(model, opt, steps=3, seed=rank, shift=3.0 * rank)
        own = _buffers(model)
        rank0 = _from_rank0(own)
        if rank != 0:
            assert not torch.equal(own["bn.running_mean"], rank0["bn.running_mean"]), level
            assert not torch.equal(own["bn.running_var"], rank0["bn.running_var"]), level
        # model.state_dict() gives this rank's own buffers
        state = model.state_dict()
        for name in BUFFERS:
            torch.testing.assert_close(state[name], own[name], atol=0, rtol=0)
        checkpoint.save(path, model, opt)
        # the rank's own statistics are untouched by the save
        for name, t in _buffers(model).items():
            torch.testing.assert_close(t, own[name], atol=0, rtol=0)

        # a fresh model whose statistics differ from both ranks' saved ones
        fresh, fresh_opt = _wrapped(level, seed=100 + rank)
        _train(fresh, fresh_opt, steps=2, seed=50 + rank, shift=-5.0 - rank)
        before = _buffers(fresh)
        assert not torch.equal(before["bn.running_mean"], rank0["bn.running_mean"]), level
        checkpoint.load(path, fresh, fresh_opt)
        loaded = _buffers(fresh)
        for name in BUFFERS:  # every rank now holds rank 0's saved statistics
            torch.testing.assert_close(loaded[name], rank0[name], atol=0, rtol=0, msg=name)
        if rank != 0:  # not its own
            assert not torch.equal(loaded["bn.running_mean"], own["bn.running_mean"]), level


def test_checkpoint_keeps_rank0_batchnorm_statistics(tmp_path):
    run_distributed(_save_and_load, 2, str(tmp_path))
