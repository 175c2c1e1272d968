"""What writing a GPTQ act-order layer's input in its order costs the engine's glue kernels.

The residual add + RMSNorm with and without ``columns`` (the row permuted in registers before its
stores), at 4 / 8 / 16 warps, and the decode attention with and without ``scatter`` (o_proj's input
order), Llama-2-7B's shapes, CUDA graphs, 3 interleaved rounds, median (H200).

    PYTHONPATH=. python3 benchmarks/scripts/act_order_glue_ab.py --json $OUT/act-order-glue.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.timing import env_meta, time_against  # noqa: E402
from nibble.eval import engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rows", default="1,8,128")
    ap.add_argument("--cache", type=int, default=256, help="attention: keys in the cache")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    dev, dt, N = "cuda", torch.bfloat16, args.hidden
    perm = torch.randperm(N, device=dev)
    w = torch.randn(N, device=dev, dtype=dt)
    rows = []
    shipped_warps = engine._norm_warps
    for M in (int(m) for m in args.rows.split(",")):
        x, res = (torch.randn(1, M, N, device=dev, dtype=dt) for _ in range(2))
        want = engine.add_rmsnorm(x, res, w, 1e-5)[1][..., perm]
        arms = {"norm": lambda: engine.add_rmsnorm(x, res, w, 1e-5)}
        for warps in (4, 8, 16):
            def permuted(warps=warps):
                engine._norm_warps = lambda block, permuted=False: warps
                try:
                    return engine.add_rmsnorm(x, res, w, 1e-5, columns=perm)
                finally:
                    engine._norm_warps = shipped_warps
            assert torch.equal(permuted()[1], want) and engine._glue_failure is None, warps
            arms[f"norm_columns_w{warps}"] = permuted
        rows += time_against(arms, "norm", args.rounds, rows=M, N=N)
    H, rep, D, S = 32, 1, 128, args.cache
    for B in (1, 8):
        q = torch.randn(B, H, rep, D, device=dev, dtype=dt)
        kc, vc = (torch.randn(B, H, S, D, device=dev, dtype=dt) for _ in range(2))
        pos = torch.full((B,), S - 1, device=dev)
        mask = torch.zeros(B, 1, 1, S, device=dev, dtype=dt)
        inv = torch.argsort(torch.randperm(H * rep * D, device=dev))
        arms = {"attention": lambda: engine.decode_attention(q, kc, vc, pos, D ** -0.5, mask),
                "attention_scatter": lambda: engine.decode_attention(q, kc, vc, pos, D ** -0.5, mask, inv)}
        rows += time_against(arms, "attention", args.rounds, batch=B, cache=S)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": env_meta(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
