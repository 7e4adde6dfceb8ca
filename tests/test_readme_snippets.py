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

A command's printed output: a ``` block after ``<!-- output of: zerokit ARGS[; exit N][;
varies: WHAT] -->`` is what ``zerokit ARGS`` prints on stdout (exit status N, default 0; a
first line ``$ zerokit ...`` in the block is the command, shown, not compared), run in a fresh
directory where a ``--model MODULE:factory`` finds the document's python block that begins
``# MODULE.py``. What differs between machines is left out of the comparison, and only that:
``varies: fields I J`` (those whitespace-separated fields of every line, Python indices: a
table's peak and step time), ``varies: e-notation`` (numbers written 1.2e-07: rounding
differences). Marked slow (each trains). ``python tests/test_readme_snippets.py --regenerate
[TEXT]`` runs the commands (those containing TEXT) and writes what they print into the
documents.
"""

import os
import re
import shlex
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
    # the call's signature, and the Trainer script (test_hf_trainer.py::test_guide_snippet runs
    # it with its printed torchrun command and a model directory)
    assert sum(bool(s.skip) for s in SNIPPETS) <= 2, [s.test_id for s in SNIPPETS if s.skip]


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


# -- a command's printed output ---------------------------------------------------------------
PRINTED = re.compile(r"<!-- output of: (.*?) -->\n```[a-z]*\n(.*?)```", re.S)
E_NOTATION = re.compile(r"^[-+]?\d+(\.\d+)?e[-+]\d+\W*$")


@dataclass
class Printed:
    document: str
    command: str  # "zerokit ARGS"
    exit: int
    varies: str | None  # "fields -4 -2", "e-notation" or None
    output: str  # the block as printed, its "$ ..." line included
    start: int  # the block's text span in the document
    end: int

    @property
    def shown(self) -> str:
        """The output without a first "$ command" line."""
        return re.sub(r"\A\$ [^\n]*\n", "", self.output)

    @property
    def test_id(self) -> str:
        return f"{self.document}-" + re.sub(r"\W+", "-", self.command).strip("-")


def printed_outputs(text: str, document: str) -> list[Printed]:
    found = []
    for match in PRINTED.finditer(text):
        command, *options = (part.strip() for part in match.group(1).split(";"))
        assert command.startswith("zerokit "), f"{document}: {command!r} is not a zerokit command"
        exit_code, varies = 0, None
        for option in options:
            key, _, value = option.partition(" ")
            assert key in ("exit", "varies:"), f"{document}: unknown option {option!r}"
            if key == "exit":
                exit_code = int(value)
            else:
                varies = value.strip()
        found.append(Printed(document, command, exit_code, varies, match.group(2),
                             match.start(2), match.end(2)))  # fmt: skip
    return found


def _masked(text: str, varies: str | None) -> list[list[str]]:
    fields = [int(f) for f in varies.split()[1:]] if varies and varies.startswith("fields") else []
    lines = []
    for line in _lines(text):
        tokens = line.split()
        for i in fields:
            if -len(tokens) <= i < len(tokens):
                tokens[i] = "~"
        if varies == "e-notation":
            tokens = ["~" if E_NOTATION.match(t) else t for t in tokens]
        lines.append(tokens)
    return lines


def _module_files(document: str, command: str) -> dict[str, str]:
    """The python blocks of the document a ``--model MODULE:factory`` imports, by file name."""
    modules = re.findall(r"--model (\w+):", command)
    text = DOCUMENTS[document].read_text()
    return {
        f"{m}.py": code
        for code in BLOCK.findall(text)
        for m in modules
        if code.startswith(f"# {m}.py")
    }


def run_printed(printed: Printed, cwd: Path) -> subprocess.CompletedProcess:
    for name, code in _module_files(printed.document, printed.command).items():
        (cwd / name).write_text(code)
    argv = [sys.executable, "-m", "zerokit", *shlex.split(printed.command)[1:]]
    env = {**os.environ, **ENV_THREADS}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


PRINTS = [p for doc, path in DOCUMENTS.items() for p in printed_outputs(path.read_text(), doc)]


@pytest.mark.slow
@pytest.mark.time_limit(960)  # past run_printed's own timeout (900 s), which names the command
@pytest.mark.parametrize("printed", PRINTS, ids=[p.test_id for p in PRINTS])
def test_a_printed_output_is_what_the_command_prints(printed, tmp_path):
    done = run_printed(printed, tmp_path)
    assert done.returncode == printed.exit, done.stderr[-4000:]
    assert _masked(done.stdout, printed.varies) == _masked(printed.shown, printed.varies), (
        f"{printed.test_id}: regenerate with python tests/test_readme_snippets.py --regenerate "
        f"'{printed.command}'\n{done.stdout}"
    )


def test_printed_outputs_are_found_and_compared_by_their_options():
    ids = [p.test_id for p in PRINTS]
    assert "README-zerokit-compare" in ids and len(set(ids)) == len(ids), ids
    text = (
        "<!-- output of: zerokit verify --model m:f; exit 1; varies: e-notation -->\n"
        "```\n$ zerokit verify --model m:f\nloss 7.65 diff 1.6e-07, x\n```\n"
        "<!-- output of: zerokit compare; varies: fields -4 -2 -->\n```\na 1 2 3 4 5\n```\n"
    )
    verify, compare = printed_outputs(text, "GUIDE")
    assert (verify.command, verify.exit, verify.shown) == (
        "zerokit verify --model m:f", 1, "loss 7.65 diff 1.6e-07, x\n")  # fmt: skip
    assert _masked("loss 7.65 diff 3.2e-08, x", verify.varies) == _masked(
        verify.shown, "e-notation"
    )
    assert _masked("loss 7.66 diff 1.6e-07, x", "e-notation") != _masked(verify.shown, "e-notation")
    assert _masked("a 1 9 3 9 5", compare.varies) == _masked(compare.output, compare.varies)
    assert _masked("a 9 2 3 4 5", compare.varies) != _masked(compare.output, compare.varies)


def regenerate(text_filter: str = "") -> None:
    """Run each printed command (those containing ``text_filter``) and write its output into
    its document, the "$ command" line kept."""
    import tempfile

    for document, path in DOCUMENTS.items():
        for printed in reversed(printed_outputs(path.read_text(), document)):  # spans stay valid
            if text_filter not in printed.command:
                continue
            print(f"{document}: {printed.command}", file=sys.stderr, flush=True)
            with tempfile.TemporaryDirectory() as tmp:
                done = run_printed(printed, Path(tmp))
            assert done.returncode == printed.exit, done.stderr[-4000:]
            shown = printed.output[: len(printed.output) - len(printed.shown)]  # "$ ..." line
            text = path.read_text()
            path.write_text(text[: printed.start] + shown + done.stdout + text[printed.end :])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--regenerate"]:
        regenerate(" ".join(sys.argv[2:]))
