"""W4A4 kernels for Hopper: per-token INT4 activation quantization (optionally fused with the
online Hadamard rotation) and INT4 x INT4 matrix products computed exactly in integers.

The spec is `nibble.kernels.reference` (`quantize_activations`, `w4a4_accumulate`, `w4a4_matmul`,
`w4a4_linear`); docs/ARCHITECTURE.md describes the formats. Three Triton kernels:

``_act_quant_kernel``   one pass over x [M, K] (fp16/bf16): [Hadamard; a token whose float32 rotation
                        is not all finite -> zeros] -> saturate non-finite values -> scale = amax / 7
                        per row -> q = clamp(rint(x / scale), -8, 7).
                        Writes int8 q [M, K] (INT4 values in an INT8 container: the tensor cores
                        take int8, so a packed layout would only move the unpacking into the GEMM)
                        and float32 scales [M]. The quotients x / scale are the correctly rounded
                        ones (`_row_quotients`), rounding is half-to-even (rint): bit-identical to
                        the float32 spec without Hadamard.
                        (`_act_quant_chunked_kernel`: a two-pass variant for many tokens of long
                        rows, where it measured faster.)
``_w4a4_mma_kernel``    multi-token GEMM on the INT8 tensor cores (sm_90 `.s4` MMA is emulated and
                        slow, so INT4 values in [-8, 7] ride in int8): the packed weight tile is
                        unpacked in registers to int8 (q - 8) by a short PTX sequence (one word ->
                        two int8x4 registers, 9 instructions), `tl.dot` int8 x int8 -> int32, float
                        epilogue acc * (sx[m] * sw[n]) (+ bias), optional split-K. Triton keeps int8
                        wgmma synchronous (int32 accumulators), so tiles are 4-warp 128x128 to fit
                        two programs per SM, whose unpacking and MMAs then overlap. The weight as
                        wgmma's register operand A (the transposed product) was tried, not kept:
                        benchmarks/notes-w4a4.md, design decision 4.
``_w4a4_gemv_kernel``   decode (M = 1): streams the packed weight once with 16-byte loads and
                        computes on the CUDA cores with `dp4a` (4 products per instruction): the
                        low / high nibbles of each word are masked into four unsigned bytes each
                        (codes 0..15, no sign fix-up) and dotted with the even / odd activation
                        bytes; sum_k x*(q-8) = sum_k x*q - 8*sum_k x, exact in int32. Split-K
                        over the grid so every SM streams, partials reduced in int32 by the last
                        program of each column tile (deterministic, no float atomics).

Three CUDA C++ kernels (built by `cuda_build` at first use) take over where they are faster:
``csrc/w4a4_mma.cu`` (`w4a4_mma`, M <= 16: the W4A16 decode kernel's skeleton on int8 MMAs),
``csrc/w4a4_wgmma.cu`` (`w4a4_wgmma`, Hopper only, many tokens: persistent, asynchronous int8 wgmma fed by TMA,
the weight unpacked into register fragments; it reads the activations in an "even_odd" K order,
which the act-quant kernels write when asked, `order="even_odd"`) and ``csrc/rotate_quantize.cu``
(`rotate_quantize`, sm_90+, up to 16 rows: the online Hadamard and the quantization in one launch,
each row a thread-block cluster; `quantize_activations_gpu` picks it).

Every matrix kernel can return the raw int32 accumulators (tests check them bit-exactly against
`reference.w4a4_accumulate`). The op `torch.ops.nibble.w4a4_linear` chains quantization and the
matrix kernel `w4a4_matmul` picks: `w4a4_mma` for M <= 16, `w4a4_wgmma` above on Hopper
(`wgmma_preferred`), the Triton kernels otherwise; `torch.ops.nibble.w4a4_linears` does the
same for several layers reading one input, quantizing it once. On CPU (and without Triton) they
run `reference.w4a4_linear`.

This module imports without CUDA and without Triton.
"""
from __future__ import annotations

import ctypes
import functools
import math
import warnings
from typing import Optional

import torch

from nibble.formats.int4 import PACK
from nibble.kernels import cuda_build, hopper, reference
from nibble.kernels.early_launch import early_launch
from nibble.kernels.triton_device import (check_triton_device, interpreting, triton_unavailable,
                                          warn_reference_on_gpu)
from nibble.kernels import hadamard as _had
from nibble.kernels.launch import (SUCCESSOR_AT_END, SUCCESSOR_CAPPED, SUCCESSORS, cdiv, check_bias, next_pow2,
                                   num_sms, split_counters)
from nibble.kernels.w4a16 import MmaConfig, select_mma_config

try:
    import triton
    import triton.language as tl
    from nibble.kernels.early_launch import after_prior_grids
    _jit = triton.jit
except ImportError:  # CPU-only install: the op runs the reference
    triton = tl = None

    def _jit(fn=None, **_kw):
        return fn if fn is not None else (lambda f: f)

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
W_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# 0x88888888 as an int32: flips bit 3 of every nibble, so nibble q becomes the 4-bit two's
# complement of q - 8.
_XOR_SIGN = tl.constexpr(-2004318072) if tl is not None else -2004318072
_LOW_NIBBLES = tl.constexpr(0x0F0F0F0F) if tl is not None else 0x0F0F0F0F
_MAX_ROW = _had.MAX_KERNEL_ROW  # act-quant keeps a whole row in registers (28672 pads to 32768)


def kernels_available(t: torch.Tensor) -> bool:
    """True when the Triton kernels can run on tensors like ``t`` (CUDA, or CPU under TRITON_INTERPRET=1)."""
    return triton is not None and (t.is_cuda or interpreting())


# ================================================================================================
# Activation quantization
# ================================================================================================

@_jit
def _row_quotients(xf, scale, INTERPRET: tl.constexpr):
    """x / scale[row] for xf [R, C] float32 and scale [R] > 0, correctly rounded like div.rn.f32 but
    without a division per element: div.rn costs ~70 issue slots, and it made the act-quant kernel
    compute-bound at many tokens (H200, 4096 x 11008: 147 us with it, 62 us with this).
    Markstein's correction: with inv = RN(1 / s) and q0 = RN(x inv) (within an ulp of x / s), the
    remainder r = x - q0 s is exact in one FMA and RN(q0 + r inv) is the correctly rounded quotient,
    barring underflow. So rows with a tiny scale are first multiplied, x and s alike, by 2^64
    (exact, the quotient unchanged), keeping 1 / s finite; quotients that still underflow are far
    below 1/2 and round to 0 either way. (Checked against div.rn on the H200, bf16 and fp16, with
    quotients on and next to every half-integer: the same codes.) The interpreter's FMA rounds
    twice, so there it divides."""
    if INTERPRET:
        return tl.math.div_rn(xf, tl.broadcast_to(scale[:, None], xf.shape))
    pre = tl.where(scale < 1.0e-19, 18446744073709551616.0, 1.0)  # 2^64
    s = scale * pre
    inv = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    x = xf * pre[:, None]
    q0 = x * inv[:, None]
    r = tl.fma(q0, tl.broadcast_to(-s[:, None], x.shape), x)  # negated per row: -q0 took an FFMA per value
    return tl.fma(r, tl.broadcast_to(inv[:, None], x.shape), q0)


