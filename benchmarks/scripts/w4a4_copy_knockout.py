"""What the W4A4 Hopper GEMM's copies cost (`csrc/w4a4_wgmma.cu`): the shipped build against builds
whose producer skips the TMA copies of x, of the weight, or of both, each stage's barrier expecting
only the bytes still copied (`cuda_build.build_edited`). The consumers then run on whatever the ring
holds: those builds are wrong on purpose and only timed (`wgmma_ab.time_builds`, exact=False: CUDA
graphs, weights rotated past the L2, medians, builds timed A, B, ..., B, A). What the product loses
without a copy is what that copy costs on its critical path. nvcc runs where the script runs:
``--build-only DIR`` compiles the variants (on a machine without a GPU), ``--prebuilt DIR`` loads them.

    PYTHONPATH=. python3 benchmarks/scripts/w4a4_copy_knockout.py --build-only .exp/knockout
    PYTHONPATH=. python3 benchmarks/scripts/w4a4_copy_knockout.py --prebuilt .exp/knockout --json out.json
"""
from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from wgmma_ab import SHAPES, build_variants, time_builds, variant_builds, variants_main  # noqa: E402

STAGE_BYTES = "            bars, base, STAGE, STAGE, work.k_begin, work.k_tiles, first,"
X_COPY = "            [&](uint32_t dst, int k0, uint32_t full) { tma_load(dst, &x_map, k0, work.m0, full); });"
W_COPY = "                load_weight_boxes<CH>(dst + X_STAGE, w_map, work.n0 - col0, k0, full);"
VARIANT_EDITS = {  # name -> edits of csrc/w4a4_wgmma.cu
    "no_x": [(STAGE_BYTES, STAGE_BYTES.replace("STAGE, work", "STAGE - X_STAGE, work")),
             (X_COPY, "            [&](uint32_t, int, uint32_t) {});")],
    "no_w": [(STAGE_BYTES, STAGE_BYTES.replace("STAGE, work", "STAGE - L::W_BYTES, work")), (W_COPY, "")],
    "no_copies": [(STAGE_BYTES, STAGE_BYTES.replace("STAGE, work", "0, work")), (W_COPY, ""),
                  (X_COPY, "            [&](uint32_t, int, uint32_t) {});")],
}


def time_knockouts(prebuilt: Path, ms) -> list[dict]:
    return time_builds(variant_builds(prebuilt, VARIANT_EDITS), SHAPES, ms, lambda line: print(line, flush=True),
                       exact=False)


if __name__ == "__main__":
    variants_main(__doc__, partial(build_variants, VARIANT_EDITS), time_knockouts, "128,1024", dict(variants=list(VARIANT_EDITS)))
