"""W4A4's rotated activation quantization (online Hadamard + per-token INT4, the op `w4a4_linear`
runs before down_proj in a rotated model) and the Hadamard transform alone, bf16, at the sizes
with a dense Hadamard factor (11008 = 172 x 64, 14336 = 28 x 512, 28672 = 28 x 1024) and SmolLM2's
576 = 36 x 16, from decode to prefill row counts. CUDA graphs, inputs rotated past the L2, median.

    PYTHONPATH=. python3 benchmarks/scripts/hadamard_act_quant.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.timing import bench_us, env_meta, rotations  # noqa: E402
from nibble.kernels import hadamard, w4a4  # noqa: E402

OPS = {"actquant_h": lambda x: w4a4.quantize_activations_triton(x, True, "even_odd"),
       "hadamard": hadamard.hadamard_transform_triton}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args()
    torch.manual_seed(0)
    rows = []
    for K in (11008, 14336, 28672, 576):
        for M in (1, 16, 128, 512, 2048):
            xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(rotations(4 * M * K))]
            for op, fn in OPS.items():
                us = bench_us(lambda i, fn=fn: (lambda: fn(xs[i])), len(xs))
                rows.append(dict(op=op, K=K, M=M, us=us))
                print(f"{op:11s} K={K:6d} M={M:5d} {us:8.2f} us", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"meta": env_meta(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
