"""What nibble takes of a Hugging Face causal LM, below `convert` and the calibrated quantizers that both need it: its
family (`check_architecture`), where it holds its decoder layers (`decoder_layers`), and the calibration token ids it
can be calibrated on (`check_calibration`)."""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from nibble.config import check_token_ids
from nibble.warn import warn

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")


def check_architecture(model: nn.Module) -> None:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unknown model architecture {model_type!r}: nibble converts causal LMs of the "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)} families")
    if not (isinstance(getattr(model, "lm_head", None), nn.Module) and hasattr(getattr(model, "model", None), "layers")):
        raise ValueError(f"nibble converts causal LMs (a decoder under .model and its .lm_head, as *ForCausalLM); got "
                         f"{type(model).__name__}: load the model with transformers' AutoModelForCausalLM")


DECODER_LAYERS = "model.layers"  # where a causal LM holds its decoder layers (check_architecture)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.get_submodule(DECODER_LAYERS)


@contextmanager
def decoder_layers_replaced(model: nn.Module, stand_in: nn.ModuleList):
    """``model`` with ``stand_in`` where `decoder_layers` finds its layers, for the body; its own layers are put
    back after, whatever the body raised."""
    layers = decoder_layers(model)
    model.set_submodule(DECODER_LAYERS, stand_in)
    try:
        yield
    finally:
        model.set_submodule(DECODER_LAYERS, layers)


def check_calibration_window(seq_len: int, context: int | None, name: str = "seq_len") -> None:
    """Refuse calibration windows of ``seq_len`` tokens (option ``name``) that cannot calibrate a model of
    ``context`` tokens (config.max_position_embeddings; None: unknown): `check_calibration_ids`, and the CLI's
    --calib-seq-len before the model loads."""
    if seq_len < 2:  # as calibration_batches refuses it
        raise ValueError(f"calibration windows of {name}={seq_len} show the model position 0 alone, where attention "
                         "has nothing but the token itself to read, never a token in context as it will run on: give "
                         "windows of >= 2 tokens (calibration_for makes 128 x 512)")
    if context is not None and seq_len > context:  # as run_qat refuses its windows
        raise ValueError(f"calibration windows of {name}={seq_len} exceed the model's context ({context} = "
                         "config.max_position_embeddings), and would calibrate it on positions it never learned: cut "
                         "them to at most that")


def check_calibration_ids(model: nn.Module, calibration) -> None:
    """Calibration must be token ids of this model's vocabulary: ids made by another model's tokenizer failed
    deep in the embedding (an IndexError on the CPU, a device-side assert on a GPU). Windows of one token, or longer
    than the model's context, cannot calibrate it and are refused (`check_calibration` warns of too few tokens
    too). Each was taken without a word, and the model came back "calibrated"."""
    # bool is refused too: an attention mask given by mistake calibrated on tokens 0 and 1
    if not (isinstance(calibration, torch.Tensor) and calibration.dim() == 2 and not calibration.is_floating_point()
            and not calibration.is_complex() and calibration.dtype != torch.bool and calibration.numel()):
        raise ValueError("calibration must be token ids, an integer tensor [n_samples, seq_len]; got "
                         f"{type(calibration).__name__} {getattr(calibration, 'dtype', '')} "
                         f"{tuple(getattr(calibration, 'shape', ()))}")
    check_token_ids(model, calibration, "calibration", "make them with this model's tokenizer "
                    "(nibble.quantize.calibration.calibration_for(config, tokenizer, model))")
    from nibble.eval.perplexity import context_length
    check_calibration_window(calibration.shape[1], context_length(model))


def check_calibration(model: nn.Module, calibration) -> None:
    """What GPTQ and AWQ check of their calibration as they start (`gptq_quantize_model`, `awq_quantize_model`),
    called by `quantize_model` (which refuses by `check_calibration_ids` before it touches the model) or directly:
    `check_calibration_ids`' refusals, and a warning where there are fewer tokens than a layer has inputs."""
    check_calibration_ids(model, calibration)
    widest = max(m.in_features for m in decoder_layers(model).modules() if isinstance(m, nn.Linear))
    if calibration.numel() < widest:
        warn(f"calibration of {calibration.numel()} tokens is fewer than the {widest} inputs of the model's widest "
             "layer: the input statistics GPTQ and AWQ calibrate on (X^T X) are singular there, and say nothing of the "
             "directions those tokens do not span (GPTQ's damping alone fills them in); give more tokens "
             "(calibration_for makes 128 x 512)")
