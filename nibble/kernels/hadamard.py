"""Walsh-Hadamard rotation: y = x @ H_n.T over the last dimension, H_n orthonormal (H_n @ H_n.T = I).

Sizes are n = m * 2^k with H_n = H_m (x) H_{2^k} (Kronecker product). H_{2^k} is Sylvester's,
entry (i, j) = (-1)^popcount(i & j). H_m (entries +-1, scaled by 1/sqrt(n) only at the end) is built
by construction, never pasted:

    m = 1                                   powers of two: 64, 128, 4096, 8192, ...
    m = q + 1,   q prime, q % 4 == 3        Paley I:  12, 20, 24, 32, 44, 48, 60, ...
    m = 2(q+1),  q prime, q % 4 == 1        Paley II: 12, 28, 36, 60, 76, 84, ...
    m = 172                                 Williamson, four circulants of order 43

For each n the smallest usable m is taken, so most of the work is in the cheap 2^k part.
Model sizes: 576 = 36*16, 1536 = 12*128, 11008 = 172*64, 14336 = 28*512, 28672 = 28*1024.

Three ways to apply it, all computing y = x @ H_n.T (or x @ H_n with inverse=True):
  hadamard_transform_reference  pure PyTorch, float32 (float64 for float64 input): the spec
  hadamard_transform_triton     the Triton kernel (CUDA; CPU tensors under TRITON_INTERPRET=1)
  hadamard_transform            torch.ops.nibble.hadamard_transform: kernel on CUDA, reference
                                elsewhere; works under torch.compile / CUDA graphs, has autograd.

Non-finite values: every output depends on every input of its row, so a row holding NaN or +-Inf
(or whose sums overflow the compute type, float32 or float64) has outputs that are not finite. Each such
output is NaN, on every device and path, before the result is rounded to x.dtype (where a finite value
past the type's range still becomes +-Inf). Without the rule one +Inf gave +-Inf in the reference and NaN
in the kernel (its tf32 pieces compute Inf - Inf), and W4A4 zeroes a token by this NaN.

`hadamard_load_rows` is the load-and-transform of a block of rows as a @triton.jit function, so
other kernels (W4A4 activation quantization) can fuse it: call it, quantize the tile, store.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from nibble.kernels import transforms_active
from nibble.kernels.launch import cdiv, next_pow2
from nibble.kernels.triton_device import check_triton_device, triton_unavailable, warn_reference_on_gpu
from nibble.warn import warn

try:
    import triton
    import triton.language as tl
    _jit = triton.jit
except ImportError:  # CPU-only install (triton is the `gpu` extra): the reference and the op still work
    triton = tl = None

    def _jit(fn):  # the kernel functions stay plain Python and are never launched
        return fn

# ----------------------------------------------------------------------------------------------
# Matrix constructions (float64 with +-1 entries, so every product below is exact)
# ----------------------------------------------------------------------------------------------

# Williamson matrices of order 43: symmetric circulants A, B, C, D with A^2 + B^2 + C^2 + D^2 = 172 I.
# Each first row is constant on the cosets of the multiplicative subgroup {+-1, +-6, +-36} of Z_43^*,
# so it is given by its entry at 0 and one sign per coset 3^i * {+-1, +-6, +-36}, i = 0..6.
# Found by a meet-in-the-middle search over those 2^8 rows per matrix, matching periodic
# autocorrelations (they must sum to 0 at every non-zero shift); tests re-check the property.
_WILLIAMSON_43 = ("+ ++---++", "+ +--+--+", "+ ++-++--", "+ -+++--+")


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, math.isqrt(q) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[i, j] = chi(j - i) with chi the quadratic character of the field Z_q (chi(0) = 0)."""
    chi = torch.full((q,), -1.0, dtype=torch.float64)
    chi[[(x * x) % q for x in range(1, q)]] = 1.0
    chi[0] = 0.0
    idx = torch.arange(q)
    return chi[(idx[None, :] - idx[:, None]) % q]


def _paley1(q: int) -> torch.Tensor:
    """Order q + 1 for q = 3 mod 4: H = I + S with S = [[0, 1], [-1, Q]] skew and S S^T = q I."""
    s = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, _jacobsthal(q)
    return torch.eye(q + 1, dtype=torch.float64) + s


