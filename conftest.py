"""Doctest collection (pyproject's ``--doctest-modules``) imports every module: an integration
whose trainer is not installed is left out instead of failing the collection."""

import importlib.util

collect_ignore = []
if importlib.util.find_spec("lightning") is None:
    collect_ignore.append("zerokit/integrations/lightning.py")
