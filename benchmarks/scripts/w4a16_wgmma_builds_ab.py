"""A/B of builds of the W4A16 Hopper GEMM (`csrc/w4a16_wgmma.cu`) in either activation dtype: each
build's library is loaded in turn in place of the package's and times `w4a16_wgmma` on the same
inputs at the config the op picks (CUDA graphs, weights rotated past the L2; the builds timed in
alternating order over --rounds, median). Every build's output is checked against the fp32 reference
(the largest error over the largest output, printed) and against the first build's.

    PYTHONPATH=. python3 benchmarks/scripts/w4a16_wgmma_builds_ab.py old.so new.so --dtype float16 --json ab.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.kernels import GROUP, SHAPES, TIMING, int4_sets  # noqa: E402
from nibble.bench.timing import bench_us, env_meta  # noqa: E402
from nibble.kernels import reference, w4a16 as W  # noqa: E402
from wgmma_ab import load_build  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("builds", nargs="+", help="shared libraries of csrc/w4a16_wgmma.cu (sm_90a); the first is the baseline")
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="float16")
    ap.add_argument("--ms", default="64,128,512,1024")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    dev, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    libs = {Path(p).stem: load_build(W, p) for p in args.builds}
    names = list(libs)
    rows = []
    for N, K in SHAPES:
        sets = int4_sets(N, K, GROUP, dev)
        w_ref = reference.dequantize(*sets[0], GROUP, dtype=dtype).float()
        for M in map(int, args.ms.split(",")):
            x = torch.randn(M, K, device=dev, dtype=dtype)
            ref = x.float() @ w_ref.t()
            outs = [torch.empty(M, N, device=dev, dtype=dtype) for _ in sets]
            first, errors = None, {}
            for name in names:
                W.WGMMA.lib = lambda _device, lib=libs[name]: lib
                y = W.w4a16_wgmma(x, *sets[0], GROUP)
                errors[name] = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                first = y if first is None else first
                errors[name + " equal"] = bool(torch.equal(y, first))
            times = {name: [] for name in names}
            for r in range(args.rounds):
                for name in (names if r % 2 == 0 else names[::-1]):
                    W.WGMMA.lib = lambda _device, lib=libs[name]: lib
                    times[name].append(bench_us(lambda i: (lambda: W.w4a16_wgmma(x, *sets[i], GROUP, out=outs[i])),
                                                len(sets), **TIMING))
            us = {name: statistics.median(t) for name, t in times.items()}
            print(f"{N}x{K} M={M} " + " ".join(f"{n} {u:7.2f} us ({us[names[0]] / u:.3f}x, err {errors[n]:.1e})"
                                               for n, u in us.items()), flush=True)
            rows.append(dict(N=N, K=K, M=M, config=W.WGMMA.config(M, N, K, W.WGMMA.clusters(dev)), us=us,
                             errors=errors))
        sets = None
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(dict(meta=env_meta(), dtype=args.dtype, builds=args.builds, rows=rows), indent=1))


if __name__ == "__main__":
    main()
