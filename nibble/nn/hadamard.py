"""HadamardInputLinear: an nn.Linear that rotates its input online with the Walsh-Hadamard transform."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nibble.kernels.hadamard import hadamard_transform, hadamard_transform_reference


class HadamardInputLinear(nn.Linear):
    """y = hadamard_transform(x) @ W.T + b, i.e. x @ (W @ H).T + b.

    Built by `from_linear` with W = W_orig @ H.T, so the layer computes exactly what the original
    did, but its input is rotated first: outlier channels are spread over all of them before any
    per-token quantization. `input_hadamard = True` tells whole-model quantization to build a W4A4
    QuantLinear that fuses this online transform into its activation quantization.
    """

    input_hadamard = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(hadamard_transform(x), self.weight, self.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, weight: torch.Tensor | None = None) -> "HadamardInputLinear":
        """The same function as `linear`: weight W @ H.T, computed in float64, stored in linear's dtype.

        `weight` (default linear.weight) lets a caller pass an already transformed float64 weight so
        it is rounded to the storage dtype once. The bias is shared, not copied.
        """
        w = linear.weight if weight is None else weight
        if isinstance(linear, HadamardInputLinear):
            raise ValueError("this linear already has an online Hadamard; folding another would change its output")
        if w.shape != linear.weight.shape:
            raise ValueError(f"weight has shape {tuple(w.shape)}, the linear {tuple(linear.weight.shape)}")
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        # Rows of W transformed as rows: W @ H.T. The online transform then gives (x @ H.T) @ (W @ H.T).T = x @ W.T.
        folded = hadamard_transform_reference(w.detach().to(torch.float64))
        layer.weight = nn.Parameter(folded.to(linear.weight.dtype).to(linear.weight.device),
                                    requires_grad=linear.weight.requires_grad)
        layer.bias = linear.bias
        return layer
