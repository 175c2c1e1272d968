"""Could ping-pong consumers pay in the W4A4 Hopper GEMM? A ping-pong item is one warpgroup's tile:
at most 128 tokens x 128 channels (128 int32 accumulators a thread), two m64 instructions a step,
its own x tile. This builds that item as a kernel, `csrc/w4a4_wgmma.cu` rewritten to one consumer
warpgroup per CTA that owns the whole 128-channel tile (J = CH / 64, stage barriers released by one
arrival), and times it against the shipped kernel's cooperative 128 x 256 and 128 x 128 tiles (two
warpgroups sharing each x tile) on the same inputs: exact int32 products checked equal first, CUDA
graphs, weights rotated past the L2, median. One warpgroup that runs its items back to back, its
epilogue included, bounds what ping-pong can reach (it hides only the epilogue).

    PYTHONPATH=. python3 benchmarks/scripts/w4a4_one_warpgroup.py --json out.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nibble.bench.timing import bench_us, env_meta, rotations  # noqa: E402
from nibble.kernels import cuda_build, w4a4  # noqa: E402

CSRC = ROOT / "nibble" / "kernels" / "csrc"
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


def build_one_warpgroup(out_dir: Path) -> ctypes.CDLL:
    src = (CSRC / "w4a4_wgmma.cu").read_text()
    for old, new in EDITS:
        if src.count(old) != 1:
            raise RuntimeError(f"csrc/w4a4_wgmma.cu changed: cannot apply {old.splitlines()[0]!r}")
        src = src.replace(old, new)
    cu, so = out_dir / "w4a4_wgmma_one_warpgroup.cu", out_dir / "w4a4_wgmma_one_warpgroup.so"
    cu.write_text(src)
    subprocess.run([cuda_build.find_nvcc(), "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-I", str(CSRC),
                    "-gencode=arch=compute_90a,code=sm_90a", "-o", str(so), str(cu)], check=True)
    lib = ctypes.CDLL(str(so))
    w4a4._WGMMA_SIGNATURES(lib)
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="512,1024,4096")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    shipped = w4a4._wgmma_lib(dev)
    with tempfile.TemporaryDirectory() as tmp:
        one = build_one_warpgroup(Path(tmp))
        variants = (("cooperative 128x256", shipped, 256), ("cooperative 128x128", shipped, 128),
                    ("one warpgroup 128x128", one, 128))
        rows = []
        for N, K in SHAPES:
            n_rot = rotations(K * N // 2)
            weights = [torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32, device=dev) for _ in range(n_rot)]
            w_scale = torch.rand(N, device=dev, dtype=torch.bfloat16) / 64
            for M in (int(m) for m in args.ms.split(",")):
                qx = torch.randint(-8, 8, (M, K), dtype=torch.int8, device=dev)
                sx = torch.rand(M, device=dev) / 8
                row, ref = dict(N=N, K=K, M=M), None
                for name, lib, channels in variants:
                    w4a4._wgmma_lib = lambda _d, lib=lib: lib
                    cfg = dict(bn=128, channels=channels, split_k=1)
                    acc = w4a4.w4a4_wgmma(qx, sx, weights[0], w_scale, out_int32=True, order="even_odd", config=cfg)
                    ref = acc if ref is None else ref
                    assert torch.equal(acc, ref), f"{name} differs at M={M} N={N} K={K}"
                    row[name] = bench_us(lambda j: lambda: w4a4.w4a4_wgmma(qx, sx, weights[j], w_scale, order="even_odd",
                                                                           config=cfg), n_rot)
                rows.append(row)
                base = row[variants[0][0]]
                print(f"{N:5d} x {K:5d} M={M:5d}: " + "  ".join(f"{name} {row[name]:8.2f} us ({base / row[name]:.3f}x)"
                                                               for name, _, _ in variants), flush=True)
        w4a4._wgmma_lib = lambda _d: shipped
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": env_meta(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
