"""Host synchronisations zerokit makes, counted on any device: the CPU stand-in for
``torch.cuda.set_sync_debug_mode("error")`` that benchmarks/gpu_check.py runs around a step.

On CUDA a read of a device tensor by the host (``.item()``, ``bool(t)``, ``int(t)``,
``.tolist()``, ``.cpu()``) waits for every kernel queued before it: the CPU stops running ahead
of the GPU, and every overlap of communication with compute is lost for that step. On the CPU
nothing waits, so the same reads pass unseen; ``SyncPoints`` counts them instead, where
zerokit's own code makes them (the caller's frame is a file of the ``zerokit`` package):

    with SyncPoints() as syncs:
        loss = loss_fn(model(x), y); loss.backward(); optimizer.step()
    assert not syncs.seen, syncs.seen

Note: reads of ``torch.bool`` tensors are not counted. zerokit keeps its per-parameter
bookkeeping (which parameters delivered or hold a gradient: ``UnitGroup.contributed`` and
``has_grad``) in Python lists, made a CPU tensor once per step to agree it, and the agreed
flags come back as a CPU bool tensor read with ``tolist()``: never a device sync; the
control values that do travel through a device (the order digest, int64; the "holds a
gradient" flags, reduced as uint8; a norm or an inf flag, float) are of other dtypes, and
``.cpu()`` is counted whatever the dtype. A Python value made into a tensor on a device
(``torch.tensor(data, device=...)``, a host-to-device copy that waits on CUDA) is counted too.
"""

from __future__ import annotations

import os
import sys

import torch

import zerokit

_PACKAGE = os.path.dirname(os.path.abspath(zerokit.__file__)) + os.sep
_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class SyncPoints:
    """Count host reads of tensors made from zerokit's code while inside the ``with``."""

    def __init__(self):
        self.seen: list[str] = []  # "Tensor.item at zerokit/core/state.py:281 (_settle_order_vote)"
        self._saved: dict[str, object] = {}

    def __enter__(self) -> SyncPoints:
        for name in _READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._counting_read(name, original))
        self._saved["tensor"] = torch.tensor
        torch.tensor = self._counting_tensor(torch.tensor)
        return self

    def __exit__(self, *exc) -> None:
        torch.tensor = self._saved.pop("tensor")
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()

    def _note(self, what: str) -> None:
        frame = sys._getframe(2)  # the caller of the counted call
        filename = os.path.abspath(frame.f_code.co_filename)
        if filename.startswith(_PACKAGE):
            where = os.path.relpath(filename, os.path.dirname(_PACKAGE.rstrip(os.sep)))
            self.seen.append(f"{what} at {where}:{frame.f_lineno} ({frame.f_code.co_name})")

    def _counting_read(self, name: str, original):
        def read(tensor, *args, **kwargs):
            if tensor.dtype is not torch.bool or name == "cpu":
                self._note(f"Tensor.{name}")
            return original(tensor, *args, **kwargs)

        return read

    def _counting_tensor(self, original):
        def make(*args, **kwargs):
            if kwargs.get("device") is not None:
                self._note("torch.tensor(..., device=)")
            return original(*args, **kwargs)

        return make


def describe(seen: list[str]) -> str:
    """The distinct sync points, each with how often it was made."""
    counts: dict[str, int] = {}
    for s in seen:
        counts[s] = counts.get(s, 0) + 1
    return "; ".join(f"{s} x{n}" for s, n in counts.items()) or "none"
