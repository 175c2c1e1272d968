"""The engine's residual add + RMSNorm, plain (`add_rmsnorm`, both sides' glue) and quantizing for
W4A4 projections (`add_rmsnorm_quantize`), against the norm then the act-quant kernel it replaces;
rows of 4096 (Llama-2-7B's hidden size), bf16, CUDA graphs, inputs rotated past the L2, median, the
kernels' warps swept. The fused result is checked equal to the unfused one before it is timed.

    PYTHONPATH=. python3 benchmarks/scripts/fused_quantization.py --json out.json
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.timing import bench_us, rotations, token_sweep_main  # noqa: E402
from nibble.eval import engine  # noqa: E402
from nibble.kernels import w4a4  # noqa: E402

TOKENS = (1, 16, 64, 128, 512, 1024, 4096)
WARPS = (None, 4, 8, 16, 32)  # None: the engine's choice (`_norm_warps`)


def order_for(M: int, K: int, N: int) -> str:
    return w4a4.activation_order(M, K, [N], torch.device("cuda"))


def time_norm(M: int, N: int, say) -> list[dict]:
    dev, dt = "cuda", torch.bfloat16
    order = order_for(M, N, 3 * N)
    n_rot = rotations(3 * M * N * 2)
    xs = [(torch.randn(1, M, N, device=dev, dtype=dt), torch.randn(1, M, N, device=dev, dtype=dt)) for _ in range(n_rot)]
    w = torch.rand(N, device=dev, dtype=dt) + 0.5
    ops = {
        "norm": lambda i: lambda: engine.add_rmsnorm(*xs[i], w, 1e-5),
        "norm, act-quant": lambda i: lambda: w4a4.quantize_activations(engine.add_rmsnorm(*xs[i], w, 1e-5)[1].view(M, N),
                                                                     False, order),
        "norm quantizing": lambda i: lambda: engine.add_rmsnorm_quantize(*xs[i], w, 1e-5, order)[1:],
    }
    chosen, rows = engine._norm_warps, []
    for warps in WARPS:
        engine._norm_warps = chosen if warps is None else (lambda *_a, w=warps: w)
        a, b = ops["norm, act-quant"](0)(), ops["norm quantizing"](0)()
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), "fused norm + quantization differs"
        line = f"M={M:5d} N={N} warps {warps or 'auto':>4}:"
        for name, op in ops.items():
            us = bench_us(op, n_rot)
            rows.append(dict(op=name, M=M, N=N, warps=warps or "auto", us=us))
            line += f"  {name} {us:6.2f} us"
        say(line)
    engine._norm_warps = chosen
    return rows


def main() -> None:
    token_sweep_main(__doc__, TOKENS, lambda tokens: [row for M in tokens for row in time_norm(M, 4096, print)])


if __name__ == "__main__":
    main()