def _paley2(q: int) -> torch.Tensor:
    """Order 2(q + 1) for q = 1 mod 4: from the symmetric conference matrix C = [[0, 1], [1, Q]],
    replace 0 by [[1, -1], [-1, -1]] and +-1 by +-[[1, 1], [1, -1]]."""
    c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    c[0, 1:], c[1:, 0], c[1:, 1:] = 1.0, 1.0, _jacobsthal(q)
    one = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    zero = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    return torch.kron(c, one) + torch.kron(torch.eye(q + 1, dtype=torch.float64), zero)


def _williamson_rows_43() -> list[torch.Tensor]:
    """First rows of the four order-43 Williamson circulants, expanded from `_WILLIAMSON_43`."""
    coset = torch.zeros(43, dtype=torch.long)
    for i in range(7):
        g = pow(3, i, 43)  # 3 generates Z_43^*
        coset[[(g * h) % 43 for h in (1, 42, 6, 37, 36, 7)]] = i + 1
    rows = []
    for spec in _WILLIAMSON_43:
        signs = torch.tensor([1.0 if ch == "+" else -1.0 for ch in spec.replace(" ", "")], dtype=torch.float64)
        rows.append(signs[coset])  # position 0 has coset index 0, the entry at 0
    return rows


def _williamson172() -> torch.Tensor:
    n = 43
    idx = torch.arange(n)
    shift = (idx[None, :] - idx[:, None]) % n
    a, b, c, d = (row[shift] for row in _williamson_rows_43())  # circulant: M[i, j] = row[j - i]
    return torch.cat([torch.cat(r, dim=1) for r in (
        (a, b, c, d), (-b, a, -d, c), (-c, d, a, -b), (-d, -c, b, a))], dim=0)


