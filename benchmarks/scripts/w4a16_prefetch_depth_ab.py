"""How much of its weight a skinny W4A16 launch pulls into the L2 before it waits for its input
(the shipped kernel: its first 4 steps, every lane its own 16-byte piece, so 8 lanes ask for each
128-byte line), against variants of csrc/w4a16_mma.cu that ask once per line, for the first 4 or 16
steps or the warp's whole K range: Llama-2-7B W4A16 decode, each way's decode captured in its own
CUDA graph, alternating rounds, greedy tokens compared (w4a16_skinny_variants.decode_ab); and the op
back to back on its decode layers.

    PYTHONPATH=. python3 benchmarks/scripts/w4a16_prefetch_depth_ab.py --json $OUT/prefetch-depth-ab.json

Session 9 measured 8 and 16 steps the old way (every lane): decode 486 / 459 tokens/s against 500.
Mind the registers: in the H200 run of session 25 (results/w4a16-prefetch-depth-ab-h200.json) every
variant's several-weight kernels spilled 16 bytes where the shipped ones spill none (`cuobjdump
-res-usage`), so only the single-weight layers (o, down) compare cleanly there.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.kernels import random_int4  # noqa: E402
from nibble.bench.timing import bench_us, env_meta, rotations  # noqa: E402
from nibble.eval import speed  # noqa: E402
from nibble.kernels import cuda_build  # noqa: E402
from nibble.kernels import w4a16 as W  # noqa: E402
from w4a16_skinny_variants import decode_ab, library_installers  # noqa: E402  (this folder: the skinny-kernel variants' decode A/B)

SHIPPED = "  ws.prefetch<RING>(s_begin, s_end);\n"


def per_line(rows: str) -> str:
    """Lanes take the weight's 128-byte lines (4 rows of 32 columns a step) in turn, one request each."""
    return ("  for (int r = lane; r < " + rows + "; r += 32)\n"
            "    prefetch_l2(true, qweight + (size_t)(4 * s_begin + r) * N + tile_col);\n")


VARIANTS = {"lines4": per_line("min(16, 4 * (s_end - s_begin))"),
            "lines16": per_line("min(64, 4 * (s_end - s_begin))"),
            "lines_all": per_line("4 * (s_end - s_begin)")}
LAYERS = {"llama2-qkv": ([4096] * 3, 4096), "llama2-o": ([4096], 4096), "llama2-gate-up": ([11008] * 2, 4096),
          "llama2-down": ([4096], 11008)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", required=True)
    ap.add_argument("--build-dir", default=None, help="where the variants are compiled (default: a temporary folder)")
    args = ap.parse_args()
    build_dir = Path(args.build_dir or tempfile.mkdtemp(prefix="nibble-prefetch-"))
    dev = torch.device("cuda")
    libs = {"shipped": W._mma_lib(dev)}
    for name, new in VARIANTS.items():
        lib = cuda_build.build_edited("w4a16_mma", [(SHIPPED, new)], build_dir / name,
                                      cuda_build.device_arch(dev))
        W._MMA_SIGNATURES(lib)
        libs[name] = lib
    shipped_lib = W._mma_lib
    rows = []
    G = 128
    for label, (ns, K) in LAYERS.items():  # back to back: the predecessor is the same launch
        n_rot = rotations(sum(n * K // 2 for n in ns))
        weights = [[random_int4(n, K, G, dev) for n in ns] for _ in range(n_rot)]
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        outs, times = {}, {name: [] for name in libs}
        for name, lib in libs.items():
            W._mma_lib = lambda d, lib=lib: lib
            outs[name] = W.w4a16_mma_many(x, weights[0], G)
        for r in range(2):
            for name in speed.round_order(libs, r):
                W._mma_lib = lambda d, lib=libs[name]: lib
                times[name].append(bench_us(lambda i: (lambda: W.w4a16_mma_many(x, weights[i], G)), n_rot))
        W._mma_lib = shipped_lib
        base = statistics.median(times["shipped"])
        for name, t in times.items():
            us, same = statistics.median(t), all(torch.equal(a, b) for a, b in zip(outs[name], outs["shipped"]))
            rows.append(dict(layer=label, M=1, way=name, us=us, rounds=t, speedup=base / us, bit_exact=same))
            print(f"{label:15s} M=1 {name:9s} {us:7.2f} us ({base / us:.3f}x){'' if same else ' DIFFER'}", flush=True)
    batches = [int(b) for b in args.batches.split(",") if b]
    if batches:  # each engine's decode graph is captured with its own library's kernels
        rows += decode_ab("llama-2-7b", library_installers(libs), batches, args.rounds)
        W._mma_lib = shipped_lib
    Path(args.json).write_text(json.dumps({"meta": env_meta(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
