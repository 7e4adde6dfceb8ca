"""A tensor-parallel linear layer given an input of the wrong width says what to pass instead
(the bare matmul error named neither the layer nor the split): RowParallelLinear with
input_is_parallel=False given one rank's slice, with True given the full input, and a
ColumnParallelLinear given a slice. Right widths still run."""

import pytest
import torch
from dist_helpers import run_distributed

import zerokit
from zerokit import tensor_parallel as tp


def _check_widths(rank, world_size):
    layout = zerokit.init_hybrid_parallel(dp_degree=1, tp_degree=2)
    torch.manual_seed(0)
    full, part = torch.randn(3, 16), torch.randn(3, 8)
    splitting = tp.RowParallelLinear(16, 4, input_is_parallel=False, layout=layout)
    parallel = tp.RowParallelLinear(16, 4, input_is_parallel=True, layout=layout)
    column = tp.ColumnParallelLinear(16, 4, layout=layout)
    assert splitting(full).shape == parallel(part).shape == column(full).shape == (3, 4)
    cases = [
        (
            splitting,
            part,
            r"takes the full input, \[\.\.\., 16\]; got \[\.\.\., 8\].*"
            r"pass input_is_parallel=True",
        ),
        (
            parallel,
            full,
            r"slice of the input \(2 tp ranks\), \[\.\.\., 8\]; got \[\.\.\., 16\]"
            r".*pass input_is_parallel=False",
        ),
        (column, part, r"ColumnParallelLinear\(in_features=16\).*got \[\.\.\., 8\].*gather it"),
        (splitting, torch.randn(3, 5), r"RowParallelLinear\(in_features=16\) takes the full"),
    ]
    for layer, x, message in cases:
        with pytest.raises(ValueError, match=message):
            layer(x)


def test_wrong_input_width_says_what_to_pass():
    run_distributed(_check_widths, 2)
