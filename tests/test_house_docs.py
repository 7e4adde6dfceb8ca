"""The documents stay true by construction: README stays a map (at most 450 lines),
ARCHITECTURE's package list names exactly the modules under ``zerokit/``, and every figure
block of BENCHMARKS names the commit it was measured at."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zerokit"
README_MAX_LINES = 450

# The package list: the lines between these markers (inside a fenced block or not); an entry
# is a list item whose first code span is a path relative to zerokit/ (a package ends in /).
LIST_BEGIN = "<!-- package list: begin -->"
LIST_END = "<!-- package list: end -->"
ENTRY = re.compile(r"^\s*[-*]\s+`([^`]+)`")


def test_readme_is_a_map():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail into "
        "docs/GUIDE.md and link to it"
    )


def package_list(text: str) -> set[str]:
    """The paths ARCHITECTURE's package list names (``core/``, ``core/state.py``, ...)."""
    assert text.count(LIST_BEGIN) == 1 and text.count(LIST_END) == 1, (
        f"ARCHITECTURE.md must mark its package list once with {LIST_BEGIN!r} ... {LIST_END!r}"
    )
    body = text.split(LIST_BEGIN, 1)[1].split(LIST_END, 1)[0]
    named = [m.group(1).strip() for line in body.splitlines() if (m := ENTRY.match(line))]
    doubled = sorted({p for p in named if named.count(p) > 1})
    assert not doubled, f"named twice in the package list: {doubled}"
    return set(named)


def modules_on_disk(package: Path) -> set[str]:
    """Every module file under the package (but ``__init__.py``) and every subpackage."""
    found = set()
    for path in package.rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        relative = path.relative_to(package)
        for parent in list(relative.parents)[:-1]:  # each enclosing subpackage
            found.add(parent.as_posix() + "/")
        if path.name != "__init__.py":
            found.add(relative.as_posix())
    return found


def list_differences(named: set[str], on_disk: set[str]) -> list[str]:
    missing = sorted(on_disk - named)
    stale = sorted(named - on_disk)
    problems = []
    if missing:
        problems.append(f"modules not in ARCHITECTURE's package list: {missing}")
    if stale:
        problems.append(f"package-list entries with no such module: {stale}")
    return problems


def test_architecture_package_list():
    named = package_list((ROOT / "docs" / "ARCHITECTURE.md").read_text())
    problems = list_differences(named, modules_on_disk(PACKAGE))
    assert not problems, "\n".join(problems)


def test_the_package_list_parser(tmp_path):
    """Entries are found in a fenced or plain list, with continuation lines and nesting; a
    module missing from the list and an entry with no module are both reported."""
    text = (
        "## Packages\n- `api.py` — outside the markers\n"
        f"{LIST_BEGIN}\n```\n- `api.py` — the call\n  continued, `not_a_path.py` inside\n"
        "- `core/` — the core\n  - `core/state.py` — ShardState\n* `gone.py` — removed\n```\n"
        f"{LIST_END}\n"
    )
    assert package_list(text) == {"api.py", "core/", "core/state.py", "gone.py"}
    (tmp_path / "core").mkdir()
    for name in ("api.py", "__init__.py", "core/__init__.py", "core/state.py", "core/new.py"):
        (tmp_path / name).write_text("")
    on_disk = modules_on_disk(tmp_path)
    assert on_disk == {"api.py", "core/", "core/state.py", "core/new.py"}
    problems = list_differences(package_list(text), on_disk)
    assert problems == [
        "modules not in ARCHITECTURE's package list: ['core/new.py']",
        "package-list entries with no such module: ['gone.py']",
    ]
    with pytest.raises(AssertionError, match="named twice"):
        package_list(f"{LIST_BEGIN}\n- `a.py` — x\n- `a.py` — y\n{LIST_END}\n")
    with pytest.raises(AssertionError, match="mark its package list"):
        package_list("- `a.py` — no markers\n")


# -- BENCHMARKS: every figure names its commit ------------------------------------------------
MEASURED_AT = re.compile(r"(?i)\bmeasured at\b[^\n]*?\b([0-9a-f]{7,40})\b")
FENCE = re.compile(r"^ *```(\w*)\n(.*?)^ *```", re.S | re.M)


def figure_sections(text: str) -> list[tuple[str, str]]:
    """(heading, the text from that heading to the block) for each block of figures: a fenced
    block that is not a shell command (```bash)."""
    found = []
    for match in FENCE.finditer(text):
        if match.group(1) in ("bash", "sh"):
            continue
        before = text[: match.start()]
        heading = re.findall(r"^#+ (.+)$", before, flags=re.M)[-1]
        start = before.rindex(f" {heading}\n")
        found.append((heading, text[start : match.end()]))
    return found


def commits_named(section: str) -> list[str]:
    return MEASURED_AT.findall(section)


def test_every_benchmark_figure_names_its_commit():
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    sections = figure_sections(text)
    assert len(sections) >= 8, [h for h, _ in sections]
    unnamed = [heading for heading, section in sections if not commits_named(section)]
    assert not unnamed, f"BENCHMARKS blocks with no 'measured at <commit>' above them: {unnamed}"


def test_the_named_commits_exist():
    """Each commit BENCHMARKS names is one git knows (skipped outside a full git checkout)."""
    shallow = subprocess.run(
        ["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True
    )
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip("not a full git checkout")
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    named = {sha for _, section in figure_sections(text) for sha in commits_named(section)}
    unknown = [
        sha
        for sha in sorted(named)
        if subprocess.run(
            ["git", "cat-file", "-e", f"{sha}^{{commit}}"], cwd=ROOT, capture_output=True
        ).returncode
    ]
    assert not unknown, f"BENCHMARKS names commits git does not know: {unknown}"


def test_the_benchmark_parser():
    text = (
        "## A\n\nMeasured at 0934fe1.\n\n```bash\npython x.py\n```\n\n```\nfigures\n```\n"
        "## B\n\n```\nno commit, at 0934fe1\n```\n### C\n\n- `x`, measured at branch `dcp`'s c16103e:\n\n  ```\n  f\n  ```\n"
    )
    sections = figure_sections(text)
    assert [h for h, _ in sections] == ["A", "B", "C"]
    assert [commits_named(s) for _, s in sections] == [["0934fe1"], [], ["c16103e"]]
