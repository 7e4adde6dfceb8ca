"""An async save's staging: host buffers reused between saves (the first save allocates, the
next ones copy into the same memory), prewarmed on request, their bytes reported, and what
is written still the state at the call at world sizes 2 and 3 (uneven shards)."""

import pytest
import torch
from dist_helpers import run_distributed
from torch import nn

import zerokit
from zerokit import checkpoint
from zerokit.checkpoint import background
from zerokit.checkpoint.holdings import collect


def _model(value: float):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    opt = torch.optim.AdamW(model.parameters())
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, "os_g")
    model(torch.ones(2, 7)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _primary_bytes(model, opt) -> int:
    return sum(
        c.tensor.numel() * c.tensor.element_size()
        for c in collect(model, opt).chunks
        if c.primary and c.tensor.numel()
    )


def _reused(rank, world_size, path, prewarm):
    model, opt = _model(1.0)
    if prewarm:
        warmed = checkpoint.prewarm_async_save(model, opt)
        assert warmed == _primary_bytes(model, opt)
    before = [b.data_ptr() for b in background._STAGING.buffers]
    checkpoint.async_save(path, model, opt).result()
    first = [b.data_ptr() for b in background._STAGING.buffers]
    if prewarm:
        assert first == before, "the first save did not use the prewarmed buffers"
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(2.0)
    future = checkpoint.async_save(path, model, opt)
    with torch.no_grad():  # after the call: never written
        for p in model.parameters():
            p.fill_(5.0)
    future.result()
    assert [b.data_ptr() for b in background._STAGING.buffers] == first, "buffers reallocated"
    assert checkpoint.async_save_staging_bytes() == _primary_bytes(model, opt)
    plain = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3))
    checkpoint.load(path, plain)
    for p in plain.parameters():
        assert torch.equal(p, torch.full_like(p, 2.0))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("prewarm", [False, True])
def test_staging_buffers_are_reused_and_prewarmed(tmp_path, world, prewarm):
    run_distributed(_reused, world, str(tmp_path / "ckpt"), prewarm)
