"""LoRA adapters (peft) on nibble's quantized layers: QLoRA-style fine-tuning of a nibble model.

peft wraps the layer types it knows and refuses the others by name ("Target module QuantLinear(...) is not
supported"), so a `QuantLinear` is taught to it per config, as peft's custom-module API takes it:

    config = nibble.nn.lora.lora_config(r=16, target_modules=["q_proj", "v_proj"])   # a peft LoraConfig
    model = peft.get_peft_model(quantized_model, config)        # train; model.save_pretrained(dir): the adapter
    model = nibble.nn.lora.load_adapter(quantized_model, dir)   # back onto the quantized model (peft's
                                                                # PeftModel.from_pretrained, taught QuantLinear)
    nibble.nn.lora.load_adapter(model, dir2, "other")           # one more onto the PeftModel

y = QuantLinear(x) + s B A x: the INT4 layer runs its own kernel as in inference, the adapter is a 16-bit (float32
by default) branch beside it, as peft's GPTQ and bitsandbytes layers do. The frozen INT4 weight passes the gradient
to x (`QuantLinear`'s dequantized-weight backward), so adapters of every layer, not only the last, learn. An adapter
cannot be merged into INT4 codes without quantizing again: merging is refused (a W4A4 model fine-tuned to be
deployed is PE-QAT's job, `nibble.qat`, whose adapters are merged before the fake quantization).
"""
from __future__ import annotations

import torch
from torch import nn

from nibble.config import optional_dependency

with optional_dependency("peft", "qat", "LoRA on nibble layers (nibble.nn.lora)"):
    from peft import LoraConfig, PeftModel
    from peft.tuners.lora.layer import Linear as PeftLoraLinear
    from peft.tuners.lora.layer import LoraLayer

from nibble.nn.quant_linear import QuantLinear


MERGE_REFUSED = ("a LoRA adapter cannot be merged into a nibble layer's INT4 weights without quantizing them again: "
                 "merge it into the 16-bit model and quantize that (nibble.quantize_model), or keep it as a branch "
                 "(unload the adapter with peft's unload() to drop it)")


class QuantLoraLinear(nn.Module, LoraLayer):
    """peft's LoRA layer around a `QuantLinear`: the quantized product plus the adapters' ``s B A x``."""

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: LoraConfig, r: int = 0,
                 lora_alpha: int = 1, **kwargs):
        super().__init__()
        LoraLayer.__init__(self, base_layer)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config)

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config: LoraConfig, **kwargs) -> None:
        """Every adapter this layer takes, the first and those peft's ``add_adapter`` adds later, is checked here."""
        if config.use_dora:
            raise ValueError("DoRA rescales the weight's columns, which a QuantLinear's INT4 codes cannot follow: "
                             "use plain LoRA (use_dora=False) on nibble layers")
        if config.init_lora_weights not in (True, False, "gaussian"):  # pissa, olora, ... factor the 16-bit weight
            raise ValueError(f"init_lora_weights={config.init_lora_weights!r} starts from the layer's 16-bit weight, "
                             "which a nibble layer holds only as INT4 codes: use True (the default) or 'gaussian'")
        config._nibble_targets_int4 = True  # read by the adapter's 16-bit layers (`Lora16BitLinear.merge`)
        super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        return module.in_features, module.out_features  # peft's guess warns of an unknown layer type

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        # an adapter this layer does not hold merges elsewhere (on 16-bit layers): nothing to refuse here, as peft's
        # own layers skip it; refusing it too left the 16-bit layers peft had merged before this one merged
        if any(name in self.lora_A for name in (self.active_adapters if adapter_names is None else adapter_names)):
            raise ValueError(MERGE_REFUSED)

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """``s B A`` [out, in]: what the adapter adds to the weight (peft's SVD adapter combination reads it)."""
        return (self.lora_B[adapter].weight @ self.lora_A[adapter].weight) * self.scaling[adapter]

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        self._check_forward_args(x, *args, **kwargs)
        adapter_names = kwargs.pop("adapter_names", None)
        if adapter_names is not None and not self.disable_adapters:  # a batch whose rows name their adapters
            return self._mixed_batch_forward(x, adapter_names=adapter_names)
        result = self.base_layer(x)
        if self.disable_adapters:
            return result
        for name in self.active_adapters:
            if name not in self.lora_A:
                continue
            a, b = self.lora_A[name], self.lora_B[name]
            xa = self._cast_input_dtype(x, a.weight.dtype)
            result = result + (b(a(self.lora_dropout[name](xa))) * self.scaling[name]).to(result.dtype)
        return result

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


