"""The house rules, read from the source: the library never imports its command-line tools
(``zerokit/tools/``); the tools' old module names still import, with a warning; no
``unittest.mock`` in the package; a level's name is compared only where levels are decoded
(the core's ``LevelPlan``) or estimated by the ZeRO paper's formulas (``zerokit.memory``);
no function of the tools over 80 lines."""

import ast
import importlib
import pathlib
import subprocess
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


def test_imports_are_resolved_as_python_does():
    """The checker itself: relative imports at each depth, and ``from . import name``."""
    tree = ast.parse("from .tools import cli\nfrom ..tools.plan import x\nfrom . import tools\n")
    found = _imported(tree, "checkpoint/saving.py")
    assert "zerokit.checkpoint.tools" in found and "zerokit.tools.plan" in found
    assert "zerokit.tools" in _imported(ast.parse("from . import tools\n"), "api.py")


def test_the_library_never_imports_the_tools():
    """Every module outside ``zerokit/tools/`` (``__main__``, the command's entry point, aside)."""
    found = [
        f"{module}: {name}"
        for module, tree in _modules()
        if not module.startswith("tools/") and module != "__main__.py"
        for name in _imported(tree, module)
        if name == "zerokit.tools" or name.startswith("zerokit.tools.")
    ]
    assert not found, found


def test_importing_the_library_loads_no_tool():
    code = "import sys, zerokit; print([m for m in sys.modules if m.startswith('zerokit.tools')])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


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
    """Lines comparing with a level's name (``level == 'p_g_os'``, ``level in ('os', ...)``)."""
    lines = []
    for node in ast.walk(tree):
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
    """The core decodes a level once (``core/build.py``, held by test_levels_and_config);
    ``memory.py`` estimates by the ZeRO paper's per-level formulas. Everything else reads the
    decoded level or the dry run's play (``zerokit plan``), never the name."""
    assert _level_comparisons(ast.parse("a = level == 'p_g_os'\nb = x in ('os', 'y')\n")) == [1, 2]
    allowed = {"core/build.py", "memory.py"}
    found = [
        f"{module}:{line}"
        for module, tree in _modules()
        if module not in allowed
        for line in _level_comparisons(tree)
    ]
    assert not found, found


def test_no_function_of_the_tools_is_over_80_lines():
    long = [
        f"{module}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for module, tree in _modules(PACKAGE / "tools")
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > 80
    ]
    assert not long, long
