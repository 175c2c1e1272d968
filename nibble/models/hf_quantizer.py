"""nibble's models in transformers' eyes: its ``from_pretrained`` reading nibble's format, and its Trainer seeing them
as quantized.

A checkpoint's config.json says ``"quant_method": "nibble"``; transformers knows no such method, warns, skips the
quantization and leaves every quantized linear randomly initialised. `register` adds the method to transformers'
registry of quantizers, so that ``AutoModelForCausalLM.from_pretrained(directory)``, and what calls it (pipelines, a
user's own loading code), builds the model `nibble.load_quantized` builds, logits equal bit for bit. Importing
`nibble.models.serialization` (``nibble.load_quantized``, ``save_quantized``) registers it;
``nibble.register_hf_quantizer()`` does it alone.

transformers builds the float model on the meta device, then reads the weights by name. Before they are read, the
quantizer checks the checkpoint as load_quantized does (checksums, the config.json digest, shapes, names, finite
values that the requested dtype can hold) and swaps in nibble's layers (QuantLinear, its act-order and
online-Hadamard forms) from the structure load_quantized builds; transformers then fills their buffers. After,
what a load does once the weights are in (`finish_load`). AutoAWQ / GPTQ exports need none of this: transformers
reads them with its own quantizers (and nibble with `load_quantized`).

Every nibble model, however made, carries the quantizer as from_pretrained leaves it (`mark_hf_quantized`), which is
what transformers' Trainer and generate read of a quantized model, and what ``model.dequantize()`` calls to give the
float model back (`nibble.models.convert.dequantize_model`).
"""
from __future__ import annotations

from pathlib import Path

from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

from nibble.config import QUANT_METHOD
from nibble.models.checkpoint_files import config_changes, digested_config
from nibble.models.loading import CONFIG, read_config
from nibble.nn.quant_linear import PermutedInputQuantLinear


class NibbleQuantizationConfig(QuantizationConfigMixin):
    """A nibble checkpoint's ``quantization_config`` as transformers holds it: the dict config.json holds, as it is
    (nibble's own `QuantConfig` reads it, `nibble.models.serialization`)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)
        self.quant_method = QUANT_METHOD


class NibbleHfQuantizer(HfQuantizer):
    """Loads a checkpoint nibble wrote (`nibble.save_quantized`); it quantizes nothing: a float model is quantized
    with `nibble.quantize_model`, and transformers refuses ``pre_quantized=False`` for a method that requires
    calibration."""

    requires_calibration = True

    def _process_model_before_weight_loading(self, model, checkpoint_files, **kwargs):
        from nibble.models import serialization  # which imports this module

        directory = Path(checkpoint_files[0]).parent
        overrides = config_changes(digested_config(read_config(directory / CONFIG)), model.config.to_dict())
        if overrides:  # from_pretrained(directory, num_hidden_layers=1): the saved layers no longer fit the model
            raise ValueError(f"from_pretrained's arguments change the config {directory} was quantized with "
                             f"({overrides}): load it without them")
        structure = serialization.checked_structure(directory, model.dtype)
        for name, layer in structure.named_modules():
            if name and type(layer) is not type(model.get_submodule(name)):  # nibble's layers, on the meta device
                model.set_submodule(name, layer)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        from nibble.models.serialization import finish_load

        for layer in model.modules():  # transformers filled the buffers without the layer's load hook
            if isinstance(layer, PermutedInputQuantLinear):
                layer.recompute_input_order()
        return finish_load(model, model.config.quantization_config.to_dict())

    def dequantize(self, model, dtype=None):
        """``model.dequantize(dtype)``: the float model (`convert.dequantize_model`), in the dtype the model runs in
        (transformers' default is config.json's, which a load in another dtype leaves as saved)."""
        return super().dequantize(model, dtype or model.dtype)

    def _dequantize(self, model, dtype):
        from nibble.models.convert import dequantize_model  # which imports this module

        return dequantize_model(model, dtype)

    def is_serializable(self):
        return False  # `mark_quantized` turns save_pretrained into a refusal naming nibble.save_quantized

    @property
    def is_trainable(self):
        return True  # peft's LoRA on nibble's layers (`nibble.nn.lora.lora_config`): the Trainer takes the adapters

    @property
    def is_compileable(self):
        return True  # the layers are torch.library ops: generate's static-cache decode compiles them


def mark_hf_quantized(model, quantization_config: dict) -> None:
    """Leave on ``model`` what from_pretrained leaves on a model a quantizer loaded, whichever way it became a nibble
    model (`quantize_model`, `load_quantized`): transformers' Trainer then refuses to train it bare (its INT4 weights
    are frozen buffers) and takes peft's LoRA on it."""
    model.hf_quantizer = NibbleHfQuantizer(NibbleQuantizationConfig(**quantization_config))
    model.is_quantized, model.quantization_method = True, QUANT_METHOD


def register() -> None:
    """Add quant_method "nibble" to transformers' quantizers (once; again is a no-op)."""
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantization_config(QUANT_METHOD)(NibbleQuantizationConfig)
        register_quantizer(QUANT_METHOD)(NibbleHfQuantizer)
