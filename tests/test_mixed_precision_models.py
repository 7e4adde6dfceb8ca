"""Mixed precision on ordinary models: a CNN with BatchNorm and a float-input MLP train at
every level in bf16 and fp16 (with the loss scaler), tracking the same run in fp32.

BatchNorm keeps per-rank statistics (as with DDP), so the reference here is zerokit itself
without a policy: the same sharded run in fp32. The tolerance is bf16's: losses within 3e-2
relative over 4 steps (a bf16 mantissa is 8 bits, 4e-3 relative per rounding)."""

import pytest
import torch
from dist_helpers import run_distributed
from torch import nn

import zerokit

TOL = 3e-2


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 10))


def _batches(kind, rank, steps=4):
    gen = torch.Generator().manual_seed(100 + rank)
    shape = (4, 3, 6, 6) if kind == "cnn" else (4, 12)
    return [
        (torch.randn(shape, generator=gen), torch.randint(0, 10, (4,), generator=gen))
        for _ in range(steps)
    ]


def _train(kind, level, policy, scaler, rank):
    model = _cnn() if kind == "cnn" else _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, scaler = zerokit.group_sharded_parallel(
        model, opt, level, mixed_precision=policy, scaler=scaler
    )
    losses = []
    for x, y in _batches(kind, rank):
        out = model(x)  # float32 input: cast to the compute dtype by the policy
        loss = nn.functional.cross_entropy(out.float(), y)
        (scaler.scale(loss) if scaler else loss).backward()
        scaler.step(opt) if scaler else opt.step()
        if scaler:
            scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    return model, out, losses


def _every_level(rank, world_size, both_dtypes=True):
    """Each model at each level in bf16 and fp16; with ``both_dtypes=False`` (the fast subset)
    in one of them, bf16 and fp16 taken in turn."""
    combos = [(kind, level) for kind in ("cnn", "mlp") for level in ("os", "os_g", "p_g_os")]
    for i, (kind, level) in enumerate(combos):
        _, _, want = _train(kind, level, None, None, rank)
        dtypes = (torch.bfloat16, torch.float16)
        for dtype in dtypes if both_dtypes else dtypes[i % 2 : i % 2 + 1]:
            policy = zerokit.MixedPrecision(param_dtype=dtype)
            scaler = zerokit.ShardedGradScaler() if dtype == torch.float16 else None
            model, out, got = _train(kind, level, policy, scaler, rank)
            what = f"{kind} {level} {dtype}"
            assert out.dtype == dtype, what
            for g, w in zip(got, want):
                assert abs(g - w) <= TOL * abs(w), f"{what}: {got} vs fp32 {want}"
            if kind == "cnn":  # BatchNorm stays fp32 (weight and running statistics)
                bn = model[1]
                assert bn.running_mean.dtype == torch.float32, what
                sd = model.state_dict()
                assert sd["1.weight"].dtype == torch.float32, what


@pytest.mark.slow
def test_cnn_with_batchnorm_and_float_input_mlp_at_every_level():
    run_distributed(_every_level, 2)


def test_cnn_with_batchnorm_and_float_input_mlp_at_every_level_one_dtype_each():
    """The fast subset's share of the test above: bf16 and fp16 in turn, not both."""
    run_distributed(_every_level, 2, False)


def _switches(rank, world_size):
    # cast_forward_inputs=False: a float32 batch meets bf16 weights and torch refuses
    policy = zerokit.MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=False)
    model = _mlp()
    model, _, _ = zerokit.group_sharded_parallel(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "os_g", mixed_precision=policy
    )
    with pytest.raises(RuntimeError, match="dtype"):
        model(torch.randn(2, 12))
    # output_dtype: the model's outputs come back in fp32
    policy = zerokit.MixedPrecision(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    model = _mlp()
    model, _, _ = zerokit.group_sharded_parallel(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "p_g_os", mixed_precision=policy
    )
    assert model(torch.randn(2, 12)).dtype == torch.float32
    # no full-precision modules: BatchNorm in bf16 meets fp32 running statistics and fails
    policy = zerokit.MixedPrecision(param_dtype=torch.bfloat16, full_precision_modules=())
    model = _cnn()
    model, _, _ = zerokit.group_sharded_parallel(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "os", mixed_precision=policy
    )
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 3, 6, 6))


def test_policy_switches():
    run_distributed(_switches, 2)
