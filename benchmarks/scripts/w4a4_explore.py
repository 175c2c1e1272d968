"""W4A4 prefill product on one device call: the wgmma kernel (csrc/w4a4_wgmma.cu) checked, then
its tile shapes and split-K timed against cuBLAS bf16 (and the Triton kernel, with --triton).

A wrong result is diagnosed before anything is timed: which K row of the weight each K slot
actually read (one-hot activations), and whether outputs landed on other (token, channel) cells.

PYTHONPATH=. python3 benchmarks/scripts/w4a4_explore.py [--quick] [--triton] [--tiles 64x128,...] [--ms 64,128]
    [--shapes 4096x11008,...]   (log: $OUT/w4a4_explore.log)
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

from nibble.bench.timing import bench_us, rotations, shape_list, tee
from nibble.bench.w4a4 import _dense_bf16, random_w4a4
from nibble.formats.int4 import unpack_int4
from nibble.kernels import hopper, reference
from nibble.kernels import w4a4 as W

OUT = os.environ.get("OUT", "/tmp")
log = print  # main: tee(OUT/w4a4_explore.log) (not opened on import)
SHAPES = [(4096, 4096), (12288, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336),
          (28672, 8192), (8192, 28672)]


def acc_of(qx, qw, cfg=None):
    M, N = qx.shape[0], qw.shape[1]
    return W.w4a4_wgmma(qx, torch.ones(M, device="cuda"), qw, torch.ones(N, device="cuda"), out_int32=True,
                        config=cfg)


def diagnose(M=64, N=256, K=128) -> bool:
    gen = torch.Generator().manual_seed(0)
    qw = torch.randint(-2**31, 2**31 - 1, (K // 8, N), generator=gen, dtype=torch.int64).to(torch.int32).cuda()
    qx = torch.randint(-8, 8, (M, K), generator=gen, dtype=torch.int8).cuda()
    got, exact = acc_of(qx, qw), reference.w4a4_accumulate(qx, qw)
    if torch.equal(got, exact):
        log(f"diagnose M={M} N={N} K={K}: exact")
        return True
    bad = (got != exact).nonzero()
    log(f"diagnose M={M} N={N} K={K}: {len(bad)} of {got.numel()} differ; first {bad[:8].tolist()}")
    # which weight K row each K slot reads: activations one-hot at k, weight rows distinct
    w = unpack_int4(qw).cuda().to(torch.int32) - 8  # [K, N]
    mapping = []
    for k in range(K):
        x1 = torch.zeros(M, K, dtype=torch.int8, device="cuda")
        x1[:, k] = 1
        row = acc_of(x1, qw)[0]
        hits = [j for j in range(K) if torch.equal(row, w[j])]
        mapping.append(hits[0] if len(hits) == 1 else hits)
    log(f"  K slot -> weight row read: {mapping}")
    # misplaced outputs: does got[m, n] equal exact elsewhere?
    flat = {v: i for i, v in enumerate(exact.flatten().tolist())}
    for m, n in bad[:8].tolist():
        i = flat.get(got[m, n].item())
        log(f"  out[{m},{n}] = {got[m, n].item()} = exact{divmod(i, N) if i is not None else '?'}")
    return False


def main(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="M = 128 and 1024 on five of the shapes")
    ap.add_argument("--triton", action="store_true", help="time the Triton kernel too")
    ap.add_argument("--tiles", help="BNxCHANNELS tiles, comma-separated (default: the package's)")
    ap.add_argument("--ms", help="token counts, comma-separated")
    ap.add_argument("--shapes", help="NxK, comma-separated")
    args = ap.parse_args(argv)
    global log
    log = tee(os.path.join(OUT, "w4a4_explore.log"))
    quick, triton = args.quick, args.triton
    tiles = shape_list(args.tiles) if args.tiles else W.WGMMA.tiles()
    log(f"device {torch.cuda.get_device_name()} torch {torch.__version__}")
    ok = all([diagnose(), diagnose(M=17, N=260, K=160), diagnose(M=300, N=1024, K=1024),
              diagnose(M=128, N=512, K=4096)])
    if not ok:
        log("wgmma kernel WRONG: stopping before timing")
        return 1
    table = []
    clusters = W.WGMMA.clusters("cuda")
    log(f"clusters resident at once, by split: {clusters}")
    ms = [128, 1024] if quick else [64, 128, 256, 512, 1024]
    ms = [int(m) for m in args.ms.split(",")] if args.ms else ms
    shapes = SHAPES[:3] + SHAPES[6:] if quick else SHAPES
    for N, K in shape_list(args.shapes) if args.shapes else shapes:
        n4 = rotations(K // 8 * N * 4)
        w4 = [random_w4a4(N, K, "cuda") for _ in range(n4)]
        nb = rotations(N * K * 2)
        wb = [_dense_bf16(*w4[i % n4]) for i in range(nb)]
        for M in ms:
            x = (torch.randn(M, K, device="cuda") * torch.logspace(-1, 1, K, device="cuda")).to(torch.bfloat16)
            qx, sx = W.quantize_activations(x)
            qe = W.to_even_odd(qx)
            row = dict(N=N, K=K, M=M)
            row["bf16"] = bench_us(lambda i: (lambda: F.linear(x, wb[i])), nb)
            if triton:
                row["triton"] = bench_us(lambda i: (lambda: W.w4a4_matmul_triton(qx, sx, w4[i][0], w4[i][1])), n4)
            auto = W.WGMMA.config(M, N, K, W.WGMMA.clusters("cuda"))
            cfgs = {"auto": auto}
            for bn, ch in tiles:
                if bn == 64 and M > 256:
                    continue
                for sp in hopper.SPLITS:
                    if sp == 1 or (hopper.tile_count(M, N, bn, ch) * sp <= 4 * 132 and K // 128 // sp >= 2):
                        cfgs[f"bn{bn}_ch{ch}_s{sp}"] = dict(bn=bn, channels=ch, split_k=sp)
            for name, cfg in cfgs.items():
                row[name] = bench_us(lambda i, c=cfg: (lambda: W.w4a4_wgmma(qe, sx, w4[i][0], w4[i][1], order="even_odd",
                                                                            config=c)), n4)
            row["actquant"] = bench_us(lambda i: (lambda: W.quantize_activations_triton(x, False, "even_odd")), 1)
            row["op"] = bench_us(lambda i: (lambda: torch.ops.nibble.w4a4_linear(x, w4[i][0], w4[i][1], None, False)), n4)
            best = min((v, k) for k, v in row.items() if k not in ("N", "K", "M", "bf16", "triton", "actquant", "op"))
            log(f"{N:6d}x{K:<6d} M={M:5d} bf16 {row['bf16']:8.1f}  triton {row.get('triton', float('nan')):8.1f}  wgmma auto "
                f"{row['auto']:8.1f} ({auto})  best {best[1]} {best[0]:8.1f}  actq {row['actquant']:6.1f}  "
                f"op {row['op']:8.1f} = {row['bf16'] / row['op']:.2f}x bf16  | " +
                " ".join(f"{k}={v:.1f}" for k, v in row.items() if k.startswith("bn")))
            table.append(row)
        w4 = wb = None  # freed (not del: the lambdas above close over them)
        torch.cuda.empty_cache()
    with open(os.path.join(OUT, "w4a4_explore.json"), "w") as f:
        json.dump({"clusters": clusters, "rows": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