class Lora16BitLinear(PeftLoraLinear):
    """peft's own LoRA layer on a 16-bit ``nn.Linear`` (lm_head, ``modules_to_not_convert``) of a nibble model.

    peft's ``merge_and_unload`` merges and unwraps module by module: the 16-bit layers it met before the first
    nibble layer refused were already merged, and the refused call left a changed model (``disable_adapter`` no
    longer gave the base model, a save lost their adapters). This layer refuses the merge of an adapter that also
    sits on nibble layers first, so a refused merge changes nothing; adapters on 16-bit layers alone still merge.
    """

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config: LoraConfig, **kwargs) -> None:
        self.adapter_configs = {**getattr(self, "adapter_configs", {}), adapter_name: config}
        super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        for name in self.active_adapters if adapter_names is None else adapter_names:
            if getattr(self.adapter_configs.get(name), "_nibble_targets_int4", False):
                raise ValueError(f"adapter {name!r} also sits on nibble layers (its LoraConfig was given to a "
                                 f"QuantLinear; a config serves one model: make another for a model without nibble "
                                 f"layers): {MERGE_REFUSED}")
        super().merge(safe_merge=safe_merge, adapter_names=adapter_names)


def lora_config(**kwargs) -> LoraConfig:
    """A peft ``LoraConfig(**kwargs)`` whose targets may be nibble `QuantLinear` layers (`QuantLoraLinear`), for
    ``peft.get_peft_model``; 16-bit layers (lm_head, ``modules_to_not_convert``) get peft's own LoRA
    (`Lora16BitLinear`, which refuses to merge an adapter that also sits on nibble layers)."""
    if kwargs.get("target_modules") == "all-linear":  # peft expands it to the nn.Linear layers alone
        raise ValueError("target_modules='all-linear' finds torch's nn.Linear layers only, not nibble's: name the "
                         "projections, e.g. ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', "
                         "'down_proj']")
    if kwargs.get("bias", "none") != "none":  # peft marks nn.Parameter biases trainable; a QuantLinear's is a buffer
        raise ValueError(f"bias={kwargs['bias']!r} trains the model's bias Parameters, and a nibble layer's bias is a "
                         "frozen buffer, as its INT4 weight is: it would train none of theirs, without a word; pass "
                         "bias='none' (the default)")
    return _taught_quant_layers(LoraConfig(**kwargs))


def load_adapter(model: nn.Module, directory, adapter_name: str = "default", is_trainable: bool = False,
                 **kwargs) -> PeftModel:
    """``PeftModel.from_pretrained(model, directory)`` for a nibble model, or for a PeftModel (one more adapter, as
    peft's ``model.load_adapter(directory, adapter_name)``; returns the model): an adapter's saved config does not
    hold the registration of `QuantLoraLinear` (peft said "QuantLinear is not supported")."""
    config = _taught_quant_layers(LoraConfig.from_pretrained(directory))
    if not isinstance(model, PeftModel):
        return PeftModel.from_pretrained(model, directory, adapter_name=adapter_name, is_trainable=is_trainable,
                                        config=config, **kwargs)
    if adapter_name in model.peft_config:
        raise ValueError(f"this PeftModel holds an adapter named {adapter_name!r} already: pass another adapter_name")
    # what peft's load_adapter does for a config it reads itself, which it skips for one the model already holds
    model._check_new_adapter_config(config, is_trainable=is_trainable)
    config.inference_mode = not is_trainable
    model.add_adapter(adapter_name, config)  # leaves the new adapter frozen
    if is_trainable:
        model.set_requires_grad(adapter_name)
    model.load_adapter(directory, adapter_name, is_trainable=is_trainable, **kwargs)
    return model


def _taught_quant_layers(config: LoraConfig) -> LoraConfig:
    # peft's custom-module API, one config at a time
    config._register_custom_module({QuantLinear: QuantLoraLinear, nn.Linear: Lora16BitLinear})
    return config
