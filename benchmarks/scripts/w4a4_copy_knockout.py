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

import argparse
import ctypes
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from nibble.bench.timing import env_meta  # noqa: E402
from nibble.kernels import cuda_build, w4a4  # noqa: E402
from wgmma_ab import SHAPES, time_builds  # noqa: E402

STAGE_BYTES = "            bars, base, STAGE, STAGE, work.k_begin, work.k_tiles, first,"
X_COPY = "            [&](uint32_t dst, int k0, uint32_t full) { tma_load(dst, &x_map, k0, work.m0, full); });"
W_COPY = "                load_weight_boxes<CH>(dst + X_STAGE, w_map, work.n0 - col0, k0, full);"
KNOCKOUTS = {  # name -> edits of csrc/w4a4_wgmma.cu
    "no_x": [(STAGE_BYTES, STAGE_BYTES.replace("STAGE, work", "STAGE - X_STAGE, work")),
             (X_COPY, "            [&](uint32_t, int, uint32_t) {});")],
    "no_w": [(STAGE_BYTES, STAGE_BYTES.replace("STAGE, work", "STAGE - L::W_BYTES, work")), (W_COPY, "")],
    "no_copies": [(STAGE_BYTES, STAGE_BYTES.replace("STAGE, work", "0, work")), (W_COPY, ""),
                  (X_COPY, "            [&](uint32_t, int, uint32_t) {});")],
}


def build_all(out_dir: Path) -> None:
    for name, edits in KNOCKOUTS.items():
        cuda_build.build_edited("w4a4_wgmma", edits, out_dir / name)
        print(f"built {out_dir / name}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build-only", type=Path)
    ap.add_argument("--prebuilt", type=Path)
    ap.add_argument("--ms", default="128,1024")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.build_only:
        build_all(args.build_only)
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.prebuilt is None:
            args.prebuilt = Path(tmp)
            build_all(args.prebuilt)
        builds = [("shipped", w4a4._wgmma_lib(torch.device("cuda")), None)]
        for name in KNOCKOUTS:
            lib = ctypes.CDLL(str(args.prebuilt / name / "w4a4_wgmma_edited.so"))
            w4a4._WGMMA_SIGNATURES(lib)
            builds.append((name, lib, None))
        rows = time_builds(builds, SHAPES, [int(m) for m in args.ms.split(",")], lambda line: print(line, flush=True),
                           exact=False)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": env_meta(variants=list(KNOCKOUTS)), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
