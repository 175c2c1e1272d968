"""W4A16 GPU kernels for the canonical INT4 format, and the ``nibble::w4a16_linear`` op.

``torch.ops.nibble.w4a16_linear(x [M, K] fp16/bf16, qweight int32 [K//8, N], scales fp16 [K//G, N],
zeros fp16 [K//G, N], group_size) -> [M, N]`` in x's dtype, ``y = x @ W.T`` with
``W[n, k] = q[k, n] * s[k // G, n] + z[k // G, n]`` (docs/ARCHITECTURE.md). CPU inputs run
``reference.w4a16_matmul``; CUDA inputs run the kernels below. The weight is consumed in the
canonical layout as stored (no re-layout step).

Dispatch on CUDA (measured on the H200, benchmarks/notes-w4a16.md):

* Few tokens (M <= 32; <= 64 for a tiny layer): ``w4a16_mma``, the CUDA C++ tensor-core kernel in
  ``csrc/w4a16_mma.cu`` (weight as the MMA's A operand straight from the canonical words, raw codes
  through the MMA, group affine in fp32 per group, cp.async ring per warp), built by nvcc at first
  use (``cuda_build``). Needs N, K multiples of 32 and a power-of-two group >= 32 (or per column).
* Many tokens on Hopper (up to WGMMA_MAX_M; not for a tiny layer alone): ``w4a16_wgmma``,
  ``csrc/w4a16_wgmma.cu`` (asynchronous wgmma fed by TMA, the weight dequantized in fp32 straight
  into the register fragments), built for sm_90a; tile and split-K from ``WGMMA.config``.
  ``large_m_kernel`` says which path a shape takes.
* Shapes these do not take, or no nvcc: the Triton kernels below, Triton GEMV (M <= 2) /
  tensor-core dot kernel (M <= 16); M > 16: dequantise + cuBLAS (also the measured best for a tiny
  layer alone above 64 tokens and for every layer above WGMMA_MAX_M).

Triton kernels (design; see benchmarks/notes-w4a16.md for the measurements behind it):

* One packed word ``qweight[i, n]`` holds K rows ``8i .. 8i+7`` of column n. A tile
  ``[BLOCK_K // 8, BLOCK_N]`` is a coalesced 2-D load along N (16-byte vectors); nibble j of every
  word forms *plane* j (K rows ``k0 + 8i + j``).
* Integer-to-float without the conversion unit: a nibble OR-ed into the mantissa of a constant is a
  float ``C + q / D`` exactly (bf16 ``0x4300 | q`` = 128 + q, fp16 ``0x6400 | q`` = 1024 + q, fp32 with
  the nibble on mantissa bits 15..18 / 19..22 = 1 + q/256 / 1 + q/16). The constant is removed
  algebraically per K block: ``sum_k x_k (C + q_k/D) s = D s * dot - C D s * sum_k x_k``.
* M <= 2, ``_w4a16_gemv_kernel`` (CUDA cores): one PTX block per word does 4 shifts + 8 lop3 + 8 FMA
  (even/odd nibbles share a shift); each thread owns all word-rows of its 4 columns, the group
  scale is applied per column per K block; split-K over the grid.
* M <= 16, ``_w4a16_dot_kernel`` (tensor cores, "trans": W^T tile is the MMA's A operand, x^T the
  B operand, M padded to 16): PTX FasterTransformer-style dequant (3 shifts + 4 lop3 per 8 weights,
  nibbles j and j+4 in one register), the planes are re-woven with join/permute/reshape into ONE
  [BN, BK] tile per K block (K slots permuted; x permuted to match), raw ``C + q`` codes go through
  the MMA and the group scale/offset are applied to the fp32 block result (the weight is never
  rounded to 16 bits). A non-factored mode (q*s+z in fp32, rounded once) serves groups smaller than
  BLOCK_K and the large-M GEMM variants.
* M > 16: dequantise to x.dtype in one Triton pass at HBM speed, then cuBLAS (measured faster than
  the fused Triton GEMM for M >= 128; needs a temporary [N, K] buffer).
* Split-K with an in-kernel fix-up: each K slice writes its fp32 partial tile to a workspace,
  bumps a per-tile counter, and the last slice to arrive sums the partials in a fixed order
  (deterministic) and writes the output, then resets the counter. One launch, no memset. Each
  stream has its own counters, so calls on two streams of one device never share one.

The tile configuration comes from ``select_config(M, N, K, group_size)``, a pure function over a
small table (``DISPATCH``) tuned offline with ``benchmarks/scripts/w4a16_explore.py``.
"""
from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass, replace

import torch

from nibble.formats.int4 import PACK, check_group_width
from nibble.kernels import cuda_build, hopper, reference
from nibble.kernels.early_launch import MAX_TOKENS as EARLY_LAUNCH_MAX_TOKENS
from nibble.kernels.early_launch import early_launch
from nibble.kernels.launch import (NUM_SMS_DEFAULT, SUCCESSOR_AT_END, SUCCESSOR_CAPPED, SUCCESSOR_IF_FULL, SUCCESSORS,
                                   cdiv, num_sms, split_counters)
from nibble.kernels.triton_device import check_triton_device, triton_unavailable

try:  # the module must import without triton (CPU-only installs)
    import triton
    import triton.language as tl
    from nibble.kernels.early_launch import after_prior_grids
    HAS_TRITON = True
except Exception:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None
    HAS_TRITON = False

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------------------------
# configuration and dispatch
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    kind: str = "dot"          # "dot" (tensor cores), "gemv" (CUDA-core FMA, M <= 2),
                               # "dequant" (dequantise to x.dtype once, then cuBLAS)
    block_m: int = 16
    block_n: int = 128
    block_k: int = 128         # multiple of 128 for "dot" (each plane is >= 16 rows)
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2
    factored: bool = True      # apply group scales to the block result (needs group % block_k == 0)
    trans: bool = False        # compute (W^T tile) @ (x^T tile): weight is the MMA's A operand
    dq_asm: int = 2            # dequant: 0 Triton ops, 1 PTX prmt/lop3 (pack 2), 2 PTX lop3 pairs j/j+4
                               # (PTX on CUDA only: the interpreter's `_launch` runs 1 as 0 and 2 as 3,
                               # Triton-op planes in 2's slot order)
    group_m: int = 8           # tile swizzle for L2 reuse of x (large M)
    waves: float = 2.0         # split-K target: CTAs ~ waves * SMs
    max_split: int = 32


# Per (M bucket) tile choices for the H200 (NUM_SMS_DEFAULT SMs). Filled from the offline sweep
# (benchmarks/scripts/w4a16_explore.py); see benchmarks/notes-w4a16.md.
DISPATCH = {
    # M upper bound -> config (split_k is filled in by with_split for the problem at hand)
    1: Config(kind="gemv", block_n=512, block_k=64, num_warps=4, num_stages=1),
    2: Config(kind="gemv", block_n=512, block_k=64, num_warps=4, num_stages=1),
    16: Config(kind="dot", block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3, trans=True),
    # M > 16: dequantise once + cuBLAS. Measured faster than the fused Triton GEMM at every shape for
    # M >= 128 (benchmarks/notes-w4a16.md); the dot kernel with block_m 32 / 64 was never timed on the
    # GPU, so M = 17..64 takes the measured path too. Costs a temporary [N, K] buffer in x.dtype.
    1 << 62: Config(kind="dequant"),
}


def _pick_split(m_tiles: int, n_tiles: int, k_blocks: int, num_sms: int, waves: float = 2.0,
                max_split: int = 32) -> int:
    """Split of K so that ~waves * num_sms CTAs run with a full last wave (1 when tiles suffice)."""
    tiles = m_tiles * n_tiles
    target = waves * num_sms
    if tiles >= target:
        return 1
    best, best_score = 1, -1.0
    for s in range(1, min(max_split, k_blocks) + 1):
        ctas = tiles * s
        eff = ctas / (cdiv(ctas, num_sms) * num_sms)  # useful fraction of the last wave
        score = min(ctas / target, 1.0) * eff
        if score > best_score + 1e-9:
            best, best_score = s, score
    return best


