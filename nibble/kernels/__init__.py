"""Kernel dispatch: the GPU kernel where one applies, the pure-PyTorch reference otherwise.

On a GPU where the kernels cannot run (no usable triton), "auto" runs the reference there and says so once.
Every op here has one signature for every backend; `backend="reference"` forces the reference,
`backend="triton"` demands the GPU kernels, which are Triton kernels and the CUDA C++ kernels of `csrc/` alike (the
name is older than the C++ ones; each op's dispatch in `w4a16.py` / `w4a4.py` says which runs where, and a C++ kernel
that cannot build falls back to Triton), and says clearly why they cannot run.
"""
from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD
from torch.utils._python_dispatch import _get_current_dispatch_mode

from nibble.formats.int4 import PACK
from nibble.kernels import reference
from nibble.kernels.launch import check_bias
from nibble.kernels.triton_device import (TRITON_UNUSABLE, KernelUnavailableError, triton_unavailable,
                                          warn_reference_on_gpu)

BACKENDS = ("auto", "reference", "triton")
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_backend(backend: str) -> None:
    """Refuse a backend name that is not one of `BACKENDS`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def _use_kernel(x: torch.Tensor, backend: str) -> bool:
    check_backend(backend)
    if backend == "reference":
        return False
    if backend == "triton":
        if not torch.cuda.is_available():
            raise KernelUnavailableError("the Triton kernels need a CUDA GPU and none is visible; "
                                         "use backend='reference' (or 'auto') to run on the CPU")
        if not x.is_cuda:
            raise KernelUnavailableError(f"the Triton kernels need CUDA tensors; the input is on {x.device}: move "
                                         "the model and inputs to the GPU with .to('cuda')")
    if x.is_cuda and TRITON_UNUSABLE:
        if backend == "triton":
            raise triton_unavailable("GPU")
        if not _traced():  # the warning reads the caller's frames, which Dynamo cannot trace
            warn_reference_on_gpu()
        return False
    return x.is_cuda


def eager_or_op(body, op):
    """``body``, the Python function behind custom op ``op``, when called eagerly; ``op`` while
    torch.compile traces (the op is what its graphs hold). Called directly, the body skips the op's
    dispatch, which costs the host ~17 us a call (torch 2.13, CPU; more than a decode-sized kernel
    takes on the GPU) that every eager forward (transformers' ``generate``, for one) pays per layer.
    Nothing else may run here while tracing: an import, for one, breaks the graph at every layer. Under a
    dispatch mode (FakeTensorMode, make_fx, profilers' modes) the op too: the body would launch kernels on tensors
    without data, where the op answers with its fake implementation."""
    return op if _traced() else body


def _traced() -> bool:
    return torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None


def transforms_active() -> bool:
    """Whether a torch.func transform or forward-mode AD is active. A tensor shows only its own level's tangent or
    batch dimension: under ``jacfwd(jacrev(f))`` (``hessian``) the input wants a gradient at the inner level and
    carries its tangent at the outer one, and under ``jacfwd(vmap(f))`` a batched input refuses ``unpack_dual``
    (no batching rule). Two global flags, cheaper on the host than asking a tensor."""
    return torch._C._are_functorch_transforms_active() or fwAD._current_level >= 0


def _kernel_input(x: torch.Tensor) -> torch.Tensor:
    """2-D, contiguous, 16-bit: fp32 activations run the kernel in bf16 (its accumulation is fp32 anyway)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype not in _KERNEL_DTYPES:
        x2 = x2.to(torch.bfloat16)
    return x2.contiguous()


def _check_no_gradient(x: torch.Tensor, biases) -> None:
    """The products have no backward of their own: the GPU kernels' outputs carry none (a gradient was lost without a
    word), and the CPU reference's W4A4 one would not be the straight-through gradient a QuantLinear gives."""
    if torch.is_grad_enabled() and (x.requires_grad or any(b is not None and b.requires_grad for b in biases)):
        raise ValueError("nibble.kernels' linear functions give no gradient: call the layer (nibble.nn.QuantLinear, "
                         "whose dL/dx is that of its dequantized weight) or run them under torch.no_grad()")


def check_activations(x: torch.Tensor) -> None:
    """What a layer's product takes on every path: float32 runs the kernels in bfloat16 and returns float32, but
    any other dtype would come back cast (integers truncated) or overflow the reference's float32."""
    if not isinstance(x, torch.Tensor):  # a numpy array's float32 was "not float32"; a list failed on .dtype
        raise TypeError(f"activations must be a torch.Tensor, got {type(x).__name__}: torch.as_tensor(x) makes one")
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"activations must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("activations must have at least one dimension, the last holding the input features; got a "
                         "0-d tensor")


def _packed_k_n(x, qweight) -> tuple[int, int]:
    """(K, N) of a canonical packed weight [K // 8, N] whose K is x's last dimension, else a ValueError saying
    which: checked before the CPU reference runs, which would multiply mismatched tensors into a bare shape
    error. Shape arithmetic only (every layer call on the CPU passes here)."""
    if qweight.dim() != 2:
        raise ValueError(f"qweight must be a 2-D int32 tensor [K // 8, N], got shape {tuple(qweight.shape)}")
    K, N = qweight.shape[0] * PACK, qweight.shape[1]
    if x.shape[-1] != K:
        raise ValueError(f"x has K={x.shape[-1]} in its last dimension but qweight {tuple(qweight.shape)} packs K={K}")
    return K, N


def _check_w4a16_arguments(x, qweight, scales, zeros, group_size: int, bias) -> None:
    """What the GPU op's checks ask for (`w4a16._check_weight`; the bias, which the op does not take, is
    `_finish`'s), on the CPU path, so that a call the GPU refuses is refused on the CPU too."""
    N = _packed_k_n(x, qweight)[1]
    w4a16._check_weight(qweight, scales, zeros, group_size)
    check_bias(bias, N)
    w4a16.check_one_device(x, qweight, scales, zeros, bias)


def w4a16_linear(x, qweight, scales, zeros, group_size: int, bias=None, backend: str = "auto"):
    """y = x @ W.T + bias with W in the canonical INT4 format (`nibble.formats.int4.Int4Weight`); any leading dims.

    x: float16, bfloat16 or float32 (the GPU kernels run float32 in bfloat16), [..., K]; qweight: int32 [K // 8, N];
    scales, zeros: float16 [K // group_size, N]; group_size: the groups' width, an int (a multiple of 8 dividing K;
    K for one group a row: -1 is only the quantizers', QuantConfig's and QuantLinear's shorthand); bias: None or a
    float [N]. Every device takes the same arguments and refuses the same ones."""
    check_activations(x)
    return _w4a16_linear(x, qweight, scales, zeros, group_size, bias, backend)


# The linear functions past `check_activations`, for QuantLinear, whose forward has checked x already (its width
# too, before a GPTQ act-order layer's gather): a check a call, not one more per layer in every eager decode step.

def _w4a16_linear(x, qweight, scales, zeros, group_size: int, bias, backend: str):
    _check_no_gradient(x, [bias])
    if not _use_kernel(x, backend):
        _check_w4a16_arguments(x, qweight, scales, zeros, group_size, bias)
        return reference.w4a16_matmul(x, qweight, scales, zeros, group_size, bias)
    y = eager_or_op(w4a16.linear, torch.ops.nibble.w4a16_linear)(_kernel_input(x), qweight, scales, zeros, group_size)
    return _finish(y, bias, x)


def w4a16_linears(x, layers, group_size: int, backend: str = "auto"):
    """``w4a16_linear`` for several layers that read the same x, ``layers`` = [(qweight, scales, zeros,
    bias), ...]: on CUDA, one kernel launch where the skinny kernel (decode sizes) or the Hopper GEMM
    (prefill sizes) runs. Returns the outputs in order."""
    check_activations(x)
    if not layers:  # the GPU op refuses it; the CPU path returned []
        raise ValueError("layers must hold at least one (qweight, scales, zeros, bias)")
    return _w4a16_linears(x, layers, group_size, backend)


def _w4a16_linears(x, layers, group_size: int, backend: str):
    _check_no_gradient(x, [layer[3] for layer in layers])
    if not _use_kernel(x, backend):
        for qw, s, z, b in layers:
            _check_w4a16_arguments(x, qw, s, z, group_size, b)
        return [reference.w4a16_matmul(x, qw, s, z, group_size, b) for qw, s, z, b in layers]
    linears = eager_or_op(w4a16.linears, torch.ops.nibble.w4a16_linears)
    ys = linears(_kernel_input(x), *([layer[i] for layer in layers] for i in range(3)), group_size)
    return [_finish(y, layer[3], x) for y, layer in zip(ys, layers)]


def gather_columns(x, index, backend: str = "auto"):
    """x[..., index]: the input of a layer whose weight lists its inputs in another order (GPTQ act-order,
    `nibble.nn.quant_linear.PermutedInputQuantLinear`). On CUDA a Triton kernel that takes part in early
    launch, so the matmul after it still starts under it at decode sizes."""
    if not _use_kernel(x, backend) or not w4a16.HAS_TRITON or _traced():
        return reference.gather_columns(x, index)
    return w4a16.gather_columns(x, index)


def _finish(y, bias, x):
    """A kernel's [M, N] output with the bias added, in x's leading dims and dtype, rounded once, as the reference
    does: where the bias's or x's dtype is not the kernel's, the sum is taken in float32 (rounded to the kernel's dtype
    first, then to x's, it was one ulp off the compiled layer, whose fusion drops the intermediate rounding); where all
    three are one dtype, one add (a decode step in a CUDA graph pays each extra cast kernel)."""
    check_bias(bias, y.shape[-1])
    if bias is not None:
        y = y + bias if bias.dtype == y.dtype == x.dtype else y.float() + bias.float()
    return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)  # N, not -1: x may hold no token


