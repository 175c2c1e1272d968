"""Causal prefill attention (SDPA) per backend at Llama-2-7B's shape (32 heads of 128), bf16: flash,
cuDNN and memory-efficient, each timed as ``python -m nibble.bench`` times kernels (CUDA graphs,
median) and compared with flash's output. Why the engine prefers cuDNN's.

    PYTHONPATH=. python3 benchmarks/scripts/sdpa_backends.py
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.timing import bench_us  # noqa: E402

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    for B, T in ((1, 128), (1, 512), (8, 128), (8, 512)):
        q, k, v = (torch.randn(B, 32, T, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        line, ref = f"B={B} T={T}:", None
        for name, backend in BACKENDS.items():
            def call(_i, backend=backend):
                def run():
                    with sdpa_kernel([backend]):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
                return run
            try:
                y = call(0)()
            except RuntimeError as e:
                line += f" {name} unavailable ({str(e)[:60]})"
                continue
            ref = y if ref is None else ref
            line += f" {name} {bench_us(call, 1):.1f} us (max diff vs flash {(y.float() - ref.float()).abs().max().item():.2e})"
        print(line, flush=True)


if __name__ == "__main__":
    main()