def _construction(m: int):
    """The builder of a +-1 Hadamard matrix of order m, or None when none of ours applies."""
    if m == 1:
        return lambda: torch.ones(1, 1, dtype=torch.float64)
    if m == 172:
        return _williamson172
    if _is_prime(m - 1) and (m - 1) % 4 == 3:
        return functools.partial(_paley1, m - 1)
    if m % 2 == 0 and _is_prime(m // 2 - 1) and (m // 2 - 1) % 4 == 1:
        return functools.partial(_paley2, m // 2 - 1)
    return None


def _factor(n: int) -> tuple[int, int] | None:
    """(m, 2^k) with n = m * 2^k and m the smallest order we can build, or None."""
    if n < 1:
        return None
    odd = n // (n & -n)
    if odd == 1:
        return 1, n
    m = 4 * odd  # a Hadamard order above 2 is a multiple of 4
    while n % m == 0:
        if _construction(m) is not None:
            return m, n // m
        m *= 2
    return None


def hadamard_factors(n: int) -> tuple[int, int]:
    """(m, 2^k) with n = m * 2^k and H_n = H_m (x) H_{2^k}; ValueError naming the rule if unsupported."""
    if n < 1:
        raise ValueError(f"a Hadamard matrix needs a size of at least 1, got {n}")
    f = _factor(n)
    if f is None:
        lo = next(s for s in range(n - 1, 0, -1) if _factor(s))  # 1 always is
        hi = next(s for s in range(n + 1, 2 * n + 1) if _factor(s))  # so is the power of two in (n, 2n]
        raise ValueError(
            f"no Hadamard matrix of size {n}: nibble builds n = m * 2^k with m = 1, m = q + 1 "
            f"(q prime, q % 4 == 3; Paley I), m = 2(q + 1) (q prime, q % 4 == 1; Paley II) or m = 172 "
            f"(Williamson); the nearest supported sizes are {lo} and {hi}")
    return f


def supported_hadamard_sizes(limit: int) -> list[int]:
    """Every n in [1, limit] that hadamard_matrix / hadamard_transform accept."""
    return [n for n in range(1, limit + 1) if _factor(n) is not None]


@functools.cache
def _base_matrix_on(m: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`_base_matrix` where the reference runs, copied there once: a copy per call synchronised with the host, which
    a CUDA graph cannot capture (the GPU's fallback for sizes the kernels cannot hold runs the reference)."""
    return _base_matrix(m).to(device=device, dtype=dtype)


@functools.cache
def _base_matrix(m: int) -> torch.Tensor:
    """The +-1 (unnormalised) H_m, float64 on CPU; cached, never modified."""
    return _construction(m)()  # each construction's H H^T = m I is a test (a check here broke compiled graphs)


def _sylvester(p: int) -> torch.Tensor:
    """+-1 Sylvester matrix of order p = 2^k: entry (i, j) = (-1)^popcount(i & j)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < p:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
    return h


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The orthonormal n x n Hadamard matrix H_n = (H_m (x) H_{2^k}) / sqrt(n), on CPU.

    Built from cached factors; it is dense (n = 28672 takes 3.3 GB in float32), so to rotate
    activations or weights use hadamard_transform*, which never materialise it.
    """
    m, p = hadamard_factors(n)
    return (torch.kron(_base_matrix(m), _sylvester(p)) / math.sqrt(n)).to(dtype)


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------

def _check_transform_input(x: torch.Tensor) -> None:
    """A rotation is of real numbers along a last dimension: integers and bools came back truncated, complex
    numbers without their imaginary part."""
    if not x.is_floating_point():
        raise TypeError(f"the Hadamard transform takes a real floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("the Hadamard transform rotates the last dimension; got a 0-d tensor")


def hadamard_transform_reference(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """y = x @ H_n.T (inverse: x @ H_n) on the last dim; float32 math (float64 for float64 x), x.dtype out;
    an output that is not finite in that math is NaN (the module docstring says why).

    The row is viewed as [m, 2^k]: a Sylvester butterfly over the 2^k axis, then H_m over the m axis.
    """
    _check_transform_input(x)
    n = x.shape[-1]
    m, p = hadamard_factors(n)
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.to(cdt).reshape(-1, m, p)
    h = 1
    while h < p:  # H_{2^k} = H_2 (x) ... (x) H_2: one butterfly per bit, on indices that differ in bit h
        y = y.view(-1, m, p // (2 * h), 2, h)
        lo, hi = y[..., 0, :], y[..., 1, :]
        y = torch.stack((lo + hi, lo - hi), dim=-2).view(-1, m, p)
        h *= 2
    if m > 1:
        hm = _base_matrix_on(m, x.device, cdt)
        y = (hm.T if inverse else hm) @ y  # y[i] = sum_j H_m[i, j] y[j]; Sylvester is symmetric
    y = y * (1.0 / math.sqrt(n))
    return torch.where(torch.isfinite(y), y, torch.nan).reshape(x.shape).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------
# Measured on an H200, 64 MiB of bfloat16 per call, read + written (copy roofline ~4.3 TB/s):
# n = 64: 3.1 TB/s, 128: 2.0, 4096: 1.8, 8192: 1.4, 1536: 1.1, 576: 0.7, 14336: 0.63,
# 28672: 0.58, 11008: 0.19 (0.56 since its dense factor's matrix is read K-major, below). Large
# rows run one program per SM, so loads and tensor-core work do not overlap. A few rows (decode)
# split each row's dense outputs over programs instead (`dense_slice_width`): W4A4 rotate +
# quantize of one row of 11008 went from 39 to 11 us (6 of them the quantization), 7 us now.

# The largest padded row one program keeps in registers, and the largest dense factor (172, padded). They cover
# the sizes of the models nibble is measured on (28672 pads to 32 * 1024); two real ones are past them and run the
# reference on a GPU, said once (`warn_past_kernel`): Qwen2-72B's intermediate 29568 = 924 * 32 (a dense factor of
# 924) and Llama-3.1-405B's 53248 = 104 * 512 (a row of 128 * 512 once padded).
MAX_KERNEL_ROW = 32768
MAX_KERNEL_DENSE = 256
# tl.dot needs every dimension >= 16.
_MIN_DOT = 16
# The dense factor is multiplied in chunks of this many input columns (of the dense axis), so its
# +-1 matrix passes through shared memory 32 rows at a time (times the loop's pipeline stages),
# never whole: 172 pads to 256 x 256 float32, more than an SM's shared memory.
_DENSE_CHUNK = 32
# Elements of the row tile one program of 4 warps handles best.
_TILE = 8192


class PastKernelError(ValueError):
    """A size the reference rotates but one program of the kernel cannot hold; ``limit`` says which limit it passes
    (the GPU's fallback warns with it, `warn_past_kernel`)."""

    def __init__(self, limit: str):
        super().__init__(f"hadamard kernel: {limit}; use hadamard_transform_reference")
        self.limit = limit


@dataclass(frozen=True)
class HadamardPlan:
    """How the kernel splits a row of n: a tile [rows, dense_pad, a, b] of rows padded to
    dense_pad * a * b, with n = dense * a * b.

    dense: the order of the part done as a matmul against a stored +-1 matrix (H_m, or
    H_m (x) H_{2^j} when 2^j < 16 is too small for tl.dot); 1 when n is a power of two >= 16.
    a, b: the Sylvester part 2^k = a * b, each 1 or >= 16, multiplied by in-register +-1 tiles.
    Padding (dense_pad > dense) sits at the end of each row, so callers see a plain
    [rows, row_pad] tile whose columns >= n are zero.
    """
    n: int
    dense: int
    dense_pad: int
    dense_chunk: int
    a: int
    b: int
    rows: int
    num_warps: int

    @property
    def row_pad(self) -> int:
        return self.dense_pad * self.a * self.b


@functools.cache
def hadamard_plan(n: int) -> HadamardPlan:
    m, p = hadamard_factors(n)
    if p < _MIN_DOT:
        dense, a, b = m * p, 1, 1
    elif p < _MIN_DOT * _MIN_DOT:
        dense, a, b = m, 1, p
    else:
        b = 1 << (p.bit_length() // 2)  # the larger half of the bits
        dense, a = m, p // b
    dense_pad = 1 if dense == 1 else max(_MIN_DOT, next_pow2(dense))
    row_pad = dense_pad * a * b
    if row_pad > MAX_KERNEL_ROW or dense_pad > MAX_KERNEL_DENSE:
        raise PastKernelError(f"size {n} = {m} * {p} needs a row of {row_pad} (at most {MAX_KERNEL_ROW}) and a dense "
                              f"factor of {dense_pad} (at most {MAX_KERNEL_DENSE}) in one program")
    # Every tl.dot's row count (the tile's other dims times rows) must reach 16; beyond that, small
    # sizes take rows up to an 8K-element tile with 4 warps, the best setting measured on an H200
    # (bf16, n = 128 ... 8192); larger rows need more warps to hold the tile in registers.
    others = [d for d, on in ((dense_pad * a, b > 1), (dense_pad * b, a > 1), (a * b, dense_pad > 1)) if on]
    rows = max([next_pow2(cdiv(_MIN_DOT, o)) for o in others] + [max(1, _TILE // row_pad)])
    return HadamardPlan(n, dense, dense_pad, min(dense_pad, _DENSE_CHUNK), a, b, rows, _warps_for(rows * row_pad))


def _warps_for(tile: int) -> int:
    """Warps for a program holding `tile` float32 elements (beyond 8K elements 4 warps spill)."""
    return 4 if tile <= _TILE else 8 if tile <= 2 * _TILE else 16


@functools.cache
def _dense_operand(n: int, inverse: bool, device: torch.device) -> torch.Tensor:
    plan = hadamard_plan(n)
    m, _ = hadamard_factors(n)
    h = torch.kron(_base_matrix(m), _sylvester(plan.dense // m))
    out = torch.zeros(plan.dense_pad, plan.dense_pad, dtype=torch.float32)
    out[:plan.dense, :plan.dense] = h.T if inverse else h
    return out.to(device)


def hadamard_dense_operand(n: int, inverse: bool, device) -> torch.Tensor:
    """The `dense_ptr` tensor of `hadamard_load_rows` for size n on `device` (cached per device):
    +-1 float32 [dense_pad, dense_pad], zero padded. Rows are transformed as row @ H.T, i.e. the
    matmul's operand is H.T [in, out]; it is stored transposed, [out, in] (H_dense for the forward
    transform, H_dense.T for the inverse), so that its contraction index is contiguous (see
    `hadamard_load_rows`)."""
    return _dense_operand(n, inverse, torch.device(device))


@_jit
def _sylvester_tile(N: tl.constexpr):
    """+-1 Sylvester matrix [N, N] in registers: (-1)^popcount(i & j), parity by xor-folding bits."""
    i = tl.arange(0, N)[:, None]
    j = tl.arange(0, N)[None, :]
    v = i & j
    v = v ^ (v >> 8)
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    return (1 - 2 * (v & 1)).to(tl.float32)


@_jit
def _dot_pm1(x, h, acc, TERMS: tl.constexpr):
    """acc + x @ h for float32 x and a +-1 float32 h on tf32 tensor cores, keeping x's bits.

    A tf32 operand keeps 10 mantissa bits, so x is cut into TERMS pieces (each but the last
    truncated to 10 bits by masking, hence exact in tf32) and each piece is one dot. Products with
    +-1 are exact; only the accumulation and the last piece's tail round. One term is exact for
    float16/bfloat16 input; two leave 2^-21 relative error, three carry float32. (float32 masking,
    not bfloat16 pieces, because Triton 3.6's interpreter multiplies bfloat16 tensors as raw bits.)
    """
    for _ in tl.static_range(TERMS - 1):
        head = (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)  # clear 13 low bits
        acc = tl.dot(head, h, acc, input_precision="tf32")
        x = x - head  # exact
    return tl.dot(x, h, acc, input_precision="tf32")


@_jit
def hadamard_load_rows(x_ptr, row_offs, row_mask, n, dense_ptr, scale, dense_lo, ROWS: tl.constexpr,
                       DENSE_PAD: tl.constexpr, DENSE_OUT: tl.constexpr, DENSE_CHUNK: tl.constexpr,
                       A: tl.constexpr, B: tl.constexpr, TERMS_IN: tl.constexpr, TERMS: tl.constexpr):
    """Load ROWS rows of n elements and return (row @ H_n.T) * scale as float32 [ROWS, DENSE_OUT * A * B]:
    the outputs whose dense index lies in [dense_lo, dense_lo + DENSE_OUT), i.e. output columns
    dense_lo * A * B onwards, NaN where not finite (the module's rule); columns >= n (and masked rows)
    come back 0, or NaN in a row that held a non-finite value (H's zero padding times +-Inf). For fusing
    into other kernels (W4A4 quantization) with DENSE_OUT = DENSE_PAD, dense_lo = 0: the whole row.

    row_offs: [ROWS, 1] int64 offset of each row's first element from x_ptr; row_mask: [ROWS, 1].
    DENSE_PAD, DENSE_CHUNK, A, B from `hadamard_plan(n)`; dense_ptr from `hadamard_dense_operand`
    (any pointer when DENSE_PAD == 1, where DENSE_OUT must be 1 and dense_lo 0); scale = 1/sqrt(n);
    `hadamard_dot_terms(dtype)` gives TERMS_IN, TERMS (tf32 pieces per operand for the first factor,
    which sees the input, and the rest).

    The row is a [DENSE_PAD, A, B] tensor and H = H_dense (x) H_A (x) H_B, so each factor is one
    matmul along its own axis on tensor cores. The dense factor comes first, straight from memory in
    chunks of its axis: its matrix then never has to sit in shared memory whole. The A and B factors
    act within one dense index, so a slice of dense outputs needs only that slice of H_dense's
    columns: programs that split a row this way each read the whole row and produce their slice.
    """
    AB: tl.constexpr = A * B
    if DENSE_PAD > 1:
        ab = tl.arange(0, AB)[None, :, None]
        out = dense_lo + tl.arange(0, DENSE_OUT)[None, :]
        acc = tl.zeros((ROWS * AB, DENSE_OUT), dtype=tl.float32)
        # All of the padded axis, though its last chunks add zeros: stopping the loop at 192 of 256
        # (11008's 172 in whole chunks) saved ~10% of the time but made the 4-warp programs' sums
        # lose bits on the H200 (max error 0.0023 against 0.0018 in float16, deterministic).
        for k0 in range(0, DENSE_PAD, DENSE_CHUNK):
            k = k0 + tl.arange(0, DENSE_CHUNK)
            # [ROWS, AB, chunk]: the chunk of the dense axis last, ready to be the contraction dim
            ptrs = x_ptr + row_offs[:, :, None] + k[None, None, :] * AB + ab
            mask = row_mask[:, :, None] & (k[None, None, :] < n // AB)
            xk = tl.reshape(tl.load(ptrs, mask=mask, other=0.0).to(tl.float32), (ROWS * AB, DENSE_CHUNK))
            # Rows k of H_dense.T, the slice's columns, read as the stored [out, in] tile and
            # transposed in place: tf32 tensor cores take this operand only K-major in shared
            # memory, so a copy of an [in, out] tile had to transpose element by element (4-byte
            # cp.async, one L1 wavefront per lane: 35 us for 128 rows of 11008 on an H200, the L1
            # 81% busy and the tensor cores idle); from [out, in] it is 16-byte copies (13 us).
            d = tl.trans(tl.load(dense_ptr + out.T * DENSE_PAD + k[None, :]))
            acc = _dot_pm1(xk, d, acc, TERMS_IN)
        x = tl.permute(tl.reshape(acc, (ROWS, A, B, DENSE_OUT)), (0, 3, 1, 2))
    else:
        c = tl.arange(0, AB)[None, :]
        x = tl.load(x_ptr + row_offs + c, mask=row_mask & (c < n), other=0.0).to(tl.float32)
        x = tl.reshape(x, (ROWS, 1, A, B))
    if B > 1:
        zero = tl.zeros((ROWS * DENSE_OUT * A, B), dtype=tl.float32)
        terms: tl.constexpr = TERMS if DENSE_PAD > 1 else TERMS_IN
        x = _dot_pm1(tl.reshape(x, (ROWS * DENSE_OUT * A, B)), _sylvester_tile(B), zero, terms)
        x = tl.reshape(x, (ROWS, DENSE_OUT, A, B))
    if A > 1:
        zero = tl.zeros((ROWS * DENSE_OUT * B, A), dtype=tl.float32)
        x = tl.reshape(tl.permute(x, (0, 1, 3, 2)), (ROWS * DENSE_OUT * B, A))
        x = _dot_pm1(x, _sylvester_tile(A), zero, TERMS)
        x = tl.permute(tl.reshape(x, (ROWS, DENSE_OUT, B, A)), (0, 1, 3, 2))
    return tl.reshape(_nan_unless_finite(x * scale), (ROWS, DENSE_OUT * AB))


@_jit
def _nan_unless_finite(y):
    """y with every value that is not finite made NaN (the module's rule for non-finite values). Tested explicitly:
    the tf32 pieces turn an infinite value NaN only where a factor after the first splits it (Inf - Inf), so a
    single-factor plan (n < 256 for 16-bit input: 8, 16, 40, 128, 200, ...) kept +-Inf. y * 0 + y is y where y is
    finite (y * 0 is a signed zero, exact) and NaN where it is not (Inf * 0): one FFMA an output, which no
    compiler folds (x * 0 -> 0 holds only without NaN and Inf)."""
    return tl.fma(y, tl.zeros_like(y), y)


@_jit
def _hadamard_kernel(x_ptr, y_ptr, dense_ptr, n_rows, n, stride_x, stride_y, scale,
                     ROWS: tl.constexpr, DENSE_PAD: tl.constexpr, DENSE_OUT: tl.constexpr,
                     DENSE_CHUNK: tl.constexpr, A: tl.constexpr, B: tl.constexpr, TERMS_IN: tl.constexpr,
                     TERMS: tl.constexpr):
    # Program (i, j) owns ROWS rows and the j-th slice of DENSE_OUT dense outputs of each: with
    # DENSE_OUT = DENSE_PAD (one slice) each row is read once and written once; with narrower slices
    # a few rows spread over more SMs (each program rereads the rows, from L2).
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    dense_lo = tl.program_id(1) * DENSE_OUT
    row_mask = r < n_rows
    r = r.to(tl.int64)
    y = hadamard_load_rows(x_ptr, r * stride_x, row_mask, n, dense_ptr, scale, dense_lo, ROWS, DENSE_PAD,
                           DENSE_OUT, DENSE_CHUNK, A, B, TERMS_IN, TERMS)
    c = dense_lo * A * B + tl.arange(0, DENSE_OUT * A * B)[None, :]
    tl.store(y_ptr + r * stride_y + c, y.to(y_ptr.dtype.element_ty), mask=row_mask & (c < n))


# The dtypes the transform's kernel takes (float32 too: the W4A4 kernels' KERNEL_DTYPES are the 16-bit ones only).
TRANSFORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def hadamard_dot_terms(dtype: torch.dtype) -> tuple[int, int]:
    """(TERMS_IN, TERMS) for `hadamard_load_rows` on input/output of `dtype`: 16-bit input is exact
    in one tf32 piece; float32 intermediates need two pieces for 16-bit output, three for float32."""
    return (3, 3) if dtype == torch.float32 else (1, 2)


# Programs' worth of rows (row tiles) below which the kernel splits each row's dense outputs over
# programs: with a dense factor a row tile is one program of 4-16 warps at ~250 registers, so a
# handful of rows (decode) ran on a handful of SMs: 39 us for one row of 11008 on an H200, against
# ~2 us of memory traffic.
SPLIT_ROW_TILES = 32
# The narrowest slice: tl.dot's 16-row minimum.
_SPLIT_OUT = _MIN_DOT


def dense_slice_width(plan: HadamardPlan, row_tiles: int, split: bool | None = None) -> int:
    """Dense outputs per program for `row_tiles` programs' worth of rows: the whole (padded) dense
    axis, or for few rows (``split`` None: fewer than SPLIT_ROW_TILES) slices of 16."""
    if plan.dense_pad == 1 or not (row_tiles < SPLIT_ROW_TILES if split is None else split):
        return plan.dense_pad
    return _SPLIT_OUT


def hadamard_transform_triton(x: torch.Tensor, inverse: bool = False, split: bool | None = None) -> torch.Tensor:
    """The Triton kernel: y = x @ H_n.T (inverse: x @ H_n) on the last dim, same dtype and shape as x.

    x: CUDA tensor (CPU under TRITON_INTERPRET=1), float16/bfloat16/float32, last dim contiguous,
    any leading dims. Products are exact, sums run in the tensor cores' float32 accumulators (not
    IEEE-rounded: about 2^-19 of the largest output, far below 16-bit rounding), and the result is
    rounded once to x.dtype; an output that is not finite in float32 is NaN, as in the reference (module
    docstring). ``split`` (default: only for a few rows) spreads each row's dense outputs over several
    programs; the result is the same.
    """
    if x.dtype not in TRANSFORM_DTYPES:
        raise TypeError(f"hadamard kernel takes float16/bfloat16/float32, got {x.dtype}; "
                        f"use hadamard_transform_reference for other dtypes")
    if triton is None:
        raise triton_unavailable("Hadamard")
    check_triton_device(x, "Hadamard")
    if x.dim() == 0 or x.stride(-1) != 1:
        raise ValueError("hadamard kernel needs at least 1 dim and a contiguous last dim; call .contiguous()")
    n = x.shape[-1]
    plan = hadamard_plan(n)
    x2 = x.reshape(-1, n)  # a view whenever the leading dims collapse
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(-1, n)
    if x2.shape[0] == 0:
        return y
    dense = hadamard_dense_operand(n, inverse, x.device) if plan.dense_pad > 1 else x2
    terms_in, terms = hadamard_dot_terms(x.dtype)
    row_tiles = cdiv(x2.shape[0], plan.rows)
    dense_out = dense_slice_width(plan, row_tiles, split)
    slices = cdiv(plan.dense, dense_out)  # enough to cover the real (unpadded) dense entries
    _hadamard_kernel[(row_tiles, slices)](
        x2, y2, dense, x2.shape[0], n, x2.stride(0), y2.stride(0), 1.0 / math.sqrt(n), ROWS=plan.rows,
        DENSE_PAD=plan.dense_pad, DENSE_OUT=dense_out, DENSE_CHUNK=plan.dense_chunk, A=plan.a, B=plan.b,
        TERMS_IN=terms_in, TERMS=terms, num_warps=_warps_for(plan.rows * dense_out * plan.a * plan.b))
    return y


# ----------------------------------------------------------------------------------------------
# The dispatching op
# ----------------------------------------------------------------------------------------------

@torch.library.custom_op("nibble::hadamard_transform", mutates_args=())
def _hadamard_op(x: torch.Tensor, inverse: bool) -> torch.Tensor:
    # Every device without a registered kernel (CPU, ...) runs the reference.
    return hadamard_transform_reference(x, inverse)


def kernel_fits(n: int) -> bool:
    """Whether the Triton kernel runs size n (`hadamard_plan`), a stricter rule than the reference's."""
    try:
        hadamard_plan(n)
    except ValueError:
        return False
    return True


@functools.cache
def warn_past_kernel(n: int) -> None:
    """Said once per size: a size the reference rotates but one program of the GPU kernels cannot hold runs the
    reference on the GPU, the same values, slower; a user who chose W4A4 for its speed is told which layer pays."""
    try:
        hadamard_plan(n)
    except PastKernelError as e:
        warn(f"the online Hadamard of size {n} runs PyTorch's reference rotation on the GPU (the same values, "
             f"slower): {e.limit}")


@_hadamard_op.register_kernel("cuda")
def _hadamard_op_cuda(x: torch.Tensor, inverse: bool) -> torch.Tensor:
    if triton is None:
        warn_reference_on_gpu()
    if triton is None or x.dtype not in TRANSFORM_DTYPES:
        return hadamard_transform_reference(x, inverse)
    if not kernel_fits(x.shape[-1]):
        warn_past_kernel(x.shape[-1])
        return hadamard_transform_reference(x, inverse)
    return hadamard_transform_triton(x.contiguous(), inverse)


@_hadamard_op.register_fake
def _hadamard_op_fake(x: torch.Tensor, inverse: bool) -> torch.Tensor:
    _check_transform_input(x)  # fail at trace time, not at run time
    hadamard_factors(x.shape[-1])
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _hadamard_op_setup(ctx, inputs, output):
    ctx.inverse = inputs[1]


def _hadamard_op_backward(ctx, grad):
    # y = x @ H.T  =>  dL/dx = dL/dy @ H: the opposite transform.
    return _hadamard_op(grad, not ctx.inverse), None


# the op's own (opcheck, torch.ops callers); `hadamard_transform` goes through `_Hadamard`, which torch.func takes too
_hadamard_op.register_autograd(_hadamard_op_backward, setup_context=_hadamard_op_setup)


@torch.library.register_vmap("nibble::hadamard_transform")
def _hadamard_op_vmap(info, in_dims, x, inverse):
    # the op takes any leading dims: the vmapped one goes first, the transformed one stays last
    return _hadamard_op(x.movedim(in_dims[0], 0) if in_dims[0] is not None else x, inverse), 0


class _Hadamard(torch.autograd.Function):
    """The op with its derivatives in every mode, taken under a torch.func transform or forward-mode AD. The transform
    is linear: y = x @ H.T gives dL/dx = dL/dy @ H (the opposite transform) and an output tangent that is the
    transform of the input's. The op's register_autograd serves reverse mode outside torch.func only (torch.func.grad
    / jacrev refused it, and forward mode took the transform for a constant); elsewhere the op is called directly:
    the Function cost ~40 us a call on the host, and Dynamo cannot trace its jvp."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, inverse: bool) -> torch.Tensor:
        return _hadamard_op(x, inverse)

    setup_context = staticmethod(_hadamard_op_setup)

    @staticmethod
    def backward(ctx, grad):
        return _Hadamard.apply(grad, not ctx.inverse), None

    @staticmethod
    def jvp(ctx, tangent, _):
        return _Hadamard.apply(tangent, ctx.inverse)


def hadamard_transform(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """y = x @ H_n.T (inverse: x @ H_n) on the last dim, via torch.ops.nibble.hadamard_transform:
    the Triton kernel on CUDA, the reference elsewhere; differentiable (torch.func included) and
    torch.compile-safe. A row holding NaN or +-Inf comes out NaN, on every device: each output that is not
    finite in float32 (float64 for float64 x) is NaN (the module docstring)."""
    if transforms_active():
        return _Hadamard.apply(x, inverse)
    return _hadamard_op(x, inverse)  # its own register_autograd: reverse mode, eager and compiled
