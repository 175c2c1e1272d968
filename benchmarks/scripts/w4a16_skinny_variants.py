"""Variants of the skinny W4A16 kernel (csrc/w4a16_mma.cu), built from the package's sources with
a few edits each, and timed side by side.

    PYTHONPATH=. python3 benchmarks/scripts/w4a16_skinny_variants.py --set ring --build .exp/skinny   # nvcc only
    PYTHONPATH=. python3 benchmarks/scripts/w4a16_skinny_variants.py --set ring --libs .exp/skinny --json $OUT/v.json

Sets (results under benchmarks/results/):
- ``ring`` (w4a16-ring-depth-h200): bytes in flight. RING stages per warp, AHEAD steps in flight
  and MIN_CTAS resident 512-thread CTAs in the one-token-tile launch bounds (2: the shipped
  64-register cap; 1: up to 128). Sessions 4 and 8 measured rings of 8 no faster, but under the
  64-register cap ptxas spills 28-48 bytes there; here the cap is lifted with it.
- ``spill`` (w4a16-grouped-spill-h200): the several-weight kernel's output weight held through the
  loop (the previous source: a 16-byte spill per ring round at one token tile) or the 64-register
  cap lifted for it, against the shipped kernel.
- ``prefetch`` (w4a16-l2-prefetch-h200): more bytes in flight without registers: once a ring round,
  an L2 prefetch of 4 steps that lie `distance` steps past the copies.
- ``layout`` (w4a16-weight-layout-h200): the canonical weight layout against a tile-major copy
  of it, each with and without the arithmetic (the DRAM locality of the weight stream).
- ``decompose`` (w4a16-decompose-h200): the loop without its arithmetic, and without its weight
  copies.
- ``tma`` (w4a16-tma-stream-h200): the weight stream by TMA boxes into an mbarrier ring (see TMA).
- ``xcache`` (w4a16-x-through-l1-h200): x copied through the L1 (cp.async.ca) or around it,
  against the op's own choice (w4a16.x_through_l1).
- ``trigger``, ``single_wave``, ``early_start`` (w4a16-successor-*-h200; these sets are in this
  script at commit b2e5fdd, before the kernel took them as its successor modes): letting the next
  kernel launch early (griddepcontrol.launch_dependents) after the loop or at the start, with the
  CTAs per SM capped by shared memory or not (``--kernel-rounds 3 --picked-warps --decode
  llama-2-7b``).

- ``running`` (w4a16-running-fold-*-h200): the raw sums kept in the output accumulators, rescaled per
  group (RunningFold; shipped at four token tiles), at other tile counts, with the two-tile kernel
  capped at 80 registers or not.
- ``late`` (w4a16-steps-in-flight-*-h200): 3 steps in flight in the same 4-stage ring, the copy issued
  after the step's barrier or before it with a second barrier.
- ``chains`` (w4a16-mma-chains-h200): each step's two K halves into their own raw and x sums (no MMA
  waits for the other half's result) at one token tile, under an 80- or 96-register cap, and the
  shipped code under the 80 cap.
- ``bases`` (w4a16-fp16-bases-h200, ``--dtype float16``): fp16's raw codes with one shift a word (the
  shipped kernel, one and two token tiles) against a shift per nibble pair, and at four tiles too.
- ``tiles`` (w4a16-token-tile-grid-h200, ``--ms 16``): 9-16 tokens as one-token-tile CTAs, two per
  column block (a grid dimension for the token tile), against the two-tile kernel.

``--variants a,b,...`` times only those variants of the set (the first is the reference).
``--summarize RUN.json --variants a,b,...`` prints a run's table at the op's warps (the .log files of the
session-36 sets).
``--decode MODEL`` adds the engine's decode, one engine per variant library, in alternating rounds.

For every case at each M: cuBLAS in x's dtype (single weights; rows named "bf16" whatever --dtype) and every (variant, warps) that fits, each
output first checked bit for bit against the first variant at the same warps (only the variants
without arithmetic, in ``decompose`` and ``layout``, change a sum). Same timing as ``python -m nibble.bench kernels``.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.kernels import cuda_build  # noqa: E402

RING = "constexpr int RING = 4, AHEAD = RING - 2;"
BOUNDS = "MT == 1 || MT == 4 ? 2 : 1)"


def ring(depth: int, ahead: int, min_ctas: int) -> dict:
    return {"skinny.cuh": [("static_assert(AHEAD == RING - 2,", "static_assert(AHEAD <= RING - 2,")],
            "w4a16_mma.cu": [(RING, f"constexpr int RING = {depth}, AHEAD = {ahead};"),
                             (BOUNDS, f"MT == 4 ? 2 : MT == 1 ? {min_ctas} : 1)")]}


PIPELINE = "run_pipeline<RING, AHEAD>(s_begin, s_end, issue, step, [&] { xstream.advance(RING); });"


def prefetch(distance: int) -> dict:
    """At the end of every ring round, lanes 0-15 pull the 4 x 4 rows of the steps `distance` past the
    next one to copy into the L2 (one prefetch instruction a round; no registers hold the data)."""
    return {"w4a16_mma.cu": [(PIPELINE, f"""const int pf_lane = lane < 16;
  const int pf_off = (4 * ({distance} + ((lane >> 2) & 3)) + (lane & 3) - (lane >> 3)) * N - 4 * (lane & 7);
  int pf_step = s_begin + AHEAD + {distance} + ((lane >> 2) & 3);
  run_pipeline<RING, AHEAD>(s_begin, s_end, issue, step, [&] {{
    xstream.advance(RING);
    pf_step += RING;
    prefetch_l2(pf_lane && pf_step < s_end, ws.src + pf_off);
  }});""")]}


# The weight stream by TMA (the Hopper GEMMs' copies, hopper.cuh): per warp a ring of RING 512-byte
# stages in the 128-byte swizzle, one mbarrier each; lane 0 issues a 32-column x 4-word-row box per
# step (one predicated instruction pair), every lane waits on the stage's barrier. x and the group
# parameters stay on cp.async. sm_90 only (an experiment: the product kernel also builds for sm_80).
TMA = {"w4a16_mma.cu": [
    ('#include "skinny.cuh"\n', '#include "skinny.cuh"\n#include "hopper.cuh"\n'),
    ("  int n[MAX_WEIGHTS], ldo[MAX_WEIGHTS], cta_end[MAX_WEIGHTS];",
     "  int n[MAX_WEIGHTS], ldo[MAX_WEIGHTS], cta_end[MAX_WEIGHTS];\n  CUtensorMap map[MAX_WEIGHTS];"),
    ("w4a16_mma_kernel(const T* __restrict__ x, const Weights<T> weights,",
     "w4a16_mma_kernel(const T* __restrict__ x, const __grid_constant__ Weights<T> weights,"),
    ("  ws.prefetch<RING>(s_begin, s_end);", """  ws.prefetch<RING>(s_begin, s_end);
  // the weight rings after every warp's cp.async ring, 1024-byte aligned (the swizzle's period)
  const uint32_t smem_addr = (uint32_t)__cvta_generic_to_shared(smem);
  const uint32_t wring_all = (smem_addr + warps * RING * STAGE + 1023) & ~1023u;
  const uint32_t wring = wring_all + warp * RING * 512, bars = wring_all + warps * RING * 512 + warp * RING * 8;
  const unsigned char* wring_gen = smem + (wring - smem_addr);
  if (lane == 0) {
#pragma unroll
    for (int st = 0; st < RING; ++st) mbar_init(bars + 8 * st, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();
  const CUtensorMap* wmap = pick_address(weights.map, which);
  // lane (g, t) reads quad g of word row t: in the swizzle, chunk g ^ (line % 8), the line 4 * (stage % 2) + t
  const int read_w = (lane & 3) * 128 + ((g ^ (lane & 3)) << 4);
  int phase = 0;"""),
    ("    cp_async_16(live, ws.copy_dst + stage * STAGE, ws.src);", """    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %0, 0; @p mbarrier.arrive.expect_tx.shared::cta.b64 _, [%1], 512;"
        " @p cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%2], [%3, {%4, %5}], [%1]; }"
        ::"r"((int)(live && lane == 0)), "r"(bars + 8 * stage), "r"(wring + stage * 512), "l"(wmap), "r"(tile_col),
        "r"(4 * j) : "memory");"""),
    ("    const uint4 wv = *reinterpret_cast<const uint4*>(here + ws.read_src);",
     "    mbar_wait(bars + 8 * i, phase);\n"
     "    const uint4 wv = *reinterpret_cast<const uint4*>(wring_gen + i * 512 + (read_w ^ (i & 1 ? 64 : 0)));"),
    (PIPELINE, PIPELINE.replace("xstream.advance(RING); }", "xstream.advance(RING); phase ^= 1; }")),
    ("  return ring > partial ? ring : partial;",
     "  return (ring > partial ? ring : partial) + 1024 + (size_t)warps * RING * (512 + 8);"),
    ("  const int ctas = running_ends(count, ns, 32, w.cta_end);", """  const int ctas = running_ends(count, ns, 32, w.cta_end);
  for (int i = 0; i < count; ++i) {
    const cudaError_t e = tensor_map_2d(&w.map[i], CU_TENSOR_MAP_DATA_TYPE_INT32, qweights[i], ns[i], K / 8,
                                        (uint64_t)ns[i] * 4, 32, 4);
    if (e != cudaSuccess) return e;
  }"""),
]}


NO_COMPUTE = ("auto step = [&](int i, int s) {", "auto step = [&](int i, int s) {\n    if (M > 0) return;")

# The weight stream over a tile-major weight (`tile_major` below): the stream is handed K instead of
# N, its step is 4 rows of 32 words, and a CTA's words start at tile_col * K / 8.
TILE_MAJOR = {
    "w4a16_mma.cu": [("WeightStream ws(ring_addr, lane, qweight, N, s_begin, tile_col);",
                      "WeightStream ws(ring_addr, lane, qweight, K, s_begin, tile_col);")],
    "skinny.cuh": [("step_stride = (size_t)4 * N;", "step_stride = 128;"),
                   ("src = qweight + (size_t)(4 * s_begin + copy_row) * N + tile_col + 4 * copy_quad;",
                    "src = qweight + (size_t)tile_col * (N >> 3) + (4 * s_begin + copy_row) * 32 + 4 * copy_quad;")],
}


def tile_major(qweight):
    """[K / 8, N] canonical words -> the same words as [N / 32][K / 8][32], viewed as [K / 8, N]."""
    rows, n = qweight.shape
    return qweight.view(rows, n // 32, 32).permute(1, 0, 2).contiguous().view(rows, n)


WEIGHT_LAYOUT = {"tile": tile_major, "tile_copy": tile_major}

X_COPY = "      cp_async_16<X_L1>(live && xstream.live[mt], ring_addr + stage * STAGE + XS + xstream.offset(mt),"


# set -> variant -> {file: [(old, new)]}; the first variant of a set is the reference for exactness
SETS = {
    "ring": {
        "r4a2": {},  # shipped
        "r4a2_nocap": ring(4, 2, 1),
        "r8a6_cap": ring(8, 6, 2),  # sessions 4 / 8 (spills)
        "r8a4": ring(8, 4, 1),
        "r8a6": ring(8, 6, 1),
        "r12a10": ring(12, 10, 1),
        "r16a14": ring(16, 14, 1),
    },
    "spill": {
        "shipped": {},
        "which_held": {"w4a16_mma.cu": [("const int out_weight = cta_weight<MANY>(weights.cta_end, tile_col);",
                                         "const int out_weight = which;")]},
        "many_nocap": {"w4a16_mma.cu": [(BOUNDS, "(MT == 1 && !MANY) || MT == 4 ? 2 : 1)")]},
    },
    "prefetch": {"shipped": {}, "pf0": prefetch(0), "pf4": prefetch(4), "pf8": prefetch(8), "pf16": prefetch(16)},
    "tma": {"shipped": {}, "tma": TMA,
            "tma_nocap": {"w4a16_mma.cu": TMA["w4a16_mma.cu"] + [(BOUNDS, "MT == 4 ? 2 : 1)")]}},
    # x through the L1 (cp.async.ca) or around it (.cg) whatever w4a16.x_through_l1 picks:
    # the CTAs of an SM read the same steps of x (for other columns) at about the same time, and at
    # 16 tokens x is twice the weight's bytes. (The committed result predates the rule: its
    # "shipped" is today's x_cg.)
    "xcache": {
        "shipped": {},
        "x_cg": {"w4a16_mma.cu": [(X_COPY, X_COPY.replace("cp_async_16<X_L1>(", "cp_async_16<false>("))]},
        "x_ca": {"w4a16_mma.cu": [(X_COPY, X_COPY.replace("cp_async_16<X_L1>(", "cp_async_16<true>("))]},
    },
    # DRAM locality of the weight stream: the canonical layout, where a CTA's 32 columns are a
    # 128-byte piece of every word row (rows 4 N bytes apart), against a tile-major copy of the same
    # words ([N / 32][K / 8][32]: a CTA's K range one contiguous block, a step 512 contiguous bytes),
    # each with and without its arithmetic (the copy ceiling). Same arithmetic: outputs exact.
    "layout": {
        "shipped": {},
        "tile": TILE_MAJOR,
        "copy": {"w4a16_mma.cu": [NO_COMPUTE]},
        "tile_copy": {"w4a16_mma.cu": TILE_MAJOR["w4a16_mma.cu"] + [NO_COMPUTE], "skinny.cuh": TILE_MAJOR["skinny.cuh"]},
    },
    # where the time goes: the loop without its arithmetic (copies, waits and barriers only), and
    # without its weight copies (the arithmetic on whatever the ring holds); M >= 1 always, but the
    # compiler cannot know it, so the code stays and only its effect goes. Outputs are not exact.
    "decompose": {
        "shipped": {},
        "no_compute": {"w4a16_mma.cu": [NO_COMPUTE]},
        "no_weights": {"w4a16_mma.cu": [("cp_async_16(live, ws.copy_dst + stage * STAGE, ws.src);",
                                         "cp_async_16(live && M < 0, ws.copy_dst + stage * STAGE, ws.src);")]},
    },
}


RUNNING = "constexpr bool running_fold(int mt) { return mt == 4; }"


def running(condition: str, mt2_cap: bool = False) -> dict:
    """RunningFold (the raw sums kept in the output accumulators, in units of the group's scale) at
    the token tiles `mt` where the C++ `condition` holds, and the two-tile kernel capped at 80 registers
    (24 warps an SM in CTAs of 4 or 8 warps, where its 107 registers leave room for 16)."""
    edits = [(RUNNING, RUNNING.replace("mt == 4", condition))]
    if mt2_cap:
        edits.append((BOUNDS, BOUNDS + " __maxnreg__(MT == 2 ? 80 : MT == 1 ? 64 : MT == 4 ? 128 : 255)"))
    return {"w4a16_mma.cu": edits}


# The copy issued after the step's wait and warp barrier instead of before them ("late"): the
# barrier then orders every lane's reads of the previous step before the refill of its stage, so a
# ring of RING stages keeps RING - 1 steps in flight instead of RING - 2, with the same unrolled ring
# (session 18's deeper rings needed more registers, so fewer warps, and their bytes in flight per SM
# barely grew).
PIPELINE_ROUND = """      issue((i + AHEAD) % RING, s + AHEAD, i + AHEAD, !TAIL || s + AHEAD < s_end);
      cp_async_wait<AHEAD>();
      // The pieces of this step were copied by other lanes. (bar.warp.sync itself: __syncwarp()
      // adds a divergence check and a branch around it.)
      asm volatile("bar.warp.sync -1;" ::: "memory");
"""
LATE_ROUND = """      cp_async_wait<AHEAD - 1>();
      asm volatile("bar.warp.sync -1;" ::: "memory");
      issue((i + AHEAD) % RING, s + AHEAD, i + AHEAD, !TAIL || s + AHEAD < s_end);
"""


# Or the copy issued early, as shipped, with a second warp barrier after each step's reads (the
# stage refilled next).
SECOND_BARRIER = ("      step(i, s);\n", '      step(i, s);\n      asm volatile("bar.warp.sync -1;" ::: "memory");\n')


def four_stages(ahead: int, order_edit: tuple) -> dict:
    """The 4-stage ring with `ahead` steps in flight, its pipeline round edited by `order_edit`."""
    return {"skinny.cuh": [("static_assert(AHEAD == RING - 2,", "static_assert(AHEAD <= RING - 1,"), order_edit],
            "w4a16_mma.cu": [(RING, f"constexpr int RING = 4, AHEAD = {ahead};")]}


LATE = (PIPELINE_ROUND, LATE_ROUND)
SETS["late"] = {"shipped": {}, "late_a3": four_stages(3, LATE), "late_a2": four_stages(2, LATE),
                "early_a3": four_stages(3, SECOND_BARRIER), "early_a2_2bar": four_stages(2, SECOND_BARRIER)}


# What the tensor pipe costs the loop (knockouts, outputs wrong): the x-sum MMAs (2 of the 6 a step and
# token tile) left out, the second m16 tile's MMAs left out (2 more), or both.
NO_XSUM = ("""    if (fresh && half == 0) mma<T, true>(xsum, ones, b[half][0], b[half][1]);
    else mma<T, false>(xsum, ones, b[half][0], b[half][1]);
""", "")
ONE_TILE = ("    for (int tile = 0; tile < 2; ++tile) {", "    for (int tile = 0; tile < 1; ++tile) {")
SETS["mmas"] = {"shipped": {}, "no_xsum": {"w4a16_mma.cu": [NO_XSUM]}, "one_tile": {"w4a16_mma.cu": [ONE_TILE]},
                "neither": {"w4a16_mma.cu": [NO_XSUM, ONE_TILE]}}


# Session 36 (w4a16-running-fold-*-h200): the shipped kernel folds with RunningFold at four token
# tiles only; "never" is the kernel before it (SASS-identical, all 88 instantiations).
SETS["running"] = {"never": running("false"), "shipped": {}, "from2": running("mt >= 2"),
                   "from2_cap80": running("mt >= 2", True), "from1_cap80": running("mt >= 1", True),
                   "from4": running("mt >= 4")}


# Shorter dependent MMA chains at one token tile (session 36's lead): each step's two K halves add
# into their own raw sums and x sums (half 1 no longer waits for half 0's result), folded together at
# the group's end. 12 more registers, so the one-tile cap goes from 64 to 80 ("cap80": the shipped
# code under the same cap, the control: 8-warp CTAs keep 3 an SM, 4 become 3 on the 70B layers).
# Measured on the sources of commit 571658d, before fp16's one-shift codes (the bf16 kernels are the
# same since); the edits now anchor on today's fold and step.
HALVES_STEP = """// (chains set) Both K halves of a step into their own sums.
template <typename T, bool TWO_BASES>
__device__ __forceinline__ void step_halves(float (&raw0)[2][4], float (&xs0)[4], float (&raw1)[2][4], float (&xs1)[4],
                                            const uint32_t (&r)[4][4], uint4 xr, bool fresh) {
  uint32_t ones[4] = {Num<T>::ONE2, Num<T>::ONE2, Num<T>::ONE2, Num<T>::ONE2};
  if constexpr (TWO_BASES) ones[0] = Num<T>::BASE2, ones[2] = Num<T>::BASE2_ODD;
  const uint32_t b[2][2] = {{__byte_perm(xr.x, xr.z, 0x5410), __byte_perm(xr.x, xr.z, 0x7632)},
                            {__byte_perm(xr.y, xr.w, 0x5410), __byte_perm(xr.y, xr.w, 0x7632)}};
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float (&raw)[2][4] = half == 0 ? raw0 : raw1;
    float (&xsum)[4] = half == 0 ? xs0 : xs1;
#pragma unroll
    for (int tile = 0; tile < 2; ++tile) {
      const uint32_t a[4] = {r[2 * tile][2 * half], r[2 * tile + 1][2 * half], r[2 * tile][2 * half + 1],
                             r[2 * tile + 1][2 * half + 1]};
      if (fresh) mma<T, true>(raw[tile], a, b[half][0], b[half][1]);
      else mma<T, false>(raw[tile], a, b[half][0], b[half][1]);
    }
    if (fresh) mma<T, true>(xsum, ones, b[half][0], b[half][1]);
    else mma<T, false>(xsum, ones, b[half][0], b[half][1]);
  }
}

// Four fp16 values"""
HALVES = [
    ("// Four fp16 values", HALVES_STEP),
    ("""  __device__ __forceinline__ void operator()(float (&acc)[2][4], const float (&raw)[2][4],
                                             const float (&xsum)[4]) const {""",
     """  __device__ __forceinline__ void operator()(float (&acc)[2][4], const float (&raw)[2][4],
                                             const float (&xsum)[4], const float (&raw1)[2][4],
                                             const float (&xsum1)[4]) const {"""),
    ("""        const float r = TWO_BASES ? raw[tile][c] - xsum[c & 1] : raw[tile][c];
        acc[tile][c] = fmaf(s[j], r, fmaf(zb[j], xsum[(TWO_BASES ? 2 : 0) + (c & 1)], acc[tile][c]));""",
     """        const int x = (TWO_BASES ? 2 : 0) + (c & 1);
        const float r = raw[tile][c] + raw1[tile][c] - (TWO_BASES ? xsum[c & 1] + xsum1[c & 1] : 0.f);
        acc[tile][c] = fmaf(s[j], r, fmaf(zb[j], xsum[x] + xsum1[x], acc[tile][c]));"""),
    ("float acc[MT][2][4], raw[MT][2][4], xsum[MT][4];", "float acc[MT][2][4], raw[MT][2][4], xsum[MT][4], raw1[MT][2][4], xsum1[MT][4];"),
    ("acc[mt][0][j] = acc[mt][1][j] = raw[mt][0][j] = raw[mt][1][j] = xsum[mt][j] = 0.f;",
     "acc[mt][0][j] = acc[mt][1][j] = raw[mt][0][j] = raw[mt][1][j] = xsum[mt][j] = raw1[mt][0][j] = raw1[mt][1][j] = xsum1[mt][j] = 0.f;"),
    ("""      step_mmas<T, RUNNING, TWO_BASES>(RUNNING ? acc[mt] : raw[mt], xsum[mt], r,
                                       *reinterpret_cast<const uint4*>(here + XS + xstream.offset(mt)),
                                       GS && i % GSTEP == 0);""",
     """      if constexpr (RUNNING)
        step_mmas<T, true, false>(acc[mt], xsum[mt], r, *reinterpret_cast<const uint4*>(here + XS + xstream.offset(mt)),
                                  GS && i % GSTEP == 0);
      else
        step_halves<T, TWO_BASES>(raw[mt], xsum[mt], raw1[mt], xsum1[mt], r,
                                  *reinterpret_cast<const uint4*>(here + XS + xstream.offset(mt)), GS && i % GSTEP == 0);"""),
    ("fold(acc[mt], raw[mt], xsum[mt]);", "fold(acc[mt], raw[mt], xsum[mt], raw1[mt], xsum1[mt]);"),
    ("for (int c = 0; c < 4; ++c) raw[mt][0][c] = raw[mt][1][c] = xsum[mt][c] = 0.f;",
     "for (int c = 0; c < 4; ++c) raw[mt][0][c] = raw[mt][1][c] = xsum[mt][c] = raw1[mt][0][c] = raw1[mt][1][c] = xsum1[mt][c] = 0.f;"),
]


def one_tile_cap(regs: int) -> tuple:
    """The one-tile kernel capped at `regs` registers instead of 2 CTAs of 512 threads (64)."""
    return (BOUNDS, f"MT == 4 ? 2 : 1) __maxnreg__(MT == 1 ? {regs} : MT == 4 ? 128 : 255)")


# fp16's raw codes with one shift a word (odd nibble pairs read at bits 4-7 over 64; the x-sum MMA's
# rows g weighted by the bases: the shipped kernel since session 37, at one and two token tiles)
# against one base for every pair (a shift per pair, as bf16 must), and at four tiles too; time with
# --dtype float16 (bf16 compiles to the same SASS in all three).
SETS["bases"] = {"one_base": {"w4a16_mma.cu": [("  return Num<T>::ONE_SHIFT && mt <= 2;", "  return false;")]},
                 "shipped": {}, "from1to4": {"w4a16_mma.cu": [("  return Num<T>::ONE_SHIFT && mt <= 2;",
                                                               "  return Num<T>::ONE_SHIFT && mt <= 4;")]}}

SETS["chains"] = {"shipped": {}, "cap80": {"w4a16_mma.cu": [one_tile_cap(80)]},
                  "halves_cap80": {"w4a16_mma.cu": HALVES + [one_tile_cap(80)]},
                  "halves_cap96": {"w4a16_mma.cu": HALVES + [one_tile_cap(96)]}}


# (tiles set) 9-16 tokens as two CTAs of one token tile each over the same columns (grid.y = the
# token tile): 64 registers a warp instead of 107, the weight read twice through the L2.
TILE_GRID = {"w4a16_mma.cu": [
    ("  const int m_rows = M < MT * 8 ? M : MT * 8;",
     "  const int m_left = M - (int)blockIdx.y * (8 * MT), m_rows = m_left < MT * 8 ? m_left : MT * 8;"),
    ("TokenStream<T, uint4, MT> xstream(x, ldx", "TokenStream<T, uint4, MT> xstream(x + (size_t)blockIdx.y * (8 * MT) * ldx, ldx"),
    ("  const int ldo = pick(weights.ldo, out_weight);",
     "  const int ldo = pick(weights.ldo, out_weight);\n  out += (size_t)blockIdx.y * (8 * MT) * ldo;"),
    ("successor_smem<kernel>(successor, pdl, ctas,", "successor_smem<kernel>(successor, pdl, ctas * ((M + 8 * MT - 1) / (8 * MT)),"),
    ("return launch_kernel(kernel, ctas,", "return launch_kernel(kernel, dim3(ctas, (M + 8 * MT - 1) / (8 * MT)),"),
    ("    case 2: return x_l1 ? NIBBLE_LAUNCH_MT(2, true) : NIBBLE_LAUNCH_MT(2, false);",
     "    case 2: return x_l1 ? NIBBLE_LAUNCH_MT(1, true) : NIBBLE_LAUNCH_MT(1, false);")]}
SETS["tiles"] = {"shipped": {}, "tile_grid": TILE_GRID}


def build(out_dir: Path, name: str, edits: dict) -> None:
    kernel = edits.get("w4a16_mma.cu", [])
    headers = {file: pairs for file, pairs in edits.items() if file != "w4a16_mma.cu"}
    cuda_build.build_edited("w4a16_mma", kernel, out_dir / name, arch="90", header_edits=headers)


def ring_depth(edits: dict) -> int:
    for old, new in edits.get("w4a16_mma.cu", []):
        if old == RING:
            return int(new.split("=")[1].split(",")[0])
    return 4


ISSUE3_BIG = ["4096x11008", "4096x14336", "8192x28672", "11008x4096", "12288x4096", "14336x4096", "28672x8192"]


def summarize(rows: list, names: list) -> list:
    """The table of a run's --json rows, per M and case, at the warps the op picks: each variant's time
    and the first's time over it, then the geometric mean against bf16 over the >= 64 MB shapes."""
    times, bf16, picked = {}, {}, {}
    for r in rows:
        key = (r["M"], r["case"])
        if r["variant"] == "bf16":
            bf16[key] = r["us"]
            continue
        times[key + (r["variant"], r["warps"])] = r["us"]
        if r["picked"]:
            picked[key] = r["warps"]
    lines = []
    for M in sorted({m for m, _ in picked}):
        cases = [c for m, c in picked if m == M]
        us = {c: [times[(M, c, n, picked[M, c])] for n in names] for c in cases}
        for c in cases:
            lines.append(f"{M} {c:22s} w{picked[M, c]:<2d} " + " ".join(
                f"{n} {u:6.2f} ({us[c][0] / u:.3f})" for n, u in zip(names, us[c])))
        big = [c for c in ISSUE3_BIG if c in us]
        lines.append(f"{M} geomean big vs bf16: " + " ".join(
            f"{n} {math.exp(statistics.fmean(math.log(bf16[M, c] / us[c][i]) for c in big)):.3f}"
            for i, n in enumerate(names)))
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--summarize", type=Path, metavar="JSON", help="only print the table of a run's --json "
                    "(`summarize`) for the variants of --variants, the first the reference")
    ap.add_argument("--build", type=Path, help="only compile every variant into this folder")
    ap.add_argument("--libs", type=Path, help="the folder --build filled")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--set", choices=SETS)
    ap.add_argument("--variants", help="comma-separated: only these variants of the set (the first the reference)")
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16", help="x, and cuBLAS's weight")
    ap.add_argument("--cases", choices=["issue3", "grouped", "all", "none"], default="all")
    ap.add_argument("--kernel-rounds", type=int, default=1, help="time every variant this many times, each round "
                    "in another order; the median counts (successive timings of one kernel drift by a few %%)")
    ap.add_argument("--picked-warps", action="store_true", help="only the warps the op picks")
    ap.add_argument("--decode", nargs="*", default=[], metavar="MODEL",
                    help="also time W4A16 decode of these random-weight models (nibble.eval.speed.SPEED_MODELS), "
                    "one engine per variant, each capturing its graphs on its variant, replayed in alternating rounds")
    ap.add_argument("--batches", default="1,8", help="decode batches (--decode)")
    ap.add_argument("--rounds", type=int, default=4, help="decode rounds, even: each order runs as often (--decode)")
    args = ap.parse_args()
    if args.summarize:
        print("\n".join(summarize(json.loads(args.summarize.read_text())["rows"], args.variants.split(","))))
        return
    if args.set is None:
        ap.error("--set is required (or --summarize)")
    variants = SETS[args.set]
    if args.variants:
        variants = {name: variants[name] for name in args.variants.split(",")}
    if args.build:
        with ThreadPoolExecutor(len(variants)) as pool:
            list(pool.map(lambda n: build(args.build, n, variants[n]), variants))
        return

    import torch
    import torch.nn.functional as F
    from nibble.bench.kernels import GROUP, TIMING, random_int4
    from nibble.bench.timing import bench_us, env_meta, rotations
    from nibble.kernels import w4a16 as W

    dev = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    G = GROUP
    libs = {}
    for name in variants:
        libs[name] = ctypes.CDLL(str(args.libs / name / "w4a16_mma_edited.so"))
        W._MMA_SIGNATURES(libs[name])

    use = library_installers(libs)

    def call(name, x, weights, cfg, outs):
        """The package's op on variant `name`'s library."""
        use[name]()
        W.w4a16_mma_many(x, weights, G, config=cfg, outs=outs)

    # (label, [(N, K)] of one launch): the issue-3 shapes; Llama-2-7B's and Llama-3-8B's grouped launches
    cases = []
    if args.cases in ("issue3", "all"):
        cases += [(f"{n}x{k}", [(n, k)]) for n, k in
                  [(4096, 4096), (12288, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336),
                   (28672, 8192), (8192, 28672)]]
    if args.cases in ("grouped", "all"):
        cases += [("qkv 3x4096x4096", [(4096, 4096)] * 3), ("gate/up 2x11008x4096", [(11008, 4096)] * 2)]
    if args.cases == "grouped":
        cases += [("L3 qkv 4096+2x1024", [(4096, 4096), (1024, 4096), (1024, 4096)]),
                  ("L3 gate/up 2x14336x4096", [(14336, 4096)] * 2)]
    first = next(iter(variants))
    rows = []
    for label, shapes in cases:
        K = shapes[0][1]
        per_set = sum(n * K // 2 + 4 * (K // G) * n for n, _ in shapes)
        sets = [[random_int4(n, K, G, dev) for n, _ in shapes] for _ in range(rotations(per_set))]
        laid_out = {name: [[(WEIGHT_LAYOUT[name](q), s, z) for q, s, z in ws] for ws in sets]
                    for name in variants if name in WEIGHT_LAYOUT}
        wb = None
        if len(shapes) == 1:
            n = shapes[0][0]
            wb = [torch.randn(n, K, device=dev, dtype=dtype) for _ in range(rotations(2 * n * K))]
        for M in map(int, args.ms.split(",")):
            if len(shapes) > 1 and M > W.MMA_MANY_MAX_M:
                continue
            x = torch.randn(M, K, device=dev, dtype=dtype)
            res = {}
            if wb is not None:
                res["bf16"] = bench_us(lambda i: (lambda: F.linear(x, wb[i])), len(wb), **TIMING)
            picked = W.select_mma_config(M, sum(n for n, _ in shapes), K)
            for warps in (picked.warps,) if args.picked_warps else (4, 8, 16):
                cfg = replace(picked, warps=warps)
                if not W.mma_config_valid(cfg, M):
                    continue
                outs_for = [[torch.empty(M, n, device=dev, dtype=x.dtype) for n, _ in shapes] for _ in sets]
                shipped = [torch.full((M, n), float("nan"), device=dev, dtype=x.dtype) for n, _ in shapes]
                call(first, x, sets[0], cfg, shipped)
                fitting = [name for name, edits in variants.items()
                           if W.mma_smem_bytes(cfg, ring_depth(edits)) <= W.MMA_SMEM_LIMIT]
                exact = {}
                for name in fitting:
                    got = [torch.full_like(o, float("nan")) for o in shipped]
                    call(name, x, laid_out.get(name, sets)[0], cfg, got)
                    torch.cuda.synchronize()
                    exact[name] = all(torch.equal(a, b) for a, b in zip(got, shipped))
                    if not exact[name]:  # how far: the largest difference against the largest output
                        rel = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                                  for a, b in zip(got, shipped))
                        print(f"MISMATCH {label} M={M} {name} w{warps} rel {rel:.2e}", flush=True)
                times = {name: [] for name in fitting}
                for r in range(args.kernel_rounds):  # each round in another order (a rotation)
                    for name in fitting[r % len(fitting):] + fitting[:r % len(fitting)]:
                        mine = laid_out.get(name, sets)
                        times[name].append(bench_us(lambda i: (lambda: call(name, x, mine[i], cfg, outs_for[i])),
                                                    len(mine), **TIMING))
                for name in fitting:
                    us = statistics.median(times[name])
                    res[f"{name}/w{warps}"] = us
                    rows.append(dict(case=label, M=M, variant=name, warps=warps, us=round(us, 3), exact=exact[name],
                                     picked=warps == picked.warps, rounds=[round(t, 3) for t in times[name]]))
            base = res.get("bf16")
            ship = res.get(f"{first}/w{picked.warps}")
            best = min((k for k in res if k != "bf16"), key=res.get)
            print(f"{label:22s} M={M:2d} shipped(w{picked.warps}) {ship:7.2f} us"
                  + (f" {base / ship:4.2f}x" if base else "")
                  + f" | best {best} {res[best]:7.2f} us" + (f" {base / res[best]:4.2f}x" if base else "")
                  + " | " + " ".join(f"{k}={v:.1f}" for k, v in sorted(res.items())), flush=True)
            if base:
                rows.append(dict(case=label, M=M, variant="bf16", warps=None, us=round(base, 3)))
        sets = wb = laid_out = None
        torch.cuda.empty_cache()
    for name in args.decode:
        rows += decode_ab(name, use, list(map(int, args.batches.split(","))), args.rounds)
    if args.json:
        args.json.write_text(json.dumps(dict(meta=env_meta(), set=args.set, dtype=args.dtype, variants=variants,
                                             rows=rows), indent=1))


