"""QuantLinear: a drop-in replacement for nn.Linear holding INT4 weights in the canonical format."""
from __future__ import annotations

import torch
from torch import nn

from nibble import kernels
from nibble.config import QuantConfig
from nibble.formats.int4 import PACK, Int4Weight
from nibble.quantize.rtn import rtn_quantize

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class QuantLinear(nn.Module):
    """y = x @ W.T + b with W stored as INT4 (buffers ``qweight``, ``scales``, ``zeros``).

    ``mode="w4a16"``: activations stay 16-bit, the weight is dequantized inside the GEMM.
    ``mode="w4a4"``: activations are quantized per token to INT4 (after an online Hadamard
    transform when ``input_hadamard``), the product runs on integer tensor cores.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group_size: int = 128,
                 mode: str = "w4a16", input_hadamard: bool = False, dtype: torch.dtype = torch.float16,
                 device=None):
        super().__init__()
        group_size = in_features if group_size == -1 else group_size
        if in_features % PACK or in_features % group_size:
            raise ValueError(f"in_features={in_features} must be divisible by 8 and by group_size={group_size}")
        if mode not in ("w4a16", "w4a4"):
            raise ValueError(f"mode must be 'w4a16' or 'w4a4', got {mode!r}")
        if mode == "w4a4" and group_size != in_features:
            raise ValueError("w4a4 QuantLinear needs per-channel weights (group_size = in_features)")
        if input_hadamard and mode != "w4a4":
            raise ValueError("input_hadamard is part of the w4a4 path")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.mode, self.input_hadamard = mode, input_hadamard
        self.backend = "auto"
        groups = in_features // group_size
        self.register_buffer("qweight", torch.empty(in_features // PACK, out_features, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.empty(groups, out_features, dtype=torch.float16, device=device))
        self.register_buffer("zeros", torch.empty(groups, out_features, dtype=torch.float16, device=device))
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device) if bias else None)

    @classmethod
    def from_weight(cls, weight: Int4Weight, bias: torch.Tensor | None = None, mode: str = "w4a16",
                    input_hadamard: bool = False, dtype: torch.dtype = torch.float16) -> "QuantLinear":
        layer = cls(weight.in_features, weight.out_features, bias is not None, weight.group_size, mode,
                    input_hadamard, dtype=bias.dtype if bias is not None else dtype, device=weight.qweight.device)
        layer.qweight.copy_(weight.qweight)
        layer.scales.copy_(weight.scales)
        layer.zeros.copy_(weight.zeros)
        if bias is not None:
            layer.bias.copy_(bias.detach())
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: QuantConfig) -> "QuantLinear":
        """Quantize an nn.Linear with round-to-nearest (+ clipping search) per ``config``."""
        weight = rtn_quantize(linear.weight.detach(), config.group_size, config.symmetric, config.zero_point,
                              config.clip_search)
        return cls.from_weight(weight, linear.bias, config.mode, getattr(linear, "input_hadamard", False),
                               dtype=linear.weight.dtype)

    def weight_int4(self) -> Int4Weight:
        return Int4Weight(self.qweight, self.scales, self.zeros, self.group_size)

    def _check_input(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features in its last dimension but this layer expects "
                             f"{self.in_features} (input shape {tuple(x.shape)})")
        if x.dtype not in INPUT_DTYPES:
            raise TypeError(f"QuantLinear takes float16, bfloat16 or float32 input, got {x.dtype}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        if self.mode == "w4a16":
            return kernels.w4a16_linear(x, self.qweight, self.scales, self.zeros, self.group_size, self.bias,
                                        backend=self.backend)
        return kernels.w4a4_linear(x, self.qweight, self.scales[0], self.bias, self.input_hadamard,
                                   backend=self.backend)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"mode={self.mode}, group_size={self.group_size}, input_hadamard={self.input_hadamard}")


def shared_input_forward(layers, x: torch.Tensor) -> list[torch.Tensor]:
    """The outputs of several layers that read the same ``x`` (a block's q/k/v or gate/up projections).

    W4A4 QuantLinears with one rotation setting and backend quantize ``x`` once for all of them (on
    CUDA a separate quantization per layer costs a kernel launch each); any other layer is called as is.
    """
    if (len(layers) > 1 and all(isinstance(m, QuantLinear) and m.mode == "w4a4" for m in layers)
            and len({(m.input_hadamard, m.backend) for m in layers}) == 1):
        for m in layers:
            m._check_input(x)
        return kernels.w4a4_linears(x, [(m.qweight, m.scales[0], m.bias) for m in layers], layers[0].input_hadamard,
                                    backend=layers[0].backend)
    return [m(x) for m in layers]
