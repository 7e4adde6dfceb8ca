"""The flat bucket layout is pure data: tested with no process group at all."""

import pytest
import torch

from zerokit.core.bucket_layout import ParamSpec, plan_buckets

F32, BF16, CPU = torch.float32, torch.bfloat16, torch.device("cpu")


def specs(*shapes, dtype=F32):
    return [ParamSpec(f"p{i}", s, dtype, CPU) for i, s in enumerate(shapes)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shards_partition_every_element_exactly_once(world_size):
    params = specs((5, 3), (1,), (7,), (2, 2, 2), (3,))
    for bucket in plan_buckets(params, world_size, max_bucket_numel=16):
        assert bucket.padded_numel % world_size == 0
        assert bucket.padded_numel - bucket.numel < world_size  # padding only to divide evenly
        covered = {slot: [] for slot in range(len(bucket.slots))}
        for rank in range(world_size):
            lo, hi = bucket.shard_range(rank)
            assert hi - lo == bucket.shard_numel
            for piece in bucket.pieces(rank):
                covered[piece.slot].append((piece.start, piece.end))
                flat_start = bucket.slots[piece.slot].offset + piece.start
                assert lo <= flat_start and flat_start + piece.numel <= hi
        for slot_index, ranges in covered.items():
            elements = sorted(i for start, end in ranges for i in range(start, end))
            assert elements == list(range(bucket.slots[slot_index].numel))


def test_buckets_follow_registration_order_and_size_limit():
    params = specs((4,), (4,), (4,), (10,), (2,))
    buckets = plan_buckets(params, 2, max_bucket_numel=8)
    assert [[s.param_index for s in b.slots] for b in buckets] == [[0, 1], [2], [3], [4]]
    assert buckets[2].numel == 10  # larger than the limit: a bucket of its own


def test_dtypes_never_share_a_bucket():
    params = specs((4,)) + specs((4,), dtype=BF16) + specs((4,))
    buckets = plan_buckets(params, 3, max_bucket_numel=100)
    assert [(b.dtype, [s.param_index for s in b.slots]) for b in buckets] == [
        (F32, [0, 2]),
        (BF16, [1]),
    ]


def test_tensor_smaller_than_world_size_leaves_empty_shards():
    (bucket,) = plan_buckets(specs((1,)), 4, max_bucket_numel=100)
    assert bucket.padded_numel == 4 and bucket.shard_numel == 1
    assert [len(bucket.pieces(r)) for r in range(4)] == [1, 0, 0, 0]


def test_empty_parameters_are_skipped_and_bad_arguments_refused():
    assert plan_buckets(specs((0,), (3,)), 2, 10)[0].slots[0].param_index == 1
    with pytest.raises(ValueError, match="world_size"):
        plan_buckets(specs((3,)), 0, 10)
    with pytest.raises(ValueError, match="buffer_max_size"):
        plan_buckets(specs((3,)), 2, 0)
