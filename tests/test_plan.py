"""`zerokit plan` against real runs: the collectives of a real training step, recorded at
zerokit's collective helpers on 2 and 3 gloo ranks, are the plan's (same ops, group sizes,
calls and bytes, one by one), no collective bypasses those helpers, and every rank's
``measure()`` after the backward equals the plan's memory for that rank, byte for byte, at
every level, in fp32, bf16 and fp16. Then the CLI: the pinned JSON, grouping of alike ranks,
usage errors."""

import itertools
import json
import re
import sys
import threading
import weakref

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed

from zerokit import LEVELS, MixedPrecision, ShardedGradScaler, group_sharded_parallel
from zerokit.layout import init_hybrid_parallel
from zerokit.memory import format_bytes, measure
from zerokit.tools import cli
from zerokit.tools.plan import LOW, PlanConfig, plan_with_calls
from zerokit.tools.workload import build_workload, load_factory

MODEL = "verify_models:tiny_gpt"
BUFFER = 600  # elements: the embedding and each block span several buckets
SEQ = 8

# zerokit.core.collectives' helpers: the op each is, and the bytes of its logical collective
HELPERS = {
    "start_all_reduce_mean": ("all_reduce", lambda tensor, *_, **__: tensor.nbytes),
    "all_reduce_": ("all_reduce", lambda tensor, *_, **__: tensor.nbytes),
    "start_all_reduce_": ("all_reduce", lambda tensor, *_, **__: tensor.nbytes),
    "start_reduce_scatter_mean": ("reduce_scatter", lambda full, *_, **__: full.nbytes),
    "start_all_gather_": ("all_gather", lambda full, *_, **__: full.nbytes),
    "broadcast_": ("broadcast", lambda tensor, *_, **__: tensor.nbytes),
    "all_gather_bytes": ("all_gather_bytes", lambda data, *_, **__: len(data)),
}
RAW = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
       "reduce_scatter_tensor", "all_to_all_single", "barrier", "all_gather_object",
       "broadcast_object_list", "send", "recv")  # fmt: skip


class Recorder:
    """Wraps the helpers wherever zerokit imported them, and torch.distributed's collectives
    to catch any call made outside a helper."""

    def __init__(self, tp_group=None):
        self.on = False
        self.calls: list[tuple[str, int, int]] = []
        self.bypassing: list[str] = []
        self._inside = threading.local()
        self.tp_group = tp_group  # the tp layers' raw collectives on it are recorded too

    def install(self) -> None:
        from zerokit.core import collectives

        for name, (op, size_of) in HELPERS.items():
            original = getattr(collectives, name)
            wrapper = self._helper(original, op, size_of)
            for module in list(sys.modules.values()):
                if (
                    module.__name__.startswith("zerokit")
                    and getattr(module, name, None) is original
                ):
                    setattr(module, name, wrapper)
        for name in RAW:
            if hasattr(dist, name):
                setattr(dist, name, self._raw(getattr(dist, name), name))

    def _helper(self, fn, op, size_of):
        def wrapper(*args, **kwargs):
            group = kwargs.get("group", args[-1] if op != "reduce_scatter" else args[2])
            group = group if group is not None and not isinstance(group, bool) else None
            outermost = getattr(self._inside, "depth", 0) == 0  # one helper may call another
            if self.on and outermost and group is not None and group.size() > 1:
                self.calls.append((op, group.size(), size_of(*args, **kwargs)))
            self._inside.depth = getattr(self._inside, "depth", 0) + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._inside.depth -= 1

        return wrapper

    def _raw(self, fn, name):
        def wrapper(*args, **kwargs):
            if self.on and getattr(self._inside, "depth", 0) == 0:
                if self.tp_group is not None and kwargs.get("group") is self.tp_group:
                    self.calls.append(_tp_call(name, self.tp_group.size(), *args))
                else:
                    self.bypassing.append(name)
            return fn(*args, **kwargs)

        return wrapper


