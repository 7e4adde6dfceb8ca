"""The first day with zerokit, run the way a new user runs it: README's two commands, the
`zerokit` console script, `--version`, a model of one's own, `--plot` without matplotlib, and
`zerokit.memory.estimate` on a parameter count written as a float."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import zerokit
from zerokit.memory import estimate
from zerokit.tools import cli
from zerokit.tools import compare as compare_mod
from zerokit.tools.compare import LEVELS, CompareConfig, run_compare
from zerokit.tools.compare_report import format_bytes, format_table, write_plot

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1")

TINY_MODEL = """
import torch
from zerokit.models.gpt import GPT, GPTConfig


def make():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
"""


def _readme_commands() -> list[str]:
    """The shell commands in README's "Two commands" section, in order."""
    section = (ROOT / "README.md").read_text().split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)


def _zerokit_script() -> str:
    script = shutil.which("zerokit")
    assert script, "the `zerokit` console script is not on PATH: pip install -e . (README)"
    return script


def _fake_report(precision: str = "fp32", scale: int = 1) -> dict:
    def sizes(n):
        return {"params": n, "grads": n, "optimizer": 2 * n, "total": 4 * n}

    rows = [
        {
            "level": level,
            "measured": {**sizes(scale * 1000 // (i + 1)), "peak": 80 * 2**20},
            "estimated": sizes(scale * 1000 // (i + 1)),
            "step_time_s": 0.01,
            "step_time_spread_s": [0.01, 0.01],
            "step_time_rounds": 1,
            "final_loss": 1.0,
        }
        for i, level in enumerate(compare_mod.LEVELS)
    ]
    return {
        "world_size": 2,
        "backend": "gloo",
        "model": "fake",
        "precision": precision,
        "steps": 2,
        "memory_steps": 2,
        "batch": 4,
        "rows": rows,
    }


def test_readme_commands_are_the_ones_that_work(monkeypatch, capsys):
    compare_cmd, test_cmd = _readme_commands()
    # CI runs README's test command verbatim
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_cmd.strip() in ci_lines
    # the main job's command line parses into the documented defaults
    argv = shlex.split(compare_cmd.split("&&")[-1])
    assert argv[0] == "zerokit"
    seen = []
    monkeypatch.setattr(cli, "in_torchrun", lambda: False)
    monkeypatch.setattr(
        cli, "run_compare", lambda cfg, progress: seen.append(cfg) or _fake_report()
    )
    assert cli.main(argv[1:]) == 0
    assert seen == [CompareConfig()]
    assert "measured / estimated" in capsys.readouterr().out


def test_compare_as_a_user_runs_it(tmp_path):
    """The console script with a model module of one's own in the current directory (not on
    sys.path): float inputs, its own batches and loss. Progress per level on stderr, the table
    on stdout, totals in the JSON, a chart; the loss is the one process's on the global batch."""
    shutil.copy(Path(__file__).with_name("compare_models.py"), tmp_path / "my_models.py")
    out, chart = tmp_path / "report.json", tmp_path / "memory.png"
    cmd = [
        _zerokit_script(),
        "compare",
        "--model",
        "my_models:classifier",
        "--steps",
        "2",
        "--batch",
        "6",
        "--json",
        str(out),
        "--plot",
        str(chart),
    ]
    done = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    for i, level in enumerate(compare_mod.LEVELS, 1):
        assert f"[{i}/4] {level}" in done.stderr and f"{level:<7} done in" in done.stderr
    table = done.stdout.splitlines()
    assert "measured / estimated; fp32; 2 steps, global batch 6" in table[0]
    assert [line.split()[0] for line in table[2:6]] == list(compare_mod.LEVELS)
    assert not re.search(r"(?<![\d.])0\.0 [KMG]iB", done.stdout)  # 322 parameters: bytes, KiB
    assert chart.read_bytes()[:4] == b"\x89PNG"
    report = json.loads(out.read_text())
    for row in report["rows"]:
        m, e = row["measured"], row["estimated"]
        assert m["total"] == m["params"] + m["grads"] + m["optimizer"]
        assert e["total"] == e["params"] + e["grads"] + e["optimizer"]
    # the factory's loss_fn, and the same training as one process on the whole batch
    from compare_models import classifier

    model, make_batch, loss_fn = classifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # compare's optimizer
    for step in range(2):
        x, y = make_batch(step, 6)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    for row in report["rows"]:
        assert abs(row["final_loss"] - loss.item()) < 1e-5, (row["level"], row["final_loss"], loss)


@pytest.mark.slow
@pytest.mark.time_limit(960)  # past its own subprocess timeout (900 s), which names the command
def test_readme_compare_command_exactly(tmp_path):
    """`zerokit compare` with nothing else, as README prints it: a 5.3M-parameter GPT."""
    argv = shlex.split(_readme_commands()[0].split("&&")[-1])
    done = subprocess.run(
        [_zerokit_script(), *argv[1:]],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr

    def byte_cells(table: str) -> dict[str, list[str]]:
        """Per level, its four 'measured / estimated' cells (peak and time vary by machine)."""
        rows = [line for line in table.splitlines() if line.split()[:1] in ([x] for x in LEVELS)]
        return {row.split()[0]: re.findall(r"[\d.]+ \w+ / [\d.]+ \w+", row) for row in rows}

    readme = (ROOT / "README.md").read_text()
    printed = readme.split("What the main job prints", 1)[1].split("```", 2)[1]
    assert byte_cells(done.stdout) == byte_cells(printed)  # README shows what the command prints
    assert len(byte_cells(printed)["ddp"]) == 4


def test_version():
    done = subprocess.run(
        [_zerokit_script(), "--version"], env=ENV, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == f"zerokit {zerokit.__version__}"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'version = "{zerokit.__version__}"' in pyproject


@pytest.mark.slow
def test_compare_a_float_input_model_in_bf16():
    """Float inputs under bf16: MixedPrecision casts them for the zerokit levels, autocast for
    DDP; compare passes them as make_batch returns them."""
    report = run_compare(
        CompareConfig(
            model="compare_models:mlp", nproc=2, steps=3, batch=8, mixed_precision="bf16"
        ),
        progress=lambda _: None,
    )
    assert report["precision"] == "bf16"
    assert "bf16 compute with fp32 master shards" in format_table(report).splitlines()[0]
    for row in report["rows"]:
        m, e = row["measured"], row["estimated"]
        for category in ("params", "grads", "optimizer"):  # Adam's step counts are extra
            assert abs(m[category] - e[category]) <= 0.05 * e[category], (row["level"], m, e)
    losses = [row["final_loss"] for row in report["rows"]]
    assert max(losses) - min(losses) < 1e-2 and 0 < losses[0] < 10


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("compare_models:bad_batch", "must return (inputs, targets), got Tensor"),
        ("models:wrong_output", "return (model, make_batch) from the factory"),
    ],
)
def test_a_model_compare_cannot_train_is_refused_before_any_rank_starts(model, message, capsys):
    assert cli.main(["compare", "--model", model]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "[1/4]" not in err


def test_plot_without_matplotlib_fails_before_training(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.setattr(cli, "in_torchrun", lambda: False)
    monkeypatch.setattr(cli, "run_compare", lambda *a: pytest.fail("trained before checking"))
    assert cli.main(["compare", "--plot", str(tmp_path / "m.png")]) == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err and "pip install matplotlib" in err


def test_a_failing_plot_keeps_the_table_and_the_json(monkeypatch, capsys, tmp_path):
    def broken_plot(report, path):
        raise OSError("disk full")

    monkeypatch.setattr(cli, "in_torchrun", lambda: False)
    monkeypatch.setattr(cli, "run_compare", lambda cfg, progress: _fake_report())
    monkeypatch.setattr(cli, "write_plot", broken_plot)
    out = tmp_path / "r.json"
    assert cli.main(["compare", "--json", str(out), "--plot", str(tmp_path / "m.png")]) == 1
    captured = capsys.readouterr()
    assert "measured / estimated" in captured.out and "disk full" in captured.err
    assert json.loads(out.read_text())["rows"][0]["measured"]["total"] == 4000


def test_plot_shows_peak_totals_and_what_is_measured(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    texts = []
    real_savefig = plt.Figure.savefig

    def savefig(fig, path, *a, **k):
        texts.extend(t.get_text() for ax in fig.axes for t in ax.texts)
        texts.extend(ax.get_title() for ax in fig.axes)
        texts.extend(
            t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()
        )
        return real_savefig(fig, path, *a, **k)

    monkeypatch.setattr(plt.Figure, "savefig", savefig)
    write_plot(_fake_report(), str(tmp_path / "m.png"))
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"
    joined = " | ".join(texts)
    assert "80.0 MiB" in joined  # every level's peak is labelled
    assert "3.9 KiB" in joined  # ddp's total, measured and estimated
    assert "solid: measured" in joined and "hatched: estimated" in joined
    assert "peak" in joined


def test_small_sizes_are_readable():
    assert [format_bytes(n) for n in (900, 1800, 3 * 2**20, 5 * 2**30)] == [
        "900 B",
        "1.8 KiB",
        "3.0 MiB",
        "5.0 GiB",
    ]
    table = format_table(_fake_report(precision="bf16"))
    assert not re.search(r"(?<![\d.])0\.0 [KMG]iB", table) and "1000 B / 1000 B" in table
    assert "bf16 compute" in table.splitlines()[0]


def test_estimate_takes_a_count_written_as_a_float():
    assert estimate(7.5e9, "os", 64) == estimate(7_500_000_000, "os", 64)
    assert estimate(np.float64(1e6), "p_g_os", 4) == estimate(np.int64(10**6), "p_g_os", 4)
    with pytest.raises(ValueError, match=re.escape("whole number, got 7500000000.5")):
        estimate(7.5e9 + 0.5, "os", 64)
    with pytest.raises(TypeError, match=re.escape("nn.Module or a number of parameters, got str")):
        estimate("7.5e9", "os", 64)
    # one name for plain data parallelism, as compare prints it; 'dp' still understood
    assert estimate(1000, "ddp", 2) == estimate(1000, "dp", 2)
    with pytest.raises(ValueError, match="valid: ddp, os, os_g, p_g_os"):
        estimate(1000, "zero1", 2)


def _option_entries(help_text: str) -> list[str]:
    """Each option's entry in argparse's help, except -h and --version."""
    options = help_text.split("options:", 1)[1]
    entries = re.split(r"\n  (?=-)", options)[1:]
    return [e for e in entries if not e.startswith(("-h", "--version"))]


def test_compare_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["compare", "--help"])
    entries = _option_entries(capsys.readouterr().out)
    flags = {entry.split()[0] for entry in entries}
    assert {
        "--model",
        "--nproc",
        "--steps",
        "--batch",
        "--seq",
        "--mixed-precision",
        "--json",
        "--plot",
    } <= flags, flags  # and whatever compare gains later, checked below too
    for entry in entries:
        assert "default" in entry, entry


def _positional_entries(help_text: str) -> list[str]:
    """Each positional argument's entry in argparse's help."""
    if "positional arguments:" not in help_text:
        return []
    section = help_text.split("positional arguments:", 1)[1].split("\n\n", 1)[0]
    return re.split(r"\n  (?=\S)", section)[1:]


@pytest.mark.parametrize(
    "command, flags, positionals",
    [
        (["inspect"], {"--tensors"}, ["checkpoint"]),
        (
            ["consolidate"],
            {"--max-shard-size", "--optimizer", "--lightning", "--no-verify", "--writers"},
            ["checkpoint", "output"],
        ),
        (
            ["convert"],
            {"--to", "--no-optimizer", "--max-shard-size", "--writers"},
            ["source", "output"],
        ),
    ],
)
def test_ckpt_help_shows_every_default(command, flags, positionals):
    """`zerokit ckpt inspect|consolidate --help`, run as a user runs it (the console script):
    every option says its default and every positional argument says what it is."""
    done = subprocess.run(
        [_zerokit_script(), "ckpt", *command, "--help"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    entries = _option_entries(done.stdout)
    assert {entry.split()[0] for entry in entries} == flags, done.stdout
    for entry in entries:
        assert "(default" in entry, entry
    described = _positional_entries(done.stdout)
    assert [entry.split()[0] for entry in described] == positionals, done.stdout
    for entry in described:
        assert len(entry.split()) > 1, entry  # a help text after the name


# every script a user runs; a *_worker.py is started by its script, not by a user
SCRIPTS = sorted(
    str(path.relative_to(ROOT))
    for folder in ("benchmarks", "examples")
    for path in (ROOT / folder).glob("*.py")
    # a script runs as one (a helper module such as sync_points.py, a _worker, has no main)
    if not path.name.endswith("_worker.py") and '__name__ == "__main__"' in path.read_text()
)
# prints each script's --help after a line "== <script>"; one interpreter for all of them
HELP_DRIVER = """
import contextlib, os, runpy, sys
for script in sys.argv[1:]:
    print("== " + script, flush=True)
    sys.argv = [script, "--help"]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script` has it
    with contextlib.suppress(SystemExit):
        runpy.run_path(script, run_name="__main__")
"""


def test_scripts_help_shows_defaults_and_whole_descriptions():
    done = subprocess.run(
        [sys.executable, "-c", HELP_DRIVER, *SCRIPTS],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    helps = dict(zip(SCRIPTS, done.stdout.split("== ")[1:]))
    assert list(helps) == SCRIPTS
    for script, text in helps.items():
        assert text.startswith(script) and "options:" in text, (script, text)
        for entry in _option_entries(text):
            assert "default" in entry, (script, entry)
        prose = text.split("\n\n")[1]  # the description's first paragraph, after usage
        assert prose.rstrip().endswith((".", ":")), (script, prose)


@pytest.mark.slow
def test_torchrun_measures_each_level_in_fresh_processes(tmp_path):
    """Under torchrun each level's peak starts from a clean process: running the levels one
    after another in the same processes reported 'os' at 2.6 MiB against 184 MiB."""
    torchrun = shutil.which("torchrun")
    assert torchrun
    out = tmp_path / "r.json"
    cmd = [
        torchrun,
        "--nproc-per-node",
        "2",
        "-m",
        "zerokit",
        "compare",
        "--model",
        "my_tiny_model:make",
        "--steps",
        "2",
        "--batch",
        "4",
        "--seq",
        "8",
        "--json",
        str(out),
    ]
    (tmp_path / "my_tiny_model.py").write_text(TINY_MODEL)
    done = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[4/4] p_g_os" in done.stderr
    peaks = [row["measured"]["peak"] for row in json.loads(out.read_text())["rows"]]
    # a fresh process pays the same runtime overhead each time (tens of MiB); a level run
    # after another in the same process reuses that memory and shows a fraction of it
    assert min(peaks) > 0.5 * max(peaks), peaks
