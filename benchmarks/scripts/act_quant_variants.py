"""The W4A4 activation quantization (no Hadamard, even_odd order, bf16) at prefill sizes: the op's
choice (`quantize_activations_triton`) against the two-pass chunked kernel at other chunks, warps
and rows per program (CUDA graphs, x rotated past the L2, median); each variant's codes and scales
checked equal to the op's first.

    PYTHONPATH=. python3 benchmarks/scripts/act_quant_variants.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.timing import bench_us, env_meta, rotations  # noqa: E402
from nibble.kernels import w4a4  # noqa: E402

VARIANTS = [(chunk, warps, rows) for chunk in (1024, 2048, 4096) for warps in (4, 8) for rows in (1, 2)]


def chunked(x, chunk, warps, rows):
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    s = torch.empty((M,), dtype=torch.float32, device=x.device)
    w4a4._act_quant_chunked_kernel[(triton.cdiv(M, rows),)](
        x, q, s, M, K, x.stride(0), q.stride(0), float(torch.finfo(x.dtype).max), ROWS=rows, BLOCK_K=chunk,
        EVEN_ODD=True, INTERPRET=False, num_warps=warps)
    return q, s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="4096,11008,14336")
    ap.add_argument("--ms", default="128,512,1024,4096")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for K in (int(k) for k in args.ks.split(",")):
        for M in (int(m) for m in args.ms.split(",")):
            n_rot = rotations(M * K * 3)
            xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) * 3 for _ in range(n_rot)]
            ref = w4a4.quantize_activations_triton(xs[0], False, "even_odd")
            row = dict(M=M, K=K, op=bench_us(lambda i: lambda: w4a4.quantize_activations_triton(xs[i], False, "even_odd"),
                                               n_rot))
            for chunk, warps, r in VARIANTS:
                got = chunked(xs[0], chunk, warps, r)
                assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (M, K, chunk, warps, r)
                row[f"chunked_{chunk}_{warps}w_{r}r"] = bench_us(lambda i: lambda: chunked(xs[i], chunk, warps, r), n_rot)
            rows.append(row)
            best = min((k for k in row if k.startswith("chunked")), key=row.get)
            print(f"M={M:5d} K={K:5d}: op {row['op']:7.2f} us, best chunked {best} {row[best]:7.2f} us; "
                  + " ".join(f"{k[8:]} {row[k]:.1f}" for k in row if k.startswith("chunked")), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": env_meta(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
