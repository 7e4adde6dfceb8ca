"""What may import what inside zerokit (issue 33), read from the source as the level rule is
(tests/test_levels_and_config.py): every ``import`` statement, function-level ones too.

- ``zerokit.runtime`` (bounded waits, timeouts, the gloo exit) imports nothing of zerokit
  outside itself: the core, tensor parallelism, pipelines and checkpoints all stand on it.
- The core imports nothing of zerokit but itself, ``zerokit.runtime`` and
  ``zerokit.mixed_precision`` (the policy it is given).
- Outside the core, the core is used only through its face, ``zerokit.core``'s ``__all__``;
  the one exception is the dry run's stand-in backend, ``zerokit.core.stand_in``, which the
  dry-run tools (under ``zerokit/tools/``) may import.
- Tensor parallelism asks the core two things only (is a parameter rank-local, is a model
  wrapped); its waits and its exit are the runtime's.
- Nothing outside ``zerokit/tools/`` imports ``zerokit.tools``: the library never needs its
  command-line tools (``zerokit/__main__.py``, the command's entry point, aside).
"""

import ast
import pathlib

import zerokit
import zerokit.core

ROOT = pathlib.Path(zerokit.__file__).parent
FACE = set(zerokit.core.__all__)
STAND_IN = "zerokit.core.stand_in"
TP_NEEDS = {"is_distributed", "state_of"}


def _module_name(path: pathlib.Path) -> str:
    parts = ("zerokit", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, what) for every zerokit import in ``source``: ``what`` is the absolute name of
    a module, or ``package.name`` for each name taken from a package or module."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return [(n, what) for n, what in found if what == "zerokit" or what.startswith("zerokit.")]


def _inside(what: str, package: str) -> bool:
    return what == package or what.startswith(package + ".")


def breaks(module: str, what: str) -> str | None:
    """Why ``module`` may not import ``what``, or None."""
    if _inside(module, "zerokit.runtime") and not _inside(what, "zerokit.runtime"):
        return "the runtime imports nothing of zerokit outside itself"
    if _inside(module, "zerokit.core"):
        allowed = ("zerokit.core", "zerokit.runtime", "zerokit.mixed_precision")
        if not any(_inside(what, a) for a in allowed):
            return "the core imports only itself, zerokit.runtime and zerokit.mixed_precision"
        return None
    entry_point = module == "zerokit.__main__"
    if _inside(what, "zerokit.tools") and not (_inside(module, "zerokit.tools") or entry_point):
        return "only zerokit/tools imports zerokit.tools"
    if _inside(what, "zerokit.core") and what != "zerokit.core":
        name = what.removeprefix("zerokit.core.")
        if _inside(what, STAND_IN) and _inside(module, "zerokit.tools"):
            return None
        if "." in name or name not in FACE:
            return f"{what} is inside the core: use a name of zerokit.core.__all__"
        if _inside(module, "zerokit.tensor_parallel") and name not in TP_NEEDS:
            return f"tensor parallelism asks the core only {sorted(TP_NEEDS)}"
    return None


def _violations() -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        for line, what in imports(path.read_text(), module, path.name == "__init__.py"):
            why = breaks(module, what)
            if why:
                found.append(f"{path.relative_to(ROOT)}:{line} imports {what}: {why}")
    return found


def test_the_rules_catch_what_they_name():
    """Each rule, broken once in a made-up module, is caught."""

    def why(source: str, module: str, is_package: bool = False) -> list[str | None]:
        return [breaks(module, what) for _, what in imports(source, module, is_package)]

    assert why("from ..core import state_of\n", "zerokit.runtime.teardown")[0]
    assert why("from ..layout import Layout\n", "zerokit.core.units")[0]
    assert why("from .state import state_of\n", "zerokit.core.units") == [None]
    assert why("from ..runtime import teardown\n", "zerokit.core.units") == [None]
    assert why("from .core.state import state_of\n", "zerokit.clip")[0]
    assert why("import zerokit.core.state\n", "zerokit.scaler")[0]
    assert why("def f():\n    from ..core.group import Phase\n", "zerokit.pipeline.x")[0]
    assert why("from .core import state_of\n", "zerokit.clip") == [None]
    assert why("from . import build\n", "zerokit.core", is_package=True) == [None]
    assert why("from ..core import all_reduce_\n", "zerokit.tensor_parallel.layers")[0]
    assert why("from ..core import is_distributed\n", "zerokit.tensor_parallel.x") == [None]
    assert why("from ..core.stand_in import Call\n", "zerokit.tools.plan") == [None]
    assert why("from .core.stand_in import Call\n", "zerokit.memory")[0]
    assert why("from .tools import plan\n", "zerokit.cli")[0]
    assert why("from .tools.cli import main\n", "zerokit.__main__") == [None]
    assert why("from ..core import stand_in\n", "zerokit.tools.dry_run") == [None]


def test_zerokit_keeps_its_import_rules():
    assert not (found := _violations()), "\n".join(found)


def test_the_face_names_exist():
    missing = [n for n in zerokit.core.__all__ if not hasattr(zerokit.core, n)]
    assert not missing, missing
