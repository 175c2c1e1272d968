"""The W4A4 Hopper product's unsplit configs (every tile, split 1) on four issue-4 shapes at M = 128,
512 and 1024, timed with the package on PYTHONPATH; one JSON line on stdout. An A/B of two source
trees whose libraries cannot share a process (their entry points differ) runs it alternately from
each, e.g. three times each:

    for r in 1 2 3; do
      PYTHONPATH=old python3 benchmarks/scripts/w4a4_unsplit_configs.py | sed 's/^/old /' >> ab.log
      PYTHONPATH=. python3 benchmarks/scripts/w4a4_unsplit_configs.py | sed 's/^/new /' >> ab.log
    done

(benchmarks/results/w4a4-unsplit-kernel-ab-h200.log: session 15's sources as "head", the split
path as its own kernel instantiation as "new"; each line a label and a JSON object.)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.timing import bench_us, rotations  # noqa: E402
from nibble.bench.w4a4 import random_w4a4  # noqa: E402
from nibble.kernels import w4a4 as W  # noqa: E402


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    out = {}
    for N, K in ((12288, 4096), (4096, 4096), (28672, 8192), (4096, 11008)):
        n_rot = rotations(K // 8 * N * 4)
        weights = [random_w4a4(N, K, "cuda") for _ in range(n_rot)]
        for M in (128, 512, 1024):
            qx, sx = W.quantize_activations(torch.randn(M, K, device="cuda").to(torch.bfloat16))
            qe = W.to_even_odd(qx)
            for bn, ch in W.WGMMA.tiles():
                cfg = dict(bn=bn, channels=ch, split_k=1)
                out[f"{N}x{K} M={M} {bn}x{ch}"] = bench_us(lambda i: (lambda: W.w4a4_wgmma(
                    qe, sx, weights[i][0], weights[i][1], order="even_odd", config=cfg)), n_rot)
        weights = None  # freed (not del: the lambdas above close over them)
        torch.cuda.empty_cache()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