@_jit(do_not_specialize=["M"])
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, dense_ptr, M, K, stride_x, stride_q, had_scale, fmax,
                      ROWS: tl.constexpr, BLOCK: tl.constexpr, HADAMARD: tl.constexpr,
                      DENSE_PAD: tl.constexpr, DENSE_CHUNK: tl.constexpr, HA: tl.constexpr, HB: tl.constexpr,
                      TERMS_IN: tl.constexpr, TERMS: tl.constexpr, ROTATED: tl.constexpr, EVEN_ODD: tl.constexpr,
                      INTERPRET: tl.constexpr, PDL: tl.constexpr):
    after_prior_grids(PDL)  # at decode the product kernel launches under this one (early_launch.py)
    # One program owns ROWS whole rows, held in registers: x is read once, q written once.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    r = rows[:, None].to(tl.int64)
    c = tl.arange(0, BLOCK)[None, :]
    mask = (rows[:, None] < M) & (c < K)
    if HADAMARD:
        # nibble.kernels.hadamard's fusable loader: float32 (row @ H_K.T) / sqrt(K), zero padded, NaN
        # where a sum is not finite.
        xf = hadamard_load_rows(x_ptr, r * stride_x, rows[:, None] < M, K, dense_ptr, had_scale, 0, ROWS,
                                DENSE_PAD, DENSE_PAD, DENSE_CHUNK, HA, HB, TERMS_IN, TERMS)
        # The spec rotates in float32 and returns x.dtype; round the same way before quantizing.
        xf = xf.to(x_ptr.dtype.element_ty).to(tl.float32)
    else:
        xf = tl.load(x_ptr + r * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    if ROTATED:
        # Rows rotated here or by hadamard_transform_triton, where NaN marks a float32 sum that was not finite
        # (x held NaN or +-Inf, or bfloat16 sums overflowed): such a token quantizes to zeros (the spec,
        # reference.rotate_activations), whatever the plan; one that is finite in float32 but past x.dtype's
        # range is +-Inf here and saturates as usual. The row's amax, taken before any value is sanitized with
        # a max that propagates NaN, is NaN exactly for those rows: the test costs nothing beyond the amax the
        # scale needs, and a NaN-free row needs no NaN -> 0 select, so a value pays a select and a clamp
        # (an explicit row test, then store_int4_rows' sanitizing, paid eight; SASS in notes-w4a4, session 64).
        amax = tl.reduce(tl.abs(xf), 1, _max_propagating_nan)
        nan_row = amax != amax
        xf = tl.where(nan_row[:, None], 0.0, tl.minimum(tl.maximum(xf, -fmax), fmax))
        scale = _int4_scale(tl.where(nan_row, 0.0, tl.minimum(amax, fmax)))
        _store_int4_codes(xf, scale, q_ptr + r * stride_q + c, mask, EVEN_ODD, INTERPRET)
        tl.store(s_ptr + rows, scale, mask=rows < M)
    else:
        store_int4_rows(xf, q_ptr + r * stride_q + c, mask, s_ptr + rows, rows < M, fmax, EVEN_ODD, INTERPRET)


@_jit
def store_int4_rows(xf, q_ptrs, q_mask, s_ptrs, s_mask, fmax, EVEN_ODD: tl.constexpr, INTERPRET: tl.constexpr):
    """Whole rows xf [R, C] (float32, 0 where masked off) -> their int8 codes at q_ptrs [R, C] and
    float32 scales at s_ptrs [R]: the spec's per-token quantization, for any kernel that holds whole
    rows (this file's, and the engine's RMSNorm, which quantizes its output for W4A4 projections)."""
    xf = _sanitize(xf, fmax)
    scale = _int4_scale(tl.max(tl.abs(xf), axis=1))
    _store_int4_codes(xf, scale, q_ptrs, q_mask, EVEN_ODD, INTERPRET)
    tl.store(s_ptrs, scale, mask=s_mask)


@_jit
def _int4_scale(amax):
    """A token's scale from its largest magnitude: amax / 7, correctly rounded (the spec divides)."""
    return tl.math.div_rn(amax, tl.full(amax.shape, 7.0, tl.float32))


@_jit
def _store_int4_codes(xf, scale, q_ptrs, q_mask, EVEN_ODD: tl.constexpr, INTERPRET: tl.constexpr):
    """Codes clamp(rint(xf / scale), -8, 7) of sanitized rows xf [R, C] (all of a row or a chunk of
    it) with their rows' scales [R] (0 for a zero row: codes 0), stored at q_ptrs in the product's order.
    The clamp is never active, so it is not computed (two FMNMX a value, 11% of the instructions of
    a 16384-wide program): |x| <= amax and scale = RN(amax / 7) >= (amax / 7)(1 - 2^-14) (2^-24
    where amax / 7 is a normal float, 2^-14 where it is at the bottom of float32's subnormals) keep
    |x / scale| <= 7.001, whose correctly rounded quotient rounds into [-7, 7]."""
    safe = tl.where(scale > 0.0, scale, 1.0)
    tl.store(q_ptrs, _codes(_round_to_int8(_row_quotients(xf, safe, INTERPRET)), EVEN_ODD), mask=q_mask)


@_jit
def _round_to_int8(y):
    """int8 rint(y) (half to even) of float32 y in [-8.5, 7.5) without rint or a float-to-int conversion
    (16 a clock per SM each, an eighth of the FP32 rate: with them, one program quantizing a row of
    28672 took 7.1 us at 128 rows, 5.5 without; H200, benchmarks/notes-w4a4.md, session 31).
    Adding 1.5 * 2^23 leaves y's integer in the float's low mantissa bits, rounded half to even by
    the addition itself, and 1.5 * 2^23 + k for k in [-8, 7] has bits 0x4B400000 + k: the low byte
    is k as a two's complement int8."""
    return (y + 12582912.0).to(tl.int32, bitcast=True).to(tl.int8)


@_jit
def _codes(q, EVEN_ODD: tl.constexpr):
    """int8 codes q [R, C] in the order the product wants: natural, or with EVEN_ODD each 32-column
    block as its 16 even columns, then its 16 odd ones (the K order of csrc/w4a4_wgmma.cu's weight
    fragments; a register shuffle here, free in a memory-bound pass). The permutation stays inside
    32-column blocks, so the store mask (columns < K, K % 32 == 0) is unchanged."""
    if EVEN_ODD:
        R: tl.constexpr = q.shape[0]
        C: tl.constexpr = q.shape[1]
        q = tl.reshape(tl.permute(tl.reshape(q, (R, C // 32, 16, 2)), (0, 1, 3, 2)), (R, C))
    return q


@_jit
def _max_propagating_nan(a, b):
    """max(a, b), NaN where either is (max.NaN.f32; tl.max's own max drops NaN on the GPU)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@_jit
def _sanitize(xf, fmax):
    """NaN -> 0, +-Inf (and anything beyond) -> +-finfo(x.dtype).max."""
    xf = tl.where(xf != xf, 0.0, xf)
    return tl.minimum(tl.maximum(xf, -fmax), fmax)


@_jit(do_not_specialize=["M"])
def _act_quant_chunked_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, fmax,
                              ROWS: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_ODD: tl.constexpr,
                              INTERPRET: tl.constexpr):
    """Many-token variant: two passes over each row in BLOCK_K chunks (the second from L2), so a
    program holds only a chunk and many programs share an SM, keeping enough loads in flight."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    r = rows[:, None].to(tl.int64)
    rmask = rows[:, None] < M
    amax = tl.zeros((ROWS,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        c = k0 + tl.arange(0, BLOCK_K)[None, :]
        xf = _sanitize(tl.load(x_ptr + r * stride_x + c, mask=rmask & (c < K), other=0.0).to(tl.float32), fmax)
        amax = tl.maximum(amax, tl.max(tl.abs(xf), axis=1))
    scale = _int4_scale(amax)
    for k0 in range(0, K, BLOCK_K):
        c = k0 + tl.arange(0, BLOCK_K)[None, :]
        mask = rmask & (c < K)
        xf = _sanitize(tl.load(x_ptr + r * stride_x + c, mask=mask, other=0.0).to(tl.float32), fmax)
        _store_int4_codes(xf, scale, q_ptr + r * stride_q + c, mask, EVEN_ODD, INTERPRET)
    tl.store(s_ptr + rows, scale, mask=rows < M)


# Where the chunked act-quant kernel replaces the whole-row one: many tokens of rows that pad to
# 32768. Measured on the H200 (bf16, even_odd, x rotated past the L2): at 1024 x 28672 the whole-row
# kernel takes 51-53 us, the chunked one 51.5 with divisions; at 4096 x 28672 185 against 169.
# Shorter rows are faster whole, once the divisions are gone (4096 x 11008: 62 against 80 us).
CHUNKED_MIN_M = 512
CHUNKED_MIN_K = 16385
CHUNK_K = 4096
# The activation quantization and the Hopper product after it launch early (early_launch.py) up to
# this many tokens, beyond the other kernels' MAX_TOKENS: the quantization lets the product launch
# at once, whose producer then copies its first stages' weights while the quantization runs. H200,
# same process, 64 -> 128 (benchmarks/results/w4a4-early-launch-128-ab-h200.json): the op at M = 128
# 18.35 -> 17.03 us on 12288 x 4096, 28.1 -> 26.8 on 4096 x 14336; Llama-2-7B W4A4 prefill 1 x 128
# 3.455 -> 3.414 ms, 1 x 512 and 8 x 128 unchanged (their products are over 128 tokens).
PRODUCT_EARLY_TOKENS = 128


if triton is not None:
    hadamard_load_rows = _had.hadamard_load_rows  # a @triton.jit helper, fused into _act_quant_kernel


@functools.cache
def _act_plan(K: int, hadamard: bool):
    """(ROWS, BLOCK, num_warps, had_consts or None) for rows of length K."""
    if hadamard:
        plan = _had.hadamard_plan(K)  # callers check `_had.kernel_fits(K)` first
        return plan.rows, plan.row_pad, plan.num_warps, plan
    block = next_pow2(K)  # over _MAX_ROW: the chunked kernel runs it
    rows = max(1, 4096 // block)
    # up to 64 elements per thread (H200, many rows of 11008: 8 warps 62 us, 16 warps 66)
    num_warps = max(4, min(16, rows * block // 2048))
    return rows, block, num_warps, None


def _check_act_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K] (flatten leading dims first), got shape {tuple(x.shape)}")
    if x.dtype not in KERNEL_DTYPES:
        raise TypeError(f"the W4A4 kernels take float16 or bfloat16 activations, got {x.dtype}")


ORDERS = ("natural", "even_odd")


def check_order(order: str, K: int) -> None:
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if order == "even_odd" and K % 32:
        raise ValueError(f"the even_odd order permutes 32-column blocks: K={K} must be a multiple of 32")


def to_even_odd(q: torch.Tensor) -> torch.Tensor:
    """Codes [M, K] in natural order -> the "even_odd" order of `w4a4_wgmma` (each 32-column block
    as its 16 even columns, then its 16 odd ones); what the act-quant kernel writes with that order."""
    M, K = q.shape
    check_order("even_odd", K)
    return q.reshape(M, K // 32, 16, 2).transpose(-1, -2).reshape(M, K)


def quantize_activations_triton(x: torch.Tensor, input_hadamard: bool = False,
                                order: str = "natural") -> tuple[torch.Tensor, torch.Tensor]:
    """The act-quant kernel: x [M, K] fp16/bf16 -> (q int8 [M, K], scale float32 [M]); q in
    `order` ("natural", or "even_odd" for `w4a4_wgmma`)."""
    _check_act_input(x)
    check_order(order, x.shape[1])
    if triton is None:
        raise triton_unavailable("W4A4")
    check_triton_device(x, "W4A4")
    M, K = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if input_hadamard and not _had.kernel_fits(K):
        # A size the reference rotates but the fused kernel cannot hold in one program (a dense
        # factor over 256, or a row over 32768; hadamard.MAX_KERNEL_ROW names the real ones): the
        # reference's rotation (float32 sums, a non-finite token zeroed, rounded once to x.dtype),
        # then the plain kernel; the codes are the reference's.
        _had.warn_past_kernel(K)
        return quantize_activations_triton(reference.rotate_activations(x), False, order)
    rows, block, num_warps, plan = _act_plan(K, bool(input_hadamard))
    q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    s = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        s.zero_()
        return q, s
    if plan is not None and _had.dense_slice_width(plan, cdiv(M, rows)) < plan.dense_pad:
        # A few rows with a dense Hadamard factor: fused, each row would be one program on one SM
        # (39 us for a row of 11008 on an H200). The row-splitting transform spreads it, then the
        # plain kernel quantizes its output as the fused one would (ROTATED): the fused kernel rounds
        # the rotation to x.dtype before quantizing too, so the codes are the same.
        x = _had.hadamard_transform_triton(x)
        rows, block, num_warps, plan = _act_plan(K, False)
    fmax = float(torch.finfo(x.dtype).max)
    if not input_hadamard and (block > _MAX_ROW or M >= CHUNKED_MIN_M and K >= CHUNKED_MIN_K):
        # (plain rows only: the chunked kernel knows nothing of a rotation's non-finite tokens)
        _act_quant_chunked_kernel[(M,)](x, q, s, M, K, x.stride(0), q.stride(0), fmax, ROWS=1,
                                        BLOCK_K=min(CHUNK_K, next_pow2(K)), EVEN_ODD=order == "even_odd",
                                        INTERPRET=interpreting(), num_warps=8)
        return q, s
    if plan is not None:
        dense = _had.hadamard_dense_operand(K, False, x.device) if plan.dense_pad > 1 else s
        terms_in, terms = _had.hadamard_dot_terms(x.dtype)
        consts = dict(DENSE_PAD=plan.dense_pad, DENSE_CHUNK=plan.dense_chunk, HA=plan.a, HB=plan.b,
                      TERMS_IN=terms_in, TERMS=terms)
        had_scale = 1.0 / math.sqrt(K)
    else:
        dense, consts, had_scale = s, dict(DENSE_PAD=1, DENSE_CHUNK=1, HA=1, HB=1, TERMS_IN=1, TERMS=1), 1.0
    grid = (cdiv(M, rows),)
    if plan is None and x.is_cuda and grid[0] < num_sms(x.device):
        # Fewer programs than SMs (decode): each row's latency is the kernel's, so spread it over
        # more threads, 8 elements each (H200, M = 1: K = 4096 2.42 -> 1.67 us at 16 warps instead
        # of 4, K = 11008 5.70 -> 4.97 and K = 28672 8.14 -> 7.50 at 32 instead of 16).
        num_warps = min(32, max(num_warps, rows * block // 256))
    pdl = not interpreting() and early_launch(x.device, M, PRODUCT_EARLY_TOKENS)
    _act_quant_kernel[grid](x, q, s, dense, M, K, x.stride(0), q.stride(0), had_scale, fmax,
                            ROWS=rows, BLOCK=block, HADAMARD=plan is not None, ROTATED=bool(input_hadamard),
                            EVEN_ODD=order == "even_odd",
                            INTERPRET=interpreting(), num_warps=num_warps, PDL=pdl, launch_pdl=pdl, **consts)
    return q, s


# ----------------------------------------------------------------------------------------------
# CUDA C++ rotate + quantize for a few rows (csrc/rotate_quantize.cu): the online Hadamard and the
# quantization in one launch, each row a thread-block cluster, the dense factor on the tensor cores
# ----------------------------------------------------------------------------------------------
_ROTATE_QUANTIZE_SIGNATURES = cuda_build.signatures(
    "nibble_rotate_quantize", [ctypes.c_int, ctypes.c_void_p] + [ctypes.c_int] * 2 + [ctypes.c_void_p, ctypes.c_int]
    + [ctypes.c_void_p] * 2 + [ctypes.c_int] * 2 + [ctypes.c_float] * 2 + [ctypes.c_int] * 3 + [ctypes.c_void_p],
    "nibble_rotate_quantize_error_string")
# Where `rotate_quantize` runs instead of the Triton path: up to 16 rows (decode sizes), and at most
# 192 CTAs a launch (rows x CTAs a row). H200 (benchmarks/results/rotate-quantize-cluster-ab-h200.json):
# faster at every size and 1-16 rows below that (11008 at M = 1 8.1 -> 6.4 us, 14336 10.3 -> 6.9,
# 28672 18.6 -> 8.9) but at 16 rows of 14 CTAs (224: 14336 10.9 -> 15.2 us, 28672 20.4 -> 20.1).
ROTATE_QUANTIZE_MAX_M = 16
ROTATE_QUANTIZE_MAX_CTAS = 192


def _rotate_quantize_lib(device):
    """The compiled kernel for this device, or None (see ``cuda_build.library``)."""
    return cuda_build.library("rotate_quantize", device, _ROTATE_QUANTIZE_SIGNATURES)


@functools.cache
def rotate_quantize_plan(K: int) -> tuple[int, int, int] | None:
    """(m, s, log2 p) with K = m * s * p where the kernel takes K, or None. With H_K = H_m (x) H_{2^k}
    (`hadamard.hadamard_factors`) and H_{2^k} = H_s (x) H_p (Sylvester's, natural index order), the
    row is viewed as [m s, p]: the dense factor H_m (x) H_s on the tensor cores, then butterflies over
    p. p is 64, or 128 where m * 2^k / 64 rows would pass 256 (a row is a cluster of at most 16 CTAs
    of 16 rows), or 2^k itself when smaller (at least 8: ldmatrix reads 8-column rows). Rows of p >
    128 were slower than the Triton path: 14336 = 28 x 512 as two CTAs of 16 x 512, 15.3 against 10.3
    us for one row (H200), so a CTA keeps 16 short rows. Sizes: 11008 = 172 x 64; 14336 = (28 x 8) x 64;
    18944 = 148 x 128; 28672 = (28 x 8) x 128; 4096 = 64 x 64; 1536 = (12 x 2) x 64; 576 = 36 x 16."""
    try:
        m, p2k = _had.hadamard_factors(K)
    except ValueError:
        return None
    p = min(p2k, 64 if m * p2k // 64 <= 256 else 128)
    s = p2k // p
    return (m, s, p.bit_length() - 1) if 8 <= p and m * s <= 256 else None


def rotate_quantize_smem(rows: int, log2p: int) -> int:
    """Shared memory of one CTA for a row viewed as [rows, 2^log2p] (csrc/rotate_quantize.cu: smem_bytes)."""
    p, padded = 1 << log2p, cdiv(rows, 16) * 16
    return padded * (p + 8) * 2 + 16 * (p + 4) * 4 + 9 * 4


@functools.cache
def _dense_factor(m: int, s: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """H_m (x) H_s (+-1, unnormalised) in the activations' type, zero padded to a multiple of 16: the
    A operand of the kernel's dense stage."""
    rows = m * s
    padded = cdiv(rows, 16) * 16
    h = torch.zeros(padded, padded, dtype=torch.float64)
    h[:rows, :rows] = torch.kron(_had._base_matrix(m), _had._sylvester(s))
    return h.to(device=device, dtype=dtype)


def _rotate_quantize_runs(x: torch.Tensor) -> bool:
    """Whether the kernel runs for rows like x's: CUDA float16/bfloat16 on sm_90+ (thread-block
    clusters), a row size it takes (`rotate_quantize_plan`) within the shared memory, the kernel built,
    and the GPU able to hold a row's cluster."""
    if not (x.is_cuda and x.dim() == 2 and x.dtype in KERNEL_DTYPES):
        return False
    return _rotate_quantize_runs_on(x.device, x.shape[1])


@functools.cache
def _rotate_quantize_runs_on(device: torch.device, K: int) -> bool:
    """`_rotate_quantize_runs` for rows of K on ``device``: fixed for the process, so worked out once
    (the dispatch asks, then `rotate_quantize` asks again, at every decode step)."""
    plan = rotate_quantize_plan(K)
    if plan is None or cuda_build.capability(device) < (9, 0):
        return False
    m, s, log2p = plan
    limit = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 48 << 10)
    if rotate_quantize_smem(m * s, log2p) > limit - 1024:
        return False
    lib = _rotate_quantize_lib(device)
    if lib is None:
        return False
    n = ctypes.c_int(0)
    with torch.cuda.device(device):
        err = lib.nibble_rotate_quantize_clusters(m * s, log2p, ctypes.byref(n))
    if err:
        warnings.warn(f"nibble: cannot size rotate_quantize's clusters of {cdiv(m * s, 16)} CTAs on this GPU "
                      f"({lib.nibble_rotate_quantize_error_string(err).decode()}); using the Triton kernels "
                      f"for K={K}")
    return not err and n.value > 0


def rotate_quantize_applicable(x: torch.Tensor) -> bool:
    """Whether `quantize_activations_gpu` takes `rotate_quantize` for x: the kernel runs for its rows,
    1 <= M <= ROTATE_QUANTIZE_MAX_M, and the launch has at most ROTATE_QUANTIZE_MAX_CTAS CTAs."""
    if not (_rotate_quantize_runs(x) and 1 <= x.shape[0] <= ROTATE_QUANTIZE_MAX_M):
        return False
    m, s, _ = rotate_quantize_plan(x.shape[1])
    return x.shape[0] * cdiv(m * s, 16) <= ROTATE_QUANTIZE_MAX_CTAS


def rotate_quantize_successor(M: int, product_warps: int) -> bool:
    """Whether `rotate_quantize` over M rows lets the next kernel, the product (`w4a4_mma`, CTAs of
    ``product_warps`` warps), launch early: up to 4 rows, and above 8 where the product's CTAs have
    more than 4 warps. H200 (benchmarks/results/rotate-quantize-successor-ab-h200.json), W4A4 +
    Hadamard decode (the down_proj's rotation), ms a step, letting it / not: batch 8 Llama-2-7B 2.561
    / 2.523, Llama-3-8B 2.657 / 2.591, Qwen2-7B-shaped 2.571 / 2.441; batch 1 1.987 / 2.001, 2.236 /
    2.249, 2.160 / 2.183; batch 16 Llama-2-7B 2.957 / 2.990, Qwen2 2.742 / 2.757. The op alone agrees (8 rows
    of 11008 / 14336 / 18944 before a 4096 / 4096 / 3584-wide product: 1.3 / 2.4 / 5.2 us faster
    without), and at 16 rows before the 4-warp CTAs of 11008 / 12288 / 14336 / 18944-wide products
    (4096 / 3584 deep) it cost 7.5 / 7.7 / 5.6 / 2.6 us; before 8- and 16-warp CTAs it gained 0.6-1.3."""
    return M <= 4 or (M > 8 and product_warps > 4)


def rotate_quantize(x: torch.Tensor, order: str = "natural",
                    product_warps: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA rotate + quantize kernel: x [M, K] -> (q int8 [M, K], scale float32 [M]) of x @ H_K.T
    (H_K orthonormal), as `quantize_activations(x, input_hadamard=True)`; call where
    `rotate_quantize_applicable(x)`. Codes match the float32 spec up to rare +-1 flips where a rotated
    value rounds the other way (the dense factor's sums run in tensor-core float32; it goes before
    the butterflies, so a row whose rotation overflows float32 saturates in another pattern).
    product_warps: the warps of the next kernel's CTAs, where it is `w4a4_mma`
    (`rotate_quantize_successor`; None: taken as the most it runs)."""
    _check_act_input(x)
    check_order(order, x.shape[1])
    M, K = x.shape
    if not _rotate_quantize_runs(x):
        raise ValueError(f"rotate_quantize needs a CUDA tensor on an sm_90+ GPU that holds a row's thread-block "
                         f"cluster, the kernel built (nvcc) and a row size it takes (rotate_quantize_plan: K = m s p, "
                         f"p >= 8, m s <= 256); got {x.device}, K={K}; quantize_activations(x, input_hadamard=True) "
                         f"runs on any device")
    m, sylvester, log2p = rotate_quantize_plan(K)
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:  # rows are read as 16-byte pieces
        x = x.clone(memory_format=torch.contiguous_format)
    q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    s = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M == 0:
        return q, s
    lets_product_launch = rotate_quantize_successor(M, MMA_MAX_CTA_WARPS if product_warps is None else product_warps)
    lib = _rotate_quantize_lib(x.device)
    err = cuda_build.launch(
        lib.nibble_rotate_quantize, x.device, int(x.dtype == torch.bfloat16), x.data_ptr(), M, x.stride(0),
        q.data_ptr(), q.stride(0), s.data_ptr(), _dense_factor(m, sylvester, x.dtype, x.device).data_ptr(),
        m * sylvester, log2p, 1.0 / math.sqrt(K), float(torch.finfo(x.dtype).max), int(order == "even_odd"),
        int(early_launch(x.device, M, PRODUCT_EARLY_TOKENS)), int(lets_product_launch))
    if err:
        message = lib.nibble_rotate_quantize_error_string(err).decode()
        raise RuntimeError(f"rotate_quantize launch failed: {message} (K={K})")
    return q, s


def quantize_activations_gpu(x: torch.Tensor, input_hadamard: bool = False, order: str = "natural",
                             product_warps: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The act-quant kernel for x on the GPU: `rotate_quantize` for the online Hadamard where it
    applies (product_warps: see there), else the Triton kernel (`quantize_activations_triton`)."""
    if input_hadamard and rotate_quantize_applicable(x):
        return rotate_quantize(x, order, product_warps)
    return quantize_activations_triton(x, input_hadamard, order)


def quantize_activations(x: torch.Tensor, input_hadamard: bool = False,
                         order: str = "natural") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric INT4 activations (optionally after the online Hadamard rotation).

    x: [M, K] float16/bfloat16 -> (q int8 [M, K] in [-8, 7], scale float32 [M]); the GPU kernels
    (`quantize_activations_gpu`) on CUDA, `reference.quantize_activations` elsewhere. order: see
    `quantize_activations_triton`.
    """
    if kernels_available(x) and x.dtype in KERNEL_DTYPES:
        return quantize_activations_gpu(x, input_hadamard, order)
    check_order(order, x.shape[-1])
    q, s = (reference.rotate_quantize_activations if input_hadamard else reference.quantize_activations)(x)
    return (to_even_odd(q) if order == "even_odd" else q), s


# ================================================================================================
# Shared epilogue: [split-K reduction] -> y = acc * (sx[m] * sw[n]) (+ bias[n])
# ================================================================================================

@_jit
def _store_out(acc, rm, rn, M, N, xs_ptr, ws_ptr, b_ptr, y_ptr, stride_ym,
               HAS_BIAS: tl.constexpr, OUT_INT: tl.constexpr):
    mask = (rm < M) & (rn < N)
    yp = y_ptr + rm.to(tl.int64) * stride_ym + rn
    if OUT_INT:
        tl.store(yp, acc, mask=mask)
    else:
        sx = tl.load(xs_ptr + rm, mask=rm < M, other=0.0)
        sw = tl.load(ws_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        y = acc.to(tl.float32) * (sx * sw)  # scales first, as the reference: acc * sx alone can overflow
        if HAS_BIAS:
            y = y + tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        # A token that held +-Inf has a huge scale: saturate to the output type's largest finite
        # value (as the reference does) instead of overflowing to Inf on the conversion.
        if y_ptr.dtype.element_ty == tl.float16:
            ymax = 65504.0
        elif y_ptr.dtype.element_ty == tl.bfloat16:
            ymax = 3.3895313892515355e38
        else:
            ymax = 3.4028234663852886e38
        y = tl.minimum(tl.maximum(y, -ymax), ymax)
        tl.store(yp, y.to(y_ptr.dtype.element_ty), mask=mask)


@_jit
def _finish(acc, rm, rn, M, N, xs_ptr, ws_ptr, b_ptr, y_ptr, stride_ym, part_ptr, cnt_ptr, tile_id, pid_k,
            split_k, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_INT: tl.constexpr):
    """acc: int32 tile, rm [R, 1] token rows, rn [1, C] output columns (or any broadcastable pair)."""
    if SPLIT:
        # Each split stores its int32 partial; the last program to arrive on this tile sums them
        # (integer addition: exact and order-independent) and runs the epilogue.
        mask = (rm < M) & (rn < N)
        tl.store(part_ptr + (pid_k * M + rm).to(tl.int64) * N + rn, acc, mask=mask)
        tl.debug_barrier()
        old = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel")
        if old == split_k - 1:
            tl.store(cnt_ptr + tile_id, 0)  # zero again for the next call (launch.split_counters)
            tot = tl.zeros_like(acc)
            for s in range(0, split_k):
                tot += tl.load(part_ptr + (s * M + rm).to(tl.int64) * N + rn, mask=mask, other=0,
                               cache_modifier=".cg")
            _store_out(tot, rm, rn, M, N, xs_ptr, ws_ptr, b_ptr, y_ptr, stride_ym, HAS_BIAS, OUT_INT)
    else:
        _store_out(acc, rm, rn, M, N, xs_ptr, ws_ptr, b_ptr, y_ptr, stride_ym, HAS_BIAS, OUT_INT)


# ================================================================================================
# Tensor-core GEMM (int8 x int8 -> int32)
# ================================================================================================

@_jit
def _unpack_rows(words):
    """int32 words [R, C] -> int8 [R * 8, C]: row 8 r + j = signed (q - 8) of nibble j of words[r]."""
    R: tl.constexpr = words.shape[0]
    C: tl.constexpr = words.shape[1]
    shl = 28 - 4 * tl.arange(0, 8)
    v = ((words ^ _XOR_SIGN)[:, None, :] << shl[None, :, None]) >> 28
    return tl.reshape(v.to(tl.int8), (R * 8, C))


@_jit
def _unpack_rows_asm(words):
    """As `_unpack_rows`, eight int8 results (two registers) from one word in nine instructions (PTX).

    Needs the eight values of each word consecutive in a thread's registers, which the [R, 8, C]
    broadcast gives; tests check the result bit-exactly against the reference.
    """
    R: tl.constexpr = words.shape[0]
    C: tl.constexpr = words.shape[1]
    wb = tl.broadcast_to(words[:, None, :], (R, 8, C))
    # A second operand that varies along the 8 axis keeps the compiler from hoisting the asm
    # above the broadcast (it is elementwise, so it would run on [R, 1, C] and pack across words).
    jj = tl.broadcast_to(tl.arange(0, 8)[None, :, None], (R, 8, C))
    # lo / hi: codes of nibbles 0,2,4,6 / 1,3,5,7 in bytes 0..3; c - 8 as a signed byte is
    # (c + 0x78) ^ 0x80 (no carry crosses a byte since c <= 15); prmt interleaves them back
    # into k order: bytes (n0, n1, n2, n3) and (n4, n5, n6, n7).
    v = tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 lo, hi;
        and.b32 lo, $2, 0x0F0F0F0F;
        shr.u32 hi, $2, 4;
        and.b32 hi, hi, 0x0F0F0F0F;
        add.u32 lo, lo, 0x78787878;
        add.u32 hi, hi, 0x78787878;
        xor.b32 lo, lo, 0x80808080;
        xor.b32 hi, hi, 0x80808080;
        prmt.b32 $0, lo, hi, 0x5140;
        prmt.b32 $1, lo, hi, 0x7362;
        }""",
        constraints="=r,=r" + ",r" * 16, args=[wb, jj], dtype=tl.int8, is_pure=True, pack=8)
    return tl.reshape(v, (R * 8, C))


@_jit(do_not_specialize=["M", "split_k"])
def _w4a4_mma_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr,
                     M, N, K, stride_xm, stride_ym, k_per_split, split_k,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                     EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, SPLIT: tl.constexpr,
                     HAS_BIAS: tl.constexpr, OUT_INT: tl.constexpr, UNPACK_ASM: tl.constexpr = False):
    """acc[m, n] = sum_k x[m, k] * (q[k, n] - 8) over this program's K range.

    x: int8 [M, K] (row stride stride_xm, K contiguous). w: packed int32 [K // 8, N].
    """
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    # Grouped ordering: GROUP_M token tiles share each weight tile while it is in L2.
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    gm = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % gm
    pid_n = (pid % group) // gm

    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_kk = tl.arange(0, BK)
    offs_kw = tl.arange(0, BK // 8)
    m_ok = offs_m < M
    # Clamp out-of-range token rows to valid addresses (results are masked at the store), so the
    # hot loop needs no masks when K and N divide evenly. (Packed-weight columns are masked, not
    # clamped: clamping would hide their contiguity from the compiler and cost the 16-byte loads.)
    xm = tl.where(m_ok, offs_m, 0).to(tl.int64)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)

    acc = tl.zeros((BM, BN), dtype=tl.int32)
    for k0 in range(k_begin, k_end, BK):
        if EVEN_K:
            xt = tl.load(x_ptr + xm[:, None] * stride_xm + (k0 + offs_kk)[None, :])
        else:
            xt = tl.load(x_ptr + xm[:, None] * stride_xm + (k0 + offs_kk)[None, :],
                         mask=(k0 + offs_kk)[None, :] < k_end, other=0)
        kw = k0 // 8 + offs_kw
        wp = w_ptr + kw[:, None].to(tl.int64) * N + offs_n[None, :]  # [BK/8, BN]
        if EVEN_K and EVEN_N:
            words = tl.load(wp)
        else:
            words = tl.load(wp, mask=(kw[:, None] < k_end // 8) & (offs_n[None, :] < N), other=0)
        if UNPACK_ASM:
            wt = _unpack_rows_asm(words)  # [BK, BN]
        else:
            wt = _unpack_rows(words)
        acc = tl.dot(xt, wt, acc, out_dtype=tl.int32)
    tile_id = pid_m * num_n + pid_n
    _finish(acc, offs_m[:, None], offs_n[None, :], M, N, xs_ptr, ws_ptr, b_ptr, y_ptr, stride_ym,
            part_ptr, cnt_ptr, tile_id, pid_k, split_k, SPLIT, HAS_BIAS, OUT_INT)


# ================================================================================================
# Decode GEMV (CUDA cores, dp4a)
# ================================================================================================

@_jit
def _dp4a(a, b, c, USE_ASM: tl.constexpr):
    """c + sum_j a.byte[j] (unsigned) * b.byte[j] (signed), elementwise on int32 (broadcasting)."""
    if USE_ASM:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        s = c
        for j in tl.static_range(4):
            s += ((a >> (8 * j)) & 0xFF) * ((b << (24 - 8 * j)) >> 24)
        return s


@_jit(do_not_specialize=["M", "split_k"])
def _w4a4_gemv_kernel(xw_ptr, w_ptr, xs_ptr, ws_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr,
                      M, N, KW, stride_ym, kw_per_split, split_k,
                      BN: tl.constexpr, BKW: tl.constexpr, SPLIT: tl.constexpr,
                      HAS_BIAS: tl.constexpr, OUT_INT: tl.constexpr, USE_ASM: tl.constexpr):
    """One token (M = 1). xw: the int8 activations [1, K] viewed as int32 [1, K // 4]; w: packed int32
    [KW = K // 8, N].

    Word row i of the weight holds k = 8 i .. 8 i + 7; its low nibbles (k even) are dotted with the
    even activation bytes, its high nibbles with the odd ones. 2-D tiles, so the weight load keeps its
    coalesced 16-byte-per-thread layout.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    offs_m = tl.arange(0, 1)
    i_begin = pid_k * kw_per_split
    i_end = tl.minimum(i_begin + kw_per_split, KW)
    ones = tl.full((1, 1), 0x01010101, tl.int32)
    acc = tl.zeros((BKW, BN), dtype=tl.int32)
    xsum = tl.zeros((BKW, 1), dtype=tl.int32)
    for i0 in range(i_begin, i_end, BKW):
        offs_i = i0 + tl.arange(0, BKW)
        i_ok = offs_i < i_end
        w = tl.load(w_ptr + offs_i[:, None].to(tl.int64) * N + offs_n[None, :],
                    mask=i_ok[:, None] & n_ok[None, :], other=0)
        lo = w & _LOW_NIBBLES           # codes of k = 8i + 0, 2, 4, 6 (bytes 0..3)
        hi = (w >> 4) & _LOW_NIBBLES    # codes of k = 8i + 1, 3, 5, 7
        xp = xw_ptr + 2 * offs_i[:, None]
        a0 = tl.load(xp, mask=i_ok[:, None], other=0)      # bytes x[8i .. 8i+3]
        a1 = tl.load(xp + 1, mask=i_ok[:, None], other=0)  # bytes x[8i+4 .. 8i+7]
        xe = (a0 & 0xFF) | ((a0 >> 8) & 0xFF00) | ((a1 & 0xFF) << 16) | ((a1 & 0xFF0000) << 8)
        xo = ((a0 >> 8) & 0xFF) | ((a0 >> 16) & 0xFF00) | ((a1 << 8) & 0xFF0000) | (a1 & -16777216)
        acc = _dp4a(lo, xe, acc, USE_ASM)
        acc = _dp4a(hi, xo, acc, USE_ASM)
        xsum = _dp4a(ones, a0, xsum, USE_ASM)
        xsum = _dp4a(ones, a1, xsum, USE_ASM)
    # the token's partial as the [1, BN] tile `_finish` takes
    part = tl.sum(acc[None, :, :], axis=1) - 8 * tl.sum(tl.reshape(xsum, (1, BKW)), axis=1)[:, None]
    _finish(part, offs_m[:, None], offs_n[None, :], M, N, xs_ptr, ws_ptr, b_ptr, y_ptr, stride_ym,
            part_ptr, cnt_ptr, pid_n, pid_k, split_k, SPLIT, HAS_BIAS, OUT_INT)


# ================================================================================================
# Host side: configuration and launch
# ================================================================================================

def _mma(BM, BN, BK, warps, stages, group=8):
    return dict(kind="mma", BM=BM, BN=BN, BK=BK, GROUP_M=group, num_warps=warps, num_stages=stages)


def _gemv(BN, BKW):
    return dict(kind="gemv", BN=BN, BKW=BKW, num_warps=4)


# Candidate configurations per token bucket (M == 1, <= 16, <= 128, <= 1024, larger); the first
# is the default. wgmma needs 64 token rows, so small M pads the token tile (clamped loads, masked
# stores) and every weight word is read and unpacked once. 4-warp 128x128 tiles leave room for two
# programs per SM, which overlaps one program's unpacking with the other's (synchronous) int8 wgmma.
CANDIDATES = {
    1: [_gemv(256, 16), _gemv(128, 16), _mma(64, 128, 128, 4, 4, 1)],
    16: [_mma(64, 128, 128, 4, 4, 1), _mma(64, 256, 128, 8, 3, 1)],
    128: [_mma(128, 128, 128, 4, 3), _mma(64, 128, 128, 4, 4), _mma(128, 256, 128, 8, 3)],
    1024: [_mma(128, 128, 128, 4, 3), _mma(128, 256, 128, 8, 3)],
    4096: [_mma(128, 128, 128, 4, 3), _mma(128, 256, 128, 8, 3)],
}
# The PTX unpack (`_unpack_rows_asm`) assumes the compiler gives each thread the eight values of a
# word in consecutive registers. For every config above the generated LLVM IR was checked to pass
# one word and j = 0..7 to each asm call (tests/kernels/test_w4a4.py::test_asm_unpack_layout); two
# earlier candidates (64x64x256 and 256x128x128/8 warps) got another layout and were dropped. A new
# config must pass that check, or run with "asm": False (the plain shift unpack, ~30% more ALU):
# any other config gets the plain unpack unless it asks for the asm one (a 64x64x64 / 4-warp tile
# with the asm unpack gave wrong products on the H200).
# (bucket, N, K) -> index into CANDIDATES[bucket], measured on an H200 by
# `python -m nibble.bench.w4a4 --tune` (benchmarks/results/w4a4-h200.json, "tuned").
TUNED: dict = {
    **{(1, n, k): 1 for n, k in ((4096, 4096), (12288, 4096), (11008, 4096), (4096, 11008), (14336, 4096),
                                  (4096, 14336), (28672, 8192), (8192, 28672))},
    **{(128, n, k): 1 for n, k in ((4096, 4096), (12288, 4096), (11008, 4096), (4096, 11008), (14336, 4096),
                                    (4096, 14336), (8192, 28672))},
}  # every other (bucket, N, K) measured: the default (index 0) was fastest


def _tile_key(cfg: dict) -> tuple:
    return cfg["BM"], cfg["BN"], cfg["BK"], cfg.get("num_warps", 4), cfg.get("num_stages", 3)


_ASM_CHECKED_TILES = frozenset(_tile_key(c) for b in CANDIDATES.values() for c in b if c["kind"] == "mma")


def _asm_unpack_checked(cfg: dict) -> bool:
    """Whether ``cfg``'s tile is one whose asm unpack layout the tests check (a shipped candidate)."""
    return _tile_key(cfg) in _ASM_CHECKED_TILES


def m_bucket(M: int) -> int:
    return 1 if M <= 1 else 16 if M <= 16 else 128 if M <= 128 else 1024 if M <= 1024 else 4096


def _split_for(tiles: int, iters: int, sms: int, waves: float, min_iters: int) -> int:
    """Split-K factor so that tiles * split ~ waves * sms programs, each with >= min_iters K steps."""
    want = max(1, math.ceil(waves * sms / max(1, tiles)))
    return int(max(1, min(want, iters // max(1, min_iters))))


def auto_split(cfg: dict, M: int, N: int, K: int, sms: int = 132) -> int:
    """Split K when the output tiles alone cannot keep every SM streaming."""
    if cfg["kind"] == "gemv":
        return _split_for(cdiv(N, cfg["BN"]), cdiv(K // PACK, cfg["BKW"]), sms, 4.0, 4)
    tiles = cdiv(M, cfg["BM"]) * cdiv(N, cfg["BN"])
    waves, min_iters = (2.0, 4) if M <= 64 else (1.0, 8)
    return _split_for(tiles, cdiv(K, cfg["BK"]), sms, waves, min_iters) if tiles < waves * sms else 1


def pick_config(M: int, N: int, K: int, sms: int = 132) -> dict:
    """The kernel and tile shape for an [M, K] x [K, N] W4A4 product: the tuned candidate for this
    (bucket, N, K) if there is one, else the bucket's default; split-K from `auto_split`."""
    b = m_bucket(M)
    cfg = dict(CANDIDATES[b][TUNED.get((b, N, K), 0)])
    cfg["split_k"] = auto_split(cfg, M, N, K, sms)
    return cfg


def _check_weight_operands(activations: dict, qweight, w_scale, bias) -> None:
    """One layer's weight operands against the activations ({name: tensor}, the [M, K] one first): the canonical
    packed qweight of K rows, a per-channel w_scale, a [N] bias, all on the activations' device. The op and the
    products check a layer with this, so the weight contract is written once."""
    x_name, x = next(iter(activations.items()))
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError(f"qweight must be the canonical packed int32 [K // 8, N], got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    K = x.shape[1]
    if K % PACK:
        raise ValueError(f"K={K} must be a multiple of {PACK} (eight 4-bit codes per int32 word)")
    if qweight.shape[0] * PACK != K:
        raise ValueError(f"qweight {tuple(qweight.shape)} packs K={qweight.shape[0] * PACK} rows but {x_name} has "
                         f"K={K}")
    N = qweight.shape[1]
    if w_scale.shape != (N,) or w_scale.dtype not in W_SCALE_DTYPES:
        raise ValueError(f"w_scale must be a per-channel [{N}] float16/bfloat16/float32 tensor (the W4A4 "
                         f"weight scale, scales[0] of a symmetric per-channel Int4Weight); got "
                         f"{w_scale.dtype} {tuple(w_scale.shape)}")
    check_bias(bias, N)
    devs = {t.device for t in (*activations.values(), qweight, w_scale) + (() if bias is None else (bias,))}
    if len(devs) != 1:
        raise ValueError(f"{', '.join(activations)}, qweight, w_scale and bias must be on one device, got "
                         f"{sorted(map(str, devs))}")


def _check_matmul_inputs(qx, x_scale, qweight, w_scale, bias):
    for name, t in (("qx", qx), ("x_scale", x_scale), ("qweight", qweight), ("w_scale", w_scale)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if qx.dim() != 2 or qx.dtype != torch.int8:
        raise ValueError(f"qx must be int8 [M, K], got {qx.dtype} {tuple(qx.shape)}")
    M = qx.shape[0]
    if x_scale.shape != (M,) or x_scale.dtype != torch.float32:
        raise ValueError(f"x_scale must be float32 [{M}], got {x_scale.dtype} {tuple(x_scale.shape)}")
    _check_weight_operands(dict(qx=qx, x_scale=x_scale), qweight, w_scale, bias)


def w4a4_matmul_triton(qx: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor,
                       bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16, *,
                       out_int32: bool = False, config: Optional[dict] = None) -> torch.Tensor:
    """y = (qx @ (q - 8)) * x_scale[:, None] * w_scale (+ bias) on the GPU; int32 accumulators with out_int32.

    ``config`` overrides `pick_config` (tests and benchmarks).
    """
    if triton is None:
        raise triton_unavailable("W4A4")
    _check_matmul_inputs(qx, x_scale, qweight, w_scale, bias)
    check_triton_device(qx, "W4A4")
    if out_dtype not in KERNEL_DTYPES + (torch.float32,):
        raise TypeError(f"out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    M, K = qx.shape
    N = qweight.shape[1]
    dev = qx.device
    y = torch.empty((M, N), dtype=torch.int32 if out_int32 else out_dtype, device=dev)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_() if bias is None or out_int32 else y.copy_(bias.to(y.dtype).expand(M, N))
    qx = qx if qx.stride(1) == 1 else qx.contiguous()
    qweight = qweight.contiguous()
    w_scale = w_scale.contiguous()
    cfg = dict(config) if config is not None else pick_config(M, N, K, num_sms(dev))
    split = int(cfg["split_k"]) if "split_k" in cfg else auto_split(cfg, M, N, K, num_sms(dev))
    b = bias.contiguous() if bias is not None else w_scale
    common = dict(HAS_BIAS=bias is not None, OUT_INT=out_int32)
    if cfg["kind"] == "gemv":
        if M > 1:
            raise ValueError(f"a gemv config computes one token, got M={M}: pass an mma config (or none)")
        if qx.stride(0) % 4 or qx.storage_offset() % 4:
            qx = qx.contiguous()
        KW = K // PACK
        BKW = cfg["BKW"]
        kw_per = cdiv(KW, split)
        kw_per = cdiv(kw_per, BKW) * BKW
        split = cdiv(KW, kw_per)
        n_tiles = cdiv(N, cfg["BN"])
        part, cnt = _split_buffers(split, M, N, n_tiles, dev)
        xw = qx.view(torch.int32)  # [M, K // 4]
        _w4a4_gemv_kernel[(n_tiles, split)](
            xw, qweight, x_scale, w_scale, b, y, part, cnt, M, N, KW, y.stride(0), kw_per, split,
            BN=cfg["BN"], BKW=BKW, SPLIT=split > 1, USE_ASM=not interpreting(),
            num_warps=cfg.get("num_warps", 4), **common)
        return y
    BM, BN, BK = cfg["BM"], cfg["BN"], cfg["BK"]
    k_per = cdiv(K, split)
    k_per = cdiv(k_per, BK) * BK
    split = cdiv(K, k_per)
    even_k = (K % BK == 0)
    num_m, num_n = cdiv(M, BM), cdiv(N, BN)
    part, cnt = _split_buffers(split, M, N, num_m * num_n, dev)
    _w4a4_mma_kernel[(num_m * num_n, split)](
        qx, qweight, x_scale, w_scale, b, y, part, cnt, M, N, K, qx.stride(0), y.stride(0), k_per, split,
        BM=BM, BN=BN, BK=BK, GROUP_M=cfg.get("GROUP_M", 1), EVEN_K=even_k, EVEN_N=N % BN == 0,
        SPLIT=split > 1,
        UNPACK_ASM=cfg.get("asm", _asm_unpack_checked(cfg)) and not interpreting(),
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3),
        **common)
    return y


def _split_buffers(split: int, M: int, N: int, tiles: int, dev):
    """Split-K's int32 partials and the tile counters (shared, zero between calls: every kernel
    resets its tiles' counters; no memset per call, which would also keep the product from launching
    early)."""
    if split <= 1:
        dummy = torch.empty((1,), dtype=torch.int32, device=dev)
        return dummy, dummy
    part = torch.empty((split * M * N,), dtype=torch.int32, device=dev)
    return part, split_counters(torch.device(dev), tiles)


def w4a4_accumulate_triton(qx: torch.Tensor, qweight: torch.Tensor, config: Optional[dict] = None) -> torch.Tensor:
    """The integer part alone: int32 [M, N] = qx @ (q - 8), from the same kernels (for exactness tests)."""
    M, N = qx.shape[0], qweight.shape[1]
    ones_m = torch.ones(M, dtype=torch.float32, device=qx.device)
    ones_n = torch.ones(N, dtype=torch.float32, device=qx.device)
    return w4a4_matmul_triton(qx, ones_m, qweight, ones_n, None, out_int32=True, config=config)


# ----------------------------------------------------------------------------------------------
# CUDA C++ decode kernel for M <= 16 (csrc/w4a4_mma.cu: the W4A16 kernel's skeleton on int8 MMAs)
# ----------------------------------------------------------------------------------------------
MMA_MAX_M = 16
MMA_MAX_CTA_WARPS = 16  # warps in one CTA of w4a4_mma at most (w4a16.MMA_MAX_WARPS: W4A16's cap per token tiles)
MMA_MAX_WEIGHTS = 3  # layers one launch can serve (MAX_WEIGHTS in csrc/skinny.cuh)
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


_MMA_SIGNATURES = cuda_build.signatures(
    "nibble_w4a4_mma", [ctypes.c_int] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int] * 6 + [ctypes.c_void_p] * 6
    + [ctypes.c_int, ctypes.c_int, ctypes.c_void_p],
    "nibble_w4a4_cuda_error_string")


def _mma_lib(device):
    """The compiled kernel for this device, or None (see ``cuda_build.library``)."""
    return cuda_build.library("w4a4_mma", device, _MMA_SIGNATURES)


def mma_successor(M: int) -> int:
    """When the next kernel may launch after this product (launch.SUCCESSOR_*; csrc/skinny.cuh): at once,
    this launch's CTAs per SM capped, up to 4 tokens; at the end above. H200
    (benchmarks/results/successor-ab-h200.json, alternating rounds): capped at M <= 4, the product back
    to back 8-17% faster on the 4096-wide and 4096-deep layers (4096 x 11008 at M = 1 8.67 -> 7.92 us),
    the 70B layers within 2%, Llama-2-7B / Llama-3-8B W4A4 decode at batch 1 1.006x / 1.010x. Above 4
    tokens W4A16's rule (capped where x misses the L1, which qx always goes through here, else only
    where the CTAs fill the SMs) cost decode at batch 16 3-4% and 28672 x 8192 at M = 16 9%."""
    return SUCCESSOR_CAPPED if M <= 4 else SUCCESSOR_AT_END


def mma_applicable(qx: torch.Tensor, N: int, K: int) -> bool:
    return (qx.is_cuda and 0 < qx.shape[0] <= MMA_MAX_M and N % 32 == 0 and K % 32 == 0 and K > 0
            and cuda_build.capability(qx.device) >= (8, 0) and _mma_lib(qx.device) is not None)


def _aligned_rows(qx: torch.Tensor, row_align: int) -> torch.Tensor:
    """qx with rows at `row_align`-byte boundaries (the kernels copy rows in pieces of that size)."""
    if qx.stride(1) != 1 or qx.stride(0) % row_align or qx.data_ptr() % row_align:
        qx = qx.contiguous()
    return qx


def _layer_operands(x_scale, qweight, w_scale, bias):
    """(x_scale, qweight, w_scale, bias) as the CUDA kernels read them: contiguous, weights at a
    16-byte boundary (they move in 16-byte copies; a view may start at an odd word), bias float32
    where its dtype has no code."""
    qweight, x_scale, w_scale = qweight.contiguous(), x_scale.contiguous(), w_scale.contiguous()
    if qweight.data_ptr() % 16:
        qweight = qweight.clone()
    if bias is not None:
        bias = bias.contiguous()
        if bias.dtype not in _DTYPE_CODES:
            bias = bias.float()
    return x_scale, qweight, w_scale, bias


def _output(qx, N, out_dtype, out_int32):
    return torch.empty((qx.shape[0], N), dtype=torch.int32 if out_int32 else out_dtype, device=qx.device)


def w4a4_mma(qx: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor,
             bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16, *,
             out_int32: bool = False, warps: Optional[int] = None, successor: Optional[int] = None) -> torch.Tensor:
    """`w4a4_matmul_triton`'s product for M <= 16 on the CUDA kernel (int8 tensor cores, exact int32).

    Warps per CTA follow the W4A16 kernel's rule (``w4a16.select_mma_config``) unless ``warps`` is
    given; ``successor``: see `w4a4_mma_many`.
    """
    return w4a4_mma_many(qx, x_scale, [(qweight, w_scale, bias)], out_dtype, out_int32=out_int32, warps=warps,
                         successor=successor)[0]


def _launch_dtypes(layers):
    """The w_scale dtypes and the bias dtypes of (qweight, w_scale, bias) layers, as sets: one launch
    takes one of each (a layer without bias adds none)."""
    return {ws.dtype for _, ws, _ in layers}, {b.dtype for _, _, b in layers if b is not None}


def mma_many_applicable(qx: torch.Tensor, layers) -> bool:
    """Whether `w4a4_mma_many` can run these (qweight, w_scale, bias) layers in one launch."""
    scale_dtypes, bias_dtypes = _launch_dtypes(layers)
    return (len(layers) <= MMA_MAX_WEIGHTS and all(mma_applicable(qx, qw.shape[1], qx.shape[1]) for qw, _, _ in layers)
            and len(scale_dtypes) == 1 and len(bias_dtypes) <= 1)


def mma_config(M: int, widths, K: int, device) -> MmaConfig:
    """The launch config `w4a4_mma_many` runs M tokens of K with weights of ``widths`` columns in (the
    W4A16 kernel's rule: ``w4a16.select_mma_config``)."""
    return select_mma_config(M, sum(widths), K, num_sms(device))


def w4a4_mma_many(qx: torch.Tensor, x_scale: torch.Tensor, layers, out_dtype: torch.dtype = torch.bfloat16, *,
                  out_int32: bool = False, warps: Optional[int] = None,
                  successor: Optional[int] = None) -> list[torch.Tensor]:
    """``[w4a4_mma(qx, x_scale, *layer) for layer in layers]`` in one launch, for up to MMA_MAX_WEIGHTS
    layers (qweight, w_scale, bias) that read the same qx (a block's q/k/v): their w_scales share a
    dtype, and so do the biases they have. ``successor``: when the next kernel may launch
    (launch.SUCCESSOR_*), by default `mma_successor`'s."""
    for layer in layers:
        _check_matmul_inputs(qx, x_scale, *layer)
    M, K = qx.shape
    ns = [qweight.shape[1] for qweight, _, _ in layers]
    lib = _mma_lib(qx.device) if qx.is_cuda else None
    if (lib is None or not 0 < M <= MMA_MAX_M or K % 32 or K == 0 or any(n % 32 for n in ns)
            or not 1 <= len(layers) <= MMA_MAX_WEIGHTS):
        raise ValueError(f"w4a4_mma needs the compiled kernel, 1 <= M <= {MMA_MAX_M}, N and K multiples of 32 and "
                         f"1 to {MMA_MAX_WEIGHTS} layers; got M={M} N={ns} K={K} on {qx.device}")
    if out_dtype not in _DTYPE_CODES:
        raise TypeError(f"out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    operands = [_layer_operands(x_scale, *layer) for layer in layers]
    x_scale = operands[0][0]
    scale_dtypes, bias_dtypes = _launch_dtypes([op[1:] for op in operands])
    if len(scale_dtypes) > 1 or len(bias_dtypes) > 1:
        raise ValueError("the layers of one w4a4_mma_many launch must share the w_scale dtype and the bias dtype")
    cfg = mma_config(M, ns, K, qx.device)
    warps = cfg.warps if warps is None else warps
    if not 1 <= warps <= MMA_MAX_CTA_WARPS:
        raise ValueError(f"warps must be in 1..{MMA_MAX_CTA_WARPS}, got {warps}")
    successor = mma_successor(M) if successor is None else successor
    if successor not in SUCCESSORS:
        raise ValueError(f"successor must be one of launch.SUCCESSOR_* {SUCCESSORS}, got {successor}")
    qx = _aligned_rows(qx, 8)
    ys = [_output(qx, n, out_dtype, out_int32) for n in ns]
    err = cuda_build.launch(
        lib.nibble_w4a4_mma, qx.device, 3 if out_int32 else _DTYPE_CODES[out_dtype], cfg.token_tiles, warps,
        qx.data_ptr(), x_scale.data_ptr(), _DTYPE_CODES[scale_dtypes.pop()],
        _DTYPE_CODES[bias_dtypes.pop()] if bias_dtypes else 0, M, K, qx.stride(0), len(layers),
        *cuda_build.weight_arrays(list(zip(*operands))[1:], ys, ns),  # qweights, w_scales, biases
        int(early_launch(qx.device, M)),
        successor)
    if err:
        raise RuntimeError(f"w4a4_mma launch failed: {lib.nibble_w4a4_cuda_error_string(err).decode()} "
                           f"(M={M} N={ns} K={K} warps={warps})")
    return ys


# ----------------------------------------------------------------------------------------------
# CUDA C++ GEMM for M > 16 on Hopper (csrc/w4a4_wgmma.cu: asynchronous int8 wgmma, sm_90a only)
# ----------------------------------------------------------------------------------------------
# The compiled CTA shapes (tokens, channels) and the config model (`hopper.CostModel`), fitted to
# benchmarks/scripts/w4a4_explore.py on the H200 (session 16, with session 20's 64 x 128 tile added
# and session 21's small models: SmolLM2-135M's, Qwen2-0.5B's and Llama-3.2-1B's layers at M = 64..4096;
# `fit_cost_model.py`: its picks are within 0.1% of the best measured config on average over the 40
# cells of the 8 shapes x M = 64..1024, 3% at worst, and 0.5% over the 84 small-model
# cells, 9% at worst). Per 128-deep stage a 128 x 256 tile costs 17% less per channel than two
# 128 x 128 ones, but more per item: 128 x 128 wins where the output has few tiles, and 64 x 128,
# whose stage takes about as long as 128 x 128's for half the MACs, where it has fewer still (64
# tokens; the 4096 x 4096 o_proj at 128). The 64-token tiles were swept up to 256 tokens only, so
# they are not picked above (unbounded, the previous model took 64 x 256 for the small models' layers
# at 512-4096 tokens, up to 17% slower than 128 x 128). Split-K runs in clusters (hopper.cuh:
# RowShare), ~1 us per split; the H200 holds 66 / 39 / 30 / 17 / 15 clusters of 2 / 3 / 4 / 6 / 8
# CTAs, so the 32 tiles of a 4096-wide layer at 128 tokens take 3 splits, not 4. The split costs
# were fitted when the partials went through global memory; through shared memory (session 24) a
# split costs less (4096 x 11008 at 128 tokens in 3 splits of 128 x 128: 19.6 -> 17.4 us), and on
# the configs timed both ways the model's picks stayed the fastest (benchmarks/notes-w4a4.md).
WGMMA = hopper.WgmmaGemm(
    "w4a4_wgmma",
    cuda_build.signatures("nibble_w4a4_wgmma", [ctypes.c_int] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int] * 6
                          + [ctypes.c_void_p] * 6 + [ctypes.c_int] * 4 + [ctypes.c_void_p],
                          "nibble_w4a4_wgmma_error_string"),
    hopper.CostModel(stage_us={(64, 256): 0.516, (128, 256): 0.59, (128, 128): 0.365, (64, 128): 0.328},
                     item_us={(64, 256): 1.17, (128, 256): 2.96, (128, 128): 1.51, (64, 128): 0.8},
                     split_output_us=1.54, split_us=0.71, max_tokens={(64, 256): 256, (64, 128): 256}))


def wgmma_applicable(M: int, N: int, K: int, device) -> bool:
    """Whether `w4a4_wgmma` runs this product: an sm_90 GPU (H100/H200), M > 16 (below, the decode
    kernel streams the weight faster), N % 4 == 0, K % 32 == 0, and the kernel built."""
    device = torch.device(device)
    return (device.type == "cuda" and M > MMA_MAX_M and N > 0 and N % 4 == 0 and K > 0 and K % 32 == 0
            and cuda_build.capability(device) == (9, 0) and WGMMA.lib(device) is not None)


def w4a4_wgmma(qx: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor,
               bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16, *,
               out_int32: bool = False, order: str = "natural", config: Optional[dict] = None) -> torch.Tensor:
    """`w4a4_matmul_triton`'s product for M > 16 on Hopper's asynchronous int8 tensor cores (exact int32).

    The kernel reads qx in the "even_odd" order (`to_even_odd`; the act-quant kernel writes it with
    order="even_odd"); natural-order qx is permuted here first. ``config`` overrides `WGMMA.config`.
    """
    return w4a4_wgmma_many(qx, x_scale, [(qweight, w_scale, bias)], out_dtype, out_int32=out_int32, order=order,
                           config=config)[0]


def wgmma_many_applicable(qx: torch.Tensor, layers) -> bool:
    """Whether `w4a4_wgmma_many` can run these (qweight, w_scale, bias) layers in one launch."""
    M, K = qx.shape
    widths = [qweight.shape[1] for qweight, _, _ in layers]
    scale_dtypes, bias_dtypes = _launch_dtypes(layers)
    return (1 <= len(layers) <= MMA_MAX_WEIGHTS and all(wgmma_applicable(M, n, K, qx.device) for n in widths)
            and len(scale_dtypes) == 1 and len(bias_dtypes) <= 1 and bool(WGMMA.tiles(widths)))


def w4a4_wgmma_many(qx: torch.Tensor, x_scale: torch.Tensor, layers, out_dtype: torch.dtype = torch.bfloat16, *,
                    out_int32: bool = False, order: str = "natural",
                    config: Optional[dict] = None) -> list[torch.Tensor]:
    """``[w4a4_wgmma(qx, x_scale, *layer) for layer in layers]`` in one launch, for up to
    MMA_MAX_WEIGHTS layers (qweight, w_scale, bias) that read the same qx (a block's q/k/v or
    gate/up): their w_scales share a dtype, so do the biases they have, and every width but the
    last is a multiple of a tile's channels (`WGMMA.tiles`). The kernel runs their columns side by
    side; each layer gets its own output. ``config`` overrides `WGMMA.config`."""
    for layer in layers:
        _check_matmul_inputs(qx, x_scale, *layer)
    M, K = qx.shape
    widths = [qweight.shape[1] for qweight, _, _ in layers]
    if not (1 <= len(layers) <= MMA_MAX_WEIGHTS and all(wgmma_applicable(M, n, K, qx.device) for n in widths)):
        raise ValueError(f"w4a4_wgmma needs an sm_90 GPU with the compiled kernel, M > {MMA_MAX_M}, N % 4 == 0, "
                         f"K % 32 == 0 and 1 to {MMA_MAX_WEIGHTS} layers; got M={M} N={widths} K={K} on {qx.device}")
    if out_dtype not in _DTYPE_CODES:
        raise TypeError(f"out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    cfg = WGMMA.launch_config(config, M, K, widths, WGMMA.clusters(qx.device))
    ys = [_output(qx, n, out_dtype, out_int32) for n in widths]
    _launch_wgmma(qx, x_scale, layers, ys, 3 if out_int32 else _DTYPE_CODES[out_dtype], order, cfg, gated=False)
    return ys


def gated_applicable(qx: torch.Tensor, gate, up) -> bool:
    """Whether `w4a4_wgmma_silu_mul` runs this gate and up (qweight, w_scale, bias): where
    `w4a4_wgmma` runs each, with equal widths, one w_scale dtype, and a bias on both or neither."""
    M, K = qx.shape
    N = gate[0].shape[1]
    scale_dtypes, bias_dtypes = _launch_dtypes([gate, up])
    return (up[0].shape[1] == N and wgmma_applicable(M, N, K, qx.device) and len(scale_dtypes) == 1
            and len(bias_dtypes) <= 1 and (gate[2] is None) == (up[2] is None))


# From how many tokens the engine runs a gate/up pair as one gated GEMM. Its epilogue (SiLU and
# twice the scaling per output, while the tensor cores wait) costs about what the glue kernel it
# replaces did, so it pays only on big prefills: Llama-2-7B W4A4 prefill against the products and
# the glue kernel (H200, benchmarks/scripts/gated_prefill_ab.py), with session 15's branch-free
# epilogue 0.985x at 128 tokens, 1.014x at 512, 1.04x at 1024, 1.035x at 4096 (session 14's
# epilogue: 0.98-0.99x, 1.00x, 1.00-1.02x, 1.03x).
GATED_MIN_TOKENS = 512


def gated_preferred(qx: torch.Tensor, gate, up) -> bool:
    """Whether the engine runs this gate and up as `w4a4_wgmma_silu_mul`: where it applies, from
    GATED_MIN_TOKENS tokens."""
    return qx.shape[0] >= GATED_MIN_TOKENS and gated_applicable(qx, gate, up)


def w4a4_wgmma_silu_mul(qx: torch.Tensor, x_scale: torch.Tensor, gate, up, out_dtype: torch.dtype = torch.bfloat16,
                        *, order: str = "natural", config: Optional[dict] = None) -> torch.Tensor:
    """SiLU(gate(x)) * up(x) for a SwiGLU MLP's gate and up layers (qweight, w_scale, bias) on one
    launch of `w4a4_wgmma` whose epilogue multiplies (csrc/w4a4_wgmma.cu: GATED): the same values,
    to the bit, as the two products rounded to ``out_dtype`` (float16 or bfloat16) and the engine's
    glue kernel (``nibble.eval.engine.silu_mul``) on them, without their 2N-wide output. The tile
    and split-K are `WGMMA.config`'s for a 2N-column product; ``config`` overrides them."""
    for layer in (gate, up):
        _check_matmul_inputs(qx, x_scale, *layer)
    if not gated_applicable(qx, gate, up):
        raise ValueError(f"w4a4_wgmma_silu_mul needs an sm_90 GPU with the compiled kernel, M > {MMA_MAX_M}, "
                         f"N % 4 == 0, K % 32 == 0 (as w4a4_wgmma), gate and up of one width and w_scale dtype, "
                         f"and a bias on both or neither; got M, K = {tuple(qx.shape)}, widths "
                         f"{gate[0].shape[1]} and {up[0].shape[1]}, on {qx.device}")
    if out_dtype not in KERNEL_DTYPES:
        raise TypeError(f"out_dtype must be float16 or bfloat16, got {out_dtype}")
    M, K = qx.shape
    N = gate[0].shape[1]
    # the gated columns of gate and up interleave inside every tile: one 2N-wide "weight"
    cfg = WGMMA.launch_config(config, M, K, [2 * N], WGMMA.clusters(qx.device), "w4a4_wgmma_silu_mul")
    y = _output(qx, N, out_dtype, False)
    _launch_wgmma(qx, x_scale, [gate, up], [y, y], _DTYPE_CODES[out_dtype], order, cfg, gated=True)
    return y


def _launch_wgmma(qx, x_scale, layers, ys, out_code: int, order: str, cfg: dict, gated: bool) -> None:
    """One launch of csrc/w4a4_wgmma.cu over checked layers into the outputs ys (its entry point's
    contract); gated: SiLU(gate) * up into ys[0], the launch's columns twice the layers' width."""
    M, K = qx.shape
    check_order(order, K)
    if order == "natural":
        qx = to_even_odd(qx)
    qx = _aligned_rows(qx, 16)
    operands = [_layer_operands(x_scale, *layer) for layer in layers]
    x_scale = operands[0][0]
    scale_dtypes, bias_dtypes = _launch_dtypes([op[1:] for op in operands])
    if len(scale_dtypes) > 1 or len(bias_dtypes) > 1:
        raise ValueError("the layers of one w4a4_wgmma launch must share the w_scale dtype and the bias dtype")
    widths = [qweight.shape[1] for _, qweight, _, _ in operands]
    split, per_split = hopper.split_plan(K, cfg["split_k"])
    lib = WGMMA.lib(qx.device)
    err = cuda_build.launch(
        lib.nibble_w4a4_wgmma, qx.device, out_code, cfg["bn"], cfg["channels"], qx.data_ptr(), x_scale.data_ptr(),
        _DTYPE_CODES[scale_dtypes.pop()], _DTYPE_CODES[bias_dtypes.pop()] if bias_dtypes else 0, M, K, qx.stride(0),
        len(layers), *cuda_build.weight_arrays(list(zip(*operands))[1:], ys, widths),  # qweights, w_scales, biases
        split, per_split, int(gated), int(early_launch(qx.device, M, PRODUCT_EARLY_TOKENS)))
    if err:
        raise RuntimeError(f"w4a4_wgmma launch failed: {lib.nibble_w4a4_wgmma_error_string(err).decode()} "
                           f"(M={M} N={widths} K={K} config={cfg}{', gated' if gated else ''})")


# ================================================================================================
# The op
# ================================================================================================

def _check_linear_inputs(x, qweight, w_scale, bias, input_hadamard, kernels: bool = True):
    """What the op's body takes (``kernels``: the GPU kernels run CUDA x, 16-bit only), checked by its fake too, so
    a compiled graph refuses at trace time; the reference path (``kernels=False``) takes float32 on any device."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K] (flatten leading dims first), got shape {tuple(x.shape)}")
    allowed = KERNEL_DTYPES if kernels and x.is_cuda and triton is not None else KERNEL_DTYPES + (torch.float32,)
    if x.dtype not in allowed:
        raise TypeError(f"x must be float16 or bfloat16 (float32 too on the CPU), got {x.dtype} on {x.device.type} "
                        f"(nibble.kernels.w4a4_linear casts float32 inputs to bfloat16)")
    _check_weight_operands(dict(x=x), qweight, w_scale, bias)
    if input_hadamard:
        try:
            _had.hadamard_factors(x.shape[1])
        except ValueError as e:
            raise ValueError(f"input_hadamard=True needs a supported Hadamard size: {e}") from None


def wgmma_preferred(M: int, N: int, K: int, device) -> bool:
    """Whether the op runs this product on `w4a4_wgmma`: wherever it applies (Hopper, M > 16). With
    its 128 x 128 tiles and the fitted config it beat the Triton kernel on every shape at M = 64 to
    1024 but two (H200: 4096 x 11008 and 4096 x 14336 at M = 128, by 7% and 16%), by up to 3.8x
    (28672 x 8192 at M = 64); benchmarks/notes-w4a4.md, session 7."""
    return wgmma_applicable(M, N, K, device)


def product_order(M: int, N: int, K: int, device) -> str:
    """The activation order `w4a4_matmul` wants for this product: "even_odd" where `w4a4_wgmma` runs it."""
    return "even_odd" if wgmma_preferred(M, N, K, device) else "natural"


def product_kernel(qx: torch.Tensor, N: int, order: str = "natural") -> str:
    """Which kernel `w4a4_matmul` runs for qx [M, K] (in `order`) times an N-column weight:
    "w4a4_mma" for M <= 16, "w4a4_wgmma" on Hopper where `wgmma_preferred` (or for even_odd qx),
    else "triton"."""
    M, K = qx.shape
    if order == "even_odd" and not wgmma_applicable(M, N, K, qx.device):
        raise ValueError("even_odd activations are for w4a4_wgmma only; quantize with order=product_order(...)")
    if mma_applicable(qx, N, K):
        return "w4a4_mma"
    if order == "even_odd" or wgmma_preferred(M, N, K, qx.device):
        return "w4a4_wgmma"
    return "triton"


def w4a4_matmul(qx: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor,
                bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16,
                order: str = "natural") -> torch.Tensor:
    """The product on quantized activations as the op runs it, on `product_kernel`'s choice. qx
    comes in `order`; pass `product_order(...)`'s to skip a permutation."""
    kernel = product_kernel(qx, qweight.shape[1], order)
    if kernel == "w4a4_mma":
        return w4a4_mma(qx, x_scale, qweight, w_scale, bias, out_dtype=out_dtype)
    if kernel == "w4a4_wgmma":
        return w4a4_wgmma(qx, x_scale, qweight, w_scale, bias, out_dtype=out_dtype, order=order)
    return w4a4_matmul_triton(qx, x_scale, qweight, w_scale, bias, out_dtype=out_dtype)


def checked_layers(x, qweights, w_scales, biases, input_hadamard, kernels: bool = True) -> list:
    """[(qweight, w_scale, bias), ...] of layers that read x, each checked against it (``kernels``: see
    `_check_linear_inputs`)."""
    if not (len(qweights) == len(w_scales) == len(biases)) or not qweights:
        raise ValueError(f"qweights, w_scales and biases must be non-empty lists of one length, got "
                         f"{len(qweights)}, {len(w_scales)}, {len(biases)}")
    layers = list(zip(qweights, w_scales, biases))
    for layer in layers:
        _check_linear_inputs(x, *layer, input_hadamard, kernels)
    return layers


def _w4a4_outputs_cuda(x, layers, input_hadamard):
    """x rotated (optionally) and quantized once, then one product per checked (qweight, w_scale, bias)."""
    if triton is None:
        warn_reference_on_gpu()
        return [reference.w4a4_linear(x, *layer, input_hadamard) for layer in layers]
    M, K = x.shape
    widths = [qweight.shape[1] for qweight, _, _ in layers]
    order = activation_order(M, K, widths, x.device)
    rotated_decode = input_hadamard and M <= MMA_MAX_M  # the product's CTAs decide rotate_quantize's trigger
    product_warps = mma_config(M, widths, K, x.device).warps if rotated_decode else None
    qx, sx = quantize_activations_gpu(x, input_hadamard, order, product_warps)
    return w4a4_products(qx, sx, layers, x.dtype, order)


def activation_order(M: int, K: int, widths, device) -> str:
    """The order to quantize x [M, K] into for the products with weights of ``widths`` columns:
    "even_odd" where `w4a4_wgmma` runs every one of them."""
    orders = {product_order(M, N, K, device) for N in widths}
    return orders.pop() if len(orders) == 1 else "natural"


def w4a4_products(qx: torch.Tensor, x_scale: torch.Tensor, layers, out_dtype: torch.dtype,
                  order: str = "natural") -> list[torch.Tensor]:
    """The products of quantized activations qx [M, K] (in `order`, from `activation_order`) with
    each layer (qweight, w_scale, bias): one launch for the group where a kernel takes several
    weights (the decode kernel up to 16 tokens, the Hopper GEMM above), else one per layer."""
    if len(layers) > 1 and mma_many_applicable(qx, layers):
        return w4a4_mma_many(qx, x_scale, layers, out_dtype=out_dtype)
    if len(layers) > 1 and order == "even_odd" and wgmma_many_applicable(qx, layers):
        return w4a4_wgmma_many(qx, x_scale, layers, out_dtype=out_dtype, order=order)
    return [w4a4_matmul(qx, x_scale, qweight, w_scale, bias, out_dtype=out_dtype, order=order)
            for qweight, w_scale, bias in layers]


def linears(x: torch.Tensor, qweights: list[torch.Tensor], w_scales: list[torch.Tensor],
            biases: list[Optional[torch.Tensor]], input_hadamard: bool) -> list[torch.Tensor]:
    """[online Hadamard] -> per-token INT4 activations -> exact int GEMM -> scales (+ bias), x: [M, K],
    for one or several layers that read x (a block's q/k/v or gate/up projections): on CUDA, x is
    rotated and quantized once for all of them; on any other device `reference.w4a4_linear` runs.
    Returns one output per layer. The body of the custom ops `torch.ops.nibble.w4a4_linear(s)`;
    `nibble.kernels` calls it directly outside torch.compile (`kernels.eager_or_op`)."""
    layers = checked_layers(x, qweights, w_scales, biases, input_hadamard)
    if x.device.type == "cuda":
        return _w4a4_outputs_cuda(x, layers, input_hadamard)
    return [reference.w4a4_linear(x, *layer, input_hadamard) for layer in layers]


@torch.library.custom_op("nibble::w4a4_linear", mutates_args=())
def w4a4_linear(x: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor],
                input_hadamard: bool) -> torch.Tensor:
    """`linears` of one layer as a custom op (what torch.compile traces into its graphs)."""
    return linears(x, [qweight], [w_scale], [bias], input_hadamard)[0]


@w4a4_linear.register_fake
def _w4a4_linear_fake(x, qweight, w_scale, bias, input_hadamard):
    _check_linear_inputs(x, qweight, w_scale, bias, input_hadamard)
    return x.new_empty((x.shape[0], qweight.shape[1]))


@torch.library.custom_op("nibble::w4a4_linears", mutates_args=())
def w4a4_linears(x: torch.Tensor, qweights: list[torch.Tensor], w_scales: list[torch.Tensor],
                 biases: list[Optional[torch.Tensor]], input_hadamard: bool) -> list[torch.Tensor]:
    """`linears` as a custom op."""
    return linears(x, qweights, w_scales, biases, input_hadamard)


@w4a4_linears.register_fake
def _w4a4_linears_fake(x, qweights, w_scales, biases, input_hadamard):
    layers = checked_layers(x, qweights, w_scales, biases, input_hadamard)
    return [x.new_empty((x.shape[0], qweight.shape[1])) for qweight, _, _ in layers]
