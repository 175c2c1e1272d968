"""Tune the CUDA W4A16 kernel (nibble/kernels/csrc/w4a16_mma.cu) on the GPU at hand.

    PYTHONPATH=. python3 benchmarks/scripts/w4a16_mma_sweep.py --json $OUT/w4a16-mma-sweep.json

For each issue-3 shape and M in --ms: cuBLAS bf16, tinygemm, the Triton path (the previous
dispatch) and the CUDA kernel at every warp count, plus the config that
``select_mma_config`` picks. Same timing as ``python -m nibble.bench kernels`` (CUDA-graph replay,
weights rotated past the L2, median). Every variant is first checked against an fp32 product.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.kernels import GROUP, SHAPES, TIMING, weight_sets, tinygemm_mm, tinygemm_pack  # noqa: E402
from nibble.bench.timing import bench_us, env_meta  # noqa: E402
from nibble.kernels import w4a16 as W  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,16,64")
    ap.add_argument("--warps", default="4,8,16")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for N, K in SHAPES:
        G = GROUP
        w4, wb, wf = weight_sets(N, K, G, dev)
        n4, nb = len(w4), len(wb)
        tg = [tinygemm_pack(*w, G) for w in w4]
        for M in ms:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ wf.t()
            res = {"bf16": bench_us(lambda i: (lambda: F.linear(x, wb[i])), nb, **TIMING),
                   "tinygemm": bench_us(lambda i: (lambda: tinygemm_mm(x, tg[i][0], tg[i][1], G)), n4, **TIMING)}
            tcfg = W.select_config(M, N, K, G, sms)
            res["triton"] = bench_us(lambda i: (lambda: W.w4a16_linear_cuda(x, *w4[i], G, config=tcfg)), n4, **TIMING)
            picked = W.select_mma_config(M, N, K, sms)
            cands = [replace(picked, warps=w) for w in map(int, args.warps.split(","))]
            variants = {f"w{c.warps}": c for c in cands + [picked] if W.mma_config_valid(c, M)}
            errs = {}
            for name, cfg in variants.items():
                y = W.w4a16_mma(x, *w4[0], G, config=cfg).float()
                errs[name] = ((y - ref).norm() / ref.norm()).item()
                res[name] = bench_us(lambda i: (lambda: W.w4a16_mma(x, *w4[i], G, config=cfg)), n4, **TIMING)
            best = min(variants, key=lambda k: res[k])
            pick = f"w{picked.warps}"
            floor_us = (K // 8 * N * 4 + 2 * (K // G) * N * 2) / 4.8e6  # the INT4 layer at HBM3e's 4.8 TB/s
            rows.append(dict(N=N, K=K, M=M, us={k: round(v, 2) for k, v in res.items()}, best=best, picked=pick,
                             max_rel_err=max(errs.values()), floor_us=round(floor_us, 2)))
            print(f"N={N:6d} K={K:6d} M={M:3d} bf16 {res['bf16']:7.1f} tg {res['tinygemm']:7.1f} "
                  f"triton {res['triton']:7.1f} | best {best} {res[best]:6.1f}us x{res['bf16'] / res[best]:.2f} "
                  f"| picked {pick} {res.get(pick, float('nan')):6.1f}us x{res['bf16'] / res.get(pick, float('nan')):.2f}"
                  f" (floor {floor_us:.1f}) err {max(errs.values()):.1e}", flush=True)
            print("      " + " ".join(f"{k}={res[k]:.1f}" for k in variants), flush=True)
        w4 = wb = tg = wf = None  # freed (not del: the lambdas above close over them)
        torch.cuda.empty_cache()
    Path(args.json).write_text(json.dumps(dict(meta=env_meta(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
