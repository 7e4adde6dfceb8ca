"""core/teardown.py: what gloo's worker is left to release when a collective is over.

The worker releases the tensors of a finished collective a moment after ``wait()`` returned,
taking the GIL to do so. The exit waits until every handed tensor has died; that is only safe
if recording a death runs no Python code on the worker (bytecode may yield the GIL to the
waiting main thread before the worker is done) and if the release frees nothing but the
handed tensor (a view would free the tensor it views, and run whatever watches that one).
"""

import sys

import torch

from zerokit.core import teardown


def test_a_handed_tensor_is_an_alias_that_holds_no_other_tensor():
    full = torch.zeros(8)
    chunk = full.view(2, 4)[1]
    held = full._use_count()  # the chunk's view holds the full tensor
    handed = teardown.hand(chunk)
    assert full._use_count() == held  # the handed alias does not
    assert handed.shape == chunk.shape and handed.data_ptr() == chunk.data_ptr()
    handed.fill_(1.0)  # what the collective writes lands in the caller's tensor
    assert full.tolist() == [0.0] * 4 + [1.0] * 4


def test_a_handed_tensor_dies_without_running_python_code():
    before = teardown.outstanding()
    handed = [*teardown.hand_all([torch.zeros(3), torch.ones(2)]), teardown.hand(torch.ones(4))]
    assert teardown.outstanding() == before + 3
    calls = []

    def profile(frame, event, arg):
        if event == "call":
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        del handed  # as gloo's worker lets go of the last reference
    finally:
        sys.setprofile(None)
    assert calls == []  # no Python function ran while recording the deaths
    assert teardown.outstanding() == before  # and the exit knows they died
