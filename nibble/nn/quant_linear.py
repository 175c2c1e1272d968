"""QuantLinear: in place of nn.Linear, the same forward, holding INT4 weights in the canonical format (buffers, not
parameters: no ``.weight``; the bias is a buffer too, float16, bfloat16 or float32)."""
from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import nn

from nibble import kernels
from nibble.config import FLOAT_DTYPES, MODE_GROUP_SIZES, MODES, QuantConfig, width_error
from nibble.formats.int4 import PACK, Int4Weight, check_group_size, is_symmetric
from nibble.kernels.hadamard import hadamard_transform
from nibble.kernels.launch import check_bias
from nibble.kernels.reference import dequantize
from nibble.quantize.rtn import rtn_quantize


class QuantLinear(nn.Module):
    """y = x @ W.T + b with W stored as INT4 (buffers ``qweight``, ``scales``, ``zeros``).

    ``mode="w4a16"``: activations stay 16-bit, the weight is dequantized inside the GEMM.
    ``mode="w4a4"``: activations are quantized per token to INT4 (after an online Hadamard
    transform when ``input_hadamard``), the product runs on integer tensor cores.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group_size: int | None = None,
                 mode: str = "w4a16", input_hadamard: bool = False, dtype: torch.dtype | None = None,
                 device=None):
        """``group_size=None`` picks the mode's default, as QuantConfig does (128 for w4a16, per-channel for w4a4);
        ``dtype`` is the bias's (the default dtype, as nn.Linear's); the buffers start at zero, so a layer not
        yet loaded computes 0, never what uninitialised memory held."""
        super().__init__()
        if out_features < 1:
            raise ValueError(f"out_features={out_features}: a layer without outputs has nothing to quantize; keep it "
                             "as nn.Linear")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if group_size is None:  # w4a4 took W4A16's 128, which it refuses, on every width but 128
            group_size = MODE_GROUP_SIZES[mode]
        check_group_size(group_size)
        if error := width_error(in_features, group_size):
            raise ValueError(error)
        group_size = in_features if group_size == -1 else group_size
        if mode == "w4a4" and group_size != in_features:
            raise ValueError("w4a4 QuantLinear needs per-channel weights (group_size = in_features)")
        if not isinstance(input_hadamard, bool):  # a string "false" is true: the layer rotated without a word
            raise TypeError(f"input_hadamard must be True or False, got {input_hadamard!r}")
        if dtype is not None and dtype not in FLOAT_DTYPES:  # the bias's: an integer one failed at the first forward
            raise TypeError(f"dtype (the bias's) must be one of {FLOAT_DTYPES} or None, got {dtype}")
        if input_hadamard and mode != "w4a4":
            raise ValueError("input_hadamard is part of the w4a4 path")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.mode, self.input_hadamard = mode, input_hadamard
        self.backend = "auto"
        groups = in_features // group_size
        self.register_buffer("qweight", torch.zeros(in_features // PACK, out_features, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.zeros(groups, out_features, dtype=torch.float16, device=device))
        self.register_buffer("zeros", torch.zeros(groups, out_features, dtype=torch.float16, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)

    @property
    def backend(self) -> str:
        """Which kernels the forward runs: one of `nibble.kernels.BACKENDS` ('auto': the GPU kernel where one runs
        this input, else the reference; `nibble.models.convert.set_backend` sets a whole model's)."""
        return self._backend

    @backend.setter
    def backend(self, name: str) -> None:
        kernels.check_backend(name)  # here, not at the next forward, which failed far from the line that set it
        self._backend = name

    @classmethod
    def from_weight(cls, weight: Int4Weight, bias: torch.Tensor | None = None, mode: str = "w4a16",
                    input_hadamard: bool = False, dtype: torch.dtype | None = None) -> "QuantLinear":
        """The layer of a quantized ``weight`` (`nibble.quantize`'s, on its device) and ``bias``; the bias keeps its
        own dtype, ``dtype`` is the one of a layer without one."""
        check_bias(bias, weight.out_features)  # a copy_ would broadcast a [1] bias over every output
        layer = cls(weight.in_features, weight.out_features, bias is not None, weight.group_size, mode,
                    input_hadamard, dtype=bias.dtype if bias is not None else dtype, device=weight.qweight.device)
        layer._check_zeros(weight.scales, weight.zeros)
        layer.qweight.copy_(weight.qweight)
        layer.scales.copy_(weight.scales)
        layer.zeros.copy_(weight.zeros)
        if bias is not None:
            layer.bias.copy_(bias.detach())
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: QuantConfig) -> "QuantLinear":
        """Quantize an nn.Linear with round-to-nearest (+ clipping search) per ``config``: its mode, group_size,
        symmetric, zero_point and clip_search. Its rotation and method are `quantize_model`'s, whole-model steps
        (which call this for the layers RTN quantizes, the rotation done first). A config that quantizes no layer by
        RTN (method gptq / awq with lm_head kept in 16 bits) holds no clip_search, and is refused."""
        if config.clip_search is None:
            raise ValueError(f"QuantLinear.from_linear quantizes by RTN, and this config of method={config.method!r} "
                             "quantizes no layer by RTN (lm_head stays in 16 bits), so it holds no clip_search: give "
                             "it a config of method='rtn'")
        weight = rtn_quantize(linear.weight.detach(), config.group_size, config.symmetric, config.zero_point,
                              config.clip_search)
        return cls.from_weight(weight, linear.bias, config.mode, getattr(linear, "input_hadamard", False),
                               dtype=linear.weight.dtype)

    def _check_zeros(self, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        """W4A4's product reads every weight as (q - 8) * s and never its zero: refuse others, which it would
        silently compute as another weight."""
        if self.mode == "w4a4" and not scales.is_meta and not is_symmetric(scales, zeros):
            raise ValueError("a w4a4 QuantLinear needs symmetric weights (zeros == -8 * scales): its integer product "
                             "has no zero point; quantize with symmetric=True or use mode='w4a16'")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        mine = {"qweight": self.qweight, "scales": self.scales, "zeros": self.zeros}
        loaded = {name: state_dict.get(prefix + name) for name in mine}
        # a missing key or a wrong shape is nn.Module's to report; checked before the copy leaves the layer as it was
        if all(t is None or t.shape == mine[name].shape for name, t in loaded.items()):
            # the format's dtypes too (the layer's own tensors standing in for keys not loaded): copy_ rounded a
            # float-cast qweight's words into other weights without a word, and assign=True kept float32 scales,
            # which the GPU kernels refuse
            try:
                Int4Weight(*(mine[name] if t is None else t for name, t in loaded.items()), self.group_size)
            except ValueError as e:
                raise ValueError(f"{prefix}{e}: the INT4 format keeps int32 words and float16 scales and zeros "
                                 "whatever the model's dtype; load a state_dict whose qweight, scales and zeros "
                                 "were not cast (a float cast rounds the packed words)") from None
            if loaded["scales"] is not None and loaded["zeros"] is not None:
                self._check_zeros(loaded["scales"], loaded["zeros"])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def weight_int4(self) -> Int4Weight:
        return Int4Weight(self.qweight, self.scales, self.zeros, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, [self])
        if self.differentiated(x):
            function = _WithTangent if kernels.transforms_active() else _WithInputGradient
            return function.apply(x, self.bias, self)
        return self._product(x, self.bias)

    def differentiated(self, x: torch.Tensor) -> bool:
        """Whether a call on ``x`` needs the gradient `_WithInputGradient` gives: one is wanted for x or for a
        trainable bias, or a torch.func transform or forward-mode AD is active (`kernels.transforms_active`), whose
        tangent, perhaps at an outer level x does not show, the GPU kernels would drop and W4A4's reference would
        take through the rounding."""
        if torch.is_grad_enabled() and (x.requires_grad or (self.bias is not None and self.bias.requires_grad)):
            return True
        return kernels.transforms_active()

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The product on x that `_check_input` has checked."""
        if self.mode == "w4a16":
            return kernels._w4a16_linear(x, self.qweight, self.scales, self.zeros, self.group_size, bias, self.backend)
        return kernels._w4a4_linears(x, [(self.qweight, self.scales[0], bias)], self.input_hadamard, self.backend)[0]

    def _dequantized(self, device) -> torch.Tensor:
        return dequantize(self.qweight, self.scales, self.zeros, self.group_size).to(device)

    def _input_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        """dL/dx for dL/dy = ``grad``: grad @ W with W the dequantized weight (`_WithInputGradient` says why)."""
        g = (grad.float() @ self._dequantized(grad.device)).to(grad.dtype)
        return hadamard_transform(g, inverse=True) if self.input_hadamard else g  # y = q(x H^T) W^T

    def _output_tangent(self, tangent: torch.Tensor) -> torch.Tensor:
        """dy for dx = ``tangent``, the forward-mode twin of `_input_gradient`: tangent @ W.T, after the Hadamard."""
        t = hadamard_transform(tangent) if self.input_hadamard else tangent
        return (t.float() @ self._dequantized(t.device).t()).to(t.dtype)

    def _apply(self, fn, recurse=True):
        """``module.to(dtype)`` / ``.half()`` / ``.bfloat16()`` cast every floating buffer, and would cast the
        INT4 format's float16 scales and zeros too: a bf16 model would then multiply by other weights than it
        was quantized to (bf16 keeps 8 bits of a scale), write a checkpoint off the format, and be refused by
        the GPU kernels and the AWQ / GPTQ export. ``module.type(dtype)`` casts integer buffers as well, which
        destroyed the packed words (int32 bit patterns). The format's buffers follow the module's device, never
        its dtype. A cast to another dtype than the activations' (float16, bfloat16, float32: `check_cast`) is
        refused before any buffer moves."""
        check_cast(fn)
        format_buffers = {name: t for name, t in self._buffers.items()
                          if t is not None and (name in ("scales", "zeros") or not t.is_floating_point())}
        super()._apply(fn, recurse)
        for name, kept in format_buffers.items():
            moved = self._buffers[name]
            if moved.dtype != kept.dtype:
                self._buffers[name] = kept.to(moved.device)
        return self

    @torch.no_grad()
    def permute_outputs(self, perm: torch.Tensor) -> None:
        """Output channel i becomes the old channel perm[i]: the canonical words, scales and zeros hold one
        column per output channel, so the codes move as they are (nothing is requantized)."""
        self.qweight, self.scales, self.zeros = (t[:, perm].contiguous() for t in (self.qweight, self.scales, self.zeros))
        if self.bias is not None:
            self.bias = self.bias[perm].contiguous()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"mode={self.mode}, group_size={self.group_size}, input_hadamard={self.input_hadamard}")


def check_cast(fn) -> None:
    """Refuse the ``Module._apply`` function ``fn`` (what ``.to()``, ``.double()``, ``.type()`` apply to each tensor)
    where it casts a float tensor to a dtype a QuantLinear's activations cannot take (`FLOAT_DTYPES`): the cast went
    through, and the model failed at its first forward (``model.to(torch.float64)``). Told by ``fn``'s result on an
    empty float32 tensor, before any tensor is cast."""
    dtype = fn(torch.zeros(0)).dtype
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"a quantized model runs in torch.float16, torch.bfloat16 or torch.float32 (its QuantLinears' "
                        f"activations; their INT4 weights keep their own dtypes), not {dtype}: cast it to one of those")


class PermutedInputQuantLinear(QuantLinear):
    """A QuantLinear whose canonical weight lists its inputs in another order: y = x[..., input_perm] @ W.T + b.

    GPTQ with act-order (``desc_act``) quantizes the inputs in the order of their Hessian diagonal and
    forms its groups in that order, so the groups of the original order are not contiguous; stored in
    that order instead they are, and the kernels run unchanged on x gathered once per call.
    ``input_order``, a digest of the permutation, lets `shared_input_forward` see which layers share
    one (q/k/v, gate/up: GPTQ finds the same order for layers that read the same input) without
    comparing the tensors on the device, a host sync per call.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("input_perm", torch.arange(self.in_features, device=self.qweight.device))
        self.recompute_input_order()

    def recompute_input_order(self) -> None:
        """``input_order`` of ``input_perm`` as it now holds (None on the meta device), for a loader that filled the
        buffer itself (transformers' from_pretrained: `nibble.models.hf_quantizer`); a non-permutation is refused."""
        self.input_order = None if self.input_perm.is_meta else _permutation_digest(self.input_perm)

    def set_input_perm(self, perm: torch.Tensor) -> None:
        if perm.shape != self.input_perm.shape:
            raise ValueError(f"input_perm must hold {self.in_features} indices (in_features), got shape "
                             f"{tuple(perm.shape)}")
        self.input_order = _permutation_digest(perm)  # checked before the layer takes it
        self.input_perm.copy_(perm)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        perm = state_dict.get(prefix + "input_perm")
        if perm is not None and not perm.is_meta:
            _permutation_digest(perm)  # refused before the copy, which would leave the layer gathering wrong inputs
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.recompute_input_order()

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return super()._product(kernels.gather_columns(x, self.input_perm, backend=self.backend), bias)

    def _input_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        g = super()._input_gradient(grad)  # of x[..., input_perm]
        return torch.empty_like(g).index_copy_(-1, self.input_perm.to(g.device), g)

    def _output_tangent(self, tangent: torch.Tensor) -> torch.Tensor:
        return super()._output_tangent(tangent.index_select(-1, self.input_perm.to(tangent.device)))

    def forward_in_order(self, x: torch.Tensor) -> torch.Tensor:
        """The layer on x already in its stored input order, x = x_original[..., input_perm] (the engine's
        decode attention writes it so, instead of a gather of its own). Inference only (no gradient)."""
        _check_input(x, [self])
        return QuantLinear._product(self, x, self.bias)

    def without_input_perm(self) -> QuantLinear:
        """The same weight as a plain QuantLinear that takes its input already in the stored order
        (its buffers shared, not copied): for a caller that produces x in that order
        (`nibble.models.hf_import.fold_mlp_input_orders`)."""
        plain = QuantLinear(self.in_features, self.out_features, self.bias is not None, self.group_size, self.mode,
                            self.input_hadamard, device="meta")
        for name in ("qweight", "scales", "zeros", "bias"):
            setattr(plain, name, getattr(self, name))
        plain.backend = self.backend
        return plain


class _WithInputGradient(torch.autograd.Function):
    """A QuantLinear's product with a gradient for its input: dL/dx = dL/dy @ W, W the dequantized weight. For
    W4A16 that is the product's own gradient; for W4A4 the straight-through one (the activations' rounding
    passed as the identity, as PE-QAT's fake quantization does), through the online Hadamard's transpose.
    The GPU kernels write their outputs into fresh tensors, so without this no gradient would reach x there,
    and the CPU reference's W4A4 would pass one only through each token's scale. The weights are buffers:
    frozen, as under LoRA; the bias is an input of its own, so that a trainable one gets its gradient too.
    The setup_context form lets torch.func transform it; forward mode is `_WithTangent`'s. Its backward is made of
    differentiable ops, so second derivatives (double backward, ``jacrev(jacrev)``, ``hessian``) follow."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, bias: torch.Tensor | None, layer: QuantLinear) -> torch.Tensor:
        # A view of the product, not the product: torch 2.11's Dynamo (not 2.10's, 2.12's or 2.13's) gave a zero
        # gradient to every input of a traced Function whose forward ended in a method that returns its tensor
        # itself, as ``.to(x.dtype)`` does where the product already has x's dtype (bfloat16 through the GPU kernels,
        # float32 through the CPU reference). A view costs nothing and passes the gradient in every version.
        y = layer._product(x, bias)
        return y.view_as(y)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.layer = inputs[2]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_x = ctx.layer._input_gradient(grad) if ctx.needs_input_grad[0] else None
        grad_bias = grad.reshape(-1, grad.shape[-1]).float().sum(0) if ctx.needs_input_grad[1] else None
        return grad_x, grad_bias, None


class _WithTangent(_WithInputGradient):
    """`_WithInputGradient` with forward mode, the same Jacobian: taken under a torch.func transform or forward-mode
    AD only (`kernels.transforms_active`; every level of ``jacfwd(jacrev(f))`` needs its jvp), since torch.compile
    refuses to trace a Function that defines a jvp."""

    @staticmethod
    def jvp(ctx, x_tangent, bias_tangent, _):
        y_tangent = ctx.layer._output_tangent(x_tangent)
        return y_tangent if bias_tangent is None else y_tangent + bias_tangent.to(y_tangent.dtype)


def _check_input(x: torch.Tensor, layers) -> None:
    """x for QuantLinear ``layers`` that read it, checked once (the kernels' functions they call do not check it
    again): `kernels.check_activations`, then its width for each layer, before an act-order layer gathers it."""
    kernels.check_activations(x)
    for m in layers:
        if x.shape[-1] != m.in_features:
            raise ValueError(f"input has {x.shape[-1]} features in its last dimension but this layer expects "
                             f"{m.in_features} (input shape {tuple(x.shape)})")


def _permutation_digest(perm: torch.Tensor) -> str:
    """sha1 of ``perm`` after checking it is a permutation of range(len(perm)): a corrupt one would
    gather the wrong inputs silently."""
    perm = perm.detach().cpu().long()
    if perm.dim() != 1 or not torch.equal(perm.sort().values, torch.arange(perm.numel())):
        raise ValueError(f"input_perm must be a permutation of 0..{perm.numel() - 1}; the checkpoint's is not "
                         "(a corrupt g_idx or input_perm)")
    return hashlib.sha1(perm.numpy().tobytes()).hexdigest()


def _one_launch_key(m: QuantLinear) -> tuple:
    """QuantLinears with equal keys that read one input run as one launch (`shared_input_forward`)."""
    return m.mode, m.backend, m.input_hadamard, m.group_size, getattr(m, "input_order", None)


def shared_input_perm(layers) -> torch.Tensor | None:
    """The input permutation of ``layers`` when they are GPTQ act-order layers (`PermutedInputQuantLinear`)
    that `shared_input_forward` runs as one launch in one input order, else None: a caller that writes
    their input in that order (the engine's RMSNorm kernel) passes it with ``x_in_order=True``."""
    layers = list(layers)
    if (len(layers) > 1 and all(isinstance(m, PermutedInputQuantLinear) for m in layers)
            and len({_one_launch_key(m) for m in layers}) == 1):
        return layers[0].input_perm
    return None


def shared_input_forward(layers, x: torch.Tensor, x_in_order: bool = False) -> list[torch.Tensor]:
    """The outputs of several layers that read the same ``x`` (a block's q/k/v or gate/up projections).

    On CUDA a kernel launch costs a few microseconds, as much as a decode step's matmul streams in
    weights, so what can share one launch does:
    - W4A4 QuantLinears with one rotation setting and backend quantize ``x`` once for all of them
      and run their products as one kernel launch (the decode kernel up to 16 tokens, the Hopper
      GEMM above, where a tile fits every width but the last);
    - W4A16 QuantLinears with one group size and backend run as one kernel launch where the skinny
      kernel runs (up to 32 tokens) and where the Hopper GEMM runs (the group's columns together);
      layers with an input permutation (`PermutedInputQuantLinear`) join only layers of the same one,
      and x is gathered once for them (not at all with ``x_in_order``: the caller wrote x in that
      order, `shared_input_perm`);
    - plain ``nn.Linear`` layers whose weights are consecutive rows of one tensor (`stack_weights`)
      run as one matmul.
    Any other layer is called as is, and so is every layer when a gradient or a tangent is wanted (the shared
    launches have none: `QuantLinear.differentiated`).
    """
    layers = list(layers)
    perm = shared_input_perm(layers)
    if x_in_order and perm is None:
        raise ValueError("x_in_order=True is for layers of one input permutation that run as one launch "
                         "(shared_input_perm)")
    if len(layers) > 1 and all(isinstance(m, QuantLinear) for m in layers):
        _check_input(x, layers)  # before x.requires_grad is read
        if any(m.differentiated(x) for m in layers):
            if x_in_order:
                raise ValueError("x_in_order=True is for inference (the layers' gradient is of x in its own order): "
                                 "pass x in its original order, or run under torch.no_grad()")
            return [m(x) for m in layers]  # each checks x again: training's calls, not decode's
        mode, backend = layers[0].mode, layers[0].backend
        same = len({_one_launch_key(m) for m in layers}) == 1
        # layers with one input permutation (GPTQ act-order) share x gathered once
        xs = kernels.gather_columns(x, perm, backend) if perm is not None and not x_in_order else x
        if same and mode == "w4a4":
            return kernels._w4a4_linears(xs, [(m.qweight, m.scales[0], m.bias) for m in layers],
                                         layers[0].input_hadamard, backend)
        if same and mode == "w4a16":
            return kernels._w4a16_linears(xs, [(m.qweight, m.scales, m.zeros, m.bias) for m in layers],
                                          layers[0].group_size, backend)
    stacked = _stacked_parameters(layers)
    if stacked is not None:
        return list(F.linear(x, *stacked).split([m.out_features for m in layers], dim=-1))
    return [m(x) for m in layers]


def w4a4_operands(layers, dtype: torch.dtype):
    """[(qweight, w_scale, bias), ...] for `nibble.kernels.w4a4.w4a4_products` when ``layers`` are
    W4A4 QuantLinears that would quantize one shared input alike (no online rotation, the default
    backend), so a caller may hand them that input quantized (the engine's RMSNorm does); else None.
    Biases come in ``dtype``, the activations'."""
    layers = list(layers)
    if not layers or not all(isinstance(m, QuantLinear) and m.mode == "w4a4" and not m.input_hadamard
                             and m.backend == "auto" for m in layers):
        return None
    if len({m.in_features for m in layers}) != 1:
        return None
    return [(m.qweight, m.scales[0], None if m.bias is None else m.bias.to(dtype)) for m in layers]


def stack_weights(layers) -> None:
    """Make the weights (and biases) of plain ``nn.Linear`` layers that read the same input (same
    in_features, dtype and device) consecutive rows of one tensor, in place: each layer's parameters
    become views of the stack, so memory is unchanged and the layers work as before, and
    `shared_input_forward` runs them as one matmul (gpt-fast's fused wqkv, without a new module).
    Each ``nn.Parameter`` stays the same object (its ``.data`` becomes the view), so an optimizer built
    before still trains it, and its steps reach the stack. Layers that do not qualify are left alone.
    Their parameters then share storage (safetensors refuses to save shared tensors: save the model
    before, or clone the parameters)."""
    layers = list(layers)
    if (len(layers) < 2 or not all(type(m) is nn.Linear for m in layers)
            or len({(m.in_features, m.weight.dtype, m.weight.device, m.bias is None) for m in layers}) != 1
            or _stacked_parameters(layers) is not None):
        return
    names = ("weight",) if layers[0].bias is None else ("weight", "bias")
    with torch.no_grad():
        for name in names:
            stack = torch.cat([getattr(m, name).detach() for m in layers])
            row = 0
            for m in layers:
                getattr(m, name).data = stack[row:row + m.out_features]
                row += m.out_features


def _stacked_parameters(layers):
    """(weight [sum N, K], bias [sum N] or None) of plain nn.Linear layers whose parameters are
    consecutive rows of one tensor each (see `stack_weights`), else None."""
    if len(layers) < 2 or not all(type(m) is nn.Linear for m in layers) or len({m.bias is None for m in layers}) != 1:
        return None
    weight = _consecutive([m.weight for m in layers])
    bias = None if layers[0].bias is None else _consecutive([m.bias for m in layers])
    if weight is None or (bias is None) != (layers[0].bias is None):
        return None
    return weight, bias


def _consecutive(tensors):
    """One view over tensors that lie back to back, in order, in one storage (rows of equal shape
    beyond the first dimension, contiguous), else None."""
    t0 = tensors[0]
    expected = t0.data_ptr()
    for t in tensors:
        if (not t.is_contiguous() or t.shape[1:] != t0.shape[1:] or t.dtype != t0.dtype or t.data_ptr() != expected
                or t.untyped_storage().data_ptr() != t0.untyped_storage().data_ptr()):
            return None
        expected += t.numel() * t.element_size()
    return t0.as_strided((sum(t.shape[0] for t in tensors), *t0.shape[1:]), t0.stride())