def w4a4_linear(x, qweight, w_scale, bias=None, input_hadamard: bool = False, backend: str = "auto"):
    """[online Hadamard] -> per-token INT4 activations -> int8 tensor-core GEMM -> scales (+ bias)."""
    return w4a4_linears(x, [(qweight, w_scale, bias)], input_hadamard, backend)[0]


def w4a4_linears(x, layers, input_hadamard: bool = False, backend: str = "auto"):
    """``w4a4_linear`` for several layers that read the same x, ``layers`` = [(qweight, w_scale, bias), ...]:
    the kernels rotate and quantize x once, then run the products in one launch where a kernel takes
    several weights. Returns the outputs in order."""
    check_activations(x)
    if not isinstance(input_hadamard, bool):  # a string "no" is true: x was rotated without a word
        raise TypeError(f"input_hadamard must be True or False, got {input_hadamard!r}")
    return _w4a4_linears(x, layers, input_hadamard, backend)


def _w4a4_linears(x, layers, input_hadamard: bool, backend: str):
    qweights, w_scales, biases = ([layer[i] for layer in layers] for i in range(3))
    _check_no_gradient(x, biases)
    if not _use_kernel(x, backend):
        x2 = x.reshape(-1, x.shape[-1])
        checked = w4a4.checked_layers(x2, qweights, w_scales, biases, input_hadamard, kernels=False)  # the op's
        ys = [reference.w4a4_linear(x2, *layer, input_hadamard) for layer in checked]
    else:
        x2 = _kernel_input(x)
        ys = eager_or_op(w4a4.linears, torch.ops.nibble.w4a4_linears)(
            x2, qweights, w_scales, [None if b is None else b.to(x2.dtype) for b in biases], input_hadamard)
    return [y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype) for y in ys]


# The kernel modules register the custom ops (torch.ops.nibble.*) as they are imported; they import this
# package's submodules, so they come last.
from nibble.kernels import w4a16, w4a4  # noqa: E402