def _tp_call(name: str, size: int, *args) -> tuple[str, int, int]:
    """A tp layer's raw collective, counted as the plan counts it (an all-gather's output)."""
    if name == "all_gather":
        return ("all_gather", size, sum(t.nbytes for t in args[0]))
    if name == "all_to_all_single":
        return ("all_to_all", size, args[1].nbytes)
    return (name, size, args[0].nbytes)


def _group_arg_positions_are_right():
    """The recorder reads the group from the helpers' signatures: fail loudly if they move."""
    import inspect

    from zerokit.core import collectives

    names = ("start_all_reduce_mean", "start_all_reduce_", "start_all_gather_", "all_reduce_")
    for name in (*names, "broadcast_"):
        assert list(inspect.signature(getattr(collectives, name)).parameters)[1] == "group", name
    params = list(inspect.signature(collectives.start_reduce_scatter_mean).parameters)
    assert params[2] == "group"


def _plans(world_size, precision=None, degree=None, model=MODEL, tp=1, per_rank=2):
    """Every level's plan, made here (the plan plays its ranks in this process: before the
    ranks of the real run start)."""
    batch = per_rank * world_size // tp
    config = {
        "world": world_size, "model": model, "batch": batch, "seq": SEQ, "tp": tp,
        "mixed_precision": precision, "buffer_max_size": BUFFER, "sharding_degree": degree,
    }  # fmt: skip
    return {level: plan_with_calls(PlanConfig(level=level, **config)) for level in LEVELS}


