"""The checkpoint protocol: the phases every save and every load goes through, whatever the
format. Formats plug in: a *writer* (``saving.ZerokitWriter``, ``dcp_save.DcpWriter``) and a
*source* (``loading.ZerokitSource``, ``dcp_load.DcpSource``); nothing here knows a file layout.

Note: the phases. Each ends in one all-gather (``agreement``; an async save's write and seal,
in files: ``background``) that raises the same ``CheckpointError`` on every rank, so nothing
is half-applied.

save = agree -> stage -> write -> seal -> publish  (``begin_save``, then ``SaveJob.finish``)
  The ranks agree on the path, model, optimizer, extra keys and layout before anything is
  written; the stage fixes what is written (sync: the live shards; async: a host copy); rank 0
  takes the lock and makes the temp directory; each rank writes its own file(s), a failure
  naming the rank and the file; rank 0 seals (the writer's index or metadata) and publishes
  (``swap_in``). A ``Tell`` ends the write and the seal on every rank: ``Together``'s
  all-gather (``save``) or ``background``'s files on a writer thread (``async_save``, one at a
  time per process: ``inflight``); sync and async differ only there.

load = agree -> plan reads -> stage -> validate -> apply  (``load_with``)
  The source opens, the ranks agree on the checkpoint's digest and the model; ``stage``
  compares what the checkpoint holds with what this rank holds, reads this rank's bytes into
  ``Staged`` and validates them; all ranks agree it succeeded, and only then is anything
  copied into the model, the optimizer or the extra state.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from ..core import alive, state_of, whole_shards
from . import extra as extra_state
from .agreement import (
    agree_on,
    attempt,
    gather_json,
    mark_call,
    model_fingerprint,
    named,
    optimizer_fingerprint,
    raise_any,
    rank,
    world_group,
    world_view,
)
from .fields import listing
from .holdings import Chunk, Holdings, TensorMeta, collect, holder_of, optimizers_of
from .index import CheckpointError, check_hyperparameter, is_finite_number
from .inflight import wait_in_flight
from .places import SaveLock, clear_debris, make_temp, remove, why_not_replaceable, write_whole
from .reading import OLD_SUFFIX

# ---------------------------------------------------------------------------- save


class Writer(Protocol):
    """A format's writing half."""

    name: str

    def file_of(self, rank: int) -> str: ...  # the file this rank writes (named in errors)

    def write(self, tmp: str, rank: int, h: Holdings, extras: dict, per_rank: dict) -> dict: ...

    # seal (rank 0): every rank's write checked, and the file that makes it one checkpoint
    def seal(self, tmp: str, h: Holdings, shards: list, per_rank, world) -> tuple[str, bytes]: ...


class Tell(Protocol):
    """How the ranks end the write and the seal, each raising the same ``CheckpointError`` on
    every rank: ``Together`` (an all-gather) or ``background``'s files in the temp directory."""

    stops: type[BaseException]  # what a writer may raise that is told, not raised at once

    def written(self, error: str | None, shard: dict | None) -> list: ...  # rank 0: all shards

    def committed(self, error: str | None) -> None: ...  # rank 0's seal and publish


@dataclass
class Prepared:
    """What a rank saves, collected and checked; ``error`` what went wrong here (told to every
    rank by ``agree`` before anything is written)."""

    h: Holdings | None
    extras: dict
    error: str | None


def _checked(model, optimizer, extra: Mapping[str, Any] | None) -> tuple[Holdings, dict]:
    """What this rank was given, collected and checked, and its extra state encoded."""
    h = collect(model, optimizer)
    for i, group in enumerate(h.groups):
        for key, value in group["hyperparameters"].items():
            try:
                check_hyperparameter(f"param group {i}: {key}", value)
            except CheckpointError as e:
                raise CheckpointError(f"{e}; it would not load") from None
    for param, state in h.scalars.items():
        for key, scalar in state.items():
            check_hyperparameter(f"optimizer state {key!r} of {param}", scalar["value"])
    if extra is not None and not isinstance(extra, Mapping):
        raise CheckpointError(f"extra must be a dict of name -> state, got {type(extra).__name__}")
    extras = {}
    for key, value in (extra or {}).items():
        if not isinstance(key, str):
            raise CheckpointError(f"extra: keys must be strings, got {key!r}")
        extras[key] = extra_state.encode(value, f"extra[{key!r}]")
    return h, extras