def select_config(M: int, N: int, K: int, group_size: int, num_sms: int = NUM_SMS_DEFAULT) -> Config:
    """Pure function (M, N, K, G) -> Config; no autotuning at call time."""
    for bound in sorted(DISPATCH):
        if M <= bound:
            cfg = DISPATCH[bound]
            break
    if cfg.kind == "dequant":
        return cfg
    bk = cfg.block_k
    if cfg.factored and group_size % bk != 0:
        # groups smaller than the K block (32 / 64) or not a multiple of it: scale inside the tile
        cfg = replace(cfg, factored=False)
    return with_split(cfg, M, N, K, group_size, num_sms)


def with_split(cfg: Config, M: int, N: int, K: int, group_size: int, num_sms: int = NUM_SMS_DEFAULT) -> Config:
    """cfg with split_k chosen for this problem (decode sizes only; large M never splits)."""
    if cfg.kind == "dequant":
        return cfg
    if cfg.kind == "gemv":
        bk = _pow2_divisor(group_size, cfg.block_k)
        m_tiles = 1
    else:
        bk = cfg.block_k
        m_tiles = cdiv(M, cfg.block_m)
    if M > 64:
        return replace(cfg, split_k=1)
    split = _pick_split(m_tiles, cdiv(N, cfg.block_n), cdiv(K, bk), num_sms, cfg.waves, cfg.max_split)
    return replace(cfg, split_k=split)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
