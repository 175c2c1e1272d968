"""Where nibble's Triton kernels run: on CUDA tensors, or on CPU ones under Triton's interpreter (TRITON_INTERPRET=1,
which the kernel tests use). One check for every kernel family, so that they refuse the same tensors with one
message (elsewhere Triton fails with "0 active drivers")."""
from __future__ import annotations

import functools
import os

import torch

from nibble.warn import warn

try:  # the package imports without triton (CPU-only installs)
    import triton
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None

# Programmatic dependent launch (`early_launch`: gdc_wait / gdc_launch_dependents in the kernels, launch_pdl at their
# launches) came in triton 3.4 (torch 2.8's; nibble needs torch 2.9, whose is 3.5). With an older triton the kernel
# modules' imports fail as if it were missing.
MIN_TRITON = "3.4"


class KernelUnavailableError(RuntimeError):
    """The GPU kernels cannot run here (no GPU, CPU tensors, no usable triton); the message says what to change."""


def _triton_unusable() -> str | None:
    if triton is None:
        return f"need the `triton` package: pip install 'triton>={MIN_TRITON}'"
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return (f"need triton >= {MIN_TRITON} (programmatic dependent launch), found triton {triton.__version__}: "
                f"pip install -U 'triton>={MIN_TRITON}'")
    return None


# Why nibble's Triton kernels cannot run in this environment (None: they can), as a message's end. Asked once, at
# import: the dispatch reads it at every layer, where torch.compile traces (an lru_cache there drew Dynamo's warning).
TRITON_UNUSABLE = _triton_unusable()


def triton_unavailable(kernels: str) -> KernelUnavailableError:
    """The error for the ``kernels`` (a name for the message) where their module found no usable triton."""
    why = TRITON_UNUSABLE or "could not import triton (`python -c 'import triton.language'` says why)"
    return KernelUnavailableError(f"the {kernels} kernels {why}")


@functools.lru_cache(maxsize=None)
def warn_reference_on_gpu() -> None:
    """Said once: where the GPU kernels cannot run (`TRITON_UNUSABLE`), backend "auto" runs PyTorch's reference on
    the GPU (the same values, many times slower) rather than refuse a model the user can still run."""
    warn(f"nibble's GPU kernels {TRITON_UNUSABLE}; until then, PyTorch's reference runs on the GPU (the same "
         "values, many times slower); backend='triton' makes this an error")


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
