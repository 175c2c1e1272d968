"""The canonical INT4 weight format (format version 1).

Layout (see docs/ARCHITECTURE.md for the reasoning)::

    qweight  int32   [K // 8, N]   code of row k = 8*i + j in bits [4j, 4j + 4) of qweight[i, n]
    scales   float16 [K // G, N]
    zeros    float16 [K // G, N]   additive offset: W[n, k] = q[k, n] * s[k // G, n] + z[k // G, n]

Packing along K keeps N contiguous, so a kernel tile [BLOCK_K // 8, BLOCK_N] is a coalesced
row-major load and each word holds eight consecutive K values of one output column.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# 2: nibble.save_quantized's checksums cover each tensor's dtype and shape; a nibble of version 1 read those as
# corrupt files, and says by this number that it is too old. Layout and numbers are the same in both.
FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)
PACK = 8  # 4-bit codes per int32 word
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes [K, N] with values in [0, 15] into int32 [K // 8, N], eight rows per word."""
    if codes.dim() != 2:
        raise ValueError(f"pack_int4 expects a 2-D [K, N] tensor of codes, got shape {tuple(codes.shape)}")
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise TypeError(f"pack_int4 takes integer codes, got {codes.dtype}: round them and cast to an integer dtype "
                        "first (a fractional code would be truncated)")
    K, N = codes.shape
    if K % PACK:
        raise ValueError(f"K={K} must be a multiple of {PACK} to pack 4-bit codes into int32 words")
    # range-checked before the int32 cast, so wider integers cannot wrap into range
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError("4-bit codes must lie in [0, 15]")
    c = codes.to(torch.int32).reshape(K // PACK, PACK, N) << _SHIFTS.to(codes.device).view(1, PACK, 1)
    # The OR of disjoint bit fields is their sum; int32 wrap-around on the top nibble is exactly
    # the two's-complement bit pattern we want.
    return c.sum(dim=1, dtype=torch.int32)


def unpack_int4(qweight: torch.Tensor, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """Inverse of pack_int4: int32 [K // 8, N] -> codes [K, N] in ``dtype`` (the dequantization asks for float
    codes: cast from the int32 words once, not through uint8, a pass over [K, N] on every CPU forward)."""
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"qweight must be a 2-D int32 tensor, got {qweight.dtype} {tuple(qweight.shape)}")
    codes = qweight.unsqueeze(1) >> _SHIFTS.to(qweight.device).view(1, PACK, 1)
    codes &= 0xF
    return codes.reshape(qweight.shape[0] * PACK, qweight.shape[1]).to(dtype)  # -1 is ambiguous for N = 0


def is_symmetric(scales: torch.Tensor, zeros: torch.Tensor) -> bool:
    """Whether every zero is -8 times its scale, W = (q - 8) * s (exact in float16: a power of two), the only
    weights W4A4's integer product holds: it reads q - 8 and applies s, with no zero point of its own."""
    return torch.equal(zeros, scales * -8)


def check_group_size(group_size) -> None:
    """Refuse a group size no GPU path runs: every W4A16 kernel reads a group's codes in whole int32 words of 8
    (`nibble.kernels.w4a16`); the CUDA kernels take 32, 64, 128 and larger powers of two (the Hopper GEMM
    multiples of 128 too), Triton and dequantize + cuBLAS any other multiple of 8."""
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"group_size must be an int (e.g. 128) or -1 (per output channel), got {group_size!r}")
    if group_size != -1 and (group_size <= 0 or group_size % 8):
        raise ValueError(f"group_size must be -1 (one group per output channel) or a positive multiple of 8 that "
                         f"divides in_features: 32, 64 or 128 (nibble's CUDA kernels; 256, 512, ... too), or "
                         f"another multiple of 8 such as 16 or 48 (its Triton kernels); got {group_size}")


def check_group_width(group_size, K: int) -> None:
    """The group size of a weight of K inputs (`Int4Weight`, the kernels' arguments): `check_group_size`'s int, the
    width of its groups, dividing K. -1 is refused: a shorthand of the callers that build a weight (the
    quantizers, QuantConfig, QuantLinear), which a weight replaces by the width itself."""
    check_group_size(group_size)
    if group_size == -1:
        raise ValueError(f"a weight's group_size is a group's width (in_features={K} for one group a row), not -1, "
                         f"the shorthand only the quantizers, QuantConfig and QuantLinear take")
    if K % group_size:
        raise ValueError(f"in_features={K} is not divisible by group_size={group_size}")


@dataclass
class Int4Weight:
    """One quantized linear weight in the canonical format (nn.Linear's W is [N, K])."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int

    def __post_init__(self):
        self.validate()

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * PACK

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    def validate(self) -> None:
        if self.qweight.dtype != torch.int32 or self.qweight.dim() != 2:
            raise ValueError(f"qweight must be a 2-D int32 tensor [K // 8, N], got {self.qweight.dtype} "
                             f"{tuple(self.qweight.shape)}")
        K, N, G = self.in_features, self.out_features, self.group_size
        check_group_width(G, K)
        for name in ("scales", "zeros"):
            t = getattr(self, name)
            if t.dtype != torch.float16:
                raise ValueError(f"{name} must be float16, got {t.dtype}")
            if tuple(t.shape) != (K // G, N):
                raise ValueError(f"{name} must have shape {(K // G, N)} for K={K}, N={N}, group {G}; got {tuple(t.shape)}")

    @classmethod
    def from_codes(cls, codes_nk: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> "Int4Weight":
        """Codes in nn.Linear orientation [N, K]; scales/zeros [N, K // G]."""
        return cls(pack_int4(codes_nk.t()), scales.t().contiguous().half(), zeros.t().contiguous().half(), group_size)

    def codes(self) -> torch.Tensor:
        """Codes in nn.Linear orientation [N, K] (uint8)."""
        return unpack_int4(self.qweight).t()

    def to(self, device) -> "Int4Weight":
        return Int4Weight(self.qweight.to(device), self.scales.to(device), self.zeros.to(device), self.group_size)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros))
