"""The W4A16 op's many-token path (dequantize to 16 bits, then cuBLAS): which layout the dense weight
should take. nn.Linear's [N, K] makes the dequantization re-weave every tile (a word holds 8 K rows of
one column) and store K runs of single rows; W^T [K, N] row-major lets each nibble plane be stored as
it stands, whole rows of N. Per issue-3 shape, in one process:

- the dequantization alone, [N, K] (the tile shipped before) and K-major at several tiles and warps;
- cuBLAS on the two layouts (``F.linear(x, W)`` with W [N, K] contiguous or a view of W^T);
- the whole product both ways, and the wgmma kernel, at 1,024-4,096 tokens (``WGMMA_MAX_M``).

    PYTHONPATH=. python3 benchmarks/scripts/w4a16_dequant_layout.py --json $OUT/dequant-layout.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.kernels import GROUP, SHAPES, TIMING, int4_sets  # noqa: E402
from nibble.bench.timing import bench_us, env_meta, rotations  # noqa: E402
from nibble.kernels import w4a16 as W  # noqa: E402

TILES = [(128, 64, 4), (256, 64, 4), (256, 64, 8), (128, 128, 4), (256, 32, 4), (512, 32, 8), (64, 64, 4)]


def dequant(w, out, tile):
    qw, s, z = w
    K, N = qw.shape[0] * 8, qw.shape[1]
    bn, bk, warps = tile
    k_major = out.stride(0) == 1
    W._dequant_kernel[(W._cdiv(N, bn), W._cdiv(K, bk))](qw, s, z, out, N, K, GROUP, out.stride(0), out.stride(1),
                                                         BLOCK_N=bn, BLOCK_K=bk, DQ_ASM=True, K_MAJOR=k_major,
                                                         num_warps=warps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--ms", default="1024,2048,4096")
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for N, K in SHAPES:
        sets = int4_sets(N, K, GROUP, dev)
        n_dense = rotations(N * K * 2)
        nk = [torch.empty(N, K, dtype=dt, device=dev) for _ in range(n_dense)]
        km = [W.kmajor_weight(N, K, dt, dev) for _ in range(n_dense)]
        ref = dequant(sets[0], torch.empty(N, K, dtype=dt, device=dev), (64, 128, 4))
        row = dict(N=N, K=K, dequant_us={}, cublas_us={}, op_us={})
        moved = K // 8 * N * 4 + 2 * (K // GROUP) * N * 2 + N * K * 2
        for tile in [(64, 128, 4, "nk")] + [t + ("km",) for t in TILES]:
            outs = nk if tile[3] == "nk" else km
            got = dequant(sets[0], outs[0], tile[:3])
            assert torch.equal(got, ref), f"{N}x{K} tile {tile}: dequantization differs"
            us = bench_us(lambda i: (lambda: dequant(sets[i % len(sets)], outs[i], tile[:3])), n_dense, **TIMING)
            row["dequant_us"]["%s_%dx%d_w%d" % (tile[3], *tile[:3])] = us
            print(f"{N}x{K} dequant {tile}: {us:.1f} us, {moved / us / 1e3:.0f} GB/s", flush=True)
        for i in range(n_dense):
            dequant(sets[i % len(sets)], nk[i], (64, 128, 4))
            km[i].copy_(nk[i])
        for M in ms:
            x = torch.randn(M, K, device=dev, dtype=dt)
            a, b = F.linear(x, nk[0]), F.linear(x, km[0])
            err = ((a.float() - b.float()).norm() / a.float().norm()).item()
            cub = {name: bench_us(lambda i: (lambda: F.linear(x, ws[i])), n_dense, **TIMING)
                   for name, ws in (("nk", nk), ("km", km))}
            row["cublas_us"][M] = cub
            best = min((t for t in row["dequant_us"] if t.startswith("km")), key=row["dequant_us"].get)
            bn, bk, warps = (int(v) for v in best[3:].replace("x", "_").replace("w", "").split("_"))
            op = {
                "dequant_nk": bench_us(lambda i: (lambda: F.linear(x, dequant(sets[i % len(sets)], nk[i], (64, 128, 4)))),
                                       n_dense, **TIMING),
                "dequant_km": bench_us(lambda i: (lambda: F.linear(x, dequant(sets[i % len(sets)], km[i], (bn, bk, warps)))),
                                       n_dense, **TIMING),
                "wgmma": bench_us(lambda i: (lambda: W.w4a16_wgmma(x, *sets[i], GROUP)), len(sets), **TIMING),
            }
            row["op_us"][M] = op
            print(f"{N}x{K} M={M} cuBLAS nk {cub['nk']:.1f} km {cub['km']:.1f} (rel diff {err:.1e}) | "
                  f"op: " + " ".join(f"{k} {v:.1f}" for k, v in op.items()) + f" | bf16/op best "
                  f"{cub['nk'] / min(op.values()):.3f}", flush=True)
        rows.append(row)
        sets = nk = km = None
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(dict(meta=env_meta(), command="PYTHONPATH=. python3 "
                                             "benchmarks/scripts/w4a16_dequant_layout.py --json ...", rows=rows),
                                        indent=1))


if __name__ == "__main__":
    main()
