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


# -- claims the documents make about the code and the project ---------------------------------
def _section(text: str, heading: str) -> str:
    """The text under ``heading`` (a "## " or "### " line) up to the next heading."""
    return text.split(f"{heading}\n", 1)[1].split("\n#", 1)[0]


def test_every_extra_is_listed_in_readme_and_guide():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    readme = (ROOT / "README.md").read_text()
    listed = re.search(r"^Extras: (.*?)\. ", readme, flags=re.M | re.S)
    assert listed, "README's Install section lists its extras on a line starting 'Extras: '"
    guide_install = _section((ROOT / "docs" / "GUIDE.md").read_text(), "## Install")
    for extra in set(extras) - {"test"}:  # [test] is the tests' own, in README's commands
        assert f"`[{extra}]`" in listed.group(1), f"README's extras lack [{extra}]"
        assert f'pip install -e ".[{extra}]"' in guide_install, f"GUIDE's Install lacks [{extra}]"


def test_the_index_url_advice_comes_before_the_commands_it_guards():
    two = _section((ROOT / "README.md").read_text(), "## Two commands")
    assert "--index-url" in two, "README's Two commands say to run Install's --index-url line"
    assert two.index("--index-url") < two.index("```bash"), (
        "README: 'run the --index-url line first' must come before the commands, not after"
    )


FAST_SUBSET_TIME = re.compile(r"(\d+) min(?: (\d+) s)?")


def test_the_fast_subset_takes_the_same_time_in_readme_and_pyproject():
    readme = (ROOT / "README.md").read_text()
    said = re.search(r'`-m "not slow"` runs a fast subset.*?\)', readme, flags=re.S)
    assert said, "README states the fast subset's time"
    readme_time = FAST_SUBSET_TIME.search(said.group(0)).groups()
    comment = next(
        line for line in (ROOT / "pyproject.toml").read_text().splitlines()
        if 'pytest -m "not slow"' in line
    )  # fmt: skip
    assert FAST_SUBSET_TIME.search(comment).groups() == readme_time, (
        f"pyproject.toml's fast-subset time ({comment.strip()}) differs from README's "
        f"({said.group(0)!r})"
    )


def test_the_refused_optimizers_are_the_ones_the_core_refuses():
    from zerokit.core.optimizer_needs import (
        ELEMENTWISE_OPTIMIZERS,
        REFUSED,
        WHOLE_PARAMETER_OPTIMIZERS,
    )

    guide = " ".join((ROOT / "docs" / "GUIDE.md").read_text().split())
    said = re.search(r"optimizers zerokit cannot shard \(([^:;)]*)", guide)
    assert said, "GUIDE's misuse list names the optimizers zerokit cannot shard"
    assert {n.strip() for n in said.group(1).split(",")} == set(REFUSED)
    readme = " ".join((ROOT / "README.md").read_text().split())
    refused = re.search(r"([\w ,]+?) (?:is|are) refused, with the reason", readme).group(1)
    supported = {c.__name__ for c in (*ELEMENTWISE_OPTIMIZERS, *WHOLE_PARAMETER_OPTIMIZERS)}
    assert not supported & set(re.findall(r"\w+", refused)), refused
    assert set(REFUSED) <= set(re.findall(r"\w+", refused)), refused


def test_plan_units_and_plan_groups_return_what_architecture_says():
    import typing

    from zerokit.core import units

    glossary = " ".join((ROOT / "docs" / "ARCHITECTURE.md").read_text().split())
    assert "`plan_units` and `plan_groups` cut units and buckets: they return `UnitPlan`s" in (
        glossary
    )
    for fn in (units.plan_units, units.plan_groups):
        returned = str(typing.get_type_hints(fn)["return"])
        assert "UnitPlan" in returned, (fn.__name__, returned)


def _count_cross_entropy_all_reduces(rank, world_size):
    import torch
    import torch.distributed as dist

    import zerokit
    from zerokit import tensor_parallel as tp

    layout = zerokit.init_hybrid_parallel(1, world_size)
    tokens, vocab = 6, 10
    torch.manual_seed(0)
    logits = torch.randn(tokens, vocab // world_size, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,))
    seen, all_reduce = [], dist.all_reduce

    def recording(tensor, *args, **kwargs):
        seen.append(tuple(tensor.shape))
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = recording
    try:
        loss = tp.ParallelCrossEntropy(layout=layout)(logits, target)
        forward = list(seen)
        loss.backward()
    finally:
        dist.all_reduce = all_reduce
    # GUIDE: the ranks' vocabulary sizes (tp integers), one number per token, two per token
    assert forward == [(world_size,), (tokens,), (2, tokens)], forward
    assert seen[len(forward) :] == [], "the backward sends nothing"


def test_parallel_cross_entropy_makes_the_all_reduces_guide_names():
    from dist_helpers import run_distributed

    guide = " ".join((ROOT / "docs" / "GUIDE.md").read_text().split())
    assert (
        "three all-reduces over the tp group in forward, none in backward (the ranks' vocabulary "
        "sizes, tp integers, for where this rank's range begins; each token's row maximum, one "
        "number per token; each token's sum of exponentials and target logit, two numbers per "
        "token)" in guide
    )
    run_distributed(_count_cross_entropy_all_reduces, 2)
