"""Round-to-nearest INT4 quantization per group, with an optional MSE-optimal clipping search.

Three ways to place the 16 levels of a group (all stored in the canonical offset form q*s + z):
- ``symmetric``: s = amax / 7, levels (q - 8) * s, the form W4A4's integer GEMM needs.
- ``zero_point="int"`` (default): asymmetric with an integer zero point zp in [0, 15], z = -zp * s,
  which is exactly what AutoAWQ / GPTQ checkpoints can hold.
- ``zero_point="float"``: asymmetric with a float minimum, z = min (llama.cpp's Q4_1).

Clipping search (as AWQ/HQQ do): shrink the group's range by a ratio from a grid and keep, per
group, the ratio with the smallest squared error. Outliers that would stretch the step for the
whole group get clipped when that lowers the error of the other 127 weights.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from nibble.config import KEEP_IN_16_BITS, check_count, width_error
from nibble.formats.int4 import Int4Weight
from nibble.kernels.reference import rounded

MAX_CODE = 15
MIN_SCALE = 2.0 ** -24  # float16's smallest subnormal
FP16_MIN_NORMAL = 2.0 ** -14
FP16_MAX = torch.finfo(torch.float16).max
NOT_FINITE = "weight contains NaN or Inf; fix the checkpoint before quantizing"
# A weight whose largest |w| is below this has every group scale (amax / 7 symmetric, at most 2 amax / 15
# asymmetric) under 4 of float16's subnormal steps of 2^-24: float16 keeps 2 bits of it or fewer, and the codes on
# such scales miss the weights by 30% more than on normal ones at |w| <= 1e-6 (RTN g64), 7x more at 1e-7.
TINY_AMAX = 7 * 4 * MIN_SCALE


def check_weight(weight: torch.Tensor, group_size: int) -> None:
    """Refuse a ``weight`` no quantizer here can take: one not 2-D, not floating-point, on the meta device, empty,
    holding NaN or Inf, or of a width ``group_size`` (which must be positive) does not divide."""
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D [out_features, in_features] weight, got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise TypeError(f"weight must be a floating-point tensor, got {weight.dtype}")
    if weight.is_meta:  # said before "Tensor.item() cannot be called on meta tensors", as quantize_model says it
        raise ValueError("the weight is on the meta device (built empty, e.g. under init_empty_weights): load its "
                         "values first")
    if not weight.numel():
        raise ValueError(f"an empty weight {tuple(weight.shape)} has nothing to quantize; keep the layer in 16 bits")
    if group_size <= 0:
        raise ValueError(f"group_size must be positive here (the row's width for per-channel), got {group_size}")
    if error := width_error(weight.shape[1], group_size):
        raise ValueError(error)
    if not torch.isfinite(weight).all():
        raise ValueError(NOT_FINITE)


class ScaleOverflowError(ValueError):
    """Weights whose group scale or zero point would not fit float16 (`_check_stored`)."""


def _check_not_tiny(amax: float) -> None:
    """Refuse a weight so small that float16 holds its group scales as subnormals of 2 bits or fewer (`TINY_AMAX`);
    one of zeros (amax 0) quantizes exactly. A layer's largest weight, not a group's: a small group among normal ones
    costs the layer's output next to nothing."""
    if 0 < amax < TINY_AMAX:
        raise ValueError(f"weights up to |w| = {amax:.3g} need group scales below {TINY_AMAX / 7:.3g}, which float16, "
                         f"in which nibble stores them, holds with 2 bits or fewer: {KEEP_IN_16_BITS} or scale the "
                         "weight up before quantizing")


@contextmanager
def naming(layer: str):
    """A ValueError raised quantizing ``layer`` (one name, or several of a stacked weight), or converting it to
    another tool's layout, says which layer it is about, which the code given a bare weight cannot."""
    try:
        yield
    except ValueError as e:
        raise type(e)(f"{layer}: {e}") from e


