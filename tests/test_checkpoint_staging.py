"""An async save's staging: host buffers reused between saves (the first save allocates, the
next ones copy into the same memory), faulted in on another thread without changing what is
written into them meanwhile, prewarmed on request, their bytes reported, and what is written
still the state at the call at world sizes 2 and 3 (uneven shards)."""

import ctypes
import sys
import time

import pytest
import torch
from dist_helpers import run_distributed
from torch import nn

import zerokit
from zerokit import checkpoint
from zerokit.checkpoint import background
from zerokit.checkpoint.holdings import Chunk, collect
from zerokit.checkpoint.staging import StagingBuffers


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


def _resident(t: torch.Tensor) -> bool:
    """Every page wholly inside ``t`` is in memory (``mincore``)."""
    page = 4096
    lo = -(-t.data_ptr() // page) * page
    hi = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    pages = (ctypes.c_ubyte * ((hi - lo) // page))()
    mincore = ctypes.CDLL(None).mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert mincore(lo, hi - lo, pages) == 0
    return all(p & 1 for p in pages)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and mincore: Linux")
def test_fresh_buffers_are_faulted_in_unchanged_and_kept():
    likes = [
        (torch.Size([1024, 512]), torch.float32),
        (torch.Size([3]), torch.int64),
        (torch.Size([300, 700]), torch.float32),
    ]
    chunks = [
        Chunk(f"t{i}", 0, torch.empty(s, dtype=d, device="meta"), True)
        for i, (s, d) in enumerate(likes)
    ]
    chunks.append(Chunk("not written", 0, torch.empty(5, device="meta"), False))
    staging = StagingBuffers()
    assert staging.fit(chunks)
    assert [(b.shape, b.dtype) for b in staging.buffers] == likes
    assert staging.nbytes == (1024 * 512 + 300 * 700) * 4 + 3 * 8
    first = staging.buffers[0]
    first[:100].fill_(7.0)  # written while the thread faults the block in: kept
    # the float32 block, both buffers (nothing read: a read would map the zero page)
    block = first.view(-1).as_strided((1024 * 512 + 300 * 700,), (1,))
    deadline = time.monotonic() + 30
    while not _resident(block):  # nothing else touches it: only the faulting thread can
        assert time.monotonic() < deadline, "the fresh staging was never faulted in"
        time.sleep(0.01)
    assert torch.equal(first[:100], torch.full((100, 512), 7.0))
    ptrs = [b.data_ptr() for b in staging.buffers]
    assert not staging.fit(chunks)
    assert [b.data_ptr() for b in staging.buffers] == ptrs, "kept buffers were made anew"
