"""How many pipeline stages should each tile of the W4A4 Hopper GEMM (`csrc/w4a4_wgmma.cu`) have?
The kernel's `Tile::STAGES` (4 for every tile since session 15, when this script measured 4 against
the 6 that session 7 had left on the 128 x 128 and 64 x 256 tiles: benchmarks/results/
w4a4-stages-h200.json); this rebuilds it with other counts (`cuda_build.build_edited`) and times
every build on the same inputs (`wgmma_ab.time_builds`: int32 products checked equal, CUDA graphs,
weights rotated past the L2, medians, builds timed A, B, ..., B, A). nvcc runs where the script
runs: ``--build-only DIR`` compiles the variants (on a machine without a GPU), ``--prebuilt DIR``
loads them.

    PYTHONPATH=. python3 benchmarks/scripts/w4a4_stages.py --build-only .exp/stages
    PYTHONPATH=. python3 benchmarks/scripts/w4a4_stages.py --prebuilt .exp/stages --json out.json
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from nibble.kernels import cuda_build  # noqa: E402
from wgmma_ab import time_builds, variant_builds, variants_main  # noqa: E402

SHAPES = ((12288, 4096), (22016, 4096), (4096, 4096), (4096, 11008), (28672, 8192))
ANCHOR = "static constexpr int STAGES = 4;"
# name -> (stages of 128 x 256, stages of the other tiles); "shipped" is the package's own build (4, 4)
VARIANTS = {"s4_6": (4, 6), "s5_4": (5, 4), "s6_4": (6, 4), "s3_4": (3, 4), "s4_8": (4, 8), "s4_3": (4, 3)}


def build_all(out_dir: Path) -> None:
    for name, (wide, other) in VARIANTS.items():
        d = out_dir / name
        d.mkdir(parents=True, exist_ok=True)
        edit = f"static constexpr int STAGES = BN == 128 && CH == 256 ? {wide} : {other};"
        cuda_build.build_edited("w4a4_wgmma", [(ANCHOR, edit)], d)
        print(f"built {d}", flush=True)


def time_variants(prebuilt: Path, ms) -> list[dict]:
    return time_builds(variant_builds(prebuilt, VARIANTS), SHAPES, ms, lambda line: print(line, flush=True))


if __name__ == "__main__":
    variants_main(__doc__, build_all, time_variants, "128,512,1024,4096", dict(variants=VARIANTS))
