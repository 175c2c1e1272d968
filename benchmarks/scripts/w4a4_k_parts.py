"""W4A4's Hopper GEMM with its K tiles shared by two "K parts": four consumer warpgroups instead of
two in the 128 x 128 and 64 x 128 tiles (J = 1, unsplit), the warpgroups of part p taking the tile's
K tiles p, p + 2, ... for the same 64 channels each as the shipped pair. At 128 tokens the wide
4096-deep layers run one 128 x 128 tile per SM with its mainloop at ~65% of the int8 rate, held by
each warpgroup's own step (load, unpack, issue, wait for the previous group; notes-w4a4.md, session
30), and the 128 x 256 tile, with two independent m64 instructions a step per warpgroup, reaches 79%:
twice the independent wgmma chains per SM might do the same for the tiles of one instruction.

After the mainloop part p keeps tokens [p BN / 2, (p + 1) BN / 2) of the tile: it hands its sums of the
other half to the other part through shared memory (lane-private slots, 64 KB for 128 x 128) and adds
the other part's sums of its own half (exact), then runs the epilogue for its half. Registers: 640
threads at 96, the producer down to 24 and the consumers up to 112 (no spill). Stages: a part holds its
tile and its previous one until its next tile's first step, so two parts hold four stages: "k_parts"
has 6 (128 x 128) / 8 (64 x 128) stages, "k_parts_4_stages" the shipped 4. "token_halves": the other
split of the 128 x 128 tile over four warpgroups (`token_halves_edits`). Diagnostics: "one_part_busy"
(the four warpgroups, part 0 taking every K tile and part 1 none: exact, the cost of the layout alone),
"unused_64k" (the shipped kernel asking 64 KB more shared memory than it uses, as the exchange does)
and "no_exchange" (the parts' sums never combined: wrong outputs, timed only).

    PYTHONPATH=. python3 benchmarks/scripts/w4a4_k_parts.py --build-only .exp/kparts
    PYTHONPATH=. python3 benchmarks/scripts/w4a4_k_parts.py --prebuilt .exp/kparts --json out.json
"""
from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from wgmma_ab import SHAPES, build_variants, time_builds, time_ops, variant_builds, variants_main  # noqa: E402


SMEM = "  static constexpr size_t SMEM = (size_t)STAGES * STAGE + 1024 + 16 * STAGES + 2 * 4 * BN;"