def _real_step_equals_plan(rank, world_size, plans, precision, degree=None, model_name=MODEL):
    _group_arg_positions_are_right()
    recorder = Recorder()
    recorder.install()
    low = LOW[precision]
    per_rank, batch = 2, 2 * world_size
    for level in LEVELS:
        report, planned = plans[level]
        torch.manual_seed(0)
        work = build_workload(load_factory(model_name), batch=batch, seq=SEQ, per_rank=per_rank)
        opt = torch.optim.AdamW(work.model.parameters(), lr=1e-3)
        groups = {}
        if degree is not None:  # hybrid: shard inside groups of `degree`, replicate across
            layout = init_hybrid_parallel(world_size // degree, 1, sharding_degree=degree)
            groups = {"group": layout.sharding_group, "dp_group": layout.dp_group}
        model, opt, scaler = group_sharded_parallel(
            work.model, opt, level, buffer_max_size=BUFFER, **groups,
            scaler=ShardedGradScaler() if low == torch.float16 else None,
            mixed_precision=MixedPrecision(param_dtype=low),
        )  # fmt: skip
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        for step in range(2):  # the second step is the steady one the plan describes
            recorder.on, recorder.calls, recorder.bypassing = step == 1, [], []
            x, y = (t[mine] for t in work.make_batch(step, batch))
            loss = work.loss_fn(model(x), y)
            (scaler.scale(loss) if scaler else loss).backward()
            if step == 1:
                measured = measure(model, opt)
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
        recorder.on = False
        what = f"{precision or 'fp32'} level={level} world={world_size} rank={rank}"
        assert not recorder.bypassing, f"{what}: collectives outside the helpers"
        want = sorted((c.op, c.group_size, c.bytes) for c in planned)
        assert sorted(recorder.calls) == want, f"{what}: recorded {recorder.calls}"
        memory = report["ranks"][rank]["memory"]  # hybrid: rank % degree is its shard rank
        got = {"params": measured.params, "grads": measured.grads, "optimizer": measured.optimizer}
        assert got == {k: memory[k] for k in got}, f"{what}: measured {got}, planned {memory}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_real_step_sends_and_holds_what_the_plan_says(world_size):
    run_distributed(_real_step_equals_plan, world_size, _plans(world_size), None)


def test_a_real_hugging_face_llama_step_sends_and_holds_what_the_plan_says():
    """A model people train, as Hugging Face builds it (its rotary buffers, its masks), played
    on meta and run for real on 3 ranks."""
    pytest.importorskip("transformers")
    model = "verify_models:tiny_llama"
    run_distributed(_real_step_equals_plan, 3, _plans(3, model=model), None, None, model)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_steps_send_and_hold_what_the_plan_says(precision):
    run_distributed(_real_step_equals_plan, 3, _plans(3, precision), precision)


@pytest.mark.slow
def test_hybrid_sharding_steps_send_and_hold_what_the_plan_says():
    run_distributed(_real_step_equals_plan, 4, _plans(4, degree=2), None, 2)


TP_MODEL = "verify_models:tiny_gpt_tp"


def _tp_step_equals_plan(rank, world_size, plans, tp):
    """dp x tp: the tp layers' collectives and ZeRO's over each dp group, and the memory of
    each rank's tp slices sharded over dp, as the plan says."""
    from zerokit.tensor_parallel import ParallelCrossEntropy

    dp = world_size // tp
    layout = init_hybrid_parallel(dp, tp)
    recorder = Recorder(layout.tp_group)
    recorder.install()
    per_rank, batch = 2, 2 * dp
    for level in LEVELS:
        report, _ = plans[level]
        plain = build_workload(load_factory(TP_MODEL), batch=batch, seq=SEQ, per_rank=per_rank)
        model = load_factory(TP_MODEL)(layout=layout)
        loss_fn = ParallelCrossEntropy(layout=layout)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt, _ = group_sharded_parallel(
            model, opt, level, group=layout.dp_group, buffer_max_size=BUFFER
        )
        mine = slice(layout.dp_rank * per_rank, (layout.dp_rank + 1) * per_rank)
        for step in range(2):  # the second step is the steady one the plan describes
            recorder.on, recorder.calls, recorder.bypassing = step == 1, [], []
            x, y = (t[mine] for t in plain.make_batch(step, batch))
            loss_fn(model(x), y).backward()
            if step == 1:
                measured = measure(model, opt)
            opt.step()
            opt.zero_grad(set_to_none=True)
        recorder.on = False
        what = f"tp {tp} level={level} world={world_size} rank={rank}"
        assert not recorder.bypassing, f"{what}: collectives outside the helpers"
        planned = report["ranks"][rank]["collectives"]
        want = sorted((c["op"], c["group_size"], c["calls"], c["bytes"]) for c in planned)
        got_rows: dict[tuple, list[int]] = {}
        for op, size, nbytes in recorder.calls:  # aggregated as the report does, but by op
            got_rows.setdefault((op, size), []).append(nbytes)
        planned_rows: dict[tuple, list[int]] = {}
        for c in planned:
            row = planned_rows.setdefault((c["op"], c["group_size"]), [0, 0])
            row[0] += c["calls"]
            row[1] += c["bytes"]
        got = {k: [len(v), sum(v)] for k, v in got_rows.items()}
        assert got == planned_rows, f"{what}: recorded {got}, planned {want}"
        memory = report["ranks"][rank]["memory"]
        got = {"params": measured.params, "grads": measured.grads, "optimizer": measured.optimizer}
        assert got == {k: memory[k] for k in got}, f"{what}: measured {got}, planned {memory}"


def test_a_real_tensor_parallel_step_sends_and_holds_what_the_plan_says():
    run_distributed(_tp_step_equals_plan, 2, _plans(2, model=TP_MODEL, tp=2), 2)


@pytest.mark.slow
def test_a_real_dp2_x_tp2_step_sends_and_holds_what_the_plan_says():
    run_distributed(_tp_step_equals_plan, 4, _plans(4, model=TP_MODEL, tp=2), 2)


def _plan(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_is_the_pinned_format_and_alike_ranks_are_grouped(capsys, tmp_path):
    path = tmp_path / "plan.json"
    code, out, _ = _plan(
        capsys, "--model", MODEL, "--world", "5", "--level", "p_g_os", "--seq", str(SEQ),
        "--json", str(path),
    )  # fmt: skip
    assert code == 0, out
    report = json.loads(path.read_text())
    assert {"params", "world", "level", "ranks"} <= set(report)
    assert report["world"] == 5 and report["level"] == "p_g_os"
    assert report["params"] == sum(p.numel() for p in load_factory(MODEL)().parameters())
    assert [r["rank"] for r in report["ranks"]] == list(range(5))
    for entry in report["ranks"]:
        assert set(entry["memory"]) == {"params", "grads", "optimizer", "transient", "activations"}
        for c in entry["collectives"]:
            assert {"op", "group_size", "calls", "bytes"} <= set(c) and c["group_size"] == 5
        sent = sum(c["bytes"] * (4 / 5) * (2 if c["op"] == "all_reduce" else 1)
                   for c in entry["collectives"])  # fmt: skip
        assert entry["bytes_per_step"] == round(sent)
    assert len({json.dumps(e["memory"]) for e in report["ranks"]}) > 1  # the last rank: padding
    # the text: one row per set of ranks whose printed figures are equal, naming its ranks
    rows: dict[str, list[int]] = {}
    for entry in report["ranks"]:
        memory = entry["memory"]
        shown = tuple(format_bytes(v) for v in [*memory.values(), sum(memory.values())])
        rows.setdefault(shown, []).append(entry["rank"])
    printed = [m.group(1) for m in re.finditer(r"  ranks? ([\d,-]+)$", out, flags=re.M)]
    assert [_expand(p) for p in printed] == list(rows.values()), out


def _expand(spans: str) -> list[int]:
    """'0-2,4' -> [0, 1, 2, 4]"""
    out = []
    for part in spans.split(","):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--world", "4", "--level", "os", "--batch", "6"], "must divide evenly across 4"),
        (["--world", "4", "--level", "os", "--sharding-degree", "3"], "must be at least 1 and"),
        (["--world", "4", "--level", "os", "--pp", "3"], "--pp 3 must be at least 1 and divide"),
        (
            ["--world", "4", "--level", "os", "--pp", "2", "--micro-batches", "3", "--batch", "4"],
            "--micro-batches 3 must be at least 1 and divide the 2 rows",
        ),
        (
            ["--world", "4", "--level", "os", "--pp", "2", "--model", "compare_models:mlp"],
            "pipelines are planned and verified for zerokit.models.gpt.GPT",
        ),
        (["--world", "4", "--level", "os", "--tp", "3"], "--tp 3 must be at least 1 and divide"),
        (
            ["--world", "4", "--level", "os", "--tp", "2", "--model", MODEL],
            "takes no 'layout' keyword",
        ),
        (["--world", "4", "--level", "os", "--model", "no_such:make"], "cannot import"),
        (
            ["--world", "4", "--level", "os_g", "--whole-grads"],
            "whole_grads only applies to level 'os'",
        ),
    ],
)
def test_usage_errors_exit_2(capsys, args, message):
    code, _, err = _plan(capsys, *args)
    assert code == 2 and message in err, err


