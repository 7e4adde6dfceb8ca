"""One layout object, passed in (no module-level process-group state): a ``zerokit.Layout``
from ``init_hybrid_parallel`` or a torch ``DeviceMesh`` with named dims serve alike, and two
layouts live side by side in one process."""

import ast
import pathlib
import re

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed
from torch.distributed.device_mesh import init_device_mesh

import zerokit
from zerokit import tensor_parallel as tp
from zerokit.layout import as_layout


def _mesh_and_layout(rank, world_size):
    layout = zerokit.init_hybrid_parallel(1, world_size)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    from_mesh = as_layout(mesh)
    assert (from_mesh.tp_degree, from_mesh.tp_rank) == (layout.tp_degree, layout.tp_rank)
    assert from_mesh.shard_group.size() == 1 and from_mesh.replica_group is None
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    outs = []
    for given in (layout, mesh):  # each layer built from the same seed, over either layout
        torch.manual_seed(0)
        outs.append(tp.ColumnParallelLinear(8, 4, layout=given)(x))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    # the layout's random streams are its own: seeding one leaves the other alone
    tp.model_parallel_random_seed(3, layout)
    with pytest.raises(KeyError, match="no rng state"):
        with from_mesh.rng.rng_state(tp.LOCAL_SEED):
            pass
    # the two ZeRO roles of a hybrid layout: shard inside, replicate across
    mesh2 = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "shard"))
    hybrid = as_layout(mesh2)
    assert hybrid.shard_group is hybrid.dp_group and hybrid.replica_group is None
    dist.barrier()


def test_a_device_mesh_is_a_layout():
    run_distributed(_mesh_and_layout, 2)


def test_no_module_level_process_group_state():
    """No ``global`` statement in the package: state lives on objects that are passed in."""
    root = pathlib.Path(zerokit.__file__).parent
    found = [
        f"{path.relative_to(root)}:{n}"
        for path in root.rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.fullmatch(r"\s*global\s+\w+(\s*,\s*\w+)*\s*(#.*)?", line)
    ]
    assert not found, found


def _module_level_group_tables(source: str) -> list[int]:
    """Lines of module-level assignments that key state by process group: a
    ``WeakKeyDictionary`` (keyed by objects such as groups) or anything annotated with
    ``ProcessGroup``."""
    lines = []
    for node in ast.parse(source).body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        annotation = ast.unparse(node.annotation) if isinstance(node, ast.AnnAssign) else ""
        called = node.value.func if isinstance(node.value, ast.Call) else None
        name = getattr(called, "attr", getattr(called, "id", ""))
        if "ProcessGroup" in annotation or name == "WeakKeyDictionary":
            lines.append(node.lineno)
    return lines


def test_no_module_level_tables_keyed_by_groups():
    """Per-group state (where a rank is, how many meetings it held) has one owner: an object
    (``ShardState.presence``) or the group's own store, never a module-level dict."""
    assert _module_level_group_tables("import weakref\n_w = weakref.WeakKeyDictionary()\n")
    assert _module_level_group_tables("_n: dict[ProcessGroup, int] = {}\n")
    root = pathlib.Path(zerokit.__file__).parent
    found = [
        f"{path.relative_to(root)}:{n}"
        for path in root.rglob("*.py")
        for n in _module_level_group_tables(path.read_text())
    ]
    assert not found, found


def test_layers_without_a_layout_say_what_to_pass():
    with pytest.raises(TypeError, match="there is no global default"):
        tp.ParallelCrossEntropy()
