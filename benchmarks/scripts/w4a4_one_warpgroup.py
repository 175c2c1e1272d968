"""Could ping-pong consumers pay in the W4A4 Hopper GEMM? A ping-pong item is one warpgroup's tile:
at most 128 tokens x 128 channels (128 int32 accumulators a thread), two m64 instructions a step,
its own x tile. This builds that item as a kernel, `csrc/w4a4_wgmma.cu` rewritten to one consumer
warpgroup per CTA that owns the whole 128-channel tile (J = CH / 64, stage barriers released by one
arrival), and times it against the shipped kernel's cooperative 128 x 256 and 128 x 128 tiles (two
warpgroups sharing each x tile) on the same inputs (`wgmma_ab.time_builds`: exact int32 products
checked equal first, CUDA graphs, weights rotated past the L2, medians, the builds timed A, B, C, C,
B, A). One warpgroup that runs its items back to back, its epilogue included, bounds what ping-pong
can reach (it hides only the epilogue).

    PYTHONPATH=. python3 benchmarks/scripts/w4a4_one_warpgroup.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from nibble.bench.timing import env_meta  # noqa: E402
from nibble.kernels import cuda_build, w4a4  # noqa: E402
from wgmma_ab import time_builds  # noqa: E402

SHAPES = ((12288, 4096), (11008, 4096), (4096, 11008), (28672, 8192))
# the shipped source -> one consumer warpgroup owning the tile; only the 128 x 128 tile is built
EDITS = (
    ("constexpr int THREADS = CONSUMER_THREADS + 128;", "constexpr int CONSUMERS = 128;\nconstexpr int THREADS = CONSUMERS + 128;"),
    ("static constexpr int CH = CH_, J = CH / 128;", "static constexpr int CH = CH_, J = CH / 64;"),
    ("  if (tid == 0) init_stage_barriers<STAGES>(bars);",
     "  if (tid == 0) {\n    for (int s = 0; s < STAGES; ++s) {\n      mbar_init(bars + 8 * s, 1);\n"
     "      mbar_init(bars + 8 * (STAGES + s), 1);\n    }\n"
     "    asm volatile(\"fence.mbarrier_init.release.cluster;\" ::: \"memory\");\n  }"),
    ("  if (warp >= CONSUMER_THREADS / 32) {", "  if (warp >= CONSUMERS / 32) {"),
    ("    if (tid == CONSUMER_THREADS)", "    if (tid == CONSUMERS)"),
    ("  NIBBLE_LAUNCH(64, 256)\n  NIBBLE_LAUNCH(128, 256)\n", ""),
    ("    err = out_dtype == 1 ? launch_t<__half, true>(NIBBLE_ARGS) : launch_t<__nv_bfloat16, true>(NIBBLE_ARGS);",
     "    err = cudaErrorInvalidValue;"),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="512,1024,4096")
    ap.add_argument("--json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        one = cuda_build.build_edited("w4a4_wgmma", EDITS, Path(tmp))
        w4a4.WGMMA.signatures(one)
        shipped = w4a4.WGMMA.lib(torch.device("cuda"))
        tile = {ch: dict(bn=128, channels=ch, split_k=1) for ch in (128, 256)}
        builds = [("cooperative 128x256", shipped, tile[256]), ("cooperative 128x128", shipped, tile[128]),
                  ("one warpgroup 128x128", one, tile[128])]
        rows = time_builds(builds, SHAPES, [int(m) for m in args.ms.split(",")], lambda line: print(line, flush=True))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": env_meta(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
