"""Where nibble's Triton kernels run: on CUDA tensors, or on CPU ones under Triton's interpreter (TRITON_INTERPRET=1,
which the kernel tests use). One check for every kernel family, so that they refuse the same tensors with one
message (elsewhere Triton fails with "0 active drivers")."""
from __future__ import annotations

import os

import torch

try:  # the package imports without triton (CPU-only installs)
    import triton
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (its runtime knob, which TRITON_INTERPRET sets)."""
    if triton is None:
        return False
    try:
        return bool(triton.knobs.runtime.interpret)
    except AttributeError:  # older triton
        return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_triton_device(x: torch.Tensor, kernels: str) -> None:
    """Refuse a tensor the Triton ``kernels`` (a name for the message) cannot run on."""
    if not (x.is_cuda or interpreting()):
        raise ValueError(f"the {kernels} kernels need CUDA tensors, got device {x.device} (or set TRITON_INTERPRET=1 "
                         "before importing nibble to run them on the CPU)")
