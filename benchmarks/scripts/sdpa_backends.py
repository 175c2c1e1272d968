"""Causal prefill attention (SDPA) per backend, bf16, 32 query heads of 128: flash, cuDNN and memory-efficient,
each timed as ``python -m nibble.bench`` times kernels (CUDA graphs, median) and compared with the first output.
Why the engine prefers cuDNN's (Llama-2-7B's shape, the default).

With ``--kv-heads`` below 32 (8: Llama-3-8B, Mistral-7B), each backend runs twice: with the keys and values of the
cache repeated to every query head first, as the engine's prefill did until session 79, and with SDPA's ``enable_gqa``
reading them in place (a backend that cannot is named unavailable), as it does since.

    PYTHONPATH=. python3 benchmarks/scripts/sdpa_backends.py [--kv-heads 8]
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
HEADS, HEAD_DIM = 32, 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-heads", type=int, default=HEADS, help=f"a divisor of {HEADS}")
    args = ap.parse_args()
    rep = HEADS // args.kv_heads
    if rep * args.kv_heads != HEADS:
        ap.error(f"--kv-heads must divide {HEADS}, got {args.kv_heads}")
    ways = {"": False} if rep == 1 else {" repeated": False, " enable_gqa": True}
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}, {HEADS} query heads, {args.kv_heads} kv heads",
          flush=True)
    for B, T in ((1, 128), (1, 512), (8, 128), (8, 512), (1, 2048)):
        q = torch.randn(B, HEADS, T, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, args.kv_heads, T, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        line, ref = f"B={B} T={T}:", None
        for name, backend in BACKENDS.items():
            for way, gqa in ways.items():
                def call(_i, backend=backend, gqa=gqa):
                    def run():
                        with sdpa_kernel([backend]):
                            if gqa:
                                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                            kr, vr = (k, v) if rep == 1 else (k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
                            return F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
                    return run
                try:
                    y = call(0)()
                except RuntimeError as e:
                    line += f" {name}{way} unavailable ({str(e)[:60]})"
                    continue
                ref = y if ref is None else ref
                line += (f" {name}{way} {bench_us(call, 1):.1f} us (max diff vs the first "
                         f"{(y.float() - ref.float()).abs().max().item():.2e})")
        print(line, flush=True)


if __name__ == "__main__":
    main()
