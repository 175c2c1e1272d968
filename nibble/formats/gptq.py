"""GPTQ layout (AutoGPTQ, GPTQModel, transformers' GPTQ) <-> nibble's canonical INT4 format, losslessly.

A GPTQ linear with W [N, K] and group size G stores::

    qweight  int32   [K // 8, N]        packed along K, code of row 8i + j in bits 4j of qweight[i, n]
                                        (bit-identical to the canonical qweight)
    qzeros   int32   [K // G, N // 8]   zero points packed along N, column 8c + j in bits 4j of word c
    scales   float16 [K // G, N]
    g_idx    int32   [K]                group of each input feature
    W[n, k] = (q[k, n] - zp[g_idx[k], n]) * s[g_idx[k], n]

Zero points, two conventions (``checkpoint_format``):
- ``"gptq"`` (v1, the historical one): qzeros holds zp - 1. We read it as GPTQModel does, word-wise:
  ``v2_word = v1_word + 0x11111111 (mod 2^32)``. For zp in [1, 15] that is exactly "each nibble is
  zp - 1"; a zp of 0 (an asymmetric group with no negative weight: all positive, or all zero) would
  be -1, which borrows from the next nibble, and the readers that unpack nibble-wise and add 1
  (AutoGPTQ, vLLM's gptq kernel) read 16 there and the next column's zero point one off. So
  ``to_gptq`` refuses to write such a weight in v1 and names v2 (`export_gptq` without a checkpoint_format picks
  v2 then).
- ``"gptq_v2"``: qzeros holds zp itself.

Act-order (``desc_act``) checkpoints have a g_idx that is not ``k // G``: the members of a group
are scattered over K. The canonical format needs contiguous groups, so ``from_gptq`` permutes K:
it returns ``perm`` (int64 [K]) with canonical row j = original input feature ``perm[j]``, and the
layer must compute ``x[..., perm] @ W_canonical.T``. We permute rather than refuse because most
act-order checkpoints on the Hub would otherwise be unloadable, and a gather of the activations is
cheap next to the GEMM (exllama and Marlin do the same reordering). ``to_gptq(weight, perm)`` is
the inverse and writes the act-order g_idx.
"""
from __future__ import annotations

import torch

from nibble.formats import CHECKPOINT_FORMATS
from nibble.formats.int4 import PACK, Int4Weight, pack_int4, unpack_int4
from nibble.formats.zero_points import (integer_zero_points, pack_along_n, uint32_to_int32, unpack_along_n,
                                        zeros_from_zero_points)

_ONES = 0x11111111  # +1 in every nibble


def _check_format(checkpoint_format: str) -> None:
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint_format must be one of {CHECKPOINT_FORMATS} (v1 stores zp - 1, v2 stores zp), "
                         f"got {checkpoint_format!r}")


def trivial_g_idx(in_features: int, group_size: int, device=None) -> torch.Tensor:
    return (torch.arange(in_features, device=device) // group_size).to(torch.int32)


def to_gptq(weight: Int4Weight, perm: torch.Tensor | None = None, checkpoint_format: str = "gptq") -> dict:
    """Canonical -> GPTQ tensors ``{"qweight", "qzeros", "scales", "g_idx"}``.

    ``perm`` (optional, [K]): the weight is stored in permuted input order (canonical row j is
    original input feature perm[j]), as act-order GPTQ produces it; the result is in original order
    with the act-order g_idx. Raises ValueError for float zero points, and in v1 for a zero point of 0.
    """
    _check_format(checkpoint_format)
    K, G = weight.in_features, weight.group_size
    zp = _zero_points(weight)
    words = pack_along_n(zp).to(torch.int64)
    if checkpoint_format == "gptq":
        if not bool(zp.all()):
            raise ValueError(f"{int((zp == 0).sum())} groups have zero point 0 (no negative weight), which GPTQ's v1 "
                             "format stores as -1: AutoGPTQ and vLLM's gptq kernel would read 16 there and move the "
                             "next output's group a step; write checkpoint_format 'gptq_v2', which GPTQModel, "
                             "transformers and vLLM read")
        words = words - _ONES
    qzeros = uint32_to_int32(words)
    g_idx = trivial_g_idx(K, G, weight.qweight.device)
    qweight = weight.qweight.clone()
    if perm is not None:
        perm = _check_perm(perm, K)
        codes = unpack_int4(weight.qweight)  # [K, N], row j = original feature perm[j]
        original = torch.empty_like(codes)
        original[perm] = codes
        qweight = pack_int4(original)
        g_idx = torch.empty_like(g_idx)
        g_idx[perm] = trivial_g_idx(K, G, weight.qweight.device)
    return {"qweight": qweight, "qzeros": qzeros, "scales": weight.scales.clone(), "g_idx": g_idx}


def holds_in_v1(weight: Int4Weight) -> bool:
    """Whether ``weight``'s zero points fit GPTQ's v1 format (none is 0)."""
    return bool(_zero_points(weight).all())


def _zero_points(weight: Int4Weight) -> torch.Tensor:
    return integer_zero_points(weight.scales, weight.zeros)


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None = None,
              group_size: int | None = None, checkpoint_format: str = "gptq") -> tuple[Int4Weight, torch.Tensor | None]:
    """GPTQ tensors -> ``(Int4Weight, perm)``; ``perm`` is None unless g_idx is act-order (see module doc).

    ``group_size`` (optional, -1 = per channel) is checked against the shapes; the group size
    itself is K // scales.shape[0].
    """
    _check_format(checkpoint_format)
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"GPTQ qweight/qzeros must be int32, got {qweight.dtype}/{qzeros.dtype}")
    if scales.dtype != torch.float16:
        raise ValueError(f"GPTQ scales must be float16, got {scales.dtype}")
    K, _, G = gptq_dimensions(qweight.shape, qzeros.shape, scales.shape, group_size)
    zeros = zeros_from_zero_points(gptq_zero_points(qzeros, checkpoint_format), scales)
    perm = None if g_idx is None else act_order_perm(g_idx, K, G)
    if perm is not None:
        qweight = pack_int4(unpack_int4(qweight)[perm])
    else:
        qweight = qweight.clone()
    return Int4Weight(qweight, scales.clone(), zeros, G), perm


