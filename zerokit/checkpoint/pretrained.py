"""``load_pretrained``: plain safetensors weights (a Hugging Face directory) into a model
wrapped at any level, each rank reading only the bytes of what it holds.

The names are the unwrapped model's ``state_dict()`` names. A rank's holdings
(``holdings.collect``: its shard pieces, its tp slices, whole frozen parameters and buffers)
say which elements of which tensor it needs; those become byte ranges of the file, found from
the safetensors header (``ShardFile``: the file is mapped for its header, the ranges read by
``pread``, never the whole file). Two steps, each closed by one gather so that every rank
raises the same ``CheckpointError``: (1) headers read (a file shorter than its header says is
refused here) and the names and shapes compared; what cannot be read straight into place (a
bf16 or fp16 file into fp32 masters, a tied parameter the files hold under several names, a
tensor off the CPU) is read into staging, so any of these failing changes nothing; (2) the
rest read by ``pread`` straight into the model's own tensors (no staging copy: the read is the
whole cost), then the staging copied in and full parameters refreshed. Only a read failing
in (2), after every file was checked (the disk failing, a file changed under the load),
leaves the model partly loaded, and the error says so.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from ..core import alive, state_of
from ..moe.state_dict import per_expert_sources
from .agreement import gather_json, raise_any, world_group
from .holdings import Chunk, Holdings, TensorMeta, collect, full_runs, holder_of
from .index import CheckpointError
from .reading import DTYPE_OF, ShardFile

INDEX = "model.safetensors.index.json"  # Hugging Face's sharded layout
SINGLE = "model.safetensors"
_SHOWN = 10  # names listed in an error, then the count


def load_pretrained(
    model: nn.Module, path: str | os.PathLike, strict: bool = True
) -> tuple[list[str], list[str]]:
    """Load ``path`` (a ``.safetensors`` file, or a directory holding
    ``model.safetensors.index.json`` or ``model.safetensors``) into ``model``, wrapped at any
    level or bare. Collective: every rank calls it.

    Returns ``(missing, unexpected)``: the model's names the files lack and the files' names
    the model lacks; with ``strict`` either raises ``CheckpointError``. A tied parameter is
    filled once, from whichever of its names the files hold; if they hold several with
    different values, ``CheckpointError`` names them (``from_pretrained`` would untie them).
    A shape mismatch, an unreadable file or a malformed header always raises, on every rank,
    with the model unchanged.
    """
    group = world_group()
    with alive(group):
        error, report, plan, sources = _stage(model, os.fspath(path))
        try:
            # the names, the shapes and the staged reads agreed before any byte of the model
            # changes; then the reads into place (the files are open still)
            replies = raise_any(gather_json("load_pretrained", [error, report], group, None))
            missing, unexpected = _verdict([r for _, r in replies], strict)
            error = _read_in_place(plan.in_place, sources)
        finally:
            if sources is not None:
                sources.close()
        try:
            raise_any(gather_json("load_pretrained: reads", [error, None], group, None))
        except CheckpointError as e:
            raise CheckpointError(
                f"load_pretrained: {e}; the model is partly loaded (every file was whole when "
                "checked, then a read failed: the disk, or a file changed while being read): "
                "load it again"
            ) from None
    with torch.no_grad():
        for chunk, values in plan.staged:
            chunk.tensor.copy_(values)
    state = state_of(holder_of(model))
    if state is not None:  # the shards changed: the full parameters follow
        state.refresh_params()
    return missing, unexpected


def _stage(model, path: str) -> tuple[str | None, dict, _Plan, _Sources | None]:
    """This rank's side, before the agreement: ``(error, report, plan, sources)``, the
    sources left open for the reads into place (``None`` if they could not be opened). The
    ranges are planned, and those needing staging read, only if this rank's shapes match
    (else the load fails)."""
    error, report, plan, sources = None, {}, _Plan(), None
    try:
        sources = _Sources(path)
        holdings = collect(model, None)
        sources.merge_experts(holdings.metas)
        report = _compare(holdings, sources)
        if not report["mismatched"]:
            plan = _plan(holdings, sources)
    except CheckpointError as e:
        error = str(e)
    except OSError as e:
        error = f"{path}: cannot read: {type(e).__name__}: {e}"
    except Exception as e:  # every rank must hear of it, or the others would wait for this one
        error = f"{path}: {type(e).__name__}: {e}"
    except BaseException:
        if sources is not None:
            sources.close()
        raise
    return error, report, plan, sources


class _Sources:
    """The safetensors files of ``path``: name -> (file, its header entry)."""

    def __init__(self, path: str):
        if os.path.isdir(path):
            self.dir, files = path, self._listed(path)
        elif os.path.isfile(path):
            self.dir, files = os.path.dirname(path) or ".", {os.path.basename(path): None}
        else:
            raise CheckpointError(f"{path}: no such file or directory")
        self.files: dict[str, ShardFile] = {}
        self.where: dict[str, ShardFile] = {}  # tensor name -> the file holding it
        self.merged: dict[str, tuple[list[str], list[int]]] = {}  # per_expert_sources'
        self.bytes_read = 0
        dir_fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for name, expected in files.items():
                where = os.path.join(self.dir, name)
                shard = ShardFile(dir_fd, name, where, keep_fd=True)
                self.files[name] = shard
                shard.header, shard.data_start = shard.parse_header()
                for key in shard.header:
                    if key == "__metadata__":
                        continue
                    if expected is not None and key not in expected:
                        raise CheckpointError(
                            f"{where}: holds {key!r}, which {INDEX} does not list"
                        )
                    if key in self.where:
                        raise CheckpointError(
                            f"{where}: {key!r} is also in {self.where[key].where}"
                        )
                    self.where[key] = shard
                for key in expected or ():
                    if key not in shard.header:
                        raise CheckpointError(f"{where}: has no {key!r}, which {INDEX} lists there")
        except BaseException:
            self.close()  # the files opened so far: their fds and mappings
            raise
        finally:
            os.close(dir_fd)

    @staticmethod
    def _listed(path: str) -> dict[str, set[str] | None]:
        index = os.path.join(path, INDEX)
        if not os.path.isfile(index):
            if os.path.isfile(os.path.join(path, SINGLE)):
                return {SINGLE: None}
            raise CheckpointError(f"{path}: holds neither {INDEX} nor {SINGLE}")
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files: dict[str, set[str]] = {}
            for key, file in weight_map.items():
                if not isinstance(file, str) or os.path.basename(file) != file:
                    raise ValueError(f"{key!r} maps to {file!r}, not a file name in {path}")
                files.setdefault(file, set()).add(key)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a valid index: {type(e).__name__}: {e}") from None
        return files

    def merge_experts(self, wanted) -> None:
        """The files' per-expert tensors seen as the model's 3-D experts, where ``wanted``
        (the model's names) has those and the files do not."""
        shapes = {name: shard.header[name]["shape"] for name, shard in self.where.items()}
        for target, (parts, shape) in per_expert_sources(shapes).items():
            dtypes = {self.dtype(n) for n in parts}
            if target in wanted and target not in self.where and len(dtypes) == 1:
                self.merged[target] = (parts, shape)

    def names(self) -> set[str]:
        merged = {n for parts, _ in self.merged.values() for n in parts}
        return (set(self.where) - merged) | set(self.merged)

    def holds(self, name: str) -> bool:
        return name in self.where or name in self.merged

    def shape(self, name: str) -> list[int]:
        if name in self.merged:
            return self.merged[name][1]
        return self.where[name].header[name]["shape"]

    def dtype(self, name: str) -> torch.dtype:
        name = self.merged[name][0][0] if name in self.merged else name
        return DTYPE_OF[self.where[name].header[name]["dtype"]]

    def read(self, name: str, lo: int, hi: int, into: torch.Tensor) -> None:
        """Elements ``[lo, hi)`` of ``name`` read into ``into`` (of the file's dtype) by
        ``pread`` (a merged expert tensor: from each of its parts): the mapping is only for
        the header, so no page of the file is mapped into the rank's memory (it would count
        twice until the load ends) and none faults in."""
        if name in self.merged:
            at = 0  # where the part read next begins in the merged tensor
            for part in self.merged[name][0]:
                n = math.prod(self.where[part].header[part]["shape"])
                if at < hi and lo < at + n:
                    a, b = max(lo, at), min(hi, at + n)
                    self.read(part, a - at, b - at, into[a - lo : b - lo])
                at += n
            return
        self.where[name].pread_into(name, lo, hi, into)
        self.bytes_read += (hi - lo) * into.element_size()

    def close(self) -> None:
        for shard in self.files.values():
            shard.close()


def _names_of(h: Holdings) -> dict[str, list[str]]:
    """Each tensor this rank holds -> all its names (a tied parameter has several)."""
    names = {n: [n] for n in h.metas}
    for alias, stored in h.aliases.items():
        names[stored].append(alias)
    return names


def _compare(h: Holdings, sources: _Sources) -> dict:
    """This rank's view: its names, those the files lack, and shape mismatches."""
    missing, mismatched = [], []
    for name, names in _names_of(h).items():
        found = next((n for n in names if sources.holds(n)), None)
        if found is None:
            missing += names
        elif list(h.metas[name].shape) != sources.shape(found):
            mismatched.append(
                f"{found}: {sources.shape(found)} in the file, {list(h.metas[name].shape)} "
                "in the model"
            )
    names = sorted(n for ns in _names_of(h).values() for n in ns)
    merged = sorted(n for parts, _ in sources.merged.values() for n in parts)
    return {
        "names": names, "missing": missing, "mismatched": mismatched,
        "in_files": sorted(sources.names()), "merged": merged,
    }  # fmt: skip


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return f"{len(names)} ({shown}{', ...' if len(names) > _SHOWN else ''})"


def _verdict(reports: list[dict], strict: bool) -> tuple[list, list]:
    """The same on every rank, from every rank's report alone (a pipeline stage merges only
    its own experts' per-expert files: what any rank merged is expected). Raises on a shape
    mismatch always, on missing or unexpected names with ``strict``."""
    known = {n for r in reports for n in (*r["names"], *r["merged"])}
    missing = sorted({n for r in reports for n in r["missing"]})
    unexpected = sorted({n for r in reports for n in r["in_files"] if n not in known})
    mismatched = sorted({m for r in reports for m in r["mismatched"]})
    problems = []
    if mismatched:
        problems.append(f"shapes differ for {_listing(mismatched)}")
    if strict and missing:
        problems.append(f"missing from the files: {_listing(missing)}")
    if strict and unexpected:
        problems.append(f"in the files but not in the model: {_listing(unexpected)}")
    if problems:
        hint = " (strict=False loads what both have)" if not mismatched else ""
        raise CheckpointError(f"load_pretrained: {'; '.join(problems)}{hint}; nothing was loaded")
    return missing, unexpected


@dataclass
class _Plan:
    """This rank's reads: ``staged`` (chunk, its values read already) and ``in_place`` (chunk,
    the file's name for it, its meta), read straight into the chunk once the ranks agree."""

    staged: list[tuple[Chunk, torch.Tensor]] = field(default_factory=list)
    in_place: list[tuple[Chunk, str, TensorMeta]] = field(default_factory=list)


def _plan(h: Holdings, sources: _Sources) -> _Plan:
    """Every chunk this rank holds: read into place where the file's bytes are the chunk's
    (same dtype, CPU memory), else read now, in the file's dtype, into staging. A tied
    parameter whose names the files all hold is read under each: they must agree."""
    found: dict[str, list[str]] = {}  # tensor -> its names the files hold
    for name, names in _names_of(h).items():
        present = [n for n in names if sources.holds(n)]
        if present:
            found[name] = present
    plan = _Plan()
    for chunk in h.chunks:
        present = found.get(chunk.name)
        if present is None or not chunk.tensor.numel():
            continue
        meta, target, dtype = h.metas[chunk.name], chunk.tensor, sources.dtype(present[0])
        same = dtype == target.dtype and target.device.type == "cpu"
        if len(present) == 1 and same and target.is_contiguous():
            plan.in_place.append((chunk, present[0], meta))
            continue
        values = torch.empty(target.numel(), dtype=dtype)
        _read_chunk(meta, chunk, present[0], sources, values)
        for other in present[1:]:  # this rank's elements of each: the ranks cover them all
            again = torch.empty(target.numel(), dtype=sources.dtype(other))
            _read_chunk(meta, chunk, other, sources, again)
            _same_values(values, again, present[0], other)
        plan.staged.append((chunk, values))
    return plan


def _read_in_place(reads: list[tuple[Chunk, str, TensorMeta]], sources: _Sources) -> str | None:
    """The planned reads into the model's tensors; what failed, to tell every rank (any
    error: the other ranks wait for this one's word)."""
    try:
        for chunk, source, meta in reads:
            _read_chunk(meta, chunk, source, sources, chunk.tensor.detach())
    except CheckpointError as e:
        return str(e)
    except Exception as e:
        return f"{sources.dir}: cannot read: {type(e).__name__}: {e}"
    return None


def _read_chunk(
    meta: TensorMeta, chunk: Chunk, source: str, sources: _Sources, into: torch.Tensor
) -> None:
    for full_lo, full_hi, at in full_runs(meta, chunk.start, chunk.tensor.numel()):
        sources.read(source, full_lo, full_hi, into[at : at + full_hi - full_lo])


def _same_values(a: torch.Tensor, b: torch.Tensor, name_a: str, name_b: str) -> None:
    """Note: transformers' ``from_pretrained`` unties a tied pair whose files hold different
    values and loads each name's own (checked with transformers 5.24: the head keeps
    ``lm_head.weight``); a wrapped model holds the pair as one parameter and cannot untie it,
    so choosing either value would silently differ from it."""
    if a.dtype == b.dtype and torch.equal(a, b):
        return
    if a.dtype != b.dtype and torch.equal(a.double(), b.double()):
        return
    diff = (a.double() - b.double()).abs().max().item()
    raise CheckpointError(
        f"load_pretrained: {name_a!r} and {name_b!r} are one tied parameter in the model, but "
        f"the files hold different values for them (up to {diff:.3g} apart). transformers' "
        "from_pretrained unties them and loads each, which a wrapped model cannot: build the "
        "model untied (e.g. tie_word_embeddings=False in its config) before wrapping, or "
        "remove one of the two from the files; nothing was loaded"
    )
