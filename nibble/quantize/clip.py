"""Weighted clipping search: rtn's range-shrink grid, scored by an error the caller chooses.

rtn's ``quantize_groups`` keeps, per group, the shrink ratio with the smallest plain squared
weight error. Calibrated methods know which weights matter more: AWQ scores a group by its
output error dW H_gg dW^T, GPTQ by the error of each column divided by its inverse-Hessian
diagonal (the GPTQ objective). Same grid, same (s, z) rules (rtn's ``_scale_and_zero``), different score.
"""
from __future__ import annotations

import torch

from nibble.quantize.rtn import _codes, _scale_and_zero


def group_range(w: torch.Tensor, symmetric: bool, zero_point: str):
    """(lo, hi) [R, 1] of rows of w as rtn uses them: integer zero points need 0 inside the range."""
    int_range = zero_point == "int" or symmetric
    lo = w.amin(dim=1, keepdim=True)
    hi = w.amax(dim=1, keepdim=True)
    return (lo.clamp(max=0), hi.clamp(min=0)) if int_range else (lo, hi)


def weighted_clip_search(w: torch.Tensor, error, symmetric: bool = False, zero_point: str = "int",
                         grid: int = 20, min_shrink: float = 0.5):
    """Per row of ``w`` [R, G] (one group each): (codes, s, z), s and z [R, 1], with the range shrink
    ratio in linspace(1, min_shrink, grid + 1) that minimises ``error(w - dequantized) -> [R, 1]``."""
    w = w.float()
    lo, hi = group_range(w, symmetric, zero_point)
    s, z = _scale_and_zero(lo, hi, symmetric, zero_point)
    best = error(w - (_codes(w, s, z) * s + z))
    for ratio in torch.linspace(1.0, min_shrink, grid + 1)[1:].tolist():
        s_r, z_r = _scale_and_zero(lo * ratio, hi * ratio, symmetric, zero_point)
        err = error(w - (_codes(w, s_r, z_r) * s_r + z_r))
        better = err < best
        best = torch.where(better, err, best)
        s, z = torch.where(better, s_r, s), torch.where(better, z_r, z)
    return _codes(w, s, z), s, z
