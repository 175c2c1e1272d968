"""W4A4's Hopper GEMM with 256-deep pipeline stages instead of 128. The fitted cost model says a
128-deep stage of the 128 x 128 tile takes 0.365 us and of the 128 x 256 tile 0.59 us, 0.295 us per
128 x 128 share of its MMAs (the int8 peak: 0.26 us at 1.98 GHz). If the 128 x 128 tile's extra ~0.07 us
is a fixed cost per stage (its barrier wait and release, the step that starts on a fresh stage),
stages twice as deep pay it half as often: its mainloop ~10% shorter; unchanged if it is per step.

Variant "deep": hopper.cuh's BK = 256 (weight boxes of 32 word rows), x copied as two 128-byte-wide
boxes per stage (the TMA's 128-byte swizzle caps a box row at 128 bytes) and each k32 step's wgmma
descriptor in its box; four stages where they fit in shared memory, three for 128 x 256 (64 KB a
stage). The host still counts K stages of 128 (hopper.split_plan): the kernel rounds a split's
stages up to whole 256-deep ones, so splits cover other K ranges than the shipped build's, which
int32 sums do not see (the products must be equal). "deep3": the same with three stages for every
tile. Timed against the shipped build in one process: the GEMM back to back
(`wgmma_ab.time_builds`) and the op (quantize + GEMM, `wgmma_ab.time_ops`).

    PYTHONPATH=. python3 benchmarks/scripts/w4a4_deep_stages.py --build-only .exp/deep
    PYTHONPATH=. python3 benchmarks/scripts/w4a4_deep_stages.py --prebuilt .exp/deep --json out.json
"""
from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from wgmma_ab import build_variants, time_product_and_op, variants_main  # noqa: E402

X_BOXES = (("            [&](uint32_t dst, int k0, uint32_t full) { tma_load(dst, &x_map, k0, work.m0, full); });",
            "            [&](uint32_t dst, int k0, uint32_t full) {\n"
            "              tma_load(dst, &x_map, k0, work.m0, full);\n"
            "              tma_load(dst + BN * 128, &x_map, k0 + 128, work.m0, full);\n"
            "            });"),
           ("        const uint64_t desc = smem_desc(sx + 32 * k);",
            "        const uint64_t desc = smem_desc(sx + (k / 4) * BN * 128 + 32 * (k % 4));"),
           ("  cudaError_t err = tensor_map_2d(&x_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, qx, K, M, ldx, BK, BN);",
            "  cudaError_t err = tensor_map_2d(&x_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, qx, K, M, ldx, 128, BN);"))
STAGES = "  static constexpr int STAGES = 4;"
VARIANT_EDITS = {
    "deep": [*X_BOXES, (STAGES, "  static constexpr int STAGES = 4 * STAGE + 3072 <= 227 * 1024 ? 4 : 3;")],
    "deep3": [*X_BOXES, (STAGES, "  static constexpr int STAGES = 3;")],
}
HEADER_EDITS = {"hopper.cuh": [
    ("constexpr int BK = 128;", "constexpr int BK = 256;"),
    ("  const int k_all = (K + BK - 1) / BK, k_begin = split * tiles_per_split;",
     "  tiles_per_split = (tiles_per_split * 128 + BK - 1) / BK;  // the host counts 128-deep stages\n"
     "  const int k_all = (K + BK - 1) / BK, k_begin = split * tiles_per_split;")]}


if __name__ == "__main__":
    variants_main(__doc__, partial(build_variants, VARIANT_EDITS, header_edits=HEADER_EDITS),
                  partial(time_product_and_op, names=VARIANT_EDITS), "128,64,256,1024",
                  dict(variants=list(VARIANT_EDITS)))
