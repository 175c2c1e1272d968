"""W4A4 SwiGLU gate/up on Hopper: one GEMM whose epilogue computes SiLU(gate) * up
(`w4a4.w4a4_wgmma_silu_mul`) against the two products in one launch (`w4a4_wgmma_many`) then the
engine's SiLU(gate) * up kernel, which it replaces (and the products alone: what the fused
epilogue costs); and, for scale, the bf16 side (cuBLAS on the
stacked weight, then the same glue kernel). Quantized activations in the even-odd order as the
engine's norm writes them; CUDA graphs, weights rotated past the L2, median. The fused output is
checked equal to the unfused one before it is timed.

    PYTHONPATH=. python3 benchmarks/scripts/gated_gemm.py --json out.json
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.timing import bench_us, rotations, token_sweep_main  # noqa: E402
from nibble.eval import engine  # noqa: E402
from nibble.kernels import w4a4  # noqa: E402

# (intermediate, hidden): Llama-2-7B, Llama-3-8B / Mistral-7B, Llama-2-70B / Llama-3-70B
SHAPES = ((11008, 4096), (14336, 4096), (28672, 8192))
TOKENS = (32, 128, 512, 1024, 4096)


def time_shape(N: int, K: int, tokens, say) -> list[dict]:
    dev, dt = "cuda", torch.bfloat16
    n_rot = rotations(2 * K * N // 2)  # the two INT4 weights

    def layer():
        qw = torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32, device=dev)
        return qw, (torch.rand(N, device=dev) * 2 / K ** 0.5).to(dt), None
    pairs = [(layer(), layer()) for _ in range(n_rot)]
    dense = [torch.randn(2 * N, K, device=dev, dtype=dt) / K ** 0.5 for _ in range(rotations(2 * N * K * 2))]
    rows = []
    for M in tokens:
        qx = torch.randint(-8, 8, (M, K), dtype=torch.int8, device=dev)
        sx = torch.rand(M, device=dev) + 0.5
        x = torch.randn(M, K, device=dev, dtype=dt)

        def products(i):
            return lambda: w4a4.w4a4_wgmma_many(qx, sx, list(pairs[i]), dt, order="even_odd")

        def unfused(i):
            return lambda: engine.silu_mul(*w4a4.w4a4_wgmma_many(qx, sx, list(pairs[i]), dt, order="even_odd"))

        def fused(i):
            return lambda: w4a4.w4a4_wgmma_silu_mul(qx, sx, *pairs[i], dt, order="even_odd")

        def bf16(i):
            def run():
                y = F.linear(x, dense[i])
                return engine.silu_mul(y[:, :N], y[:, N:])
            return run
        assert torch.equal(fused(0)(), unfused(0)()), "the gated GEMM differs from the products + glue kernel"
        t = {name: bench_us(op, len(dense) if name.startswith("bf16") else n_rot)
             for name, op in (("products", products), ("products + silu_mul", unfused), ("gated GEMM", fused),
                              ("bf16 + silu_mul", bf16))}
        cfg = w4a4.WGMMA.config(M, 2 * N, K, w4a4.WGMMA.clusters("cuda"))
        for name, us in t.items():
            rows.append(dict(op=name, M=M, N=N, K=K, us=us, config=cfg if name == "gated GEMM" else None))
        say(f"N={N:5d} K={K} M={M:5d}: products {t['products']:8.2f} us, + silu_mul {t['products + silu_mul']:8.2f} us, gated "
            f"{t['gated GEMM']:8.2f} us ({t['products + silu_mul'] / t['gated GEMM']:.3f}x), bf16 + silu_mul "
            f"{t['bf16 + silu_mul']:8.2f} us; config {cfg}")
    return rows


def main() -> None:
    token_sweep_main(__doc__, TOKENS, lambda tokens: [row for N, K in SHAPES for row in time_shape(N, K, tokens, print)])


if __name__ == "__main__":
    main()
