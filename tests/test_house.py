"""The house rules, read from the source: the tools' old module names still import, with a
warning; no ``unittest.mock`` in the package; a level's name is compared only where levels are
decoded (the core's ``LevelRules``) or estimated by the ZeRO paper's formulas
(``zerokit.memory``); no function in the package over 80 lines. What may import what (the
library never imports its tools, among others): tests/test_import_rules.py."""

import ast
import importlib
import pathlib
import sys
import warnings

import pytest

import zerokit
from zerokit import _moved

PACKAGE = pathlib.Path(zerokit.__file__).parent
LEVEL_NAMES = {"os", "os_g", "p_g_os"}


def _modules(where: pathlib.Path = PACKAGE):
    for path in sorted(where.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text())


def _imported(tree: ast.Module, module: str) -> list[str]:
    """Absolute names of the modules ``tree`` (the module ``module``, e.g. "zerokit/api.py")
    imports, relative imports resolved."""
    package = ["zerokit", *module.split("/")[:-1]]  # a package's __init__ is in itself
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            head = ".".join([*base, node.module] if node.module else base)
            names.append(head)
            names += [f"{head}.{a.name}" for a in node.names]  # from . import tools
    return names


@pytest.mark.parametrize("old, new", sorted(_moved.MOVED.items()))
def test_an_old_module_name_is_the_moved_module_with_a_warning(old, new):
    sys.modules.pop(old, None)  # (the moved module stays: other tests hold it)
    parent, _, leaf = old.rpartition(".")
    if hasattr(sys.modules[parent], leaf):
        delattr(sys.modules[parent], leaf)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__name__ == new and module.__spec__.name == new
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once imported, the name is bound: no second warning
        assert importlib.import_module(old) is module


def test_from_zerokit_import_an_old_name():
    sys.modules.pop("zerokit.compare", None)
    if hasattr(zerokit, "compare"):
        delattr(zerokit, "compare")
    with pytest.warns(DeprecationWarning):
        from zerokit import compare
    from zerokit.tools import compare as moved

    assert compare is moved
    with pytest.raises(ImportError):
        from zerokit import no_such_tool  # noqa: F401  (only the moved names are answered)


def test_no_mock_in_the_package():
    found = [
        f"{module}: {name}"
        for module, tree in _modules()
        for name in _imported(tree, module)
        if name == "unittest.mock" or name.startswith("unittest.mock.") or name == "mock"
    ]
    assert not found, found
    assert not [p for p in PACKAGE.rglob("*.py") if "mock" in p.read_text()]


def _level_comparisons(tree: ast.Module) -> list[int]:
    """Lines comparing with a level's name (``level == 'p_g_os'``, ``level in ('os', ...)``)
    or reading a ``keeps_full_grad`` flag (the core's old way of asking the level)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "keeps_full_grad":
            lines.append(node.lineno)
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            names = {
                c.value
                for side in sides
                for c in ast.walk(side)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            }
            if names & LEVEL_NAMES:
                lines.append(node.lineno)
    return lines


def test_level_names_are_compared_only_where_levels_are_decoded():
    """The core decodes a level once (``core/build.py``: ``LevelRules.decode``; the rest of the
    core holds the objects it chose); ``memory.py`` estimates by the ZeRO paper's per-level formulas. Everything else reads the
    decoded level or the dry run's play (``zerokit plan``), never the name."""
    assert _level_comparisons(ast.parse("a = level == 'p_g_os'\nb = x in ('os', 'y')\n")) == [1, 2]
    assert _level_comparisons(
        ast.parse("ok = level not in ('os_g', 'p_g_os')\nx = r.keeps_full_grad\n")
    ) == [1, 2]
    allowed = {"core/build.py", "memory.py"}
    found = [
        f"{module}:{line}"
        for module, tree in _modules()
        if module not in allowed
        for line in _level_comparisons(tree)
    ]
    assert not found, found


LIMIT = 80  # lines, docstring and decorators included: a function short enough to see whole


def long_functions(source: str, limit: int = LIMIT) -> list[tuple[str, int]]:
    """(name, lines) of every function or method in ``source`` longer than ``limit`` lines."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            lines = node.end_lineno - first + 1
            if lines > limit:
                found.append((node.name, lines))
    return found


def test_long_functions_are_found():
    body = "".join(f"    x{i} = {i}\n" for i in range(LIMIT))
    assert long_functions(f"def short():\n    pass\n\ndef long():\n{body}") == [("long", LIMIT + 1)]
    method = "".join(f"        x{i} = {i}\n" for i in range(LIMIT - 2))  # + decorator + def
    assert long_functions(f"class C:\n    @staticmethod\n    def m():\n{method}") == []
    assert long_functions(
        f"class C:\n    @staticmethod\n    def m():\n{method}        x = 1\n"
    ) == [("m", LIMIT + 1)]


def test_no_function_over_80_lines():
    found = [
        f"{path.relative_to(PACKAGE).as_posix()}:{name} ({lines} lines)"
        for path in sorted(PACKAGE.rglob("*.py"))
        for name, lines in long_functions(path.read_text())
    ]
    assert not found, found
