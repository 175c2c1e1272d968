"""Whole-model conversion: replace the linears of a Hugging Face causal LM by QuantLinear."""
from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from nibble.config import QuantConfig
from nibble.nn.quant_linear import QuantLinear

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")


def check_architecture(model: nn.Module) -> None:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unknown model architecture {model_type!r}: nibble converts causal LMs of the "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)} families")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers


def _skipped(name: str, config: QuantConfig) -> bool:
    return any(name == s or name.endswith("." + s) for s in config.modules_to_not_convert)


def quantized_linears(model: nn.Module):
    """(name, QuantLinear) for every converted layer."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]


def quantize_model(model: nn.Module, config: QuantConfig | None = None, progress: bool = True,
                   calibration=None) -> nn.Module:
    """Quantize every nn.Linear of the decoder layers in place (lm_head and embeddings stay 16-bit).

    For ``rotation="hadamard"`` the model is first rotated (calibration-free, same function in
    16 bits) so per-token activation quantization meets no outlier channels. ``method="gptq"`` /
    ``"awq"`` need ``calibration`` (token batches, see nibble.quantize.calibration).
    """
    config = config or QuantConfig()
    check_architecture(model)
    if config.rotation == "hadamard":
        from nibble.models.rotation import rotate_model
        rotate_model(model, seed=config.rotation_seed)
    calibrated = {}
    if config.method != "rtn":
        if calibration is None:
            raise ValueError(f"method={config.method!r} needs calibration data (see nibble.quantize.calibration)")
        from nibble.quantize import calibrated_quantizers
        calibrated = calibrated_quantizers[config.method](model, config, calibration)
    layers = decoder_layers(model)
    for i, layer in enumerate(tqdm(layers, desc=f"quantizing {config.mode}", disable=not progress)):
        for name, module in list(layer.named_modules()):
            full = f"model.layers.{i}.{name}"
            if not isinstance(module, nn.Linear) or _skipped(full, config):
                continue
            if full in calibrated:
                q = QuantLinear.from_weight(calibrated[full], module.bias, config.mode,
                                            getattr(module, "input_hadamard", False), dtype=module.weight.dtype)
            else:
                q = QuantLinear.from_linear(module, config)
            parent_name, _, child = name.rpartition(".")
            setattr(layer.get_submodule(parent_name) if parent_name else layer, child, q)
    model.config.quantization_config = config.to_dict()
    return model


def weight_bytes(model: nn.Module) -> dict:
    """Bytes of the quantized linears (codes + scales + zeros + bias) and what they were in 16 bits."""
    quant, dense16 = 0, 0
    for _, m in quantized_linears(model):
        quant += sum(t.numel() * t.element_size() for t in (m.qweight, m.scales, m.zeros))
        dense16 += m.in_features * m.out_features * 2
        if m.bias is not None:
            quant += m.bias.numel() * 2
            dense16 += m.bias.numel() * 2
    return {"quantized_bytes": quant, "bf16_bytes": dense16, "ratio": quant / dense16 if dense16 else float("nan")}


@torch.no_grad()
def set_backend(model: nn.Module, backend: str) -> None:
    """Force every QuantLinear onto 'auto' | 'reference' | 'triton'."""
    for _, m in quantized_linears(model):
        m.backend = backend


def default_group_size(model: nn.Module, config: QuantConfig | None = None) -> int:
    """The largest of 128 / 64 / 32 that divides the in_features of every linear to convert.

    SmolLM2-135M has hidden 576 = 4.5 * 128, so its default is 64.
    """
    ks = {m.in_features for i, layer in enumerate(decoder_layers(model)) for n, m in layer.named_modules()
          if isinstance(m, nn.Linear) and not (config and _skipped(f"model.layers.{i}.{n}", config))}
    for g in (128, 64, 32):
        if all(k % g == 0 for k in ks):
            return g
    raise ValueError(f"no group size in (128, 64, 32) divides every in_features {sorted(ks)}; use group_size=-1")
