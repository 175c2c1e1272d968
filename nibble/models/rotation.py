"""Calibration-free rotation of Llama / Qwen2 / Qwen3 / Mistral causal LMs (QuaRot-style) for W4A4.

The rotated model computes the same function in 16 bits, but the activations that will be
quantized per token carry no outlier channels:

* every RMSNorm weight is folded into the linears that read the norm's output (the norm keeps
  weight 1), so a norm commutes with any orthogonal Q: rms(x Q) = rms(x); Qwen3's per-head q / k
  norms read q_proj's and k_proj's outputs, which the rotation leaves as they were, and stay;
* the residual stream is rotated, x -> x Q with Q = H_d diag(s) (seeded random signs s): the
  embedding rows and every linear writing to the stream (o_proj, down_proj: W -> Q^T W) or reading
  from it (q/k/v, gate/up, lm_head: W -> W Q);
* down_proj becomes a HadamardInputLinear: the kernel rotates its input online (intermediate size),
  its weight is W_down @ H^T. With `online_o_proj`, o_proj gets the same treatment.

Row-vector convention throughout: y = x @ W.T. All the algebra runs in float64 and each weight is
rounded back to its dtype once.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from nibble.config import checked_seed, resolve_device
from nibble.kernels.hadamard import hadamard_factors, hadamard_transform_reference
from nibble.models.architecture import DECODER_LAYERS, check_architecture, decoder_layers
from nibble.models.convert import (check_not_quantized, check_weights_loaded, lm_head_tied, refuse_save_pretrained,
                                   untie_lm_head)
from nibble.nn.hadamard import HadamardInputLinear


def rotate_model(model: nn.Module, seed: int = 0, online_o_proj: bool = False,
                 device: str | torch.device | None = None) -> nn.Module:
    """Rotate a Hugging Face Llama / Qwen2 / Qwen3 / Mistral causal LM in place; returns it.

    online_o_proj: also rotate o_proj's input online (its width, heads * head_dim, must be a
    supported Hadamard size). QuaRot instead rotates V offline per head and mixes heads online: the
    product of the two, H_heads (x) H_head_dim, is a full Hadamard rotation of o_proj's input as well
    (with nibble's H_heads, its very matrix where the sizes factor alike, as 12 * 128 or 32 * 128;
    the 9 heads of SmolLM2 QuaRot cannot mix at all), which nibble's kernel applies in one pass.
    (The offline V rotation would only matter for a quantized KV cache, which nibble has not.)

    device: where the float64 algebra runs (default: each weight's own device). Every result is
    written back where its parameter lives, so a model in host memory can be rotated on a GPU.

    The rotated model refuses ``save_pretrained``: transformers would load its down_proj without the online
    Hadamard. A model quantized in W4A4 keeps it, and saves with ``nibble.save_quantized``. The model records
    ``seed`` (`rotation_seed`), and whether it untied a tied lm_head (`rotation_untied_head`): ``quantize_model``
    (given rotation 'none') writes the rotation, and a quantized head's tie, into its quantization_config.
    """
    rotate_layer = rotate_all_but_layers(model, seed, online_o_proj, device)
    for layer in decoder_layers(model):
        rotate_layer(layer)
    return model


ROTATION_SEED = "nibble_rotation_seed"  # the model attribute a rotation records its seed in
UNTIED_HEAD = "nibble_rotation_untied_head"  # the one it records, True, where it untied lm_head from the embedding


def rotation_seed(model: nn.Module) -> int | None:
    """The seed ``model`` was rotated with (by `rotate_model`, or by ``quantize_model``'s rotation), None for a
    model never rotated: ``quantize_model`` records it as the quantization_config's rotation and rotation_seed,
    whoever rotated the model, so that the checkpoint says the rotation its weights were made for."""
    return getattr(model, ROTATION_SEED, None)


def rotation_untied_head(model: nn.Module) -> bool:
    """Whether a rotation of ``model`` untied its lm_head from the embedding (to fold the final norm into the head):
    ``quantize_model`` records a quantized head that was tied (`convert.TIED_HEAD`) whoever untied it, so that the
    bytes saved are those of the 16-bit model, which held the head once, as the embedding (`convert.weight_bytes`)."""
    return getattr(model, UNTIED_HEAD, False)


def online_hadamard_linears(online_o_proj: bool = False) -> tuple[str, ...]:
    """The linears of each decoder layer (names in the layer) that the rotation gives an online Hadamard."""
    return ("self_attn.o_proj",) * online_o_proj + ("mlp.down_proj",)


def check_rotatable(model: nn.Module, online_o_proj: bool = False) -> None:
    """Refuse a model the rotation cannot take, before any of it is touched: another architecture, a quantized or
    rotated model, weights on the meta device (nothing to rotate), a hidden or intermediate size (o_proj's input
    too with ``online_o_proj``) the Hadamard transform has no matrix for, a norm other than RMSNorm without bias."""
    check_architecture(model)
    check_not_quantized(model, "rotate_model")  # its INT4 layers hold no float weight to rotate
    check_weights_loaded(model)
    cfg = model.config
    layers = decoder_layers(model)
    if rotation_seed(model) is not None or any(isinstance(layer.mlp.down_proj, HadamardInputLinear)
                                               for layer in layers):
        raise ValueError("this model is rotated already (its down_proj has an online Hadamard), and a second rotation "
                         "would be folded onto the first: take it as it is (quantize_model with rotation='none', the "
                         "default, or PE-QAT's per-token recipe; the quantized model's config records the rotation "
                         "all the same), or give a 16-bit model that was not rotated")
    attn0 = layers[0].self_attn
    for what, size in (("hidden_size", cfg.hidden_size), ("intermediate_size", cfg.intermediate_size)) + (
            (("o_proj in_features", attn0.o_proj.in_features),) if online_o_proj else ()):
        try:
            hadamard_factors(size)
        except ValueError as e:
            raise ValueError(f"cannot rotate this model: its {what} is {size}. {e}") from None
    for name, norm in _norms(model):
        # A bias would be rotated into the stream but not folded (x / rms(x) * w + b), and a norm without a weight
        # failed on it after the embedding was rotated and lm_head untied: refused here, naming what to fix.
        kind = type(norm).__name__
        if not kind.endswith("RMSNorm"):
            problem = f"is a {kind}"
        elif getattr(norm, "bias", None) is not None:
            problem = f"({kind}) has a bias"
        elif not isinstance(getattr(norm, "weight", None), torch.Tensor) or norm.weight.shape != (cfg.hidden_size,):
            problem = f"({kind}) has no weight of shape ({cfg.hidden_size},)"
        else:
            continue
        raise ValueError(f"cannot rotate this model: rotation folds the weight w of each RMSNorm (x / rms(x) * w, "
                         f"without bias) into the linears that read it, and {name} {problem}")


def rotate_all_but_layers(model: nn.Module, seed: int = 0, online_o_proj: bool = False,
                          device: str | torch.device | None = None) -> Callable[[nn.Module], None]:
    """`rotate_model` of everything but the decoder layers (the embedding; lm_head, which absorbs the final
    norm), after checking the whole model can be rotated (`check_rotatable`); returns the function that rotates
    one decoder layer, each exactly once, in any order: how ``quantize_model`` rotates each layer at its turn.
    The model records the seed (`rotation_seed`) and a tie it removed (`rotation_untied_head`)."""
    seed = checked_seed("seed", seed)  # before the model is touched
    check_rotatable(model, online_o_proj)
    if device is not None:  # "cuda" without a GPU failed in the first weight's move, the model untied and marked rotated
        device = resolve_device(device)
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    signs = (torch.randint(0, 2, (cfg.hidden_size,), generator=g) * 2 - 1).double()

    refuse_save_pretrained(model, "a rotated model's down_proj (HadamardInputLinear) rotates its input online, "
                           "which transformers' from_pretrained would load as a plain nn.Linear, another function: "
                           "quantize it (nibble.quantize_model, mode='w4a4', keeps the online rotation) and save that "
                           "with nibble.save_quantized, or save the model before rotate_model")
    if lm_head_tied(model):
        setattr(model, UNTIED_HEAD, True)
    untie_lm_head(model)  # lm_head reads the final norm, whose weight it absorbs
    setattr(model, ROTATION_SEED, seed)

    def f64(t: torch.Tensor) -> torch.Tensor:  # moved in its own dtype, widened where the algebra runs
        return t.detach().to(device or t.device).to(torch.float64)

    def times_q(m: torch.Tensor) -> torch.Tensor:
        # m @ Q = (m @ H_d) * s, without ever forming Q: rows of m take the inverse transform.
        return hadamard_transform_reference(m, inverse=True) * signs.to(m.device)

    online = online_hadamard_linears(online_o_proj)

    @torch.no_grad()
    def rotate_layer(layer: nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        _rotate_readers((attn.q_proj, attn.k_proj, attn.v_proj), layer.input_layernorm, times_q, f64)
        _rotate_readers((mlp.gate_proj, mlp.up_proj), layer.post_attention_layernorm, times_q, f64)
        attn.o_proj = _rotate_writer(attn.o_proj, times_q, "self_attn.o_proj" in online, f64)
        mlp.down_proj = _rotate_writer(mlp.down_proj, times_q, "mlp.down_proj" in online, f64)

    with torch.no_grad():
        _rotate_rows(model.model.embed_tokens.weight, times_q, f64)
        _rotate_readers((model.lm_head,), model.model.norm, times_q, f64)
    return rotate_layer


def _norms(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name in the model, norm) of every norm the rotation folds."""
    return [(f"{DECODER_LAYERS}.{i}.{part}", getattr(layer, part)) for i, layer in enumerate(decoder_layers(model))
            for part in ("input_layernorm", "post_attention_layernorm")] + [("model.norm", model.model.norm)]


def _set(param: torch.Tensor, value: torch.Tensor) -> None:
    """param's values become value, rounded once to param's dtype (where value is), in new storage: a
    parameter that transformers mapped from a safetensors file would copy every page written into process
    memory for good (copy-on-write), where dropping the mapped one costs nothing."""
    param.data = value.to(param.dtype).to(param.device)


ROW_SLAB = 4096  # rows rotated at a time: a float64 copy of Llama-3's 128K x 4096 embedding is 4 GiB


def _rotate_rows(param: torch.Tensor, row_map, f64) -> None:
    """param <- row_map(param) for a map that takes each row on its own, a slab of rows at a time, so that
    the float64 copies (the transform makes a few) of a vocabulary-sized matrix are never whole."""
    # New storage in host memory, as `_set` says why; in place on a GPU, where a second vocabulary-sized
    # copy would only raise the peak (f64 copies each slab first, so a slab never reads what it wrote).
    out = torch.empty_like(param) if param.device.type == "cpu" else param
    for rows, dst in zip(param.split(ROW_SLAB), out.split(ROW_SLAB)):
        dst.copy_(row_map(f64(rows)).to(dst.dtype))
    if out is not param:
        param.data = out


def _rotate_readers(linears, norm: nn.Module, times_q, f64) -> None:
    """x_n = x / rms(x) * w feeds each linear: fold w into its columns (W -> W diag(w)), then rotate
    its input (W -> W Q). The norm keeps weight 1."""
    w = f64(norm.weight)
    for lin in linears:
        _rotate_rows(lin.weight, lambda m: times_q(m * w), f64)
    norm.weight.fill_(1.0)


def _rotate_writer(lin: nn.Linear, times_q, online: bool, f64) -> nn.Linear:
    """Output rotated into the stream: W -> Q^T W = (W^T Q)^T, b -> b Q. With `online`, also give it an
    online Hadamard on its input (weight W @ H^T), rounded once."""
    w = times_q(f64(lin.weight).T).T
    if lin.bias is not None:
        _set(lin.bias, times_q(f64(lin.bias)))
    if online:
        return HadamardInputLinear.from_linear(lin, weight=w)
    _set(lin.weight, w)
    return lin
