"""``eager``: zerokit's hooks and collectives run outside ``torch.compile``'s graphs.

Note: a hook fires inside whatever calls the module. When that is a compiled frame
(``torch.compile(model)`` traces ``model.__call__`` with its hooks; a unit called from a
compiled parent), dynamo would trace into the hook: into the state's bookkeeping, the store,
``queue_callback`` and asynchronous collectives, which it cannot trace (graph breaks inside
them, and a hard error at 'p_g_os'), and it would bake the state's Python decisions into its
guards. So each entry point is one opaque call for dynamo (``torch.compiler.disable``, as FSDP2
does with its hooks): one graph break per hook call in a traced frame, nothing traced inside.
In eager mode it is a plain call.

Note: ``torch._disable_dynamo`` (what ``torch.optim.Optimizer`` decorates its own entry points
with) imports ``torch._dynamo`` at the first call, not at import: ``import zerokit`` stays light
(``torch._dynamo`` costs about 1 s and 70 MiB, on every rank) and a process that never compiles
pays it only when torch's autograd and optimizers import it anyway. Its wrapper lives in a
module dynamo skips, so a traced frame still sees one opaque call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def eager(fn: F) -> F:
    """Run ``fn`` eagerly, never traced, also when called from a compiled frame."""
    return torch._disable_dynamo(fn)
