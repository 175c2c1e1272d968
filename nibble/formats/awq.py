"""AutoAWQ "GEMM" layout <-> nibble's canonical INT4 format, losslessly.

AutoAWQ's ``WQLinear_GEMM`` (``quant_method: awq``, ``version: gemm``) stores a linear with
W [N, K] (N = out_features, K = in_features), group size G, as::

    qweight  int32   [K, N // 8]        packed ALONG N
    qzeros   int32   [K // G, N // 8]   integer zero points zp in [0, 15], packed the same way
    scales   float16 [K // G, N]
    W[n, k] = (q[k, n] - zp[k // G, n]) * s[k // G, n]

Packing along N is interleaved: nibble i (bits 4i..4i+3) of word ``qweight[k, c]`` holds the code
of output column ``8c + AWQ_ORDER[i]`` with ``AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)`` (the order
its CUDA kernel's fast dequantization wants). Equivalently, column ``8c + j`` sits in nibble
``(0, 4, 1, 5, 2, 6, 3, 7)[j]``.

Canonical: codes repacked along K, z = fp16(-zp * s) (exactly recoverable, see zero_points.py).
Weights with float zero points are refused: AWQ cannot hold them.
"""
from __future__ import annotations

import torch

from nibble.formats.int4 import PACK, Int4Weight, pack_int4, unpack_int4
from nibble.formats.zero_points import integer_zero_points, pack_along_n, unpack_along_n, zeros_from_zero_points

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def to_awq(weight: Int4Weight) -> dict:
    """Canonical -> AutoAWQ GEMM tensors ``{"qweight", "qzeros", "scales"}`` (bias is not part of the weight).

    Raises ValueError for float zero points or out_features not divisible by 8.
    """
    zp = integer_zero_points(weight.scales, weight.zeros, what="this weight")
    codes = unpack_int4(weight.qweight)  # [K, N]
    return {
        "qweight": pack_along_n(codes, AWQ_ORDER),
        "qzeros": pack_along_n(zp, AWQ_ORDER),
        "scales": weight.scales.clone(),
    }


def awq_dimensions(qweight_shape, qzeros_shape, scales_shape, group_size: int) -> tuple[int, int, int]:
    """(K, N, G) of a layer whose AutoAWQ GEMM tensors have these shapes (``group_size=-1``: one group per output
    channel), else a ValueError saying how they disagree: what `from_awq` reads of them before their data."""
    K, N = qweight_shape[0], qweight_shape[1] * PACK
    G = K if group_size == -1 else group_size
    if G <= 0 or K % G or K % PACK:
        raise ValueError(f"AWQ qweight has K={K} rows, which must be divisible by 8 and by group_size={group_size}")
    if tuple(qzeros_shape) != (K // G, N // PACK) or tuple(scales_shape) != (K // G, N):
        raise ValueError(f"AWQ shapes disagree: qweight {tuple(qweight_shape)} (K={K}, N={N}), group {G} needs "
                         f"qzeros {(K // G, N // PACK)} and scales {(K // G, N)}; got {tuple(qzeros_shape)} and "
                         f"{tuple(scales_shape)}")
    return K, N, G


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> Int4Weight:
    """AutoAWQ GEMM tensors -> canonical Int4Weight (``group_size=-1``: one group per output channel)."""
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"AWQ qweight/qzeros must be int32, got {qweight.dtype}/{qzeros.dtype}")
    if scales.dtype != torch.float16:
        raise ValueError(f"AWQ scales must be float16, got {scales.dtype}")
    G = awq_dimensions(qweight.shape, qzeros.shape, scales.shape, group_size)[2]
    codes = unpack_along_n(qweight, AWQ_ORDER)  # [K, N]
    zp = unpack_along_n(qzeros, AWQ_ORDER)      # [K // G, N]
    return Int4Weight(pack_int4(codes), scales.clone(), zeros_from_zero_points(zp, scales), G)