@pytest.mark.parametrize("world_size", [2, 3])
def test_stage1_plan_sends_the_paper_bytes_and_half_again_with_whole_grads(world_size):
    """'os' reduce-scatters by default: the gradients and the updated shards move the ZeRO
    paper's 2Ψ(N-1)/N per rank; ``whole_grads`` all-reduces the gradients, 3Ψ(N-1)/N. (The
    real steps are held to the plan by the tests above; padding makes the plan's bytes a
    little more than Ψ's.)"""
    config = {"world": world_size, "model": MODEL, "batch": 2 * world_size, "seq": SEQ}
    for whole, volume in ((False, 2), (True, 3)):
        report, calls = plan_with_calls(PlanConfig(level="os", whole_grads=whole, **config))
        grads = {c.op for c in calls if c.what == "reduce gradients"}
        assert grads == {"all_reduce" if whole else "reduce_scatter"}, (whole, grads)
        kinds = ("reduce gradients", "gather updated shards")
        moved = sum(c.sent for c in calls if c.what in kinds)
        paper = report["paper_bytes_per_step"] * volume / 2
        assert paper <= moved <= paper * 1.001, (whole, moved, paper)


# -- pipelines ------------------------------------------------------------------------------------
class PipeRecorder(Recorder):
    """Also records the pipeline's own raw calls (its transfers, the tied weights' sum, the
    loss), each with its group's size; p2p as a pair."""

    def install(self) -> None:
        dist.isend = self._raw(dist.isend, "isend")
        super().install()

    def _raw(self, fn, name):
        def wrapper(*args, **kwargs):
            if self.on and getattr(self._inside, "depth", 0) == 0:
                tensor = args[0]
                if name in ("isend", "send", "recv"):
                    self.calls.append(("recv" if name == "recv" else "send", 2, tensor.nbytes))
                elif name in ("all_reduce", "broadcast"):
                    group = kwargs.get("group")
                    size = group.size() if group is not None else dist.get_world_size()
                    self.calls.append((name, size, tensor.nbytes))
                else:
                    self.bypassing.append(name)
            return fn(*args, **kwargs)

        return wrapper


