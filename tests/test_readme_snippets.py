"""Every ```python block in README.md and docs/GUIDE.md (the user guide) runs as printed,
imports included, and prints what the document says it prints.

A block is run by what the HTML comment on the line before it says (a reader sees nothing):
- no comment: ``python snippet.py`` in a fresh directory;
- ``<!-- run: torchrun N -->``: ``torchrun --nproc-per-node N snippet.py`` there (marked slow);
- ``<!-- run: skip, <why> -->``: not run (a signature, not a program); the reason is required.
A block followed by ``<!-- output -->`` and a ``` block must print exactly that block on
stdout (under torchrun the snippet prints on rank 0 only).

Test ids start with the document's name (``README-zerokit``, ``GUIDE-torch-compile``). The
README's shell commands are checked elsewhere (tests/test_first_day.py: the two commands;
tests/test_compare_activations.py: ``zerokit compare --activations``'s table in the guide).
"""

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from dist_helpers import run_torchrun

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCUMENTS = {"README": README, "GUIDE": ROOT / "docs" / "GUIDE.md"}
ENV_THREADS = {"OMP_NUM_THREADS": "1"}


@dataclass
class Snippet:
    section: str  # the heading above the block, and a number if the heading has several
    code: str
    nproc: int | None  # None: one plain process
    skip: str | None  # the reason it is not run
    output: str | None  # what it must print, if the document shows it
    document: str = "README"

    @property
    def name(self) -> str:
        return re.sub(r"\W+", "-", self.section.lower()).strip("-")

    @property
    def test_id(self) -> str:
        return f"{self.document}-{self.name}"


BLOCK = re.compile(r"```python\n(.*?)```\n", re.S)
MARKER = re.compile(r"<!-- run: (.*?) -->\s*$")
OUTPUT = re.compile(r"\A\s*<!-- output -->\n```[a-z]*\n(.*?)```", re.S)


def readme_snippets(text: str, document: str = "README") -> list[Snippet]:
    snippets = []
    for match in BLOCK.finditer(text):
        before = text[: match.start()]
        headings = re.findall(r"^#+ (.+)$", before, flags=re.M)
        section = headings[-1] if headings else "top"
        last_line = before.rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(last_line)
        nproc = skip = None
        if marker:
            how = marker.group(1)
            if how.startswith("skip"):
                skip = how.partition(",")[2].strip()
                assert skip, f"{section}: say why a README snippet is not run: {how!r}"
            else:
                found = re.fullmatch(r"torchrun (\d+)", how)
                assert found, f"{section}: unknown run marker {how!r}"
                nproc = int(found.group(1))
        shown = OUTPUT.match(text[match.end() :])
        snippets.append(
            Snippet(
                section, match.group(1), nproc, skip, shown.group(1) if shown else None, document
            )
        )
    names = [s.name for s in snippets]
    for i, s in enumerate(snippets):  # unique test ids
        if names.count(s.name) > 1:
            s.section += f" {names[:i].count(s.name) + 1}"
    return snippets


SNIPPETS = [s for doc, path in DOCUMENTS.items() for s in readme_snippets(path.read_text(), doc)]


def _param(snippet: Snippet):
    marks = [pytest.mark.slow] if snippet.nproc else []
    if snippet.skip:
        marks.append(pytest.mark.skip(reason=f"{snippet.document}: {snippet.skip}"))
    return pytest.param(snippet, id=snippet.test_id, marks=marks)


def _run(snippet: Snippet, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "snippet.py"
    script.write_text(snippet.code)
    if snippet.nproc:
        return run_torchrun(script, snippet.nproc, cwd=tmp_path, timeout=600)
    import os

    env = {**os.environ, **ENV_THREADS}
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip("\n").splitlines()]


@pytest.mark.parametrize("snippet", [_param(s) for s in SNIPPETS])
def test_readme_snippet_runs_and_prints_what_readme_shows(snippet, tmp_path):
    done = _run(snippet, tmp_path)
    assert done.returncode == 0, f"{snippet.test_id}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    if snippet.output is not None:
        assert _lines(done.stdout) == _lines(snippet.output), done.stdout


def test_the_snippets_are_found_and_marked():
    """The parser sees both documents' blocks (a changed fence would make the test above
    empty), and the few skipped ones say why."""
    assert len(SNIPPETS) >= 8, [s.test_id for s in SNIPPETS]
    for doc in DOCUMENTS:  # a moved file or fence would silently drop one document
        assert sum(s.document == doc for s in SNIPPETS) >= 3, doc
    ids = [s.test_id for s in SNIPPETS]
    assert len(set(ids)) == len(ids), ids
    assert sum(s.output is not None for s in SNIPPETS) >= 3
    assert sum(s.nproc is None and not s.skip for s in SNIPPETS) >= 2  # the fast ones
    assert sum(bool(s.skip) for s in SNIPPETS) <= 1, [s.test_id for s in SNIPPETS if s.skip]


def test_the_parser_reads_markers_and_outputs():
    text = (
        "## A\n<!-- run: torchrun 3 -->\n```python\nprint(1)\n```\n"
        "<!-- output -->\n```\n1\n```\n## B\n```python\nx = 1\n```\n"
        "<!-- run: skip, a signature -->\n```python\nf(a, b=1)\n```\n"
    )
    a, b, c = readme_snippets(text)
    assert (a.section, a.nproc, a.output, a.skip) == ("A", 3, "1\n", None)
    assert (b.section, b.nproc, b.output, b.skip) == ("B 1", None, None, None)
    assert (c.section, c.skip) == ("B 2", "a signature")  # one section, two blocks: two ids
    with pytest.raises(AssertionError, match="say why"):
        readme_snippets("<!-- run: skip -->\n```python\nf()\n```\n")