def agree(path: str, p: Prepared, writer: Writer, group, timeout) -> tuple[dict, dict | None]:
    """Every rank's error (if any) told to all, then the path, model, optimizer, extra keys
    and layout agreed. Returns which extra keys differ per rank, and the pipeline's view."""
    h, extras = p.h, p.extras
    digests = {k: extra_state.digest(*v) for k, v in extras.items()}
    replies = raise_any(gather_json("checkpoint.save", [p.error, digests], group, timeout))
    world = world_view(h, "checkpoint.save", group, timeout)
    agree_on(
        "checkpoint.save: what and where",
        {
            "the path": path.encode(),
            "the format": writer.name.encode(),
            "the model's tensors": model_fingerprint(h) if world is None else world["fingerprint"],
            "the optimizer": optimizer_fingerprint(h),
            "the extra state's keys": json.dumps(sorted(extras)).encode(),
            "the layout": json.dumps(h.layout, sort_keys=True).encode(),
        },
        group,
        timeout,
    )
    return {k: len({d[k] for _, d in replies}) > 1 for k in extras}, world


def make_place(path: str) -> tuple[SaveLock | None, str | None, str | None]:
    """Rank 0: the lock, the path checked, debris cleared, a temp directory made."""
    lock = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)  # as `mkdir -p` would
        lock = SaveLock(path).acquire()
        refused = why_not_replaceable(path)
        if refused:
            raise CheckpointError(
                f"{refused}; zerokit never replaces it: choose another path, or remove it yourself"
            )
        clear_debris(path)
        return lock, make_temp(path), None
    except CheckpointError as e:
        return lock, None, str(e)
    except OSError as e:
        return lock, None, f"cannot prepare {path}: {e}"


@dataclass
class SaveJob:
    """A save the ranks agreed on, its temp directory made: what is left is ``finish``."""

    path: str
    tmp: str | None
    p: Prepared
    writer: Writer
    per_rank: dict
    world: dict | None
    group: Any
    timeout: float | None  # the save's collective timeout (None: the default)
    lock: SaveLock | None  # rank 0's
    rank: int  # fixed at the agreement: the writer thread may outlive the process group
    errno: int | None = None  # of this rank's failed write, if an OSError

    def finish(self, tell: Tell) -> None:
        """write, seal and publish, ``tell`` ending the write and the seal on every rank."""
        try:
            shard, error = self.write_mine(tell.stops)
            shards = tell.written(error, shard)
            tell.committed(self.seal_and_publish(shards) if self.rank == 0 else None)
        finally:
            if self.rank == 0:
                self.release()

    def write_mine(self, stops: type[BaseException]) -> tuple[dict | None, str | None]:
        """This rank's file(s), fsynced: what the seal needs of them, or why they failed
        (naming the file, without the rank: the replies name it)."""
        try:
            if not os.path.isdir(self.tmp):
                raise CheckpointError(
                    f"cannot see {self.tmp}, which rank 0 made: "
                    "all ranks must share one file system"
                )
            wrote = self.writer.write(self.tmp, self.rank, self.p.h, self.p.extras, self.per_rank)
            return wrote, None
        except CheckpointError as e:
            return None, str(e)
        except stops as e:  # disk full, permissions: every rank must hear of it
            self.errno = getattr(e, "errno", None)
            where = os.path.join(self.path, self.writer.file_of(self.rank))
            return None, f"writing its shard failed: {where}: {named(e)}"

    def seal_and_publish(self, shards: list) -> str | None:
        """Rank 0: the writer's index (or metadata) written whole, the directory swapped in;
        or why not."""
        try:
            name, sealed = self.writer.seal(self.tmp, self.p.h, shards, self.per_rank, self.world)
            write_whole(os.path.join(self.tmp, name), sealed)
            swap_in(self.path, self.tmp)
        except Exception as e:
            return f"finishing the checkpoint failed: {named(e)}"
        return None

    def release(self) -> None:
        """Rank 0: the temp directory removed unless it was swapped in (the previous
        checkpoint untouched), the lock released."""
        try:
            if self.tmp is not None:
                remove(self.tmp)
        finally:
            if self.lock is not None:
                self.lock.release()


