"""Tune the Hopper W4A16 GEMM (nibble/kernels/csrc/w4a16_wgmma.cu) on the GPU at hand.

    PYTHONPATH=. python3 benchmarks/scripts/w4a16_wgmma_sweep.py --json $OUT/w4a16-wgmma-sweep.json

For each issue-3 shape and M in --ms: cuBLAS bf16, the previous dispatch (the skinny CUDA kernel
up to M = 64, dequantise + cuBLAS above) and the wgmma kernel at every token tile and split-K,
plus the config ``WGMMA.config`` picks. Same timing as ``python -m nibble.bench kernels``
(CUDA-graph replay, weights rotated past the L2, median). Every variant is first checked against
an fp32 product.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.kernels import GROUP, SHAPES, TIMING, weight_sets  # noqa: E402
from nibble.bench.timing import bench_us, env_meta, shape_list  # noqa: E402
from nibble.kernels import hopper  # noqa: E402
from nibble.kernels import w4a16 as W  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="64,128,256,512,1024,4096")
    ap.add_argument("--splits", default="1,2,3,4,6,8")
    ap.add_argument("--tiles", default=None, help="tokens x channels of the tiles to time (default: every one), "
                                                  "e.g. 64x128,128x128")
    ap.add_argument("--shapes", default=None, help="N x K of the shapes to time (default: the issue-3 ones)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    splits = [int(v) for v in args.splits.split(",")]
    tiles_timed = shape_list(args.tiles) if args.tiles else W.WGMMA.tiles()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    clusters = W.WGMMA.clusters(dev)
    rows = []
    for N, K in shape_list(args.shapes) if args.shapes else SHAPES:
        G = GROUP if K % GROUP == 0 else 64  # SmolLM2's 576-deep layers take groups of 64
        w4, wb, wf = weight_sets(N, K, G, dev)
        n4, nb = len(w4), len(wb)
        k_tiles = -(-K // hopper.STAGE_K)
        for M in ms:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ wf.t()
            variants = {"bf16": lambda i: (lambda: F.linear(x, wb[i]))}
            if M <= W.MMA_MAX_M:
                variants["previous"] = lambda i: (lambda: W.w4a16_mma(x, *w4[i], G))
            else:
                variants["previous"] = lambda i: (lambda: W.w4a16_linear_cuda(x, *w4[i], G, config=W.Config(kind="dequant")))
            auto = W.WGMMA.config(M, N, K, clusters)
            for bn, channels in tiles_timed:
                if (bn == 64 and M > 256) or (bn == 256 and M < 256):
                    continue
                tiles = hopper.tile_count(M, N, bn, channels)
                for sp in splits:
                    if sp > 1 and (tiles * sp > 2 * sms or k_tiles // sp < 2):
                        continue
                    cfg = dict(bn=bn, channels=channels, split_k=sp)
                    tag = f"wgmma_bn{bn}_ch{channels}_s{sp}" + ("_auto" if cfg == auto else "")
                    variants[tag] = (lambda cfg_: lambda i: (
                        lambda: W.w4a16_wgmma(x, *w4[i], G, config=cfg_)))(cfg)
            res = {}
            for name, make in variants.items():
                y = make(0)()
                err = ((y.float() - ref).norm() / ref.norm()).item()
                if not err < 1e-2:
                    print(f"CHECK FAILED {name} N={N} K={K} M={M} rel err {err:.3e}", flush=True)
                    continue
                res[name] = bench_us(make, nb if name == "bf16" else n4, **TIMING)
            base = res["bf16"]
            for name, us in res.items():
                rows.append(dict(op=name, M=M, N=N, K=K, group_size=G, us=round(us, 3), speedup=round(base / us, 4)))
            best = min((k for k in res if k.startswith("wgmma")), key=res.get)
            auto_name = next((k for k in res if k.endswith("_auto")), best)
            print(f"N={N:6d} K={K:6d} M={M:5d} bf16 {base:8.2f} previous x{base / res['previous']:.2f}  "
                  f"best {best} x{base / res[best]:.2f}  auto {auto_name} x{base / res[auto_name]:.2f}  | "
                  + " ".join(f"{k.replace('wgmma_', '')}={v:.1f}" for k, v in res.items() if k.startswith("wgmma")),
                  flush=True)
        w4 = wb = wf = None  # freed (not del: the lambdas above close over them)
        torch.cuda.empty_cache()
    Path(args.json).write_text(json.dumps(dict(meta=env_meta(benchmark="w4a16-wgmma-sweep", command=" ".join(sys.argv),
                                                            clusters=clusters), rows=rows), indent=1))


if __name__ == "__main__":
    main()
