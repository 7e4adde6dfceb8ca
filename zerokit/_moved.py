"""Modules that moved, still importable by their old names, with a ``DeprecationWarning``.

The command-line tools left the top of the package for ``zerokit.tools`` (the library never
imports them). ``import zerokit.compare`` (or ``from zerokit import compare``) still works: a
finder on ``sys.meta_path`` answers for each old name with the module under its new name, the
same module object (so patching one patches the other). Only names are held here: nothing
under ``zerokit.tools`` is imported until an old name is.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

MOVED = {
    f"zerokit.{old}": f"zerokit.tools.{new}"
    for old, new in {
        "cli": "cli",
        "compare": "compare",
        "compare_report": "compare_report",
        "plan": "plan",
        "plan_pp": "plan_pp",
        "plan_report": "plan_report",
        "plan_optimizers": "plan_optimizers",
        "verify": "verify",
        "verify_pp": "verify_pp",
        "dry_run": "dry_run",
        "launch": "launch",
        "workload": "workload",
        "checkpoint.cli": "checkpoint_cli",
    }.items()
}
"""Old module name -> its name now."""


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name in ``MOVED`` and loads it as the module under its new name."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; import it from there ({spec.name} will go)",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module):
        # the import system has set the old name's spec on the module: give it back its own
        # (kept in create_module), so it still knows its real name (pickling, reload)
        module.__spec__ = module.__spec__.loader_state


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once): the old names are ours to answer, not
    another finder's (an editable install's would find a stale copy of the old file)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
