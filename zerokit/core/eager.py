"""``eager``: zerokit's hooks and collectives run outside ``torch.compile``'s graphs.

Note: a hook fires inside whatever calls the module. When that is a compiled frame
(``torch.compile(model)`` traces ``model.__call__`` with its hooks; a unit called from a
compiled parent), dynamo would trace into the hook: into the state's bookkeeping, the store,
``queue_callback`` and asynchronous collectives, which it cannot trace (graph breaks inside
them, and a hard error at 'p_g_os'), and it would bake the state's Python decisions into its
guards. So each entry point is one opaque call for dynamo (``torch.compiler.disable``, as FSDP2
does with its hooks): one graph break per hook call in a traced frame, nothing traced inside.
In eager mode it is a plain call. (Importing torch._dynamo here costs nothing extra: torch's
autograd and optimizers import it at the first backward or step anyway.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def eager(fn: F) -> F:
    """Run ``fn`` eagerly, never traced, also when called from a compiled frame."""
    return torch.compiler.disable(fn, reason="zerokit hooks and collectives run eagerly")
