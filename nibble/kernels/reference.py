"""Pure-PyTorch definitions of every nibble kernel: the spec the GPU kernels are tested against,
and the path that runs on CPU. Written for clarity, computed in float32 (float64 where exactness
matters), never fast.

The Hadamard transform's reference sits beside its kernel in `nibble/kernels/hadamard.py`.
"""
from __future__ import annotations

import torch

from nibble.formats.int4 import PACK, unpack_int4

# Symmetric INT4 activations use [-7, 7] for the scale (amax / 7) so +-amax are both exact;
# -8 is reachable only by rounding: never for float16 / bfloat16 tokens (the kernels', which skip the clamp), but a
# float32 token whose amax / 7 lands among float32's last subnormals (amax below ~1e-43) rounds its scale coarsely
# enough to get there (x = [-10, 3] * 2^-149 gives -8 after the clamp below).
ACT_QMAX = 7


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Canonical INT4 -> dense W [N, K]: W[n, k] = q[k, n] * s[k // G, n] + z[k // G, n], in float32.

    The codes viewed as [K // G, G, N] take their group's scale and zero by broadcasting, in place: the CPU path
    runs this on every forward, where one float [K, N] tensor is the least it can build (a transposed view of it
    is returned, which ``w.t()`` reads as it lies)."""
    K, N = qweight.shape[0] * PACK, qweight.shape[1]
    if group_size < 1 or K % group_size or scales.shape != (K // group_size, N) or zeros.shape != scales.shape:
        # broadcasting would spread a scale of the wrong shape (one row for several groups) without a word
        raise ValueError(f"scales and zeros must be [K // group_size, N] = [{K} // {group_size}, {N}] for a weight "
                         f"of K={K}, got {tuple(scales.shape)} and {tuple(zeros.shape)}")
    w = unpack_int4(qweight, torch.float32).view(K // group_size, group_size, N)
    w.mul_(scales.float().unsqueeze(1)).add_(zeros.float().unsqueeze(1))  # one rounding each, as q * s + z
    return w.view(K, N).t().to(dtype)


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequantize(W).T + bias over any leading dims, accumulated in float32, returned in x.dtype."""
    w = dequantize(qweight, scales, zeros, group_size).to(x.device)
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def gather_columns(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[..., index]: the input of a layer that lists its inputs in another order (GPTQ act-order)."""
    return x.index_select(-1, index.to(x.device))


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric INT4: returns (q int8 [..., K] in [-8, 7], scale float32 [...]).

    scale = amax|x| / 7 per row, rounded to float32 (which decides the ties: a bf16 x of amax / 2 divides to 3.5 +-
    an ulp, not 3.5); q = clamp(round_half_even(x / scale), -8, 7) in float32. Non-finite values are
    saturated first (NaN -> 0, +-Inf -> +-finfo(x.dtype).max) so one bad value cannot turn a whole
    row into NaN. All-zero rows get scale 0 and q 0. (Under the online Hadamard a non-finite value spreads
    over its whole token first: `rotate_quantize_activations`.)
    """
    finfo = torch.finfo(x.dtype)
    xf = torch.nan_to_num(x, nan=0.0, posinf=finfo.max, neginf=-finfo.max).float()
    amax = xf.abs().amax(dim=-1)
    # Divide by a tensor: CUDA turns `tensor / 7` into `tensor * (1/7)`, one rounding off the spec.
    scale = amax / torch.full_like(amax, ACT_QMAX)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(xf / safe.unsqueeze(-1)), -8, 7).to(torch.int8)
    return q, scale


@torch.library.custom_op("nibble::rounded", mutates_args=())
def _rounded_op(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype, copy=True)  # an op's output may not alias its input


_rounded_op.register_fake(lambda x, dtype: torch.empty_like(x, dtype=dtype))
_rounded_op.register_autograd(lambda ctx, grad: (grad.to(ctx.dtype), None),
                              setup_context=lambda ctx, inputs, output: setattr(ctx, "dtype", inputs[0].dtype))


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x.to(dtype), kept by torch.compile: Inductor (precision casts not emulated) fuses a float32 -> 16-bit ->
    float32 round trip away, so a compiled W4A4 reference quantized the unrounded rotation (other scales on every
    token than eager). In a compiled graph the rounding is an op whose ``dtype`` output it cannot see through."""
    return _rounded_op(x, dtype) if torch.compiler.is_compiling() else x.to(dtype)


def rotate_activations(x: torch.Tensor) -> torch.Tensor:
    """The online Hadamard as W4A4 applies it: x @ H.T, float32 sums rounded once to x's type. A token whose float32
    rotated values are not all finite held a NaN or +-Inf, which the rotation spread over every value of it: it
    becomes zeros, so it quantizes to scale 0 and its output is the bias alone, as in every kernel
    (docs/ARCHITECTURE.md)."""
    from nibble.kernels.hadamard import hadamard_transform_reference
    y = hadamard_transform_reference(x.to(torch.promote_types(x.dtype, torch.float32)))
    return rounded(torch.where(torch.isfinite(y).all(dim=-1, keepdim=True), y, torch.zeros_like(y)), x.dtype)


def rotate_quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotate_activations`, then `quantize_activations`."""
    return quantize_activations(rotate_activations(x))


def w4a4_accumulate(qx: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """The integer part of W4A4: acc[m, n] = sum_k qx[m, k] * (q[k, n] - 8), exact, as int32.

    float64 holds every partial sum exactly (|acc| <= 64 K, far below 2^53), so this is the exact
    integer product on any device.
    """
    w = unpack_int4(qweight, torch.float64).sub_(8)  # [K, N]
    return (qx.to(torch.float64) @ w.to(qx.device)).to(torch.int32)


def w4a4_matmul(qx: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """y[m, n] = acc[m, n] * (x_scale[m] * w_scale[n]) (+ bias[n]); float scaling only after the int32 sum.

    qx: int8 [M, K]; x_scale: float32 [M]; w_scale: [N] (the per-channel weight scale, scales[0]).
    """
    acc = w4a4_accumulate(qx, qweight).float()
    # The two scales first: acc * sx alone overflows float32 for a token that held +-Inf (sx =
    # finfo.max / 7) even where the whole product is representable.
    y = acc * (x_scale.float().unsqueeze(-1) * w_scale.float().to(qx.device))
    if bias is not None:
        y = y + bias.float()
    # A token that held +-Inf has a huge scale; saturate instead of overflowing to Inf in 16 bits.
    big = torch.finfo(out_dtype).max
    return y.clamp(-big, big).to(out_dtype)


def w4a4_silu_mul(qx: torch.Tensor, x_scale: torch.Tensor, gate: tuple, up: tuple,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A SwiGLU MLP's SiLU(gate) * up on quantized activations, as Hugging Face computes it from
    the two products: each rounded to out_dtype, then ``F.silu(g) * u`` in out_dtype. gate, up:
    (qweight, w_scale, bias)."""
    g = w4a4_matmul(qx, x_scale, *gate, out_dtype=out_dtype)
    u = w4a4_matmul(qx, x_scale, *up, out_dtype=out_dtype)
    return torch.nn.functional.silu(g) * u


def w4a4_linear(x: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None = None, input_hadamard: bool = False) -> torch.Tensor:
    """The whole W4A4 layer on any leading dims: [optional online Hadamard] -> per-token quantize -> int matmul."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    qx, sx = rotate_quantize_activations(x2) if input_hadamard else quantize_activations(x2)
    y = w4a4_matmul(qx, sx, qweight, w_scale, bias, out_dtype=x.dtype)
    return y.reshape(*lead, y.shape[-1])  # N, not -1: x may hold no token
