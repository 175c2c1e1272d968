"""What every kernel family (`w4a16`, `w4a4`, `hadamard`, the Hopper GEMMs of `hopper`) needs on the host side of a
launch and owns none of: grid arithmetic, the GPU's SM count, the split-K tile counters, the successor modes of the
skinny CUDA kernels (csrc/skinny.cuh, shared by W4A16 and W4A4), and the check of a layer's bias."""
from __future__ import annotations

import torch

from nibble.kernels import cuda_build

# The H200's SMs: what the configs assume where no GPU was asked (CPU tests, the Triton interpreter).
NUM_SMS_DEFAULT = 132

# When the next kernel in the stream may launch, with early launch on (csrc/skinny.cuh: Successor):
# when this one ends; at once, this launch's CTAs per SM capped at ceil(CTAs / SMs) by shared
# memory; at once where those CTAs fill an SM anyway, else at the end.
SUCCESSOR_AT_END, SUCCESSOR_CAPPED, SUCCESSOR_IF_FULL = 0, 1, 2
SUCCESSORS = (SUCCESSOR_AT_END, SUCCESSOR_CAPPED, SUCCESSOR_IF_FULL)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for b > 0."""
    return -(-a // b)


def next_pow2(x: int) -> int:
    """The least power of two >= x (1 for x <= 1)."""
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def num_sms(device: torch.device) -> int:
    """The device's streaming multiprocessors (asked once per device); NUM_SMS_DEFAULT (the H200's)
    for a non-CUDA device, e.g. the Triton interpreter on the CPU."""
    if device.type != "cuda":
        return NUM_SMS_DEFAULT
    return cuda_build.ask_once("multiprocessors", device,
                               lambda: torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)


_COUNTERS: dict = {}


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """Split-K tile counters of the current stream (int32, all zero between calls: the kernel resets
    them). Kernels on one stream run in order, so they can share; kernels on two streams could run
    at once, so each stream gets its own.

    Allocated and zeroed eagerly; a buffer first needed during CUDA-graph capture is not cached
    (its zeroing memset is only recorded, not run), so later eager calls cannot see it uninitialised.
    """
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    buf = _COUNTERS.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    size = max(n, 4096)
    buf = torch.zeros(size, dtype=torch.int32, device=device)
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        _COUNTERS[key] = buf
    return buf


def check_bias(bias, N: int) -> None:
    """A layer's bias is one value per output channel, [N], on every path: a [N, 1] or [M, N] one would broadcast
    into another sum without an error."""
    if bias is not None and (bias.shape != (N,) or not bias.is_floating_point()):
        raise ValueError(f"bias must be a float tensor of shape [{N}], got {bias.dtype} {tuple(bias.shape)}")
