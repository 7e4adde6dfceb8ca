"""The checkpoint room's import rules, read from the source (no process group): ARCHITECTURE
lists ``checkpoint/``'s modules bottom-up and each imports only those above it (an import
inside a function counts: that is how the old circles were held open), so there is no
circle and no upward arrow; no module imports another module's ``_private`` name; and
``duplicates`` finds no twin in the room."""

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOM = ROOT / "zerokit" / "checkpoint"
ENTRY = re.compile(r"^\s+[-*]\s+`checkpoint/([a-z_]+)\.py`")


def declared_order() -> list[str]:
    """The room's modules as ARCHITECTURE's package list names them, bottom first."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    body = text.split("<!-- package list: begin -->", 1)[1].split("<!-- package list: end -->")[0]
    return [m.group(1) for line in body.splitlines() if (m := ENTRY.match(line))]


def room_imports(source: str, package: str = "zerokit.checkpoint") -> list[tuple[str, list[str]]]:
    """Every import of a room module in ``source`` (module level or inside a function), as
    (module, names imported from it); ``from . import extra`` is ("extra", [])."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 1 and node.module:
            found.append((node.module.split(".")[0], [a.name for a in node.names]))
        elif node.level == 1:  # from . import a, b
            found.extend((a.name, []) for a in node.names)
        elif node.level == 0 and (node.module or "").startswith(package + "."):
            module = node.module[len(package) + 1 :].split(".")[0]
            found.append((module, [a.name for a in node.names]))
    return found


def problems(modules: dict[str, str], order: list[str]) -> list[str]:
    found = []
    rank = {name: i for i, name in enumerate(order)}
    unlisted = sorted(set(modules) - set(rank) - {"__init__"})
    if unlisted:
        found.append(f"not in ARCHITECTURE's list of the room: {unlisted}")
    for name, source in sorted(modules.items()):
        for target, names in room_imports(source):
            if target not in modules:
                continue
            if name != "__init__" and rank.get(target, -1) >= rank.get(name, -1):
                found.append(f"{name} imports {target}, which is not listed above it")
            private = [n for n in names if n.startswith("_")]
            if private:
                found.append(f"{name} imports {target}'s private {private}")
    return found


def room() -> dict[str, str]:
    return {p.stem: p.read_text() for p in sorted(ROOM.glob("*.py"))}


def test_every_import_in_the_room_points_down_and_no_private_name_crosses():
    assert problems(room(), declared_order()) == []


def absolute_imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every ``from ... import`` in ``path``, relative ones resolved."""
    package = list(path.relative_to(ROOT).parent.parts)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.append((module, [a.name for a in node.names]))
    return found


def test_no_module_outside_the_room_imports_a_private_checkpoint_name():
    found = [
        f"{path.relative_to(ROOT)} imports {module}'s {private}"
        for path in sorted((ROOT / "zerokit").rglob("*.py"))
        if ROOM not in path.parents
        for module, names in absolute_imports(path)
        if module.startswith("zerokit.checkpoint")
        and (private := [n for n in names if n.startswith("_")])
    ]
    assert found == []


def test_the_rules_catch_a_circle_an_upward_arrow_and_a_private_import():
    """The checker itself: each broken rule is reported (a circle is an upward arrow on one
    of its edges, whatever the order)."""
    order = ["low", "high"]
    circle = {"low": "from .high import thing\n", "high": "from .low import other\n"}
    assert problems(circle, order) == ["low imports high, which is not listed above it"]
    lazy = {"low": "def f():\n    from .high import thing\n", "high": ""}
    assert problems(lazy, order) == ["low imports high, which is not listed above it"]
    private = {"low": "", "high": "from .low import _secret, public\n"}
    assert problems(private, order) == ["high imports low's private ['_secret']"]
    assert problems({"low": "", "high": "", "new": ""}, order) == [
        "not in ARCHITECTURE's list of the room: ['new']"
    ]


@pytest.mark.skipif(shutil.which("duplicates") is None, reason="needs the duplicates tool")
def test_no_twin_in_the_room():
    out = subprocess.run(
        ["duplicates", "--repo", str(ROOM), "--seconds", "60"],
        capture_output=True, text=True, check=True, cwd=ROOM,
    ).stdout  # fmt: skip
    assert out.startswith("no duplicates"), out