def gptq_dimensions(qweight_shape, qzeros_shape, scales_shape, group_size: int | None = None) -> tuple[int, int, int]:
    """(K, N, G) of a layer whose GPTQ tensors have these shapes, the group size read from the scales' rows
    (``group_size``, -1 for per channel, checked against it), else a ValueError saying how they disagree: what
    `from_gptq` reads of them before their data."""
    K, N = qweight_shape[0] * PACK, qweight_shape[1]
    n_groups = scales_shape[0]
    if n_groups == 0 or K % n_groups:
        raise ValueError(f"GPTQ scales have {n_groups} group rows, which do not divide in_features={K} evenly")
    G = K // n_groups
    if group_size is not None and (K if group_size == -1 else group_size) != G:
        raise ValueError(f"group_size={group_size} disagrees with the tensors: scales {tuple(scales_shape)} of K={K} "
                         f"inputs mean group size {G}")
    if tuple(scales_shape) != (n_groups, N) or tuple(qzeros_shape) != (n_groups, N // PACK) or N % PACK:
        # N % 8 alone leaves every shape named matching: say what is wrong
        packing = f", and N a multiple of {PACK} (the zero points a qzeros word holds)" if N % PACK else ""
        raise ValueError(f"GPTQ shapes disagree: qweight {tuple(qweight_shape)} (K={K}, N={N}) needs scales "
                         f"{(n_groups, N)} and qzeros {(n_groups, N // PACK)}{packing}; got {tuple(scales_shape)} "
                         f"and {tuple(qzeros_shape)}")
    return K, N, G


def gptq_zero_points(qzeros: torch.Tensor, checkpoint_format: str) -> torch.Tensor:
    """The integer zero points zp [K // G, N] that ``qzeros`` holds in ``checkpoint_format``'s convention."""
    words = qzeros.to(torch.int64)
    if checkpoint_format == "gptq":
        words = words + _ONES
    return unpack_along_n(uint32_to_int32(words))


def act_order_perm(g_idx: torch.Tensor, in_features: int, group_size: int) -> torch.Tensor | None:
    """The input permutation that makes ``g_idx``'s groups contiguous (see the module doc), None where they are
    already (g_idx = k // G); a ValueError where no permutation can (a group not of ``group_size`` members)."""
    K, G = in_features, group_size
    g = g_idx.to(torch.int64)
    if torch.equal(g, trivial_g_idx(K, G, g_idx.device).to(torch.int64)):
        return None
    n_groups = K // G
    if g.shape != (K,) or int(g.min()) < 0 or int(g.max()) >= n_groups or \
            not bool((torch.bincount(g, minlength=n_groups) == G).all()):
        raise ValueError(f"g_idx must assign exactly {G} of the {K} input features to each of the {n_groups} "
                         "groups (as GPTQ act-order does); this one does not, so the groups cannot be made "
                         "contiguous by a permutation")
    return torch.argsort(g, stable=True)


def _check_perm(perm: torch.Tensor, K: int) -> torch.Tensor:
    perm = perm.to(torch.int64)
    if perm.shape != (K,) or not torch.equal(torch.sort(perm).values, torch.arange(K, device=perm.device)):
        raise ValueError(f"perm must be a permutation of range({K})")
    return perm
