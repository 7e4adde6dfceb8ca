"""Write a safetensors file one tensor at a time, hashing on the way.

The header is computed first (names, dtypes, shapes, offsets), then each tensor's bytes are
written straight from its memory: no second copy of the whole file in memory, no read-back to
hash it. The file is written to a temp name of its own, fsynced and renamed (the temp file is
removed if writing fails).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import struct
from collections.abc import Callable

import torch

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors(
    path: str,
    tensors: list[tuple[str, torch.dtype, list[int], Callable[[], torch.Tensor | list]]],
    metadata: dict[str, str],
    digest: bool = True,
) -> tuple[int, str | None]:
    """Write ``(name, dtype, shape, produce)`` entries; ``produce()`` is called once per tensor,
    just before its bytes are written, and gives a tensor or a list of buffers holding its
    bytes in order (pieces of a mapped file: written without a copy in between). Returns the
    file's size and sha256 (None with ``digest=False``, when no one will check it)."""
    header, offset = {}, 0
    for name, dtype, shape, _ in tensors:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
    hasher, tmp = hashlib.sha256() if digest else None, f"{path}.tmp-{secrets.token_hex(4)}"

    def put(data) -> None:
        f.write(data)
        if hasher is not None:
            hasher.update(data)

    try:
        with open(tmp, "xb") as f:
            put(struct.pack("<Q", len(raw)))
            put(raw)
            for name, dtype, shape, produce in tensors:
                for data in _buffers(name, dtype, shape, produce()):
                    put(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    return os.path.getsize(path), hasher.hexdigest() if hasher is not None else None


def _buffers(name: str, dtype: torch.dtype, shape: list[int], produced) -> list:
    """The bytes of one entry, checked against its size (and, for a tensor, dtype and shape)."""
    if isinstance(produced, list):
        size = sum(memoryview(b).nbytes for b in produced)
        if size != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{name}: produced {size} bytes for {dtype} {list(shape)}")
        return produced
    tensor = produced.detach().to("cpu").contiguous()
    if tensor.dtype != dtype or list(tensor.shape) != list(shape):
        raise ValueError(f"{name}: produced {tensor.dtype} {list(tensor.shape)}")
    return [tensor.view(-1).view(torch.uint8).numpy()]