class _Saved:
    """A tensor autograd saved, held for it: when autograd lets go, so does the meter."""

    def __init__(self, tensor):
        self.tensor = tensor


class SavedMeter:
    """The most bytes autograd holds saved for backward at once over a schedule, each storage
    once, the stage's parameters left out (as the plan counts activations)."""

    def __init__(self, stage):
        self.stage, self.live, self.peak, self.count = stage, 0, 0, {}

    def pack(self, t):
        storage = t.untyped_storage()
        key = storage._cdata
        if key in {p.untyped_storage()._cdata for p in self.stage.parameters()}:
            return t
        self.count[key] = self.count.get(key, 0) + 1
        if self.count[key] == 1:
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        held = _Saved(t)
        weakref.finalize(held, self._drop, key, storage.nbytes())
        return held

    def _drop(self, key, nbytes):
        self.count[key] -= 1
        if not self.count[key]:
            self.live -= nbytes

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Saved) else held


def _pipe_model(segment: int) -> str:
    """``segment``: the unit size; small, a stage is several units (the linears, embeddings)
    instead of one root unit, so the gathers of forward and backward differ. Then the model is
    untied (the tied head uses the embedding's weight without calling its module, which at
    'p_g_os' needs the embedding in the root unit); tied, the stages with a copy defer their
    reduction until the copies are summed."""
    return MODEL if segment == 2**20 else "verify_models:tiny_gpt_untied"


