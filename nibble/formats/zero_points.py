"""Helpers shared by the AutoAWQ and GPTQ converters: integer zero points and packing along N.

Both third-party layouts store W = (q - zp) * s with an integer zero point ``zp`` per group and
output channel; the canonical format stores the additive offset z = fp16(-zp * s). The offset
keeps zp exactly: |fp16(-zp*s) - (-zp*s)| <= 2^-11 * zp * s, so -z/s is within 15 * 2^-11 < 0.5
of zp and ``round(-z / s)`` recovers it. ``integer_zero_points`` inverts the offset and checks
that re-encoding reproduces every stored z bit for bit, which is what makes the converters
lossless and what rejects float zero points (llama.cpp Q4_1-style ``z = min``).
"""
from __future__ import annotations

import torch

from nibble.formats.int4 import PACK, pack_int4, unpack_int4

NATURAL_ORDER = (0, 1, 2, 3, 4, 5, 6, 7)


def zeros_from_zero_points(zp: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Canonical offsets z = fp16(-zp * s), computed in float32 exactly as nibble's quantizers do."""
    return (-zp.float() * scales.float()).half()


def integer_zero_points(scales: torch.Tensor, zeros: torch.Tensor, max_zp: int = 15, what: str = "this weight") -> torch.Tensor:
    """Recover integer zero points zp (int32, same shape) from canonical fp16 ``scales`` and ``zeros``.

    Raises ValueError when some z is not fp16(-zp * s) for an integer zp in [0, max_zp]: such a
    weight has float zero points (e.g. re-quantized from llama.cpp Q4_1, or quantize with
    ``zero_point="float"``) that AutoAWQ/GPTQ checkpoints cannot hold without requantizing.
    """
    s, z = scales.float(), zeros.float()
    zp = torch.where(s == 0, torch.zeros_like(s), torch.round(-z / torch.where(s == 0, torch.ones_like(s), s)))
    zp = torch.nan_to_num(zp, nan=-1.0)
    exact = (zeros_from_zero_points(zp, scales).float() == z) & (zp >= 0) & (zp <= max_zp)
    if not bool(exact.all()):
        bad = (~exact).nonzero()[0].tolist()
        g, n = bad[0], bad[1]
        raise ValueError(
            f"{what} has float zero points (e.g. group {g}, output {n}: z={z[g, n].item():.6g}, s={s[g, n].item():.6g}, "
            f"-z/s={(-z[g, n] / s[g, n]).item():.6g} is not an integer in [0, {max_zp}] with z == fp16(-zp*s)); "
            "AutoAWQ and GPTQ store integer zero points only. Re-quantize with zero_point='int' (the default) "
            "or keep the model in nibble's own format.")
    return zp.to(torch.int32)


def pack_along_n(values: torch.Tensor, order=NATURAL_ORDER) -> torch.Tensor:
    """Pack 4-bit values [R, N] into int32 [R, N // 8]: nibble i (bits 4i..4i+3) of word c holds column 8c + order[i].

    The same bit fields as the canonical packing along K, so it is ``pack_int4`` on the transpose
    with the columns of each group of 8 put in nibble order first.
    """
    if values.dim() != 2:
        raise ValueError(f"expected a 2-D [rows, N] tensor, got shape {tuple(values.shape)}")
    R, N = values.shape
    if N % PACK:
        raise ValueError(f"N={N} (out_features) must be a multiple of {PACK} to pack 4-bit values along N")
    in_nibble_order = values.reshape(R, N // PACK, PACK)[:, :, list(order)].reshape(R, N)
    return pack_int4(in_nibble_order.t()).t().contiguous()


def unpack_along_n(words: torch.Tensor, order=NATURAL_ORDER) -> torch.Tensor:
    """Inverse of pack_along_n: int32 [R, N // 8] -> int32 values [R, N] in [0, 15]."""
    if words.dtype != torch.int32 or words.dim() != 2:
        raise ValueError(f"expected a 2-D int32 tensor, got {words.dtype} {tuple(words.shape)}")
    R, C = words.shape
    nibbles = unpack_int4(words.t()).t().reshape(R, C, PACK)  # [R, C, nibble]
    out = torch.empty_like(nibbles)
    out[:, :, list(order)] = nibbles  # column 8c + order[i] <- nibble i
    return out.reshape(R, C * PACK).to(torch.int32)


def uint32_to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding unsigned 32-bit patterns (any integer, taken mod 2^32) -> int32 with the same bits."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    return torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)