def k_parts_edits(stages128: int, stages64: int, exchange: bool = True, kw: str = "(J == 1 && !SPLIT ? 2 : 1)",
                  first: str = "part", step: str = "KW") -> list:
    """csrc/w4a4_wgmma.cu's edits: two K parts for the unsplit J = 1 tiles (where ``kw`` is 2), with
    these stage counts; exchange False: the parts' sums are not combined; ``first`` / ``step``: a
    warpgroup's first K tile and its stride (C++ expressions of its part, k_tiles and KW)."""
    return [
        ("constexpr int THREADS = CONSUMER_THREADS + 128;  // registers are granted per warpgroup\n",
         f"constexpr bool EXCHANGE = {str(exchange).lower()};\n"),
        ("template <int BN, int CH_> struct Tile {", "template <int BN, int CH_, bool SPLIT = false> struct Tile {"),
        ("  static constexpr int STAGES = 4;\n",
         f"  static constexpr int KW = {kw};\n"
         f"  static constexpr int STAGES = KW == 1 ? 4 : (BN == 128 ? {stages128} : {stages64});\n"
         "  static constexpr int CONSUMERS = KW * CONSUMER_THREADS, THREADS = CONSUMERS + 128;\n"
         "  static constexpr int EXCHANGE = KW > 1 ? 2 * KW * 128 * (BN / 4) * 4 : 0;\n"),
        (SMEM,
         "  static constexpr int SCALES = STAGES * STAGE + 16 * STAGES, EXCHANGE_AT = SCALES + 2 * KW * 4 * BN;\n"
         "  static constexpr size_t SMEM = (size_t)EXCHANGE_AT + EXCHANGE + 1024;"),
        ("__global__ void __launch_bounds__(THREADS, 1)", "__global__ void __launch_bounds__(Tile<BN, CH_, SPLIT>::THREADS, 1)"),
        ("  using L = Tile<BN, CH_>;\n",
         "  using L = Tile<BN, CH_, SPLIT>;\n  constexpr int KW = L::KW, CONSUMERS = L::CONSUMERS;\n"),
        ("  if (warp >= CONSUMER_THREADS / 32) {", "  if (warp >= CONSUMERS / 32) {"),
        ('    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");\n    if (tid == CONSUMER_THREADS)',
         '    if constexpr (KW == 1) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");\n'
         '    else asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");  // 128 x 24 + 512 x 112 <= 640 x 96\n'
         "    if (tid == CONSUMERS)"),
        ('  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");',
         '  if constexpr (KW == 1) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");\n'
         '  else asm volatile("setmaxnreg.inc.sync.aligned.u32 112;");'),
        ("  float* token_scale = reinterpret_cast<float*>(smem_raw + (base - raw) + STAGES * STAGE + 16 * STAGES) + wg * BN;\n"
         "  const LaneWeights<J, GATED> lane_w(warp, g, X_STAGE, CH / 64 * W_BOX);",
         "  const int half = wg & 1, part = KW > 1 ? wg >> 1 : 0;\n"
         "  float* token_scale = reinterpret_cast<float*>(smem_raw + (base - raw) + L::SCALES) + wg * BN;\n"
         "  const LaneWeights<J, GATED> lane_w(KW > 1 ? warp & 7 : warp, g, X_STAGE, CH / 64 * W_BOX);"),
        ("    for (int i = 0; i < k_tiles; ++i) {\n      const int s = (first + i) % STAGES;",
         f"    const int i0 = {first}, di = {step};\n"
         "    for (int i = i0; i < k_tiles; i += di) {\n      const int s = (first + i) % STAGES;"),
        ("        if (k == 0 && i > 0 && wg_tid == 0) mbar_arrive(bars + 8 * (STAGES + (first + i - 1) % STAGES));",
         "        if (k == 0 && i >= i0 + di && wg_tid == 0) mbar_arrive(bars + 8 * (STAGES + (first + i - di) % STAGES));"),
        ("    if (wg_tid == 0) mbar_arrive(bars + 8 * (STAGES + (first + k_tiles - 1) % STAGES));\n    first += k_tiles;\n",
         "    if (wg_tid == 0 && (KW == 1 || i0 < k_tiles))\n"
         "      mbar_arrive(bars + 8 * (STAGES + (first + i0 + (k_tiles - 1 - i0) / di * di) % STAGES));\n"
         "    first += k_tiles;\n"
         "    int token0 = 0;\n"
         "    if constexpr (KW == 2) {\n"
         "      int* const exchange = reinterpret_cast<int*>(smem_raw + (base - raw) + L::EXCHANGE_AT) + half * 2 * (R / 2) * 128;\n"
         "      int* const mine = exchange + part * (R / 2) * 128 + wg_tid;\n"
         "      const int* const theirs = exchange + (1 - part) * (R / 2) * 128 + wg_tid;\n"
         '      asm volatile("bar.sync %0, 256;" ::"r"(6 + half) : "memory");\n'
         "      if (EXCHANGE)\n"
         "#pragma unroll\n"
         "        for (int r = 0; r < R / 2; ++r) mine[r * 128] = part ? acc[0][r] : acc[0][R / 2 + r];\n"
         '      asm volatile("bar.sync %0, 256;" ::"r"(6 + half) : "memory");\n'
         "      if (EXCHANGE)\n"
         "#pragma unroll\n"
         "        for (int r = 0; r < R / 2; ++r) acc[0][r] = (part ? acc[0][R / 2 + r] : acc[0][r]) + theirs[r * 128];\n"
         "      token0 = part * BN / 2;\n"
         "    }\n"),
        ("    T* const row_out = static_cast<T*>(pick(weights.out, which)) + (m0 + 2 * t) * ldo + wch;\n"
         "    const float* tile_scale = token_scale + 2 * t;\n"
         "    const int row_base = 2 * t - 8 * share.lo;",
         "    T* const row_out = static_cast<T*>(pick(weights.out, which)) + (m0 + token0 + 2 * t) * ldo + wch;\n"
         "    const float* tile_scale = token_scale + token0 + 2 * t;\n"
         "    const int row_base = token0 + 2 * t - 8 * share.lo;"),
        ("    for (int b = 0; b < BN / 8; ++b) {\n      const float2 xs",
         "    for (int b = 0; b < BN / 8 / KW; ++b) {\n      const float2 xs"),
        ("  constexpr size_t smem = Tile<BN, CH>::SMEM;", "  using L = Tile<BN, CH, SPLIT>;\n  constexpr size_t smem = L::SMEM;"),
        ("resident_clusters<kernel>(1, THREADS, smem, sms);", "resident_clusters<kernel>(1, L::THREADS, smem, sms);"),
        ("launch_cluster_kernel(kernel, dim3(ctas), dim3(splits), THREADS, smem,",
         "launch_cluster_kernel(kernel, dim3(ctas), dim3(splits), L::THREADS, smem,"),
        ("resident_clusters<kernel>(splits, THREADS, Tile<128, 256>::SMEM, *clusters);",
         "resident_clusters<kernel>(splits, Tile<128, 256, true>::THREADS, Tile<128, 256, true>::SMEM, *clusters);"),
    ]


