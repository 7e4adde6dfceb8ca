"""Saves destroy nothing but the checkpoint they replace: anything else at the path is refused
and named; one save at a time (a lock); debris of dead saves (whatever it is) never blocks the
next save; ranks agree on the path before anything is written; consolidate never writes into
the checkpoint it reads."""

import os
import subprocess
import sys
import textwrap

import pytest
from dist_helpers import run_distributed
from torch import nn

from zerokit import checkpoint
from zerokit.checkpoint import CheckpointError
from zerokit.checkpoint.places import SaveLock
from zerokit.tools.cli import main as cli


def _model(value: float = 1.0) -> nn.Module:
    model = nn.Linear(4, 3)
    nn.init.constant_(model.weight, value)
    return model


def _loaded_weight(path) -> float:
    model = _model(0.0)
    checkpoint.load(path, model)
    return model.weight[0, 0].item()


def _tree(root) -> dict:
    """Every path under ``root`` with its bytes (links by their target)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            if os.path.islink(full):
                out[full] = ("link", os.readlink(full))
            elif os.path.isfile(full):
                with open(full, "rb") as f:
                    out[full] = f.read()
    return out


def test_a_run_directory_is_refused_and_named(tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "config.yaml").write_text("lr: 0.1\n")
    (run / "logs" / "train.log").write_text("step 1\n")
    before = _tree(tmp_path)
    with pytest.raises(CheckpointError, match=r"run is a directory holding config\.yaml, logs/, not a zerokit checkpoint; zerokit never replaces it"):  # fmt: skip
        checkpoint.save(run, _model())
    assert _tree(tmp_path) == before


def test_a_file_a_symlink_or_a_checkpoint_with_other_files_is_refused(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("data")
    (tmp_path / "link").symlink_to(target)
    cases = {
        "precious.txt": r"precious\.txt is a regular file, not a zerokit checkpoint",
        "link": r"link is a symbolic link, not a zerokit checkpoint",
    }
    checkpoint.save(tmp_path / "ckpt", _model())
    (tmp_path / "ckpt" / "notes.txt").write_text("mine")
    cases["ckpt"] = r"ckpt is a zerokit checkpoint that also holds notes\.txt"
    before = _tree(tmp_path)
    for name, message in cases.items():
        with pytest.raises(CheckpointError, match=message):
            checkpoint.save(tmp_path / name, _model(2.0))
    assert _tree(tmp_path) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    checkpoint.save(empty, _model(3.0))  # an empty directory holds nothing to lose
    assert _loaded_weight(empty) == 3.0
    checkpoint.save(tmp_path / "new" / "step_1", _model(4.0))  # parents are made
    assert _loaded_weight(tmp_path / "new" / "step_1") == 4.0


def test_a_second_save_while_one_holds_the_lock_fails_and_the_checkpoint_survives(tmp_path):
    path = tmp_path / "ckpt"
    checkpoint.save(path, _model(1.0))
    lock = SaveLock(str(path)).acquire()  # as a concurrent save holds it
    try:
        with pytest.raises(CheckpointError, match=rf"another save of {path} is in progress \(pid {os.getpid()} on .*\); this save wrote nothing"):  # fmt: skip
            checkpoint.save(path, _model(2.0))
    finally:
        lock.release()
    assert _loaded_weight(path) == 1.0
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    checkpoint.save(path, _model(2.0))  # released: saves again
    assert _loaded_weight(path) == 2.0


_SLOW_SAVE = textwrap.dedent(
    """
    import sys, time, torch
    from zerokit.checkpoint import saving, CheckpointError
    real = saving.write_safetensors

    def slow(*args, **kwargs):
        time.sleep(float(sys.argv[3]))
        return real(*args, **kwargs)

    saving.write_safetensors = slow
    model = torch.nn.Linear(4, 3)
    torch.nn.init.constant_(model.weight, float(sys.argv[2]))
    try:
        saving.save(sys.argv[1], model)
        print("saved")
    except CheckpointError as e:
        print("refused:", e)
    """
)


@pytest.mark.slow
def test_two_processes_saving_one_path_at_once_one_is_refused(tmp_path):
    path = tmp_path / "ckpt"
    checkpoint.save(path, _model(1.0))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    jobs = [
        subprocess.Popen(
            [sys.executable, "-c", _SLOW_SAVE, str(path), str(value), "3"],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for value in (2.0, 3.0)
    ]
    outs = sorted(job.communicate(timeout=120)[0].strip() for job in jobs)
    assert outs[0].startswith("refused: another save of") and outs[1] == "saved", outs
    assert _loaded_weight(path) in (2.0, 3.0)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_debris_of_any_kind_never_blocks_the_next_save(tmp_path):
    path = tmp_path / "ckpt"
    checkpoint.save(path, _model(1.0))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    # what dead saves (of this and older versions), or a user, may have left behind
    (tmp_path / "ckpt.zerokit-old").symlink_to(outside)
    (tmp_path / "ckpt.zerokit-tmp").write_text("a file")
    (tmp_path / "ckpt.zerokit-tmp-0123456789ab").mkdir()
    (tmp_path / "ckpt.zerokit-tmp-0123456789ab" / "rank00000.safetensors").write_text("half")
    (tmp_path / "ckpt.zerokit-lock").write_text("pid 1 on a host that died")
    checkpoint.save(path, _model(2.0))
    assert _loaded_weight(path) == 2.0
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "outside"]
    assert (outside / "keep.txt").read_text() == "keep", "a symlink was followed"


def test_consolidate_refuses_to_write_into_the_checkpoint(tmp_path, capsys):
    path = tmp_path / "ckpt"
    checkpoint.save(path, _model(1.0))
    before = _tree(tmp_path)
    for output in ("index.json", "model.safetensors", "sub/model.safetensors"):
        assert cli(["ckpt", "consolidate", str(path), str(path / output)]) == 2
        assert "is inside the checkpoint" in capsys.readouterr().err
    assert cli(["ckpt", "consolidate", str(path), str(tmp_path / "m.safetensors"),
                "--optimizer", str(path / "o.safetensors")]) == 2  # fmt: skip
    assert _tree(tmp_path) == before
    assert _loaded_weight(path) == 1.0


def _different_paths(rank, world_size, root):
    path = os.path.join(root, f"rank{rank}")
    os.makedirs(path + ".zerokit-tmp")  # debris of a killed save beside one of them
    with pytest.raises(CheckpointError, match=r"the path differs \(rank 0: '.*/rank0'; rank 1: '.*/rank1'\)"):  # fmt: skip
        checkpoint.save(path, _model(float(rank)))
    assert not os.path.exists(path), "a file was written before the ranks agreed"


def test_ranks_given_different_paths_write_nothing(tmp_path):
    run_distributed(_different_paths, 2, str(tmp_path))
