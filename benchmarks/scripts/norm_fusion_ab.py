"""The RMSNorm inside the skinny W4A16 kernel (NORM, commit of this script): each CTA computes
norm(x + residual) for all K itself into shared memory before its loop, against the engine's norm
kernel followed by the projections' launch, at decode sizes, kernel level (measured, not kept:
benchmarks/notes-w4a16.md, session 25).

    PYTHONPATH=. python3 benchmarks/scripts/norm_fusion_ab.py --json $OUT/norm-fusion-ab.json

Ways, each a CUDA-graph chain of the same call (weights rotated past the L2, median of rounds):
`matmul` the grouped projections alone on a normalized x; `norm` the engine's add + RMSNorm kernel
alone; `norm+matmul` the two (what the engine ran); `fused` the NORM launch; and two variants of it
rebuilt from this commit's csrc/w4a16_mma.cu, whose outputs are wrong by construction (timing only):
`no_prologue` returns from the norm right after the wait (the loop on resident x, nothing computed),
`no_pass2` skips the second pass (normalization by rstd and the norm weight).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.kernels import random_int4  # noqa: E402
from nibble.bench.timing import bench_us, env_meta, rotations  # noqa: E402
from nibble.eval import engine  # noqa: E402
from nibble.kernels import cuda_build  # noqa: E402
from nibble.kernels import w4a16 as W  # noqa: E402

VARIANTS = {
    "no_prologue": [("  wait_for_prior_grids();\n  float ss[NORM_MAX_M] = {};",
                     "  wait_for_prior_grids();\n  __syncthreads();\n  if (M > 0) return;\n  float ss[NORM_MAX_M] = {};")],
    "no_pass2": [("  for (int u = 0; u < units; ++u) {  // the chunks this thread wrote above",
                  "  for (int u = 0; u < 0; ++u) {")],
}
GROUPS = {"llama2-qkv": ([4096] * 3, 4096), "llama2-gate-up": ([11008] * 2, 4096)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    dev, G, eps = torch.device("cuda"), 128, 1e-5
    shipped = W._mma_lib(dev)
    libs = {"fused": shipped}
    for name, edits in VARIANTS.items():
        lib = cuda_build.build_edited("w4a16_mma", edits, Path(args.json).parent / f"norm-{name}",
                                      cuda_build.device_arch(dev))
        W._MMA_SIGNATURES(lib)
        libs[name] = lib
    rows = []
    for label, (ns, K) in GROUPS.items():
        n_rot = rotations(sum(n * K // 2 for n in ns))
        weights = [[random_int4(n, K, G, dev) for n in ns] for _ in range(n_rot)]
        for M in (int(m) for m in args.ms.split(",")):
            x, res = (torch.randn(M, K, device=dev, dtype=torch.bfloat16) for _ in range(2))
            g = torch.rand(K, device=dev, dtype=torch.bfloat16) + 0.5
            xn = engine.add_rmsnorm(x, res, g, eps)[1]

            def call(i, f):
                qw, s, z = (list(t) for t in zip(*weights[i]))
                return lambda: f(qw, s, z)
            ways = {
                "matmul": lambda i: call(i, lambda qw, s, z: W.w4a16_linears(xn, qw, s, z, G)),
                "norm": lambda i: (lambda: engine.add_rmsnorm(x, res, g, eps)),
                "norm+matmul": lambda i: call(
                    i, lambda qw, s, z: W.w4a16_linears(engine.add_rmsnorm(x, res, g, eps)[1], qw, s, z, G)),
            }
            times: dict = {}
            for _ in range(args.rounds):
                for way, factory in ways.items():
                    times.setdefault(way, []).append(bench_us(factory, 1 if way == "norm" else n_rot))
                for name, lib in libs.items():
                    W._mma_lib = lambda d, lib=lib: lib
                    times.setdefault(name, []).append(bench_us(
                        lambda i: call(i, lambda qw, s, z: W.w4a16_norm_linears(x, res, g, eps, qw, s, z, G)), n_rot))
                W._mma_lib = lambda d: shipped
            for way, t in times.items():
                rows.append(dict(group=label, M=M, way=way, us=statistics.median(t), rounds=t))
                print(f"{label:15s} M={M} {way:12s} {statistics.median(t):7.2f} us", flush=True)
    Path(args.json).write_text(json.dumps({"meta": env_meta(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
