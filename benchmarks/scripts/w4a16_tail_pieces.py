"""A bound on what splitting the W4A16 decode kernel's last round of blocks along K could buy at one
token. The kernel's time follows the most 32-column blocks any SM streams (w4a16_blocks_per_sm.py):
11008 columns are 344 blocks, 2 rounds of 132 and a tail of 80, and the SMs of the tail stream a third
block while the rest idle. Here the tail's blocks are cut into P pieces along K (whole groups, the
warps of a piece CTA splitting its range), each piece a CTA of its own after the whole rounds, so the
hardware hands the pieces to whichever SMs come free first.

Timing only: the pieces write their partial sums straight to the output (no cross-CTA sum, so the
outputs are wrong and the sum's cost is left out): what this measures is an upper bound on the gain.
The edits (csrc/w4a16_mma.cu, single-weight launches): a CTA past the whole rounds takes piece
blockIdx % P of tail block blockIdx / P; the launcher reads P from NIBBLE_TAIL_PIECES (1: as shipped)
and launches whole rounds + tail x P CTAs. The shipped build is timed beside it, same inputs, same
config (the op's pick), CUDA graphs, weights rotated past the L2.

    PYTHONPATH=. python3 benchmarks/scripts/w4a16_tail_pieces.py --build-only .exp/tail
    PYTHONPATH=. python3 benchmarks/scripts/w4a16_tail_pieces.py --prebuilt .exp/tail --json out.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.kernels import GROUP, TIMING, int4_sets  # noqa: E402
from nibble.bench.timing import bench_us, env_meta, shape_list  # noqa: E402
from nibble.kernels import cuda_build, launch, w4a16  # noqa: E402

EDITS = [
    ("  int tile_col;\n  const int which = cta_weight<MANY>(weights.cta_end, tile_col);\n",
     "  int tile_col;\n  const int which = cta_weight<MANY>(weights.cta_end, tile_col);\n"
     "  // tail pieces (timing experiment): CTAs past the whole rounds take a piece of a tail block's K\n"
     "  const int blocks_all = weights.n[0] / 32, whole = blocks_all / TAIL_SMS * TAIL_SMS, tail = blocks_all - whole;\n"
     "  int pieces = 1, piece = 0;\n"
     "  if (!MANY && tail > 0 && (int)blockIdx.x >= whole) {\n"
     "    pieces = (gridDim.x - whole) / tail;\n"
     "    tile_col = (whole + ((int)blockIdx.x - whole) / pieces) * 32;\n"
     "    piece = ((int)blockIdx.x - whole) % pieces;\n"
     "  }\n"),
    ("  const int s_begin = (int)((long long)units * warp / warps) << unit_shift;\n"
     "  const int s_end = (int)((long long)units * (warp + 1) / warps) << unit_shift;\n",
     "  const int cu0 = units * piece / pieces, cu1 = units * (piece + 1) / pieces;\n"
     "  const int s_begin = (int)(cu0 + (long long)(cu1 - cu0) * warp / warps) << unit_shift;\n"
     "  const int s_end = (int)(cu0 + (long long)(cu1 - cu0) * (warp + 1) / warps) << unit_shift;\n"),
    ("  const int out_weight = cta_weight<MANY>(weights.cta_end, tile_col);\n",
     "  const int out_weight = which;  // tile_col kept: a piece's block is not its blockIdx\n"),
    ("  const int ctas = running_ends(count, ns, 32, w.cta_end);\n",
     "  int ctas = running_ends(count, ns, 32, w.cta_end);\n"
     "  if (const char* p = getenv(\"NIBBLE_TAIL_PIECES\")) {\n"
     "    const int pieces = atoi(p), whole = ctas / TAIL_SMS * TAIL_SMS;\n"
     "    if (count == 1 && pieces > 1 && ctas > whole) ctas = whole + (ctas - whole) * pieces;\n"
     "  }\n"),
    ("#include <type_traits>\n", "#include <cstdlib>\n#include <type_traits>\n\nconstexpr int TAIL_SMS = 132;  // the H200's\n"),
]
SHAPES = "11008x4096,14336x4096,12288x4096,22016x4096,28672x8192,4096x11008"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--pieces", default="1,2,4", help="1: the variant's code, unsplit")
    ap.add_argument("--build-only", type=Path, help="build the variant into this folder and exit (nvcc, no GPU)")
    ap.add_argument("--prebuilt", type=Path, help="a folder --build-only filled")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.build_only:
        cuda_build.build_edited("w4a16_mma", EDITS, args.build_only)
        return
    dev = torch.device("cuda")
    package = w4a16._mma_lib
    shipped = package(dev)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        variant = (ctypes.CDLL(str((args.prebuilt / "w4a16_mma_edited.so").resolve())) if args.prebuilt
                   else cuda_build.build_edited("w4a16_mma", EDITS, Path(tmp)))
        w4a16._MMA_SIGNATURES(variant)
        for N, K in shape_list(args.shapes):
            ws = int4_sets(N, K, GROUP, dev)
            x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
            cfg = w4a16.select_mma_config(1, N, K, launch.num_sms(dev))
            row = dict(N=N, K=K, config=str(cfg), blocks=N // 32)

            def timed(lib):
                w4a16._mma_lib = lambda _d: lib
                try:
                    return bench_us(lambda i: (lambda: w4a16.w4a16_mma(x, *ws[i], GROUP, config=cfg)), len(ws), **TIMING)
                finally:
                    w4a16._mma_lib = package

            for rnd in range(2):  # shipped, variant at each P, then the other way round
                arms = [("shipped", shipped, "1")] + [(f"pieces{p}", variant, p) for p in args.pieces.split(",")]
                for name, lib, p in (arms if rnd == 0 else arms[::-1]):
                    os.environ["NIBBLE_TAIL_PIECES"] = p
                    row.setdefault(name, []).append(timed(lib))
            os.environ.pop("NIBBLE_TAIL_PIECES", None)
            for name in [k for k in row if isinstance(row[k], list)]:
                row[name] = sum(row[name]) / len(row[name])
            rows.append(row)
            print(f"{N:6d} x {K:5d} ({N // 32} blocks): " + "  ".join(
                f"{k} {row[k]:6.2f} us" for k in row if isinstance(row[k], float)), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": env_meta(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
