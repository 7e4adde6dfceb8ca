"""Activation memory of a transformer layer, after Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models" (Megatron-LM, 2022), section 4.

Per layer, with ``s`` sequence length, ``b`` micro-batch, ``h`` hidden size, ``a`` heads,
``t`` tensor-parallel degree, 2-byte values and 1-byte dropout masks, the bytes kept for
backward are::

    no parallelism                       sbh (34 + 5as/h)
    tensor parallel                      sbh (10 + 24/t + 5as/(ht))
    tensor + sequence parallel           sbh (34/t + 5as/(ht))
    tensor + sequence + selective        sbh (34/t)          (10 + 24/t without sequence parallel)
    full recomputation                   2sbh                (2sbh/t with sequence parallel)

What the terms are (elements of ``sbh`` unless said): the two LayerNorm inputs (2), the QKV
input (1), the MLP input (1) and the two dropout masks (2 masks) are replicated under tensor
parallelism and split only by sequence parallelism; Q, K, V (3), the output projection's input
(1), the GeLU input (4) and the second MLP linear's input (4) are split by tensor parallelism;
the attention core keeps ``as^2b`` softmax values, ``as^2b`` dropped-out values and an
``as^2b`` mask, split by tensor parallelism and dropped by selective recomputation. Full
recomputation keeps only the layer's input. Values take ``bytes_per_value`` bytes; masks 1.

The paper's MB and GB are binary (2^20 and 2^30 bytes: 114 * 2048 * 12288 * 1 bytes is 2736
* 2^20 exactly). Its GPT-3 175B table (a 96, s 2048, h 12288, b 1, t 8, 96 layers):

>>> rows = [dict(tp=1), dict(tp=8), dict(tp=8, sequence_parallel=True),
...         dict(tp=8, sequence_parallel=True, recompute="selective"),
...         dict(tp=8, recompute="full")]
>>> for kw in rows:
...     e = estimate_activations(2048, 1, 12288, 96, 96, **kw)
...     print(f"{e.per_layer_mib:g} MB/layer  {round(e.total_gib, 2):g} GB")
2736 MB/layer  256.5 GB
552 MB/layer  51.75 GB
342 MB/layer  32.06 GB
102 MB/layer  9.56 GB
48 MB/layer  4.5 GB

The totals are rounded to two decimals as the paper does (9.5625 -> 9.56).

``measure_activations(model, idx)`` is the measured counterpart: the bytes autograd really
keeps for backward from a GPT's blocks (``zerokit.models.gpt.GPT``), counted through
``torch.autograd.graph.saved_tensors_hooks``. With ``GPTConfig(explicit_attention=True,
dropout=...)`` (the paper's layer) it agrees with ``estimate_activations`` at
``bytes_per_value=4`` (fp32) within 1% in each of the five settings at the sizes of
``zerokit compare --activations``, which prints them side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

RECOMPUTE_MODES = (None, "selective", "full")
MIB, GIB = 2**20, 2**30


class _ByteViews:
    """MiB/GiB views of ``per_layer_bytes`` and ``total_bytes``."""

    per_layer_bytes: float
    total_bytes: float

    @property
    def per_layer_mib(self) -> float:
        return self.per_layer_bytes / MIB

    @property
    def total_mib(self) -> float:
        return self.total_bytes / MIB

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB


@dataclass(frozen=True)
class ActivationEstimate(_ByteViews):
    """Activation bytes kept for backward, per transformer layer and for all layers, per rank."""

    per_layer_bytes: float
    layers: int

    @property
    def total_bytes(self) -> float:
        return self.per_layer_bytes * self.layers


def estimate_activations(
    seq_len: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    layers: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str | None = None,
    bytes_per_value: int = 2,
) -> ActivationEstimate:
    """The paper's activation memory per rank (see the module docstring for the terms)."""
    sizes = {"seq_len": seq_len, "micro_batch": micro_batch, "hidden": hidden, "heads": heads,
             "layers": layers, "tp": tp, "bytes_per_value": bytes_per_value}  # fmt: skip
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    if sequence_parallel and tp == 1:
        raise ValueError(
            "sequence_parallel=True needs tp > 1: sequence parallelism splits the regions that "
            "tensor parallelism leaves replicated"
        )
    s, b, h, a, t, p = seq_len, micro_batch, hidden, heads, tp, bytes_per_value
    sbh = s * b * h
    sp = t if sequence_parallel else 1
    if recompute == "full":  # only the layer's input
        return ActivationEstimate(sbh * p / sp, layers)
    replicated = (4 * p + 2) * sbh / sp  # LN inputs, QKV and MLP inputs; two dropout masks
    split = 12 * p * sbh / t  # Q, K, V, projection input, GeLU input, fc_out input
    core = 0 if recompute == "selective" else (2 * p + 1) * a * s * s * b / t
    return ActivationEstimate(replicated + split + core, layers)


@dataclass(frozen=True)
class ActivationMeasurement(_ByteViews):
    """Activation bytes autograd kept for backward from the transformer blocks, on this rank."""

    total_bytes: int
    layers: int

    @property
    def per_layer_bytes(self) -> float:
        return self.total_bytes / self.layers


def measure_activations(model, idx: torch.Tensor) -> ActivationMeasurement:
    """Run one forward and backward of ``model`` on token ids ``idx`` [B, T] and count the bytes
    autograd saved for backward inside the transformer blocks, each storage once, parameters
    left out (they are not activations). What the embedding and the head save is not counted,
    as the paper counts per transformer layer.

    ``model`` is a ``zerokit.models.gpt.GPT`` (or anything with its ``embed``, ``run_blocks``,
    ``head`` and ``blocks``), in training mode for its dropouts to count; under tensor
    parallelism call it on every rank of the tp group (it runs the model's collectives). The
    backward runs so that recomputation (``recompute="selective"`` or ``"full"``) really serves
    it; gradients accumulate into the parameters' ``.grad``. Counts the bytes of this rank.
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            # every saved tensor is held until backward, so no storage is reused meanwhile
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    x = model.embed(idx)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        x = model.run_blocks(x)
    model.head(x).float().sum().backward()  # the saved tensors serve backward
    return ActivationMeasurement(sum(seen.values()), len(model.blocks))