class Together:
    """A synchronous save's ``Tell``: an all-gather after the write and after the seal."""

    stops = Exception  # a BaseException on the calling thread is its caller's

    def __init__(self, job: SaveJob):
        self.group, self.timeout = job.group, job.timeout

    def written(self, error: str | None, shard: dict | None) -> list:
        replies = gather_json("checkpoint.save: written", [error, shard], self.group, self.timeout)
        return [s for _, s in raise_any(replies)]

    def committed(self, error: str | None) -> None:
        what = "checkpoint.save: committed"
        raise_any(gather_json(what, [error, None], self.group, self.timeout))


@contextmanager
def begin_save(
    call: str, path, model, optimizer, extra, writer: Writer, timeout, stage=None, fill=None
):
    """agree and stage (see the module's note), once this process's save in flight is done:
    yields the ``SaveJob`` every rank finishes, the ranks kept alive and the shards whole
    meanwhile. ``stage``: ``Prepared -> Prepared``, where a copy training cannot change is
    made (async); None writes the live shards. ``fill(p)``: run once the ranks agreed, its
    failure told to every rank with the temp directory's (async: the copy into staging)."""
    wait_in_flight()  # one save at a time
    path, group = os.path.abspath(os.fspath(path)), world_group()
    with alive(group), whole_shards(model, optimizer):  # state sharded over replicas
        mark_call(f"zerokit.checkpoint.{call}()", model, group)
        # any exception: every rank must hear of it, or the others would wait for this one
        got, error = attempt(lambda: _checked(model, optimizer, extra), Exception)
        p = Prepared(*(got or (None, {})), error)
        p = stage(p) if stage else p
        per_rank, world = agree(path, p, writer, group, timeout)
        me = rank()
        lock, tmp, error = make_place(path) if me == 0 else (None, None, None)
        job = SaveJob(path, tmp, p, writer, per_rank, world, group, timeout, lock, me)
        try:
            if error is None and fill is not None:
                _, error = attempt(lambda: fill(p), Exception, "staging its state failed: ")
            made = gather_json(f"checkpoint.{call}: directory", [error, tmp], group, timeout)
            if made[0][0] is not None:
                raise CheckpointError(made[0][0])
            raise_any(made)
        except BaseException:
            job.release()
            raise
        job.tmp = made[0][1]
        yield job


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def swap_in(path: str, tmp: str) -> None:
    """publish: the finished temp directory (its files fsynced) becomes ``path``: ``path``
    moved to ``.zerokit-old``, ``tmp`` renamed to ``path``, the old one removed."""
    fsync_dir(tmp)
    refused = why_not_replaceable(path)  # again: something may have appeared meanwhile
    if refused:
        raise CheckpointError(f"{refused}; zerokit never replaces it")
    old = path + OLD_SUFFIX
    if os.path.lexists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))
    remove(old)


# ---------------------------------------------------------------------------- load


@dataclass
class Staged:
    """Everything a load will write, read and checked in advance."""

    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    optimizer_state: list[tuple[torch.Tensor, dict, int]] = field(default_factory=list)
    hyperparameters: list[dict] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


class Source(Protocol):
    """A format's reading half, for ``load_with``: it answers what the checkpoint holds and
    reads ranges into staging; ``stage`` compares that with what this rank holds.

    Note: a source may read at ``ask`` (zerokit's files) or only at ``read`` (DCP plans its
    reads, then reads them all): what ``ask`` and ``ask_state`` return is final after it."""

    kind: str  # "checkpoint", "DCP checkpoint": how errors name it
    where: str  # the path as given, for "cannot read"
    directory: str  # the directory read, for "malformed" (set by ``open``)
    digest: str  # of what was opened (set by ``open``), agreed on as ``read_what``
    read_what: str
    malformed_errors: tuple  # the exceptions that mean a malformed checkpoint
    alike: bool  # one message when every failing rank failed alike (``raise_any``)
    shape_differs: str  # the format's words for a shape difference: {name}, {saved}, {model}
    extra_names: list[str]  # the extra state it holds (set by ``open``)

    def open(self, h: Holdings) -> None: ...  # raises to refuse
    def key_of(self, name: str, h: Holdings) -> str | None: ...  # where a model tensor is
    def unexpected(self, keys: set[str], h: Holdings) -> list[str]: ...  # model's, not in keys
    def described(self, key: str) -> tuple[list | str, torch.dtype]: ...  # shape, dtype
    def ask(self, key: str, meta: TensorMeta, chunk: Chunk) -> torch.Tensor: ...
    # None: no optimizer state; else, once read: each group's parameters and hyperparameters
    def ask_groups(self, h: Holdings) -> Callable[[], list[tuple[list, dict]]] | None: ...
    def ask_state(self, chunk: Chunk, key_tensor, opt, meta: TensorMeta) -> dict: ...
    def ask_extra(self, key: str) -> Callable[[], Any]: ...  # its value, once read
    def read(self) -> None: ...
    def close(self) -> None: ...