if HAS_TRITON:

    def _planes_ptx(magic: str, pack2: bool) -> str:
        """PTX: the 8 nibbles of a word as 16-bit ``C + q`` (magic 0x64006400: fp16 1024, 0x43004300:
        bf16 128). pack2: two neighbouring words in, per nibble one register holding both words'
        values (prmt gathers the halves); otherwise one word in, nibbles j and j + 4 share a register."""
        def lop3(dst, src):
            return f"lop3.b32 {dst}, {src}, 0x000F000F, {magic}, 0xEA;\n"
        if pack2:
            body = ".reg .b32 lo, hi, t;\nprmt.b32 lo, $8, $9, 0x5410;\nprmt.b32 hi, $8, $9, 0x7632;\n"
            for half, word in enumerate(("lo", "hi")):
                body += lop3(f"${4 * half}", word)
                for j in (1, 2, 3):
                    body += f"shr.u32 t, {word}, {4 * j};\n" + lop3(f"${4 * half + j}", "t")
        else:
            body = ".reg .b32 t, r;\n" + lop3("r", "$8") + "mov.b32 {$0, $4}, r;\n"
            for j in (1, 2, 3):
                body += f"shr.u32 t, $8, {4 * j};\n" + lop3("r", "t") + f"mov.b32 {{${j}, ${j + 4}}}, r;\n"
        return "{\n" + body + "}"

    _PLANES_PACK2_BF16 = tl.constexpr(_planes_ptx("0x43004300", True))
    _PLANES_PACK2_F16 = tl.constexpr(_planes_ptx("0x64006400", True))
    _PLANES_PAIRS_BF16 = tl.constexpr(_planes_ptx("0x43004300", False))
    _PLANES_PAIRS_F16 = tl.constexpr(_planes_ptx("0x64006400", False))

    @triton.jit
    def _planes_asm(w, IS_BF16: tl.constexpr):
        """8 planes (nibble j of every word) as fp16/bf16 ``C + q`` (C = 1024 / 128), via PTX, pack=2."""
        PTX: tl.constexpr = _PLANES_PACK2_BF16 if IS_BF16 else _PLANES_PACK2_F16
        DT = tl.bfloat16 if IS_BF16 else tl.float16
        return tl.inline_asm_elementwise(asm=PTX, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r",
                                         args=[w], dtype=(DT,) * 8, is_pure=True, pack=2)

    @triton.jit
    def _planes_asm_p1(w, IS_BF16: tl.constexpr):
        """8 planes as fp16/bf16 ``C + q`` from one word: 3 shifts + 4 lop3 (FasterTransformer trick).

        Nibbles j and j + 4 land in the low / high half of one 32-bit register, so the weave below
        pairs them (K slots permuted; x is permuted the same way)."""
        PTX: tl.constexpr = _PLANES_PAIRS_BF16 if IS_BF16 else _PLANES_PAIRS_F16
        DT = tl.bfloat16 if IS_BF16 else tl.float16
        return tl.inline_asm_elementwise(asm=PTX, constraints="=h,=h,=h,=h,=h,=h,=h,=h,r",
                                         args=[w], dtype=(DT,) * 8, is_pure=True, pack=1)

    @triton.jit
    def _plane16(w, J: tl.constexpr, IS_BF16: tl.constexpr):
        """Plane J as fp16/bf16 ``1 + q / 16`` with Triton integer ops (portable / interpreter)."""
        P: tl.constexpr = 3 if IS_BF16 else 6
        ONE: tl.constexpr = 0x3F80 if IS_BF16 else 0x3C00
        if 4 * J >= P:
            v = (w >> (4 * J - P)) & (0xF << P)
        else:
            v = (w << (P - 4 * J)) & (0xF << P)
        v = (v | ONE).to(tl.int16)
        if IS_BF16:
            return v.to(tl.bfloat16, bitcast=True)
        else:
            return v.to(tl.float16, bitcast=True)

    @triton.jit
    def _plane32(w, J: tl.constexpr):
        """Plane J as fp32 ``1 + q / 256`` (J even) or ``1 + q / 16`` (J odd), portable Triton ops.

        Nibble pairs (2p, 2p+1) share one shift: the even nibble lands on mantissa bits 15..18, the
        odd one on bits 19..22 (the same values as the PTX version, _planes32_asm)."""
        SH: tl.constexpr = 15 - 8 * (J // 2)
        MASK: tl.constexpr = 0x78000 if J % 2 == 0 else 0x780000
        if SH >= 0:
            v = (w << SH) & MASK
        else:
            v = (w >> (-SH)) & MASK
        return (v | 0x3F800000).to(tl.float32, bitcast=True)

    @triton.jit
    def _planes32_asm(w):
        """8 fp32 planes via PTX: 4 shifts + 8 lop3 per word (even planes 1 + q/256, odd 1 + q/16)."""
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t;
            shl.b32 t, $8, 15;
            lop3.b32 $0, t, 0x00078000, 0x3F800000, 0xEA;
            lop3.b32 $1, t, 0x00780000, 0x3F800000, 0xEA;
            shl.b32 t, $8, 7;
            lop3.b32 $2, t, 0x00078000, 0x3F800000, 0xEA;
            lop3.b32 $3, t, 0x00780000, 0x3F800000, 0xEA;
            shr.u32 t, $8, 1;
            lop3.b32 $4, t, 0x00078000, 0x3F800000, 0xEA;
            lop3.b32 $5, t, 0x00780000, 0x3F800000, 0xEA;
            shr.u32 t, $8, 9;
            lop3.b32 $6, t, 0x00078000, 0x3F800000, 0xEA;
            lop3.b32 $7, t, 0x00780000, 0x3F800000, 0xEA;
            }""",
            constraints="=&r,=&r,=&r,=&r,=&r,=&r,=&r,=&r,r",
            args=[w], dtype=(tl.float32,) * 8, is_pure=True, pack=1)

    @triton.jit
    def _planes32(w, ASM: tl.constexpr):
        """The 8 fp32 planes of a word: PTX (ASM) or portable Triton ops (interpreter); same values."""
        if ASM:
            return _planes32_asm(w)
        else:
            return (_plane32(w, 0), _plane32(w, 1), _plane32(w, 2), _plane32(w, 3),
                    _plane32(w, 4), _plane32(w, 5), _plane32(w, 6), _plane32(w, 7))

    @triton.jit
    def _gemv_asm(w, x0, x1, x2, x3, x4, x5, x6, x7):
        """Fused dequant + dot for one row of x: returns (sum_even x_j (1 + q_j/256), sum_odd x_j (1 + q_j/16)).

        Per word: 4 shifts + 8 lop3 + 8 FMA, no int->float conversion."""
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t, f;
            shl.b32 t, $2, 15;
            lop3.b32 f, t, 0x00078000, 0x3F800000, 0xEA;
            mul.rn.f32 $0, f, $3;
            lop3.b32 f, t, 0x00780000, 0x3F800000, 0xEA;
            mul.rn.f32 $1, f, $4;
            shl.b32 t, $2, 7;
            lop3.b32 f, t, 0x00078000, 0x3F800000, 0xEA;
            fma.rn.f32 $0, f, $5, $0;
            lop3.b32 f, t, 0x00780000, 0x3F800000, 0xEA;
            fma.rn.f32 $1, f, $6, $1;
            shr.u32 t, $2, 1;
            lop3.b32 f, t, 0x00078000, 0x3F800000, 0xEA;
            fma.rn.f32 $0, f, $7, $0;
            lop3.b32 f, t, 0x00780000, 0x3F800000, 0xEA;
            fma.rn.f32 $1, f, $8, $1;
            shr.u32 t, $2, 9;
            lop3.b32 f, t, 0x00078000, 0x3F800000, 0xEA;
            fma.rn.f32 $0, f, $9, $0;
            lop3.b32 f, t, 0x00780000, 0x3F800000, 0xEA;
            fma.rn.f32 $1, f, $10, $1;
            }""",
            constraints="=&r,=&r,r,r,r,r,r,r,r,r,r",
            args=[w, x0, x1, x2, x3, x4, x5, x6, x7], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)

    @triton.jit
    def _weave_t(p0, p1, p2, p3, p4, p5, p6, p7, BN: tl.constexpr, BK: tl.constexpr, PERM: tl.constexpr = False):
        """8 planes [BK/8, BN] -> W^T tile [BN, BK].

        PERM=False: natural K order, slot 8i + j holds nibble j. PERM=True: slot 8i + 4b + 2c + a holds
        nibble j = 4a + 2b + c, i.e. nibbles j and j + 4 are neighbours (x is permuted to match by
        _perm_x)."""
        if PERM:
            a = tl.join(tl.join(tl.join(p0, p4), tl.join(p1, p5)), tl.join(tl.join(p2, p6), tl.join(p3, p7)))
        else:
            a = tl.join(tl.join(tl.join(p0, p1), tl.join(p2, p3)), tl.join(tl.join(p4, p5), tl.join(p6, p7)))
        a = tl.permute(a, (1, 0, 4, 3, 2))
        return tl.reshape(a, (BN, BK))

    @triton.jit
    def _perm_x(x, BM: tl.constexpr, BK: tl.constexpr):
        """x [BM, BK] -> columns in the PERM slot order of _weave_t (slot 4b + 2c + a <- k = 4a + 2b + c)."""
        x = tl.reshape(x, (BM, BK // 8, 2, 2, 2))
        x = tl.permute(x, (0, 1, 3, 4, 2))
        return tl.reshape(x, (BM, BK))

    @triton.jit
    def _mm(a, b, acc, F32: tl.constexpr):
        """tl.dot; F32 upcasts the operands (the CPU interpreter mis-multiplies bf16 dots)."""
        if F32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            return tl.dot(a, b, acc)

    @triton.jit
    def _store_tile(acc, out_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, tile_id, pid_k, SPLIT_K,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_SPLIT: tl.constexpr,
                    TRANS: tl.constexpr):
        """Write acc ([BM, BN], or [BN, BM] when TRANS) to out; split-K fix-up when USE_SPLIT."""
        if TRANS:
            o_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
            o_mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
            loc = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        else:
            o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
            o_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
            loc = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        if not USE_SPLIT:
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
        else:
            tile_ws = ws_ptr + tile_id.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N)
            tl.store(tile_ws + pid_k * (BLOCK_M * BLOCK_N) + loc, acc)
            # all threads' partial stores are done before thread 0's release (cumulativity, as in
            # cooperative-groups grid sync); the last arriving CTA reads the partials through L2.
            tl.debug_barrier()
            old = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
            if old == SPLIT_K - 1:
                total = tl.load(tile_ws + loc, cache_modifier=".cg")
                for s in range(1, SPLIT_K):
                    total += tl.load(tile_ws + s * (BLOCK_M * BLOCK_N) + loc, cache_modifier=".cg")
                tl.store(o_ptrs, total.to(out_ptr.dtype.element_ty), mask=o_mask)
                tl.atomic_xchg(cnt_ptr + tile_id, 0)

    @triton.jit
    def _w4a16_dot_kernel(
        x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr,
        M, N, K, G, stride_xm, stride_om, SPLIT_K,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        USE_SPLIT: tl.constexpr, GROUP_M: tl.constexpr,
        FACTORED: tl.constexpr, TRANS: tl.constexpr, DQ_ASM: tl.constexpr,
        IS_BF16: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
    ):
        """Tensor-core W4A16: one K block = one [BM, BK] x [BK, BN] dot on the re-woven tile.

        FACTORED (group % BLOCK_K == 0): the tile holds raw ``C + q/D`` codes, the block result is
        scaled in fp32. Otherwise the tile is dequantised (``q*s + z`` in fp32, rounded once)."""
        BK8: tl.constexpr = BLOCK_K // 8
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        width = GROUP_M * num_pid_n
        group_id = pid // width
        first_m = group_id * GROUP_M
        gsize = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % gsize
        pid_n = (pid % width) // gsize
        tile_id = pid_m * num_pid_n + pid_n

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_i = tl.arange(0, BK8)
        offs_k = tl.arange(0, BLOCK_K)
        offs_n_ld = tl.max_contiguous(tl.multiple_of(offs_n % N, BLOCK_N), BLOCK_N)
        offs_m_ld = offs_m % M

        k_blocks = tl.cdiv(K, BLOCK_K)
        per_split = tl.cdiv(k_blocks, SPLIT_K)
        kb_start = pid_k * per_split
        kb_end = tl.minimum(kb_start + per_split, k_blocks)

        CDT: tl.constexpr = tl.bfloat16 if IS_BF16 else tl.float16
        # DQ_ASM: 0 Triton ops; 1 PTX pack-2; 2 PTX j/j+4 pairs (PERM slot order); 3 Triton ops + PERM order
        ASM_PLANES: tl.constexpr = DQ_ASM == 1 or DQ_ASM == 2
        MAGIC_C: tl.constexpr = (128.0 if IS_BF16 else 1024.0) if ASM_PLANES else 1.0
        MAGIC_D: tl.constexpr = 1.0 if ASM_PLANES else 16.0
        PERM: tl.constexpr = DQ_ASM >= 2

        if TRANS:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

        qw_ptrs = qw_ptr + offs_i[:, None] * N + offs_n_ld[None, :]
        x_ptrs = x_ptr + offs_m_ld[:, None] * stride_xm + offs_k[None, :]
        for kb in range(kb_start, kb_end):
            k0 = kb * BLOCK_K
            if EVEN_K:
                w = tl.load(qw_ptrs + (k0 // 8) * N)
                x = tl.load(x_ptrs + k0)
            else:
                k_ok = (k0 + 8 * offs_i) < K
                w = tl.load(qw_ptrs + (k0 // 8) * N, mask=k_ok[:, None], other=0)
                x = tl.load(x_ptrs + k0, mask=(k0 + offs_k[None, :]) < K, other=0.0)
            if FACTORED:
                g = k0 // G
                s = tl.load(s_ptr + g * N + offs_n_ld).to(tl.float32)
                z = tl.load(z_ptr + g * N + offs_n_ld).to(tl.float32)
                if DQ_ASM == 2:
                    p0, p1, p2, p3, p4, p5, p6, p7 = _planes_asm_p1(w, IS_BF16)
                elif DQ_ASM == 1:
                    p0, p1, p2, p3, p4, p5, p6, p7 = _planes_asm(w, IS_BF16)
                else:
                    p0 = _plane16(w, 0, IS_BF16)
                    p1 = _plane16(w, 1, IS_BF16)
                    p2 = _plane16(w, 2, IS_BF16)
                    p3 = _plane16(w, 3, IS_BF16)
                    p4 = _plane16(w, 4, IS_BF16)
                    p5 = _plane16(w, 5, IS_BF16)
                    p6 = _plane16(w, 6, IS_BF16)
                    p7 = _plane16(w, 7, IS_BF16)
                wt = _weave_t(p0, p1, p2, p3, p4, p5, p6, p7, BLOCK_N, BLOCK_K, PERM)  # [BN, BK]
                xsum = tl.sum(x.to(tl.float32), axis=1)  # [BM]
                if PERM:
                    x = _perm_x(x, BLOCK_M, BLOCK_K)
                sD = s * MAGIC_D
                zc = z - MAGIC_C * sD
                if TRANS:
                    part = _mm(wt, tl.trans(x), None, DOT_F32)
                    acc += part * sD[:, None] + zc[:, None] * xsum[None, :]
                else:
                    part = _mm(x, tl.trans(wt), None, DOT_F32)
                    acc += part * sD[None, :] + xsum[:, None] * zc[None, :]
            else:
                f0, f1, f2, f3, f4, f5, f6, f7 = _planes32(w, ASM_PLANES)
                if PERM:
                    x = _perm_x(x, BLOCK_M, BLOCK_K)
                gi = (k0 + 8 * offs_i) // G
                if EVEN_K:
                    st = tl.load(s_ptr + gi[:, None] * N + offs_n_ld[None, :]).to(tl.float32)
                    zt = tl.load(z_ptr + gi[:, None] * N + offs_n_ld[None, :]).to(tl.float32)
                else:
                    st = tl.load(s_ptr + gi[:, None] * N + offs_n_ld[None, :], mask=k_ok[:, None], other=0).to(tl.float32)
                    zt = tl.load(z_ptr + gi[:, None] * N + offs_n_ld[None, :], mask=k_ok[:, None], other=0).to(tl.float32)
                se = st * 256.0
                so = st * 16.0
                ze = zt - se
                zo = zt - so
                wt = _weave_t((f0 * se + ze).to(CDT), (f1 * so + zo).to(CDT), (f2 * se + ze).to(CDT),
                              (f3 * so + zo).to(CDT), (f4 * se + ze).to(CDT), (f5 * so + zo).to(CDT),
                              (f6 * se + ze).to(CDT), (f7 * so + zo).to(CDT), BLOCK_N, BLOCK_K, PERM)
                if TRANS:
                    acc = _mm(wt, tl.trans(x), acc, DOT_F32)
                else:
                    acc = _mm(x, tl.trans(wt), acc, DOT_F32)

        _store_tile(acc, out_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, tile_id, pid_k, SPLIT_K,
                    BLOCK_M, BLOCK_N, USE_SPLIT, TRANS)

    @triton.jit
    def _w4a16_gemv_kernel(
        x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr,
        M, N, K, G, stride_xm, stride_om, SPLIT_K,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        USE_SPLIT: tl.constexpr, DQ_ASM: tl.constexpr,
    ):
        """M <= 2 on CUDA cores. Needs group % BLOCK_K == 0 (one group per K block), so K % BLOCK_K == 0 too (groups
        tile K): no masks along K.

        Each thread owns all BLOCK_K/8 word-rows of its columns, so the K reduction is in
        registers; fp32 planes ``1 + q/256`` (even nibbles) / ``1 + q/16`` (odd) feed FMAs directly
        (PTX: 4 shifts + 8 lop3 + 8 FMA per word), and the group scale is applied per column per block:
        ``sum_k x q = 256 (A_even - X_even) + 16 (A_odd - X_odd)``."""
        BK8: tl.constexpr = BLOCK_K // 8
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_n_ld = tl.max_contiguous(tl.multiple_of(offs_n % N, BLOCK_N), BLOCK_N)
        offs_i = tl.arange(0, BK8)
        k_blocks = tl.cdiv(K, BLOCK_K)
        per_split = tl.cdiv(k_blocks, SPLIT_K)
        kb_start = pid_k * per_split
        kb_end = tl.minimum(kb_start + per_split, k_blocks)
        acc0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
        qw_ptrs = qw_ptr + offs_i[:, None] * N + offs_n_ld[None, :]
        for kb in range(kb_start, kb_end):
            k0 = kb * BLOCK_K
            kk = k0 + 8 * offs_i
            w = tl.load(qw_ptrs + (k0 // 8) * N)
            g = k0 // G
            s = tl.load(s_ptr + g * N + offs_n_ld).to(tl.float32)
            z = tl.load(z_ptr + g * N + offs_n_ld).to(tl.float32)
            for m in tl.static_range(BLOCK_M):  # BLOCK_M == M (1 or 2)
                xp = x_ptr + m * stride_xm + kk
                x0 = tl.load(xp + 0).to(tl.float32)
                x1 = tl.load(xp + 1).to(tl.float32)
                x2 = tl.load(xp + 2).to(tl.float32)
                x3 = tl.load(xp + 3).to(tl.float32)
                x4 = tl.load(xp + 4).to(tl.float32)
                x5 = tl.load(xp + 5).to(tl.float32)
                x6 = tl.load(xp + 6).to(tl.float32)
                x7 = tl.load(xp + 7).to(tl.float32)
                if DQ_ASM:
                    ae, ao = _gemv_asm(w, x0[:, None], x1[:, None], x2[:, None], x3[:, None],
                                       x4[:, None], x5[:, None], x6[:, None], x7[:, None])
                else:
                    ae = (x0[:, None] * _plane32(w, 0) + x2[:, None] * _plane32(w, 2)
                          + x4[:, None] * _plane32(w, 4) + x6[:, None] * _plane32(w, 6))
                    ao = (x1[:, None] * _plane32(w, 1) + x3[:, None] * _plane32(w, 3)
                          + x5[:, None] * _plane32(w, 5) + x7[:, None] * _plane32(w, 7))
                xe = tl.sum(x0 + x2 + x4 + x6, axis=0)
                xo = tl.sum(x1 + x3 + x5 + x7, axis=0)
                qsum = (tl.sum(ae, axis=0) - xe) * 256.0 + (tl.sum(ao, axis=0) - xo) * 16.0
                contrib = qsum * s + (xe + xo) * z
                if m == 0:
                    acc0 += contrib
                else:
                    acc1 += contrib
        offs_m = tl.arange(0, BLOCK_M)
        if BLOCK_M == 1:
            res = acc0[None, :]
        else:
            res = tl.join(acc0, acc1).trans()  # [2, BN]
        _store_tile(res, out_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, pid_n, pid_k,
                    SPLIT_K, BLOCK_M, BLOCK_N, USE_SPLIT, False)

    @triton.jit
    def _dequant_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, K, G,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DQ_ASM: tl.constexpr):
        """Dense W [N, K] (nn.Linear layout) in out's dtype: W = q * s + z in fp32, rounded once."""
        BK8: tl.constexpr = BLOCK_K // 8
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_i = pid_k * BK8 + tl.arange(0, BK8)
        mask = (offs_i[:, None] < K // 8) & (offs_n[None, :] < N)
        w = tl.load(qw_ptr + offs_i[:, None] * N + offs_n[None, :], mask=mask, other=0)
        gi = (8 * offs_i) // G
        st = tl.load(s_ptr + gi[:, None] * N + offs_n[None, :], mask=mask, other=0).to(tl.float32)
        zt = tl.load(z_ptr + gi[:, None] * N + offs_n[None, :], mask=mask, other=0).to(tl.float32)
        f0, f1, f2, f3, f4, f5, f6, f7 = _planes32(w, DQ_ASM)
        se = st * 256.0
        so = st * 16.0
        ze = zt - se
        zo = zt - so
        ty = out_ptr.dtype.element_ty
        wt = _weave_t((f0 * se + ze).to(ty), (f1 * so + zo).to(ty), (f2 * se + ze).to(ty), (f3 * so + zo).to(ty),
                      (f4 * se + ze).to(ty), (f5 * so + zo).to(ty), (f6 * se + ze).to(ty), (f7 * so + zo).to(ty),
                      BLOCK_N, BLOCK_K)  # [BN, BK]
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        tl.store(out_ptr + offs_n[:, None] * K + offs_k[None, :], wt,
                 mask=(offs_n[:, None] < N) & (offs_k[None, :] < K))


    @triton.jit
    def _gather_columns_kernel(x_ptr, index_ptr, out_ptr, K, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """Program (row, block of columns): out[row, j] = x[row, index[j]], rows of K contiguous."""
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = j < K
        src = tl.load(index_ptr + j, mask=m, other=0)  # no kernel writes the permutation: read it before the wait
        after_prior_grids(PDL)
        row = tl.program_id(0).to(tl.int64) * K
        tl.store(out_ptr + row + j, tl.load(x_ptr + row + src, mask=m), mask=m)

    @triton.jit
    def _gather_rows_kernel(x_ptr, index_ptr, out_ptr, K, BLOCK: tl.constexpr):
        """Program per row: the row loaded once, coalesced, and permuted inside the program."""
        j = tl.arange(0, BLOCK)
        m = j < K
        src = tl.load(index_ptr + j, mask=m, other=0)
        row = tl.program_id(0).to(tl.int64) * K
        tl.store(out_ptr + row + j, tl.gather(tl.load(x_ptr + row + j, mask=m), src, 0), mask=m)


# Rows wider than this stay with the column-block kernel: a whole row is held in one program's registers.
GATHER_ROW_MAX_K = 16384


def gather_columns(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[..., index] on CUDA (`reference.gather_columns`): a GPTQ act-order layer's input in its stored order.
    PyTorch's gather would be a kernel that does not take part in early launch (`early_launch.py`), so the
    matmul after it could not start under it either: in a decode step that cost more than the gather.

    Two kernels: up to the sizes where the matmul after it launches early (decode), a program per 1,024
    columns of a row, loading at random places (many programs for one row: 0.9-1.4 us at one token);
    above that, a program per whole row, which reads the row once instead of once per column block
    (H200, bf16, 128 rows: 1.1x at K = 4,096, 1.9x at 14,336; 2,048 rows 1.3-3.6x;
    benchmarks/scripts/gather_columns_ab.py, benchmarks/results/session53-h200/)."""
    check_triton_device(x, "W4A16 Triton")
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    M, K = x2.shape
    out = torch.empty_like(x2)
    if M > EARLY_LAUNCH_MAX_TOKENS and K <= GATHER_ROW_MAX_K:
        _gather_rows_kernel[(M,)](x2, index, out, K, BLOCK=triton.next_power_of_2(K), num_warps=8)
        return out.view(x.shape)
    pdl = not _INTERPRET and early_launch(x.device, M)
    BLOCK = 1024
    _gather_columns_kernel[(M, cdiv(K, BLOCK))](x2, index, out, K, BLOCK=BLOCK, PDL=pdl, launch_pdl=pdl,
                                                num_warps=4)
    return out.view(x.shape)


# ----------------------------------------------------------------------------------------------
# launch
# ----------------------------------------------------------------------------------------------
def _pow2_divisor(g: int, cap: int) -> int:
    b = 8
    while b * 2 <= cap and g % (b * 2) == 0:
        b *= 2
    return b


def _launch(x, qweight, scales, zeros, group_size, cfg: Config, out=None):
    check_triton_device(x, "W4A16 Triton")
    M, K = x.shape
    N = qweight.shape[1]
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    is_bf16 = x.dtype == torch.bfloat16
    dq_asm = int(cfg.dq_asm)
    if _INTERPRET:  # no inline PTX in the interpreter: Triton-op planes, same slot order
        dq_asm = 3 if dq_asm >= 2 else 0
    if cfg.kind == "gemv":
        if M > 2:
            raise ValueError("the gemv kernel handles M <= 2")
        bk = _pow2_divisor(group_size, cfg.block_k)  # one group per K block (and so K % bk == 0)
        bm = M
        tiles = cdiv(N, cfg.block_n)
    else:
        bk = cfg.block_k
        bm = cfg.block_m
        tiles = cdiv(M, bm) * cdiv(N, cfg.block_n)
    grid = (tiles, cfg.split_k)
    if cfg.split_k > 1:
        ws = torch.empty(tiles * cfg.split_k * bm * cfg.block_n, dtype=torch.float32, device=x.device)
        cnt = split_counters(x.device, tiles)
    else:
        ws = out  # unused
        cnt = qweight  # unused
    if cfg.kind == "gemv":
        _w4a16_gemv_kernel[grid](
            x, qweight, scales, zeros, out, ws, cnt, M, N, K, group_size, x.stride(0), out.stride(0), cfg.split_k,
            BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=bk, USE_SPLIT=cfg.split_k > 1,
            DQ_ASM=dq_asm in (1, 2), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        factored = cfg.factored and group_size % bk == 0
        _w4a16_dot_kernel[grid](
            x, qweight, scales, zeros, out, ws, cnt, M, N, K, group_size, x.stride(0), out.stride(0), cfg.split_k,
            BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=bk, USE_SPLIT=cfg.split_k > 1,
            GROUP_M=cfg.group_m, FACTORED=factored, TRANS=cfg.trans, DQ_ASM=dq_asm, IS_BF16=is_bf16,
            EVEN_K=K % bk == 0, DOT_F32=_INTERPRET and is_bf16, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


# ----------------------------------------------------------------------------------------------
# CUDA C++ tensor-core kernel for M <= 64 (csrc/w4a16_mma.cu: layout and numerics are explained there)
# ----------------------------------------------------------------------------------------------
MMA_MAX_M = 64
# Register budget: 4 and 8 token tiles take 128 / ~245 registers per thread (ptxas, sm_90), so a
# CTA of 16 warps would not fit the SM's 64K registers. (32 warps of one tile, at 64 registers,
# measured 3-10% slower than 16 on every layer of 1,024-8,192 columns, H200.)
MMA_MAX_WARPS = {1: 16, 2: 16, 4: 8, 8: 8}
MMA_RING = 4  # cp.async stages per warp (RING in the .cu)
MMA_SMEM_LIMIT = 227 * 1024  # per-block opt-in maximum on sm_80 / sm_90
MMA_MAX_WEIGHTS = 3  # weights one launch can serve (MAX_WEIGHTS in csrc/skinny.cuh), up to 32 tokens
MMA_MANY_MAX_M = 32


@dataclass(frozen=True)
class MmaConfig:
    token_tiles: int     # tiles of 8 tokens (1, 2, 4, 8): M <= 8 * token_tiles
    warps: int           # warps per CTA, splitting K; one CTA per 32 output columns
    x_l1: bool = False   # x copied through the L1 (1 or 2 token tiles; see x_through_l1)
    successor: int = SUCCESSOR_AT_END  # when the next kernel may launch (see successor_launch)


_MMA_SIGNATURES = cuda_build.signatures(
    "nibble_w4a16_mma", [ctypes.c_int] * 4 + [ctypes.c_void_p] + [ctypes.c_int] * 5 + [ctypes.c_void_p] * 6
    + [ctypes.c_int, ctypes.c_int, ctypes.c_void_p],
    "nibble_cuda_error_string")


def _mma_lib(device):
    """The compiled kernel for this device, or None (see ``cuda_build.library``)."""
    return cuda_build.library("w4a16_mma", device, _MMA_SIGNATURES)


def _group_shift_steps(group_size: int, K: int) -> int | None:
    """log2(group / 32) for power-of-two groups >= 32; 30 for one group per column; None otherwise."""
    if group_size == K:
        return 30
    steps = group_size // 32
    if group_size % 32 or steps & (steps - 1):
        return None
    return steps.bit_length() - 1


def mma_applicable(x: torch.Tensor, N: int, K: int, group_size: int) -> bool:
    return (x.is_cuda and x.shape[0] <= MMA_MAX_M and N % 32 == 0 and K % 32 == 0
            and _group_shift_steps(group_size, K) is not None
            and cuda_build.capability(x.device) >= (8, 0) and _mma_lib(x.device) is not None)


def mma_smem_bytes(cfg: MmaConfig, ring_stages: int = MMA_RING) -> int:
    """Shared memory of one CTA: the cp.async ring (4 stages of 512 B of weights, 128 B of group
    parameters, 192 at four token tiles, where the next group's scales come too, 512 B of x per token
    tile), reused for the cross-warp reduction (csrc/w4a16_mma.cu: smem_bytes).
    ``ring_stages``: another ring depth, for the experiments that rebuild the kernel with one."""
    ring = cfg.warps * ring_stages * ((704 if cfg.token_tiles == 4 else 640) + 512 * cfg.token_tiles)
    return max(ring, cfg.warps * cfg.token_tiles * 8 * 32 * 4)


def mma_config_valid(cfg: MmaConfig, M: int) -> bool:
    return (M <= 8 * cfg.token_tiles and cfg.token_tiles in MMA_MAX_WARPS
            and 1 <= cfg.warps <= MMA_MAX_WARPS[cfg.token_tiles] and mma_smem_bytes(cfg) <= MMA_SMEM_LIMIT
            and (not cfg.x_l1 or cfg.token_tiles <= 2)
            and cfg.successor in SUCCESSORS)


def x_through_l1(token_tiles: int, ctas: int, K: int, num_sms: int) -> bool:
    """Whether the kernel copies x through the L1 (cp.async.ca) rather than around it (.cg). The CTAs
    an SM holds stream other columns over the same K steps at about the same time, so where there
    are more CTAs than SMs their copies of x can hit in the L1 instead of each going to the L2; at 8
    tokens x is as many bytes as the weight, at 16 twice. H200, bit-exact either way
    (benchmarks/results/w4a16-x-through-l1-h200.json): M = 8, 12288 x 4096 11.8 -> 10.2 us,
    Llama-2-7B gate/up 21.4 -> 18.1, q/k/v 12.3 -> 10.8; M = 16, gate/up 30.0 -> 24.9, 12288 x 4096
    14.1 -> 13.5; M = 1 unchanged. Not with one CTA per SM (nothing to share: 0-2% slower), nor at
    two token tiles with K > 4096 (28672 x 8192 and 8192 x 28672 at M = 16: 3-6% slower), nor at
    four (17-32 tokens: 5-40% slower on every layer, w4a16-x-through-l1-four-tiles-h200.json: a
    step's x is 2 KB a warp there); eight token tiles were not measured."""
    return ctas > num_sms and (token_tiles == 1 or (token_tiles == 2 and K <= 4096))


def successor_launch(token_tiles: int, M: int, x_l1: bool) -> int:
    """When the next kernel in the stream may launch (SUCCESSOR_*; csrc/skinny.cuh says how each
    works). Launched at once, the successor's launch and first fetches hide under this kernel; capped,
    this launch cannot leave an SM a free slot for a successor's CTA to double up in. H200
    (benchmarks/results/w4a16-successor-*-h200.json, the op back to back and the engine's decode, each
    way in alternating rounds): capped at one and two token tiles, the 4096-deep layers at M <= 4 run
    7-12% faster back to back (12288 x 4096 10.0 -> 8.9 us, 4096 x 11008 9.6 -> 8.8), 4096 x 11008 at
    M = 16 12.4 -> 11.3, the 70B layers within +-3%; Llama-2-7B and Llama-3-8B decode 5-7% faster at
    batch 1 and 8. But capped shared memory shrinks the L1, which x goes through above 4 tokens where
    `x_through_l1` says (8192 x 28672 at M = 8: 42.9 -> 47.9 us, 14336 x 4096 at M = 16 16.3 -> 18.3):
    there the successor launches at once only where the CTAs fill the SMs anyway. At four and eight
    tiles it launches at the end (capped, back to back 4-7% slower at M = 32)."""
    if token_tiles > 2:
        return SUCCESSOR_AT_END
    return SUCCESSOR_CAPPED if M <= 4 or not x_l1 else SUCCESSOR_IF_FULL


@functools.lru_cache(maxsize=None)
def select_mma_config(M: int, N: int, K: int, num_sms: int = NUM_SMS_DEFAULT) -> MmaConfig:
    """Pure function of the problem (N: the columns of every weight of the launch together): warps
    per CTA doubled from 4 while the GPU has fewer than 32 warps per SM and each warp keeps >= 16 K
    steps at one token tile, >= 32 at more (fewer when there are fewer CTAs than SMs); at one token
    tile, only where the doubled grid still fits on the GPU at once (32 warps an SM) or each warp
    keeps >= 32 steps. Measured on the H200: at M = 16 and N = 12288, K = 4096, four warps of 32
    steps beat eight of 16 by 15%; at M = 1 eight of 16 win (12288 x 4096: 8%), but not where eight
    leave a second wave of CTAs: Llama-2-7B's gate/up launch (688 CTAs) runs 2-6% faster at four
    warps at M = 1-8, a 70B-shaped q/k/v (320 CTAs) 7-11% faster at eight than at sixteen
    (benchmarks/notes-w4a16.md, session 37). x through the L1 where ``x_through_l1`` says."""
    token_tiles = next(t for t in (1, 2, 4, 8) if M <= 8 * t)
    ctas, warps, steps = N // 32, 4, K // 32
    min_steps = 16 if token_tiles == 1 else 32
    while (warps < MMA_MAX_WARPS[token_tiles] and ctas * warps < 32 * num_sms
           and (ctas < num_sms or steps >= min_steps * 2 * warps)
           and (token_tiles > 1 or ctas * 2 * warps <= 32 * num_sms or steps >= 32 * 2 * warps)):
        warps *= 2
    x_l1 = x_through_l1(token_tiles, ctas, K, num_sms)
    return MmaConfig(token_tiles, warps, x_l1, successor_launch(token_tiles, M, x_l1))


def w4a16_mma(x, qweight, scales, zeros, group_size, config: MmaConfig | None = None, out=None):
    """y = x @ W.T on the tensor cores for M <= 64 (inputs already checked by ``_check``)."""
    return w4a16_mma_many(x, [(qweight, scales, zeros)], group_size, config, None if out is None else [out])[0]


def w4a16_mma_many(x, weights, group_size, config: MmaConfig | None = None, outs=None):
    """[x @ W_i.T for W_i in weights] in one launch, for up to MMA_MAX_WEIGHTS weights (qweight,
    scales, zeros) that read the same x, e.g. a block's q/k/v projections; inputs already checked."""
    if not x.is_cuda:
        raise ValueError(f"w4a16_mma is a CUDA kernel: it needs CUDA tensors, got device {x.device}")
    M, K = x.shape
    ns = [qw.shape[1] for qw, _, _ in weights]
    lib = _mma_lib(x.device)
    shift = _group_shift_steps(group_size, K)
    if (lib is None or shift is None or M > (MMA_MAX_M if len(weights) == 1 else MMA_MANY_MAX_M) or K % 32
            or any(n % 32 for n in ns) or not 1 <= len(weights) <= MMA_MAX_WEIGHTS):
        raise ValueError(f"w4a16_mma needs the compiled kernel, M <= {MMA_MAX_M} ({MMA_MANY_MAX_M} for several "
                         f"weights), N and K multiples of 32, a power-of-two group >= 32 (or per-column) and 1 to "
                         f"{MMA_MAX_WEIGHTS} weights; got M={M} N={ns} K={K} group={group_size}")
    cfg = config or select_mma_config(M, sum(ns), K, num_sms(x.device))
    if not mma_config_valid(cfg, M):
        raise ValueError(f"{cfg} is not a valid config for M={M}: M <= 8 * token_tiles, "
                         f"warps <= {MMA_MAX_WARPS.get(cfg.token_tiles)}, shared memory <= {MMA_SMEM_LIMIT} bytes, "
                         f"x_l1 at 1 or 2 token tiles only")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:  # rows are read as 16-byte vectors
        x = x.clone(memory_format=torch.contiguous_format)
    weights = [(qw.contiguous(), s.contiguous(), z.contiguous()) for qw, s, z in weights]
    if outs is None:
        outs = [torch.empty((M, n), dtype=x.dtype, device=x.device) for n in ns]
    err = cuda_build.launch(
        lib.nibble_w4a16_mma, x.device, int(x.dtype == torch.bfloat16), cfg.token_tiles, cfg.warps, int(cfg.x_l1),
        x.data_ptr(), M, K, shift, x.stride(0), len(weights), *cuda_build.weight_arrays(zip(*weights), outs, ns),
        int(early_launch(x.device, M)),
        cfg.successor)
    if err:
        raise RuntimeError(f"w4a16_mma launch failed: {lib.nibble_cuda_error_string(err).decode()} ({cfg})")
    return outs


# ----------------------------------------------------------------------------------------------
# CUDA C++ GEMM for many tokens on Hopper (csrc/w4a16_wgmma.cu: asynchronous 16-bit wgmma, sm_90a)
# ----------------------------------------------------------------------------------------------
# The compiled CTA shapes (tokens, channels) and the config model (`hopper.CostModel`), fitted to
# the sweeps of benchmarks/scripts/w4a16_wgmma_sweep.py on the H200 (session 16, M = 64..512, with
# session 20's 64 x 128 tile, session 21's small models' layers at M = 64..4096 and session 7's
# unsplit configs for M = 1024 and 4096; `fit_cost_model.py`: its picks are within 0.5% of the best
# measured config on average over the 48 issue-shape cells, 5% at worst, and 1.9% over the 84
# small-model cells, 20% at worst; the previous model's were 14% off on the small models, up to
# 2.1x). The 64-token tiles were swept up to 256 tokens only, so they are not picked above.
# Split-K runs in clusters, which the GPU holds fewer of than SMs / split (w4a4.py says how many);
# its costs were fitted with the partials through global memory, before shared memory made a split
# cheaper (4096 x 11008 at 128 tokens in 3 splits: 38.5 -> 33.9 us; w4a4.py, notes-w4a16.md).
WGMMA = hopper.WgmmaGemm(
    "w4a16_wgmma",
    cuda_build.signatures("nibble_w4a16_wgmma", [ctypes.c_int] * 3 + [ctypes.c_void_p, ctypes.c_int]
                          + [ctypes.c_void_p] * 6 + [ctypes.c_int] * 7 + [ctypes.c_void_p],
                          "nibble_w4a16_wgmma_error_string"),
    hopper.CostModel(stage_us={(64, 256): 1.443, (128, 256): 1.819, (128, 128): 0.975, (256, 128): 1.45,
                               (64, 128): 0.8},
                     item_us={(64, 256): 2.53, (128, 256): 3.15, (128, 128): 4.02, (256, 128): 3.32,
                              (64, 128): 3.78},
                     split_output_us=1.73, split_us=0.63, max_tokens={(64, 256): 256, (64, 128): 256}))
# Where the op takes which kernel (H200, benchmarks/notes-w4a16.md sessions 7 and 21): the skinny kernel
# up to 32 tokens, the wgmma kernel from 33 to WGMMA_MAX_M tokens, dequantise + cuBLAS above. A tiny
# layer alone (N * K <= TINY_LAYER: SmolLM2's, Qwen2-0.5B's o_proj and down_proj, Llama-3.2-1B's o_proj)
# never takes the wgmma kernel, whose fixed cost per tile outweighs a few K stages: the skinny kernel to
# 64 tokens and dequantise + cuBLAS above were the faster in 49 of the 54 tiny-layer cells swept up to
# 2,048 tokens, by up to 2x (192 x 576 at 1,024: 5.2 against 10.0 us; the wgmma kernel won by 6-28% at
# 64 tokens on 576 x 1536, 896 x 4864 and 2048 x 2048, and by 2-8% at 1,024-2,048 on two layers;
# results/w4a16-wgmma-sweep-small-models-h200.json). Several weights in one launch (q/k/v, gate/up) take
# it however small: dequantise + cuBLAS would be two launches per weight (so done, Llama-3.2-1B's
# prefill ran 2-3% slower at 512-1024 tokens, results/dispatch-ab-w4a16-tiny-groups-dequant-h200.json).
# Above TINY_LAYER the wgmma kernel was the faster from 65 tokens on every layer swept (4096 x 4096 at
# 128 tokens 24.2 -> 20.9 us, 2048 x 8192 28.0 -> 20.8, Qwen2-0.5B's gate/up launch 13.4 -> 10.8) but
# that gate/up launch at 512-2048 (3-10% slower), and at 64 tokens on all but 4096 x 4096 (7% slower
# than the skinny kernel there).
TINY_LAYER = 8 << 20
WGMMA_MAX_M = 2048


def wgmma_group_ok(group_size: int, K: int) -> bool:
    """Groups a 128-deep stage of `w4a16_wgmma` can hold whole: 32, 64, multiples of 128, or one per column."""
    return group_size in (32, 64) or group_size % hopper.STAGE_K == 0 or group_size == K


def wgmma_applicable(x: torch.Tensor, N: int, K: int, group_size: int) -> bool:
    """Whether `w4a16_wgmma` can run this product: an sm_90 GPU (H100/H200), N % 8 == 0 (16-byte
    rows of scales for the TMA), a group `wgmma_group_ok` accepts, and the kernel built."""
    return (x.is_cuda and N > 0 and N % 8 == 0 and wgmma_group_ok(group_size, K)
            and cuda_build.capability(x.device) == (9, 0) and WGMMA.lib(x.device) is not None)


def large_m_kernel(M: int, N: int, K: int, weights: int = 1) -> str:
    """Which CUDA path the op takes on Hopper for a launch of ``weights`` weights of N columns in all:
    "skinny" (`w4a16_mma`), "wgmma" (`w4a16_wgmma`) or "dequant" (dequantise + cuBLAS); measured on
    the H200 (see TINY_LAYER, WGMMA_MAX_M)."""
    tiny = weights == 1 and N * K <= TINY_LAYER
    if M <= 32 or (tiny and M <= MMA_MAX_M):
        return "skinny"
    if M > WGMMA_MAX_M or tiny:
        return "dequant"
    return "wgmma"


def w4a16_wgmma(x, qweight, scales, zeros, group_size, config: dict | None = None, out=None):
    """y = x @ W.T on Hopper's asynchronous tensor cores (inputs already checked by ``_check``).
    ``config`` (bn, channels, split_k; split_k 1 where left out) overrides `WGMMA.config`."""
    return w4a16_wgmma_many(x, [(qweight, scales, zeros)], group_size, config, None if out is None else [out])[0]


def w4a16_wgmma_many(x, weights, group_size, config: dict | None = None, outs=None):
    """[x @ W_i.T for W_i in weights] in one launch, for up to MMA_MAX_WEIGHTS weights (qweight,
    scales, zeros) that read the same x (a block's q/k/v or gate/up; inputs already checked),
    every width but the last a multiple of a tile's channels (`WGMMA.tiles`): the kernel runs their
    columns side by side, each weight writing its own output. ``config`` overrides `WGMMA.config`."""
    M, K = x.shape
    widths = [qw.shape[1] for qw, _, _ in weights]
    if not (1 <= len(weights) <= MMA_MAX_WEIGHTS and all(wgmma_applicable(x, n, K, group_size) for n in widths)):
        raise ValueError(f"w4a16_wgmma needs an sm_90 GPU with the compiled kernel, N % 8 == 0, a group of 32, 64, "
                         f"a multiple of 128 or one per column and 1 to {MMA_MAX_WEIGHTS} weights; got N={widths} "
                         f"K={K} group={group_size} on {x.device}")
    cfg = WGMMA.launch_config(config, M, K, widths, WGMMA.clusters(x.device))
    tile = (cfg["bn"], cfg["channels"])
    # The TMA reads 16-byte aligned rows; the epilogue stores 4 outputs (8 bytes) at a time.
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)
    weights = [tuple(t if t.data_ptr() % 16 == 0 else t.clone() for t in w) for w in weights]
    given = outs if outs is not None else [None] * len(weights)
    ys = [y if y is not None and y.stride(1) == 1 and y.stride(0) % 4 == 0 and y.data_ptr() % 8 == 0
          else torch.empty((M, n), dtype=x.dtype, device=x.device) for y, n in zip(given, widths)]
    split, per_split = hopper.split_plan(K, cfg["split_k"])
    lib = WGMMA.lib(x.device)
    err = cuda_build.launch(
        lib.nibble_w4a16_wgmma, x.device, int(x.dtype == torch.bfloat16), *tile, x.data_ptr(), len(weights),
        *cuda_build.weight_arrays(zip(*weights), ys, widths),
        M, K, group_size, x.stride(0), split, per_split, int(early_launch(x.device, M)))
    if err:
        raise RuntimeError(f"w4a16_wgmma launch failed: {lib.nibble_w4a16_wgmma_error_string(err).decode()} "
                           f"(M={M} N={widths} K={K} group={group_size} config={cfg})")
    for y, o in zip(ys, given):
        if o is not None and y is not o:
            o.copy_(y)
    return [y if o is None else o for y, o in zip(ys, given)]


# ----------------------------------------------------------------------------------------------
# checks and the public op
# ----------------------------------------------------------------------------------------------
def _check(x, qweight, scales, zeros, group_size):
    if x.dim() != 2:
        raise ValueError(f"w4a16_linear expects x of shape [M, K], got {tuple(x.shape)}; flatten leading dims first")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"w4a16_linear: activations must be float16 or bfloat16, got {x.dtype} "
                        f"(cast fp32 activations with x.half() / x.bfloat16() first)")
    M, K = x.shape
    if K % PACK:
        raise ValueError(f"K={K} must be a multiple of {PACK} ({PACK} 4-bit codes per int32 word)")
    packed = _packed_k(qweight)
    if packed != K:
        raise ValueError(f"x has K={K} columns but qweight {tuple(qweight.shape)} packs K={packed}")
    _check_weight(qweight, scales, zeros, group_size)
    check_one_device(x, qweight, scales, zeros)


def check_one_device(x, qweight, scales, zeros, bias=None) -> None:
    """x and a layer's tensors on one device: the GPU op's check, and the CPU path's, where the reference would move
    the weight to x's device without a word (a GPU model's to a CPU input's; meta weights failed inside torch)."""
    devices = {str(t.device) for t in (x, qweight, scales, zeros) + (() if bias is None else (bias,))}
    if len(devices) > 1:
        names = "x, qweight, scales, zeros" + (" and bias" if bias is not None else "")
        raise ValueError(f"w4a16_linear: {names} must be on one device, got {sorted(devices)}: move the model or the "
                         "input with .to(device)")


def _checked_weights(x, qweights, scales, zeros, group_size) -> list[tuple]:
    """`_check` of every weight that reads x, as [(qweight, scales, zeros), ...]."""
    if not len(qweights) == len(scales) == len(zeros) > 0:
        raise ValueError(f"w4a16_linears needs one scales and zeros tensor per qweight, got {len(qweights)} "
                         f"qweights, {len(scales)} scales, {len(zeros)} zeros")
    weights = list(zip(qweights, scales, zeros))
    for w in weights:
        _check(x, *w, group_size)
    return weights


def _packed_k(qweight) -> int:
    """K of a canonical packed weight (int32 [K // 8, N]), or a TypeError saying what it must be."""
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise TypeError(f"qweight must be a 2-D int32 tensor [K // 8, N], got {qweight.dtype} {tuple(qweight.shape)}")
    return qweight.shape[0] * PACK


def _check_weight(qweight, scales, zeros, group_size):
    """The weight's own consistency, the format's (`Int4Weight`): packed int32 words, the group's width (an int, not
    -1) divides K, float16 scales and zeros hold one row per group."""
    K, N = _packed_k(qweight), qweight.shape[1]
    check_group_width(group_size, K)
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t.dtype != torch.float16:
            raise TypeError(f"{name} must be float16, got {t.dtype}")
        if tuple(t.shape) != (K // group_size, N):
            raise ValueError(f"{name} must have shape {(K // group_size, N)} for K={K}, N={N}, group {group_size}; "
                             f"got {tuple(t.shape)}")


def w4a16_linear_cuda(x, qweight, scales, zeros, group_size, config: Config | None = None, out=None):
    """CUDA path (also usable directly with an explicit Config, e.g. by the benchmark sweep)."""
    if not HAS_TRITON:
        raise triton_unavailable("W4A16")
    check_triton_device(x, "W4A16 Triton")
    x = x.contiguous()
    qweight, scales, zeros = qweight.contiguous(), scales.contiguous(), zeros.contiguous()
    M, K = x.shape
    N = qweight.shape[1]
    if M == 0:
        return torch.empty((0, N), dtype=x.dtype, device=x.device)
    if config is None:
        kernel = large_m_kernel(M, N, K)
        if kernel == "wgmma" and wgmma_applicable(x, N, K, group_size):
            return w4a16_wgmma(x, qweight, scales, zeros, group_size, out=out)
        if kernel != "dequant" and mma_applicable(x, N, K, group_size):
            return w4a16_mma(x, qweight, scales, zeros, group_size, out=out)
    cfg = config or select_config(M, N, K, group_size, num_sms(x.device))
    if cfg.kind == "gemv" and M > 2:
        cfg = replace(DISPATCH[16], split_k=1)
    if cfg.kind == "dequant":
        w = dequantize_cuda(qweight, scales, zeros, group_size, dtype=x.dtype)
        if out is None:
            return torch.nn.functional.linear(x, w)
        return torch.mm(x, w.t(), out=out)
    return _launch(x, qweight, scales, zeros, group_size, cfg, out=out)


def linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
           group_size: int) -> torch.Tensor:
    """y = x @ dequantize(qweight, scales, zeros, group_size).T, x [M, K] fp16/bf16 -> [M, N] in x.dtype.

    Non-contiguous inputs are made contiguous; fp32 activations are rejected (TypeError). The body of
    the custom op `torch.ops.nibble.w4a16_linear`; `nibble.kernels` calls it directly outside
    torch.compile (`kernels.eager_or_op`).
    """
    _check(x, qweight, scales, zeros, group_size)
    if x.device.type == "cuda":
        return w4a16_linear_cuda(x, qweight, scales, zeros, group_size)
    return reference.w4a16_matmul(x, qweight, scales, zeros, group_size)


def linears(x: torch.Tensor, qweights: list[torch.Tensor], scales: list[torch.Tensor], zeros: list[torch.Tensor],
            group_size: int) -> list[torch.Tensor]:
    """``[linear(x, W_i) for W_i in the weights]`` for weights that read the same x (a block's q/k/v or
    gate/up projections). On CUDA up to three weights share one launch where the skinny kernel runs
    (up to 32 tokens) and where the Hopper GEMM runs (`large_m_kernel` of the launch); elsewhere each
    runs as ``linear`` would. The body of `torch.ops.nibble.w4a16_linears`."""
    weights = _checked_weights(x, qweights, scales, zeros, group_size)
    if x.device.type != "cuda":
        return [reference.w4a16_matmul(x, *w, group_size) for w in weights]
    x = x.contiguous()
    M, K = x.shape
    N = sum(qw.shape[1] for qw in qweights)
    one_launch = 1 < len(weights) <= MMA_MAX_WEIGHTS
    if (one_launch and 0 < M <= MMA_MANY_MAX_M and large_m_kernel(M, N, K, len(weights)) == "skinny"
            and all(mma_applicable(x, qw.shape[1], K, group_size) for qw in qweights)):
        return w4a16_mma_many(x, weights, group_size)
    widths = [qw.shape[1] for qw in qweights]
    if (one_launch and large_m_kernel(M, N, K, len(weights)) == "wgmma" and WGMMA.tiles(widths)
            and all(wgmma_applicable(x, n, K, group_size) for n in widths)):
        return w4a16_wgmma_many(x, [tuple(t.contiguous() for t in w) for w in weights], group_size)
    return [w4a16_linear_cuda(x, *w, group_size) for w in weights]


@torch.library.custom_op("nibble::w4a16_linear", mutates_args=())
def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int) -> torch.Tensor:
    """`linear` as a custom op (what torch.compile traces into its graphs)."""
    return linear(x, qweight, scales, zeros, group_size)


@w4a16_linear.register_fake
def _(x, qweight, scales, zeros, group_size):
    _check(x, qweight, scales, zeros, group_size)  # shapes, dtypes, devices: refused at trace time as at run time
    return x.new_empty((x.shape[0], qweight.shape[1]))


@torch.library.custom_op("nibble::w4a16_linears", mutates_args=())
def w4a16_linears(x: torch.Tensor, qweights: list[torch.Tensor], scales: list[torch.Tensor],
                  zeros: list[torch.Tensor], group_size: int) -> list[torch.Tensor]:
    """`linears` as a custom op."""
    return linears(x, qweights, scales, zeros, group_size)


@w4a16_linears.register_fake
def _(x, qweights, scales, zeros, group_size):
    return [x.new_empty((x.shape[0], qw.shape[1])) for qw, _, _ in _checked_weights(x, qweights, scales, zeros,
                                                                                      group_size)]


def dequantize_cuda(qweight, scales, zeros, group_size, dtype=torch.bfloat16, out=None):
    """Dense W [N, K] (nn.Linear layout) in ``dtype``: one Triton pass on CUDA, the reference elsewhere."""
    _check_weight(qweight, scales, zeros, group_size)
    K, N = qweight.shape[0] * PACK, qweight.shape[1]
    if qweight.device.type != "cuda" or not HAS_TRITON:
        return reference.dequantize(qweight, scales, zeros, group_size, dtype=dtype)
    if out is None:
        out = torch.empty((N, K), dtype=dtype, device=qweight.device)
    return _dequantize_launch(qweight, scales, zeros, group_size, out)


def _dequantize_launch(qweight, scales, zeros, group_size, out):
    """The Triton pass of `dequantize_cuda` into ``out`` [N, K] (checked weights; CPU tensors under the interpreter)."""
    K, N = qweight.shape[0] * PACK, qweight.shape[1]
    bn, bk = 64, 128
    _dequant_kernel[(cdiv(N, bn), cdiv(K, bk))](qweight, scales, zeros, out, N, K, group_size,
                                                BLOCK_N=bn, BLOCK_K=bk, DQ_ASM=not _INTERPRET, num_warps=4)
    return out