def _pipe_plans(world_size, pp, schedule, micro_batches, segment, precision=None):
    """Every level's pipeline plan, made here (its dry run plays the ranks in this process:
    before the ranks of the real run start)."""
    from zerokit.tools.plan_pp import plan_with_calls as plan_pipeline

    batch = 2 * micro_batches * (world_size // pp)
    config = {
        "world": world_size, "model": _pipe_model(segment), "batch": batch, "seq": SEQ,
        "pp": pp, "micro_batches": micro_batches, "schedule": schedule,
        "buffer_max_size": BUFFER, "segment_size": segment, "mixed_precision": precision,
    }  # fmt: skip
    return {level: plan_pipeline(PlanConfig(level=level, **config)) for level in LEVELS}


def _pipeline_step_equals_plan(
    rank, world_size, pp, plans, schedule, micro_batches, segment, precision=None
):
    model = _pipe_model(segment)
    from zerokit.models.gpt import gpt_layers
    from zerokit.pipeline import PipelineModule

    dp = world_size // pp
    layout = init_hybrid_parallel(dp, 1, pp_degree=pp)
    recorder = PipeRecorder()
    recorder.install()
    per_rank, batch = 2 * micro_batches, 2 * micro_batches * dp
    for level, (report, planned) in plans.items():
        torch.manual_seed(0)
        work = build_workload(load_factory(model), batch=batch, seq=SEQ, per_rank=per_rank)
        pipe = PipelineModule(gpt_layers(work.model.cfg), work.loss_fn, layout=layout)
        opt = torch.optim.AdamW(pipe.stage.parameters(), lr=1e-3)
        _, opt, _ = group_sharded_parallel(
            pipe.stage, opt, level, group=layout.dp_group, buffer_max_size=BUFFER,
            segment_size=segment, mixed_precision=MixedPrecision(param_dtype=LOW[precision]),
        )  # fmt: skip
        mine = slice(layout.dp_rank * per_rank, (layout.dp_rank + 1) * per_rank)
        for step in range(2):  # the second step is the steady one the plan describes
            recorder.on, recorder.calls, recorder.bypassing = step == 1, [], []
            x, y = (t[mine] for t in work.make_batch(step, batch))
            meter = SavedMeter(pipe.stage)
            with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                pipe.forward_backward((x, y), schedule, micro_batches)
            if step == 1:
                measured = measure(pipe.stage, opt)
            opt.step()
            opt.zero_grad(set_to_none=True)
        recorder.on = False
        what = f"pp {pp} {schedule} m={micro_batches} {precision or 'fp32'} level={level} "
        what += f"world={world_size} rank={rank}"
        assert not recorder.bypassing, f"{what}: collectives outside the helpers"
        entry = report["ranks"][rank]
        want = sorted((c.op, c.group_size, c.bytes) for c in planned[entry["stage"]])
        assert sorted(recorder.calls) == want, f"{what}: recorded {recorder.calls}"
        memory = entry["memory"]
        got = {"params": measured.params, "grads": measured.grads, "optimizer": measured.optimizer}
        assert got == {k: memory[k] for k in got}, f"{what}: measured {got}, planned {memory}"
        # the micro-batches in flight: equal within 2 % (the rows are views of the rank's
        # whole batch, whose tokens and labels a real step saves as one storage)
        assert abs(meter.peak - memory["activations"]) <= 0.02 * meter.peak, (
            f"{what}: saved at most {meter.peak} bytes at once, planned {memory['activations']}"
        )


def test_a_real_pipeline_step_sends_and_holds_what_the_plan_says():
    plans = _pipe_plans(2, 2, "1f1b", 2, 2**20)
    run_distributed(_pipeline_step_equals_plan, 2, 2, plans, "1f1b", 2, 2**20)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, segment", [("1f1b", 200), ("fthenb", 200), ("1f1b", 2**20)])
def test_a_real_pp2_x_dp2_step_sends_and_holds_what_the_plan_says(schedule, segment):
    plans = _pipe_plans(4, 2, schedule, 3, segment)
    run_distributed(_pipeline_step_equals_plan, 4, 2, plans, schedule, 3, segment)


@pytest.mark.slow
def test_a_real_bf16_pipeline_step_sends_and_holds_what_the_plan_says():
    plans = _pipe_plans(4, 2, "1f1b", 2, 200, "bf16")
    run_distributed(_pipeline_step_equals_plan, 4, 2, plans, "1f1b", 2, 200, "bf16")


def test_pipeline_json_and_printout_group_ranks_by_stage(capsys, tmp_path):
    path = tmp_path / "plan.json"
    code, out, _ = _plan(
        capsys, "--model", MODEL, "--world", "6", "--pp", "3", "--level", "os_g",
        "--seq", str(SEQ), "--schedule", "fthenb", "--micro-batches", "2", "--json", str(path),
    )  # fmt: skip
    assert code == 0, out
    report = json.loads(path.read_text())
    assert (report["pp"], report["micro_batches"], report["schedule"]) == (3, 2, "fthenb")
    # pp is outermost: ranks 2s and 2s+1 are stage s; F-then-B holds every micro-batch
    assert [e["stage"] for e in report["ranks"]] == [0, 0, 1, 1, 2, 2]
    assert [s["micro_batches_in_flight"] for s in report["stages"]] == [2, 2, 2]
    layers = [s["layers"] for s in report["stages"]]
    assert layers[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(layers))
    for entry in report["ranks"]:
        whats = {c["what"] for c in entry["collectives"]}  # activations flow forward only
        assert ("receive activations" in whats) == (entry["stage"] > 0)
        assert ("send activations" in whats) == (entry["stage"] < 2)
        stage = report["stages"][entry["stage"]]
        assert entry["memory"]["activations"] == 2 * stage["activations_per_micro_batch"]
    for s in range(3):
        assert re.search(rf"ranks {2 * s}-{2 * s + 1} \(stage {s}\)$", out, flags=re.M), out