def load_with(source: Source, model: nn.Module, optimizer, strict, extra, group, timeout):
    """agree -> plan reads -> stage -> validate -> apply (see the module's note)."""

    def tell(what: str, error: str | None) -> None:  # the same outcome on every rank
        raise_any(gather_json(what, [error, None], group, timeout), source.alike)

    def opened():
        h = collect(model, optimizer)
        source.open(h)
        return h

    with alive(group):
        try:
            h, error = attempt(opened, (OSError, ValueError), f"{source.where}: cannot read: ")
            tell("checkpoint.load", error)
            world = world_view(h, "checkpoint.load", group, timeout)  # None but for a pipeline
            fingerprint = model_fingerprint(h) if world is None else world["fingerprint"]
            what = {  # the same for every format
                source.read_what: source.digest.encode(),
                "the model's tensors": fingerprint,
                "the optimizer": str(h.optimizer_class).encode(),
                "the extra state asked for": repr(sorted(extra or {})).encode(),
            }
            agree_on("checkpoint.load: what", what, group, timeout)
            staged, error = attempt(
                lambda: stage(source, h, optimizer, strict, extra or {}, world),
                source.malformed_errors,
                f"{source.directory}: malformed {source.kind}: ",
            )
            tell("checkpoint.load: read", error)
        finally:
            source.close()
        error = None
        try:  # the extra state first: a Stateful that refuses its state stops the load here
            apply_extra(staged.extra, extra)
        except Exception as e:
            error = (
                f"restoring the extra state failed: {named(e)}; the model and "
                "optimizer are unchanged"
            )
        tell("checkpoint.load: extra", error)
        apply_staged(staged, model, optimizer)


def stage(source: Source, h: Holdings, optimizer, strict: bool, extra, world) -> Staged:
    """plan reads, stage, validate: this rank's ranges of the model's tensors, its optimizer
    state and the extra state asked for, read; the saved param groups checked."""
    keys = compare_tensors(source, h, strict, world)
    staged = Staged()
    for chunk in h.chunks:
        if chunk.name in keys and chunk.tensor.numel():
            data = source.ask(keys[chunk.name], h.metas[chunk.name], chunk)
            staged.copies.append((chunk.tensor, data))
    if optimizer is not None:
        optimizers = optimizers_of(optimizer)
        groups = source.ask_groups(h)
        if groups is None:
            raise CheckpointError(
                f"the {source.kind} holds no optimizer state; pass optimizer=None"
            )
        for chunk, key_tensor, k in h.optimizer_chunks:
            state = source.ask_state(chunk, key_tensor, optimizers[k], h.metas[chunk.name])
            staged.optimizer_state.append((key_tensor, state, k))
    missing = sorted(k for k in extra if k not in source.extra_names)
    if missing:
        raise CheckpointError(
            f"the {source.kind} holds no extra state {missing} (it holds {source.extra_names})"
        )
    asked = {k: source.ask_extra(k) for k in extra}
    source.read()
    staged.extra = {k: finish() for k, finish in asked.items()}
    if optimizer is not None:
        staged.hyperparameters = check_groups(groups(), h, optimizers, world)
    return staged