def token_halves_edits() -> tuple[list, dict]:
    """The other way to give 64 channels two warpgroups, for the 128 x 128 tile: "token halves", each
    warpgroup of a 64-channel half taking 64 of the 128 tokens over the whole K (m64 n64 k32
    instructions, x read from its token half of the stage, 32 accumulators: no exchange, and room in
    112 registers), every warpgroup releasing every stage (four releases). Returns the kernel's edits
    and hopper.cuh's."""
    # k_parts' skeleton with every warpgroup on every K tile and no exchange (its 64 KB stays unused)
    edits = k_parts_edits(4, 4, exchange=False, kw="(J == 1 && !SPLIT && BN == 128 ? 2 : 1)", first="0", step="1")
    edits += [
        ("X_STAGE = L::X_BYTES, R = BN / 2;", "X_STAGE = L::X_BYTES, R = BN / 2 / KW;"),
        ("  if (tid == 0) init_stage_barriers<STAGES>(bars);", "  if (tid == 0) init_stage_barriers<STAGES, 2 * KW>(bars);"),
        ("        const uint64_t desc = smem_desc(sx + 32 * k);",
         "        const uint64_t desc = smem_desc(sx + part * (BN / KW) * 128 + 32 * k);"),
        ("        for (int j = 0; j < J; ++j) Wgmma<S8, BN>::mma(acc[j], a[j], desc);",
         "        for (int j = 0; j < J; ++j) Wgmma<S8, BN / KW>::mma(acc[j], a[j], desc);"),
    ]
    header = {"hopper.cuh": [
        ("template <int STAGES>\n__device__ __forceinline__ void init_stage_barriers(uint32_t bars) {",
         "template <int STAGES, int RELEASES = 2>\n__device__ __forceinline__ void init_stage_barriers(uint32_t bars) {"),
        ("    mbar_init(bars + 8 * (STAGES + s), 2);  // one release per consumer warpgroup",
         "    mbar_init(bars + 8 * (STAGES + s), RELEASES);")]}
    return edits, header


TOKEN_HALVES, HEADER_EDITS = token_halves_edits()  # the header edit leaves the other variants' code as it is
VARIANT_EDITS = {"k_parts": k_parts_edits(6, 8), "k_parts_4_stages": k_parts_edits(4, 4),
                 "one_part_busy": k_parts_edits(4, 4, first="part * k_tiles", step="1"), "token_halves": TOKEN_HALVES,
                 "unused_64k": [(SMEM, SMEM[:-1] + " + 65536;")]}
KNOCKOUT_EDITS = {"no_exchange": k_parts_edits(6, 8, exchange=False)}


def time_variants(prebuilt: Path, ms) -> list[dict]:
    """The exact variants against the shipped build (the product on every shape, then the op), then
    the knockout with the product alone on the wide 4096-deep layers."""
    say = lambda line: print(line, flush=True)  # noqa: E731
    builds = variant_builds(prebuilt, VARIANT_EDITS)
    rows = time_builds(builds, SHAPES, ms, say) + time_ops(builds, SHAPES, [128], say)
    deep = [(n, k) for n, k in SHAPES if k == 4096 and n > 4096]
    return rows + time_builds(builds[:2] + variant_builds(prebuilt, KNOCKOUT_EDITS)[1:], deep, ms, say, exact=False)


if __name__ == "__main__":
    variants_main(__doc__, partial(build_variants, {**VARIANT_EDITS, **KNOCKOUT_EDITS}, header_edits=HEADER_EDITS),
                  time_variants, "64,128",
                  dict(variants=list(VARIANT_EDITS), knockouts=list(KNOCKOUT_EDITS)))