def _straight_through(value: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``value`` (``t`` rounded as it will be stored), with the gradient of ``t`` itself, in float32: the autograd of a
    cast to float16 rounds the gradient to float16 too, which flushed PE-QAT's clip-ratio gradients below ~6e-8 to
    0 and took those above 65504 to Inf; a ceil or a clamp passes none. ``t - t.detach()`` is an exact 0."""
    return value + (t - t.detach()) if t.requires_grad else value


def _float16(t: torch.Tensor) -> torch.Tensor:
    """t as float16 stores it, in float32; kept under torch.compile, whose fusion dropped the round trip (a compiled
    PE-QAT layer trained on other scales than its export's: `reference.rounded`)."""
    return _straight_through(rounded(t.detach(), torch.float16).float(), t)


def _stored_scale(s: torch.Tensor) -> torch.Tensor:
    """s as float16 stores it, kept >= its smallest subnormal: a constant group (all zeros, say) has a range of
    0, and a scale that is 0 once stored makes its codes 0 / 0 (the clamp comes after the rounding, since any
    float32 floor below float16's subnormals rounds to 0 again). Below float16's normal range its values are
    2^-24 apart, coarse next to the scale: rounded to nearest, a scale that went down left the group's top weights
    past the last level (1.9 steps off at |w| ~ 1e-6), so those round up, and the levels still span the range."""
    value = s.detach()
    subnormal = torch.ceil(value / MIN_SCALE) * MIN_SCALE  # exact: multiples of 2^-24 below 2^-14
    return _straight_through(torch.where(value < FP16_MIN_NORMAL, subnormal, _float16(value)).clamp(min=MIN_SCALE), s)


def scale_and_zero(lo: torch.Tensor, hi: torch.Tensor, symmetric: bool, zero_point: str):
    """Per-group (s, z) for the range [lo, hi], both rounded to float16 as they will be stored; s > 0, and s or
    z not finite where the range is too wide for float16 (which `_check_stored` refuses)."""
    if symmetric:
        s = _stored_scale(torch.maximum(hi, -lo) / 7)
        return s, _float16(-8 * s)
    s = _stored_scale((hi - lo) / MAX_CODE)
    if zero_point == "float":
        return s, _float16(lo)
    zp = torch.clamp(torch.round(-lo / s), 0, MAX_CODE)
    return s, _float16(-zp * s)


def _check_stored(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> None:
    """Refuse groups of ``w`` [R, G] whose full-range (s, z) [R, 1] overflow float16 (one host sync per call:
    the clipping search's narrower ranges need no check of their own, an overflowing one never wins)."""
    bad = ~(torch.isfinite(s) & torch.isfinite(z)).squeeze(1)
    if bad.any():
        amax = w[bad].abs().max().item()
        raise ScaleOverflowError(f"weights up to |w| = {amax:.4g} need a scale or zero point beyond float16's range "
                         f"(+-{FP16_MAX:g}), in which nibble stores them: {KEEP_IN_16_BITS} or scale the weight "
                         "down before quantizing")


def check_values(weight: torch.Tensor, group_size: int, symmetric: bool, zero_point: str, scales: bool = True) -> None:
    """What rtn_quantize refuses in the values of ``weight`` [N, K] (of a width ``group_size`` divides), without
    quantizing it, so that quantize_model can check every layer before it converts any: NaN or Inf, and with
    ``scales`` a group whose full-range scale or zero point float16 cannot hold (`_check_stored`) or a weight whose
    scales it holds with 2 bits or fewer (`_check_not_tiny`). One pass, the
    weight's min and max, unless its amax lets some group overflow; only then are the groups' ranges taken."""
    lo, hi = torch.aminmax(weight.detach())  # NaN propagates into both
    amax = float(torch.maximum(-lo, hi))
    if not math.isfinite(amax):
        raise ValueError(NOT_FINITE)
    if scales:
        _check_not_tiny(amax)
    # no group's scale or zero point exceeds 8/7 amax (symmetric: z = -8 amax / 7; an integer zero point is within
    # half a step, 1/15 amax, of the minimum), with a margin for their rounding to float16
    if not scales or amax * 8 / 7 * (1 + 2 ** -9) < FP16_MAX:
        return
    w = weight.detach().float().reshape(-1, group_size)
    _check_stored(w, *scale_and_zero(*group_range(w, symmetric, zero_point), symmetric, zero_point))


def round_to_codes(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes (0..15, as floats) nearest ``w`` on the grid z + s * code."""
    return torch.clamp(torch.round((w - z) / s), 0, MAX_CODE)


def group_range(w: torch.Tensor, symmetric: bool, zero_point: str):
    """(lo, hi) [R, 1] of the rows of w: integer zero points (and symmetric) need 0 inside the range."""
    lo = w.amin(dim=1, keepdim=True)
    hi = w.amax(dim=1, keepdim=True)
    return (lo.clamp(max=0), hi.clamp(min=0)) if zero_point == "int" or symmetric else (lo, hi)


def weighted_clip_search(w: torch.Tensor, error, symmetric: bool = False, zero_point: str = "int",
                         grid: int = 20, min_shrink: float = 0.5):
    """Per row of ``w`` [R, G] (one group each): (codes, s, z), s and z [R, 1], with the range shrink
    ratio in linspace(1, min_shrink, grid + 1) that minimises ``error(w - dequantized) -> [R, 1]``.

    RTN scores a ratio by the plain squared weight error; calibrated methods pass the error they
    care about (AWQ: the group's output error, GPTQ: its Hessian-weighted error).
    """
    check_count("grid", grid)
    if not 0 < min_shrink <= 1:
        raise ValueError(f"min_shrink must be in (0, 1], the smallest fraction of a group's range tried, got {min_shrink!r}")
    w = w.float()
    lo, hi = group_range(w, symmetric, zero_point)
    s, z = scale_and_zero(lo, hi, symmetric, zero_point)
    _check_stored(w, s, z)
    best = error(w - (round_to_codes(w, s, z) * s + z))
    for ratio in torch.linspace(1.0, min_shrink, grid + 1)[1:].tolist():
        s_r, z_r = scale_and_zero(lo * ratio, hi * ratio, symmetric, zero_point)
        err = error(w - (round_to_codes(w, s_r, z_r) * s_r + z_r))
        better = err < best
        best = torch.where(better, err, best)
        s, z = torch.where(better, s_r, s), torch.where(better, z_r, z)
    return round_to_codes(w, s, z), s, z


def _squared_error(dw: torch.Tensor) -> torch.Tensor:
    return (dw ** 2).sum(dim=1, keepdim=True)


def quantize_groups(w: torch.Tensor, symmetric: bool = False, zero_point: str = "int",
                    clip_search: bool = True, grid: int = 20, min_shrink: float = 0.5):
    """Quantize rows of ``w`` [R, G] (one group per row): returns (codes, s, z), s and z of shape [R, 1].

    Everything is float32; s and z hold float16-representable values.
    """
    if zero_point not in ("int", "float"):
        raise ValueError(f"zero_point must be 'int' or 'float', got {zero_point!r}")
    w = w.float()
    if clip_search:
        return weighted_clip_search(w, _squared_error, symmetric, zero_point, grid, min_shrink)
    s, z = scale_and_zero(*group_range(w, symmetric, zero_point), symmetric, zero_point)
    _check_stored(w, s, z)
    return round_to_codes(w, s, z), s, z


def rtn_quantize(weight: torch.Tensor, group_size: int = 128, symmetric: bool = False, zero_point: str = "int",
                 clip_search: bool = True, grid: int = 20, min_shrink: float = 0.5,
                 chunk_rows: int = 1 << 20) -> Int4Weight:
    """Quantize an nn.Linear weight [N, K] to the canonical INT4 format.

    ``group_size=-1`` means one group per output channel. Work is done on the weight's device in
    chunks of ``chunk_rows`` groups, so a 7B-sized layer stays within a few hundred MB of scratch.
    """
    check_count("chunk_rows", chunk_rows)
    N, K = weight.shape if weight.dim() == 2 else (0, 0)
    group_size = K if group_size == -1 else group_size
    check_weight(weight, group_size)
    lo, hi = torch.aminmax(weight.detach())  # not abs().amax(): no copy of the weight (non-empty: check_weight)
    _check_not_tiny(max(-float(lo), float(hi)))
    groups = weight.reshape(-1, group_size)
    codes, scales, zeros = [], [], []
    for start in range(0, groups.shape[0], chunk_rows):
        c, s, z = quantize_groups(groups[start:start + chunk_rows], symmetric, zero_point, clip_search, grid, min_shrink)
        codes.append(c.to(torch.uint8))
        scales.append(s)
        zeros.append(z)
    codes = torch.cat(codes).reshape(N, K)
    scales = torch.cat(scales).reshape(N, K // group_size)
    zeros = torch.cat(zeros).reshape(N, K // group_size)
    return Int4Weight.from_codes(codes, scales, zeros, group_size)