def compare_tensors(source: Source, h: Holdings, strict: bool, world) -> dict[str, str]:
    """validate: the checkpoint's model tensors against the model's, by name (under strict,
    both ways; a pipeline stage against every stage's, ``world``), shape and dtype (a cast
    that loses precision is refused). Returns where each of this rank's tensors is stored."""
    names = h.param_names if world is None else sorted(world["names"])
    keys = {n: source.key_of(n, h) for n in names}
    missing = sorted(n for n, key in keys.items() if key is None)
    unexpected = source.unexpected({key for key in keys.values() if key is not None}, h)
    problems = []
    if strict and (missing or unexpected):
        problems.append(
            f"missing from the checkpoint [{listing(missing, show=repr)}], not in the model "
            f"[{listing(unexpected, show=repr)}] "
            "(strict=False loads the tensors both have)"
        )
    found = {n: keys[n] for n in h.param_names if keys[n] is not None}
    for name, key in found.items():
        (shape, dtype), meta = source.described(key), h.metas[name]
        if shape != list(meta.shape):
            differ = {"name": name, "saved": shape, "model": list(meta.shape)}
            problems.append(source.shape_differs.format(**differ))
        elif torch.promote_types(dtype, meta.dtype) != meta.dtype:
            problems.append(
                f"{name}: the checkpoint holds {dtype}, the model {meta.dtype}: loading would "
                "lose precision (cast the model to the checkpoint's dtype first)"
            )
    if problems:
        raise CheckpointError(
            f"{source.kind} {source.directory} and the model differ: {'; '.join(problems)}; "
            "nothing was loaded"
        )
    return found


def check_groups(saved: list[tuple[list, dict]], h: Holdings, optimizers, world) -> list[dict]:
    """validate: the saved param groups against the optimizers' (several optimizers: their
    groups in order), the same parameters in each, by name (a pipeline stage: every stage's,
    ``world``); returns of each group the hyperparameters its optimizer's group holds (a key
    it does not know cannot change it), each of the kind it holds."""
    held = [g["params"] for g in h.groups] if world is None else world["groups"]
    if len(saved) != len(held):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(saved)} param groups, the optimizer {len(held)}"
        )
    current_groups = [g for opt in optimizers for g in opt.param_groups]
    out = []
    for i, ((params, values), mine, current) in enumerate(zip(saved, held, current_groups)):
        differing = sorted(set(params) ^ set(mine))
        if differing:
            raise CheckpointError(
                f"param group {i} holds other parameters than the "
                f"checkpoint's (differing: {listing(differing)})"
            )
        known = {k: v for k, v in values.items() if k in current}
        for key, value in known.items():
            check_loaded_hyperparameter(i, key, value, current[key])
        out.append(known)
    return out


_NON_NEGATIVE = {"lr", "eps", "weight_decay", "momentum", "dampening", "lr_decay", "alpha"}


def check_loaded_hyperparameter(i: int, key: str, value, current) -> None:
    """validate: a saved hyperparameter must be of the kind the optimizer holds, and finite."""
    what = f"param group {i}: {key}"
    if isinstance(current, bool) or current is None:
        ok = value is None or isinstance(value, bool)
    elif isinstance(current, (int, float, torch.Tensor)):
        ok = is_finite_number(value) and (key not in _NON_NEGATIVE or value >= 0)
    elif isinstance(current, (tuple, list)):
        ok = isinstance(value, list) and len(value) == len(current)
        ok = ok and all(
            isinstance(v, str) if isinstance(c, str) else v is None or is_finite_number(v)
            for v, c in zip(value, current)
        )
        if key == "betas":
            ok = ok and all(is_finite_number(v) and 0 <= v < 1 for v in value)
    else:
        ok = type(value) is type(current)
    if not ok:
        raise CheckpointError(
            f"{what} is {value!r} in the checkpoint; the optimizer holds {current!r} there "
            "(refused: it would fail or diverge at the next step)"
        )


def apply_extra(values: dict[str, Any], extra) -> None:
    for key, value in values.items():
        if extra_state.is_stateful(extra[key]):
            extra[key].load_state_dict(value)
        else:
            extra[key] = value


def apply_staged(staged: Staged, model: nn.Module, optimizer) -> None:
    """apply: every staged copy into the model and optimizer (nothing can fail here)."""
    with torch.no_grad():
        for target, data in staged.copies:
            target.copy_(data)
    if optimizer is not None:
        optimizers = optimizers_of(optimizer)
        for opt in optimizers:
            opt.state.clear()
        for key_tensor, state, k in staged.optimizer_state:
            if state:
                optimizers[k].state[key_tensor] = state
        groups = [g for opt in optimizers for g in opt.param_groups]
        for group, hyper in zip(groups, staged.hyperparameters):
            for key, value in hyper.items():
                current = group.get(key)
                if isinstance(current, torch.Tensor):
                    current.fill_(value)
                else:
                    group[key] = tuple(value) if isinstance(current, tuple) else value
    state = state_of(holder_of(model))
    if state is not None:  # the shards changed: refresh the full parameters
        state.refresh_params()
