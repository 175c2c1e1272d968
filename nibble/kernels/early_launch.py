"""Programmatic dependent launch (Hopper and later): a kernel may start while the previous kernel in
the stream is still running, and do whatever does not depend on it.

At decode every kernel is short: a norm, RoPE or SiLU kernel takes 2-3 us and a 4096-deep W4A16
layer 6-18 us, of which about 2 us is the launch and the first DRAM round trip. So every kernel of
nibble's decode path (up to MAX_TOKENS tokens; at prefill it measured slower) launches with it:

- the glue kernels (the engine's, the W4A4 activation quantization) call `after_prior_grids` first:
  wait for the previous kernel's writes, then let the next kernel launch at once (the CUDA rotate +
  quantize kernel only where `w4a4.rotate_quantize_successor` measured faster);
- the skinny matmuls (csrc/skinny.cuh: wait_for_prior_grids) fetch their first four weight steps
  into the L2 before they wait (weights are never written by a kernel), then read x. Prefetching 8
  or 16 steps was slower. Past their wait they let the next kernel launch too, where that measured
  faster, in a way that keeps its CTAs from doubling up on the SMs (skinny.cuh: Successor;
  `w4a16.successor_launch`, `w4a4.mma_successor`): Llama-2-7B W4A16 decode 1.055x at batch 1,
  1.074x at 8 (H200, benchmarks/results/successor-ab-h200.json).
- the Hopper GEMMs for many tokens (csrc/hopper.cuh: produce) copy the weights of their first
  pipeline stages into shared memory before they wait, then x (and, W4A4, the token scales).

A kernel launched after one that does not take part (cuBLAS, PyTorch's own) simply starts when it
ends, as before. Measured on the H200 (Llama-2-7B shape, batch 1, prompt 512, decode tokens/s, same
process): W4A16 459 -> 490, W4A4 408 -> 470, bf16 233 -> 238 (its glue kernels overlap each other;
cuBLAS does not take part). ``NIBBLE_PDL=0`` launches everything the plain way, to measure what this
buys (``benchmarks/scripts/early_launch_decode.py``).

One pair goes further: W4A4's activation quantization and the Hopper product it feeds launch early
up to w4a4.PRODUCT_EARLY_TOKENS (128) tokens, so the product's first weight stages are copied while
the quantization runs (H200, the op alone at 128 tokens: 1-1.6 us of 17-60 us;
``benchmarks/scripts/w4a4_early_launch_ab.py``).
"""
from __future__ import annotations

import functools
import os

import torch

ENABLED = os.environ.get("NIBBLE_PDL", "1") != "0"

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU-only install: nothing launches early
    triton = None


# Early launch is for decode-sized launches. At prefill the kernels are long and their grids run in
# several waves, and it cost time (H200, Llama-2-7B shape, same process, off -> on: prefill 8 x 512
# tokens bf16 89.4 -> 91.6 ms, W4A16 93.0 -> 96.6, W4A4 58.8 -> 63.6; 1 x 128 bf16 5.09 -> 5.27),
# except for the one pair above.
MAX_TOKENS = 64


def early_launch(device: torch.device, tokens: int = 1, max_tokens: int = MAX_TOKENS) -> bool:
    """Whether a kernel over ``tokens`` rows (tokens) launches with programmatic dependent launch on
    ``device``: an sm_90+ GPU, at most ``max_tokens`` tokens (MAX_TOKENS, or a kernel pair's own
    measured limit: w4a4.PRODUCT_EARLY_TOKENS), and NIBBLE_PDL not 0."""
    if device.type != "cuda" or tokens > max_tokens:
        return False
    return _early_launch(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _early_launch(index: int) -> bool:
    return ENABLED and torch.cuda.get_device_capability(index) >= (9, 0)


if triton is not None:
    @triton.jit
    def after_prior_grids(PDL: tl.constexpr):
        """First thing in a Triton kernel launched with ``launch_pdl=PDL``: wait for the previous
        kernel's writes, then let the next kernel launch (its weight fetches run under this one)."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
