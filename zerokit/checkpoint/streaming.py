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
    tensors: list[tuple[str, torch.dtype, list[int], Callable[[], torch.Tensor]]],
    metadata: dict[str, str],
) -> tuple[int, str]:
    """Write ``(name, dtype, shape, produce)`` entries; ``produce()`` is called once per tensor,
    just before its bytes are written. Returns the file's size and sha256."""
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
    digest, tmp = hashlib.sha256(), f"{path}.tmp-{secrets.token_hex(4)}"
    try:
        with open(tmp, "xb") as f:
            for chunk in (struct.pack("<Q", len(raw)), raw):
                f.write(chunk)
                digest.update(chunk)
            for name, dtype, shape, produce in tensors:
                tensor = produce().detach().to("cpu").contiguous()
                if tensor.dtype != dtype or list(tensor.shape) != list(shape):
                    raise ValueError(f"{name}: produced {tensor.dtype} {list(tensor.shape)}")
                data = tensor.view(-1).view(torch.uint8).numpy()
                f.write(data)
                digest.update(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    return os.path.getsize(path), digest.hexdigest()
