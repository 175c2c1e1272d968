"""Fake quantization for PE-QAT: the deployment numerics in float, with straight-through gradients.

Every quantized linear of the model becomes a `FakeQuantLinear` (frozen base weight, the recipe's
learnable quantization parameters), and peft wraps it in `FakeQuantLoraLinear`, whose forward is

    y = Qa(x) @ Qw(W + s * B A).T + b

(W is the frozen 16-bit weight, or a start weight such as GPTQ's compensated one, see `from_linear`.)

- ``Qw``: the deployed weight grid, symmetric INT4 per output channel, built by the same code that
  quantizes for real (`nibble.quantize.rtn`'s `quantize_groups` / `scale_and_zero` / `round_to_codes`):
  ``s = fp16(ratio * amax / 7)``, ``codes = clamp(round(w / s + 8), 0, 15)``, ``w_q = (codes - 8) * s``.
  ``ratio`` is 1 (no clipping), a fixed per-channel buffer, or a learnable ``sigmoid(theta)``.
- ``Qa``: per-token symmetric INT4, literally `nibble.kernels.reference.quantize_activations`
  (amax / 7, round half to even, clamp [-8, 7]), so the forward value is what the W4A4 kernel sees.
  The ``per-channel`` recipe instead quantizes each input channel over the batch's tokens (the
  original, non-deployable PE-QAT), after a learnable smoothing ``x / m, W * m``.
- Gradients: straight-through for the rounding. The forward value is the integer code exactly
  (``q + (u - u.detach())`` adds an exact zero), the backward is d u, where u = w / s clamped to
  [-8, 7], so the clip ratio and the weights get LSQ-style gradients and weights clipped away get none.

The weight grid is computed in float32 with autocast off, exactly as `export` recomputes it, so the
exported INT4 codes and scales are the ones the training forward used.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.tuners_utils import check_adapters_to_merge
from torch import nn

from nibble.kernels.hadamard import hadamard_transform
from nibble.kernels.reference import ACT_QMAX, quantize_activations
from nibble.quantize.rtn import quantize_groups, round_to_codes, scale_and_zero

ACT_GRANULARITIES = ("token", "channel")
# sigmoid(4) = 0.982: where OmniQuant's learnable weight clipping starts; clip ratios found by the
# MSE search that are closer to 1 start here, so the sigmoid's slope is not vanishingly small.
MAX_INIT_RATIO = 1 / (1 + math.exp(-4.0))


def _ste(value: torch.Tensor, surrogate: torch.Tensor) -> torch.Tensor:
    """Forward: ``value`` exactly (``surrogate - surrogate.detach()`` is an exact 0); backward: d surrogate."""
    return value + (surrogate - surrogate.detach())


def weight_grid(w: torch.Tensor, ratio: torch.Tensor | None = None):
    """The deployed symmetric per-output-channel INT4 grid of ``w`` [N, K]: (codes [N, K], s [N, 1], z [N, 1]).

    ``ratio`` [N, 1] shrinks each row's range before the scale is taken, as rtn's clipping search does
    (``lo * ratio``, ``hi * ratio``). ``s`` keeps the autograd graph (to ``w`` through amax, to ``ratio``);
    codes carry no gradient. Same numbers as `rtn_quantize(w, -1, symmetric=True, clip_search=False)`
    when ``ratio`` is None.
    """
    w = w.float()
    if ratio is None:
        return quantize_groups(w, symmetric=True, clip_search=False)
    lo = w.amin(dim=1, keepdim=True).clamp(max=0) * ratio
    hi = w.amax(dim=1, keepdim=True).clamp(min=0) * ratio
    s, z = scale_and_zero(lo, hi, symmetric=True, zero_point="int")
    with torch.no_grad():
        codes = round_to_codes(w, s, z)
    return codes, s, z


def fake_quant_weight(w: torch.Tensor, ratio: torch.Tensor | None = None) -> torch.Tensor:
    """``(codes - 8) * s`` of `weight_grid` (float32, exactly the dequantized deployed weight), STE gradients."""
    codes, s, _ = weight_grid(w, ratio)
    u = torch.clamp(w.float() / s, -8, 7)
    return _ste(codes.detach() - 8, u) * s


def fake_quant_tokens(x: torch.Tensor) -> torch.Tensor:
    """Per-token INT4 activations with the deployment numerics (`quantize_activations`), float32 out.

    Forward value ``q * scale`` exactly; gradient the identity (the per-token amax never clips).
    """
    q, scale = quantize_activations(x.detach())
    xf = x.float()
    return _ste(q.float() * scale.unsqueeze(-1), xf)


def fake_quant_channels(x: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """Per-input-channel INT4 activations (the original PE-QAT): one scale per channel over all tokens
    of the batch, ``ratio * amax / 7``, with a learnable clip ``ratio`` [K], and codes clamped to [-8, 7] as
    the per-token ones. Not deployable: the W4A4 GEMM can only apply a scale per row of x after the integer sum."""
    xf = x.float()
    amax = xf.detach().abs().reshape(-1, xf.shape[-1]).amax(dim=0)
    s = (amax * ratio / ACT_QMAX).clamp(min=1e-8)
    u = torch.clamp(xf / s, -8, 7)
    return _ste(torch.round(u).detach(), u) * s


def _logit(p: torch.Tensor) -> torch.Tensor:
    return torch.log(p) - torch.log1p(-p)


class FakeQuantLinear(nn.Linear):
    """An nn.Linear (frozen weight) that runs with fake-quantized weights and activations.

    ``clip``: "none" (ratio 1), "fixed" (the MSE clip search's ratio, a buffer) or "learned"
    (``sigmoid(clip_logit)``, a parameter, initialised from the search). ``act``: "token" or
    "channel"; channel mode adds learnable activation clipping and smoothing (``smooth_log``).
    ``input_hadamard``: apply the online Hadamard transform first (what rotation put on down_proj).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, clip: str = "none",
                 act: str = "token", smoothing: bool = False, input_hadamard: bool = False, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        if act not in ACT_GRANULARITIES:
            raise ValueError(f"act must be one of {ACT_GRANULARITIES}, got {act!r}")
        if clip not in ("none", "fixed", "learned"):
            raise ValueError(f"clip must be 'none', 'fixed' or 'learned', got {clip!r}")
        if smoothing and act != "channel":
            raise ValueError("learnable smoothing belongs to the per-channel recipe")
        self.clip, self.act, self.smoothing, self.input_hadamard = clip, act, smoothing, input_hadamard
        self.quant_enabled = True
        f32 = dict(device=device, dtype=torch.float32)
        if clip == "fixed":
            self.register_buffer("clip_ratio", torch.ones(out_features, 1, **f32))
        elif clip == "learned":
            self.clip_logit = nn.Parameter(torch.full((out_features, 1), 4.0, **f32))
        if act == "channel":
            self.act_clip_logit = nn.Parameter(torch.full((in_features,), 4.0, **f32))
        if smoothing:
            self.smooth_log = nn.Parameter(torch.zeros(in_features, **f32))
        self.register_buffer("start_weight", None)  # set by `set_start`

    @classmethod
    def from_linear(cls, linear: nn.Linear, start: tuple[torch.Tensor, torch.Tensor] | None = None,
                    **kwargs) -> "FakeQuantLinear":
        """Wrap ``linear``'s weight and bias (shared, not copied); clip ratios start from rtn's MSE search.

        ``start``: (weight [N, K], scales [N, 1]): quantization starts from that weight on that grid
        (symmetric, one float16 scale per output channel) instead of from ``linear.weight`` on rtn's, as
        GPTQ's compensated weights and scales (`nibble.qat.train.gptq_start`): the weight is kept as
        ``start_weight`` (the LoRA delta is added to it) and the clip ratios are set so that the grid at
        step 0 has exactly those scales. ``linear.weight`` stays the 16-bit weight the teacher runs
        (`quantization_disabled`).
        """
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    input_hadamard=getattr(linear, "input_hadamard", False), device=w.device, dtype=w.dtype, **kwargs)
        layer.weight = linear.weight
        layer.bias = linear.bias
        layer.weight.requires_grad_(False)
        if layer.bias is not None:
            layer.bias.requires_grad_(False)
        if start is not None:
            layer.set_start(*start)
        elif layer.clip != "none":
            layer.init_clip_from_search()
        return layer

    @torch.no_grad()
    def set_start(self, weight: torch.Tensor, scales: torch.Tensor) -> None:
        """Start quantization from ``weight`` on the grid of ``scales``: see `from_linear`."""
        if self.clip == "none" or self.smoothing:
            raise ValueError("a start weight needs a clip ratio to hold its scales and no smoothing (which rescales "
                             "the weight the grid sees): recipes 'per-token' and 'hadamard' take one")
        N, K = self.weight.shape
        if tuple(weight.shape) != (N, K) or tuple(scales.shape) != (N, 1):
            raise ValueError(f"start must be (weight [{N}, {K}], scales [{N}, 1]), got {tuple(weight.shape)} and "
                             f"{tuple(scales.shape)}")
        w = weight.float().to(self.weight.device)
        self.start_weight = w
        # weight_grid takes s = fp16(ratio * amax / 7): this ratio gives back the float16 scale (the float32
        # product is within an ulp of 7 s, far inside half a float16 ulp of s).
        amax = w.abs().amax(dim=1, keepdim=True)
        scales = scales.float().to(w.device)
        self.set_clip_ratio(torch.where(amax > 0, 7 * scales / amax, torch.ones_like(amax)))

    @torch.no_grad()
    def init_clip_from_search(self) -> None:
        """Per-channel clip ratio = the one rtn's MSE search picks (its scale over the unclipped scale)."""
        w = self.weight.float()
        _, s_search, _ = quantize_groups(w, symmetric=True, clip_search=True)
        _, s_full, _ = quantize_groups(w, symmetric=True, clip_search=False)
        # Snap to the search's own grid (rtn's default: 20 ratios from 1 down to 0.5), so a fixed clip
        # reproduces rtn_quantize's scales, exactly where they are float16 normals: a row whose scale is below
        # 2^-14 (amax below ~4e-4) stores it rounded up to a multiple of 2^-24, and the quotient of two such can
        # snap to a neighbouring ratio.
        grid = torch.linspace(1.0, 0.5, 21, device=w.device)
        self.set_clip_ratio(grid[((s_search / s_full) - grid).abs().argmin(dim=1)].unsqueeze(1))

    @torch.no_grad()
    def set_clip_ratio(self, ratio: torch.Tensor) -> None:
        """A fixed clip holds ``ratio`` exactly; a learned one starts at it, at most `MAX_INIT_RATIO`."""
        if self.clip == "fixed":
            self.clip_ratio.copy_(ratio)
        else:
            self.clip_logit.copy_(_logit(ratio.clamp(max=MAX_INIT_RATIO)))

    def weight_clip_ratio(self) -> torch.Tensor | None:
        if self.clip == "fixed":
            return self.clip_ratio
        if self.clip == "learned":
            return torch.sigmoid(self.clip_logit)
        return None

    def effective_weight(self, delta: torch.Tensor | None = None) -> torch.Tensor:
        """W or the start weight, + LoRA delta, times the smoothing factors: the float32 weight that gets quantized."""
        w = self.weight.float() if self.start_weight is None else self.start_weight
        if delta is not None:
            w = w + delta.float()
        if self.smoothing:
            w = w * torch.exp(self.smooth_log)
        return w

    def quantized_weight(self, delta: torch.Tensor | None = None) -> torch.Tensor:
        """The fake-quantized weight (float32), the value the exported INT4 weight dequantizes to."""
        return fake_quant_weight(self.effective_weight(delta), self.weight_clip_ratio())

    def forward_with_delta(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        if self.input_hadamard:
            x = hadamard_transform(x)
        if not self.quant_enabled:  # the 16-bit teacher (with the adapters disabled)
            w = self.weight if delta is None else (self.weight.float() + delta.float()).to(self.weight.dtype)
            return F.linear(x, w, self.bias)
        with torch.autocast(x.device.type, enabled=False):  # the grid in float32, exactly as export computes it
            wq = self.quantized_weight(delta)
        if self.smoothing:
            x = x / torch.exp(self.smooth_log).to(x.dtype)
        if self.act == "token":
            xq = fake_quant_tokens(x)
        else:
            xq = fake_quant_channels(x, torch.sigmoid(self.act_clip_logit))
        if not torch.is_autocast_enabled(x.device.type):
            xq, wq = xq.to(x.dtype), wq.to(x.dtype)
        return F.linear(xq, wq, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_with_delta(x)

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", clip={self.clip}, act={self.act}, smoothing={self.smoothing}, "
                f"input_hadamard={self.input_hadamard}")


class FakeQuantLoraLinear(LoraLinear):
    """peft's LoRA layer around a FakeQuantLinear: the adapter is merged into the weight *before*
    fake quantization (``Qw(W + s B A)``), the deployment granularity, instead of peft's parallel
    unquantized ``B A x`` branch. Registered with ``LoraConfig._register_custom_module``."""

    def lora_delta(self) -> torch.Tensor | None:
        """``sum scaling * B @ A`` over the active adapters not merged into the weight, float32; None when there
        are none (or adapters are off)."""
        if self.disable_adapters:
            return None
        delta = None
        for name in self.active_adapters:
            if name not in self.lora_A or name in self.merged_adapters:
                continue
            a, b = self.lora_A[name].weight.float(), self.lora_B[name].weight.float()
            d = (b @ a) * self.scaling[name]
            delta = d if delta is None else delta + d
        return delta

    @torch.no_grad()
    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """peft's merge (``merge_and_unload``) adds ``s B A`` to the base layer's ``weight``; a layer started from
        GPTQ quantizes its ``start_weight`` instead (`effective_weight`), so its delta goes there, or the unloaded
        model would run without its adapters. The merged model is still fake quantized: `export` deploys it."""
        base = self.get_base_layer()
        if base.start_weight is None:
            return super().merge(safe_merge, adapter_names)
        for name in check_adapters_to_merge(self, adapter_names):
            if name in self.lora_A:
                base.start_weight += self.get_delta_weight(name).float()
                self.merged_adapters.append(name)

    @torch.no_grad()
    def unmerge(self) -> None:
        base = self.get_base_layer()
        if base.start_weight is None:
            return super().unmerge()
        while self.merged_adapters:
            name = self.merged_adapters.pop()
            if name in self.lora_A:
                base.start_weight -= self.get_delta_weight(name).float()

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.disable_adapters and self.merged:  # as peft's layers: adapters off is the base weight, merged or not
            self.unmerge()
        base = self.get_base_layer()
        with torch.autocast(x.device.type, enabled=False):
            delta = self.lora_delta()
        return base.forward_with_delta(x, delta)


def fake_quant_layers(model: nn.Module) -> list[tuple[str, FakeQuantLinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, FakeQuantLinear)]


@contextmanager
def quantization_disabled(model: nn.Module):
    """Run ``model`` with fake quantization off (used, with the adapters disabled, as the 16-bit teacher)."""
    layers = [m for _, m in fake_quant_layers(model)]
    previous = [m.quant_enabled for m in layers]
    for m in layers:
        m.quant_enabled = False
    try:
        yield model
    finally:
        for m, p in zip(layers, previous):
            m.quant_enabled = p