def library_installers(libs: dict) -> dict:
    """{name: a callable that makes the op launch the skinny kernel from that variant's library} for
    `decode_ab` and the kernel timings (`w4a16._mma_lib` is read at every launch, so also while a graph
    is captured)."""
    from nibble.kernels import w4a16 as W

    def install(lib):
        W._mma_lib = lambda _device: lib
    return {name: (lambda lib=lib: install(lib)) for name, lib in libs.items()}


def decode_ab(model_name: str, variants: dict, batches, rounds: int) -> list[dict]:
    """W4A16 decode of a random-weight model after a 128-token prompt, one engine per variant
    (``variants``: {name: a callable that installs it}, e.g. `library_installers`; each engine captures
    its graphs while its variant is installed), timed in alternating rounds (128 steps, median of 3 runs
    each); the greedy tokens are compared with the first variant's (the reduction order may change them)."""
    import statistics

    import torch
    from nibble.eval import speed
    from nibble.eval.engine import Engine
    from nibble.eval.report import quant_config

    model = speed.random_model(model_name)
    speed.quantize_in_place(model, quant_config("w4a16", model, clip_search=False))
    rows = []
    for batch in batches:
        engines, tokens = {}, {}
        for name, install in variants.items():
            install()
            engines[name] = Engine(model, max_batch=batch, max_seq_len=128 + 160)
            speed.measure_decode(engines[name], batch, 128, 8, reps=1)
            tokens[name] = engines[name].generate(torch.arange(1, 9, device="cuda")[None], 6)[0].tolist()
        times = speed.alternating_decodes(engines, batch, 128, 128, rounds)  # graphs captured above
        first = next(iter(variants))
        for name in variants:
            ms = statistics.median(times[name])
            rows.append(dict(case=f"decode {model_name}", batch=batch, variant=name, ms_per_step=ms, rounds=times[name],
                             tokens_per_s=1000 * batch / ms, same_tokens=tokens[name] == tokens[first]))
            print(f"decode {model_name} b={batch} {name:12s} {ms:.4f} ms/step {1000 * batch / ms:8.1f} tok/s "
                  f"({statistics.median(times[first]) / ms:.3f}x {first}) tokens {'same' if rows[-1]['same_tokens'] else 'DIFFER'}",
                  flush=True)
        speed.release(*engines.values())
    speed.release(model)
    return rows


if __name__ == "__main__":
    main()
