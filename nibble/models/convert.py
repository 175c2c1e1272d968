"""Whole-model conversion: replace the linears of a Hugging Face causal LM by QuantLinear."""
from __future__ import annotations

import copy
import dataclasses
import functools
from contextlib import contextmanager

import torch
from torch import nn
from tqdm.auto import tqdm

from nibble import kernels
from nibble.config import QuantConfig, resolve_device, width_error
from nibble.kernels.hadamard import hadamard_transform_reference
from nibble.kernels.reference import dequantize
from nibble.models.architecture import (DECODER_LAYERS, check_architecture, check_calibration_ids, decoder_layers,
                                        decoder_layers_replaced)
from nibble.nn.quant_linear import PermutedInputQuantLinear, QuantLinear, check_cast
from nibble.quantize import calibrated_quantizers
from nibble.quantize.rtn import check_values, naming
from nibble.warn import warn

# the quantization_config key of a model whose quantized lm_head was tied to the embedding in 16 bits (`weight_bytes`)
TIED_HEAD = "lm_head_was_tied"


def _matches(name: str, entry: str) -> bool:
    """A modules_to_not_convert entry names a linear, or a module that holds it, by any whole dotted part of its full
    name: 'lm_head', 'mlp.down_proj', 'model.layers.1', 'layers.1.mlp' (never part of a segment: 'layers.1' is not
    'layers.10'). Suffixes alone let 'model.layers.1' match no linear: a warning, and the layer was quantized."""
    return f".{entry}." in f".{name}."


def _skipped(name: str, config: QuantConfig) -> bool:
    return any(_matches(name, s) for s in config.modules_to_not_convert)


def _candidate_linears(model: nn.Module) -> list[str]:
    """Full names of every linear quantize_model may convert: the decoder layers' and lm_head."""
    names = [f"{DECODER_LAYERS}.{i}.{n}" for i, layer in enumerate(decoder_layers(model))
             for n, m in layer.named_modules() if isinstance(m, nn.Linear)]
    if isinstance(getattr(model, "lm_head", None), nn.Linear):
        names.append("lm_head")
    return names


def linears_to_convert(model: nn.Module, config: QuantConfig) -> list[str]:
    """Full names of the nn.Linear modules ``quantize_model`` replaces: every linear of the decoder
    layers, and ``lm_head`` too once ``config.modules_to_not_convert`` no longer names it (it does by
    default, as in AutoAWQ / GPTQ checkpoints), less whatever ``modules_to_not_convert`` names."""
    return [n for n in _candidate_linears(model) if not _skipped(n, config)]


def untie_lm_head(model: nn.Module) -> None:
    """Drop the tie of lm_head to the embedding from the config, so that transformers never re-ties them,
    and give a tied lm_head.weight a copy of the embedding's: for changes to lm_head alone (rotation folds
    the final norm into it; quantization replaces it, after which it holds no float weight to copy)."""
    if lm_head_tied(model):
        embed = model.model.embed_tokens.weight
        model.lm_head.weight = nn.Parameter(embed.detach().clone(), requires_grad=embed.requires_grad)
    own_config(model)
    model.config.tie_word_embeddings = False
    if hasattr(model, "all_tied_weights_keys"):  # transformers >= 5 keeps the tying map on the model
        model.all_tied_weights_keys = model.get_expanded_tied_weights_keys(all_submodels=True)


def lm_head_tied(model: nn.Module) -> bool:
    """Whether lm_head reads the embedding's table (one tensor, held once): a quantized head has no float weight."""
    weight, embed = getattr(model.lm_head, "weight", None), model.model.embed_tokens.weight
    return weight is not None and (weight is embed or weight.data_ptr() == embed.data_ptr())


def rebuild_non_persistent_buffers(model: nn.Module, device) -> None:
    """Build on ``device`` the buffers of a model made on the meta device that no checkpoint holds (the rotary
    embedding's inv_freq), as its constructor computes them: in float32, whatever dtype the model is in. Any other
    buffer left on the meta device is one the checkpoint lacks: a CheckpointError."""
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            if not type(module).__name__.endswith("RotaryEmbedding"):
                from nibble.models.checkpoint_files import CheckpointError  # which imports this module (loading, gguf)
                raise CheckpointError(f"module {name} has buffers the checkpoint does not hold")
            model.set_submodule(name, type(module)(config=model.config).to(device))


def quantized_linears(model: nn.Module):
    """(name, QuantLinear) for every converted layer."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]


def online_hadamard_modules(model: nn.Module) -> list[str]:
    """Names of the linears that rotate their input online: a rotated model's W4A4 QuantLinears and the 16-bit
    linears that kept theirs (`HadamardInputLinear`, a down_proj left out of the quantization). Each holds a weight
    for a rotated input, meaningless without the rotation."""
    return [n for n, m in model.named_modules() if getattr(m, "input_hadamard", False) is True]


def quantize_model(model: nn.Module, config: QuantConfig | None = None, progress: bool = True,
                   calibration=None, device: str | torch.device | None = None) -> nn.Module:
    """Quantize the linears of the decoder layers in place; embeddings stay 16-bit, and so does lm_head
    unless it is taken out of ``config.modules_to_not_convert`` (then it is quantized with RTN, in the
    config's mode, whatever ``method`` the decoder layers use, and untied from the embedding, which keeps
    its 16-bit table: a tied model grows by the INT4 head, while a decode step reads less).

    For ``rotation="hadamard"`` the model is rotated (calibration-free, same function in 16 bits; each
    decoder layer just before it is quantized) so per-token activation quantization meets no outlier
    channels; it folds the final norm into lm_head, so a head tied to the embedding is untied (the embedding
    keeps its 16-bit table). A model rotated before (`rotation.rotate_model`) is given with rotation 'none' (a
    second rotation is refused): the quantization_config records its rotation and seed either way
    (`rotation_recorded`). ``method="gptq"`` / ``"awq"`` need ``calibration`` (token ids of this model's
    vocabulary, see nibble.quantize.calibration); RTN, which calibrates nothing, refuses it. Every refusal of what was given (a width the group size does not
    divide, a weight holding NaN or Inf or, for RTN, too large for float16 scales, calibration missing, of another
    vocabulary or in windows that cannot calibrate, `check_calibration_ids`) comes before the model is touched.

    The decoder layers are quantized one at a time (`layer_turns`), so at most one of them is in 16 bits
    apart from the model's own weights: the rotated or calibrated copy of a layer is never kept.
    ``device``: where the work runs and where the quantized model ends up (default: where the model
    is). A model held elsewhere, e.g. a 16-bit model in host memory that the GPU could not hold, moves
    there one decoder layer at a time: the device holds the embeddings, lm_head, the layers quantized
    so far and one 16-bit layer, never the whole 16-bit model, and nothing is written back to host
    memory (a model transformers loaded from safetensors stays a mapping of its files there). The results
    are those of quantizing on the device (the arithmetic is the same; the rotation's float64 algebra
    runs there too). The quantization is recorded in a copy of the config that the model then owns (`own_config`),
    so another model built from the same config object stays as it was.
    """
    config = config or QuantConfig()
    check_quantizable(model, config)  # every refusal before the model is touched (moved, rotated, a layer converted)
    names = linears_to_convert(model, config)
    if config.method == "rtn":
        if calibration is not None:  # ignored, it let a user who forgot method="gptq" believe the model calibrated
            raise ValueError("calibration was given for method='rtn', which calibrates nothing: drop it, or quantize "
                             "with QuantConfig(method='gptq') or 'awq' to calibrate on it")
    else:
        if calibration is None:
            raise ValueError(f"method={config.method!r} needs calibration token ids: pass calibration=nibble."
                             "quantize.calibration.calibration_for(config, tokenizer, model) (128 x 512 tokens of the C4 "
                             "excerpt, what `nibble quantize` uses) or your own LongTensor [n, seq_len]")
        check_calibration_ids(model, calibration)
    if device is not None:
        device = resolve_device(device)
    candidates = _candidate_linears(model)  # a typo in the skips is said before any calibration runs
    unmatched = [s for s in config.modules_to_not_convert if not any(_matches(n, s) for n in candidates)]
    if unmatched:
        warn(f"modules_to_not_convert entries {unmatched} match no linear of the model (names such as "
             f"{candidates[0]!r} match by any whole dotted part, e.g. 'mlp.down_proj' or 'layers.1')")
    # the 16-bit model held a tied head once, as the embedding, which keeps its table: `weight_bytes` counts what
    # the quantized head replaced as 0 bytes (the rotation below unties it too, so this is read first; a rotation
    # before quantize_model recorded the tie it removed)
    from nibble.models.rotation import rotation_untied_head
    head_was_tied = "lm_head" in names and (lm_head_tied(model) or rotation_untied_head(model))
    if device is not None:
        move_all_but_layers(model, device)
    rotate_layer = None
    if config.rotation == "hadamard":
        from nibble.models.rotation import rotate_all_but_layers
        rotate_layer = rotate_all_but_layers(model, seed=config.rotation_seed, device=device)
    turn = layer_turns(model, config, names, device, rotate_layer)
    if config.method != "rtn":
        calibrated_quantizers[config.method](model, config, calibration, progress=progress, onload=turn)
    else:
        for i, layer in enumerate(tqdm(decoder_layers(model), desc=f"quantizing {config.mode}", disable=not progress)):
            with turn(i, layer):
                pass
    if "lm_head" in names:  # after the head is replaced: a tied head's float weight is never copied
        _convert(model, "lm_head", config, None, device)
        untie_lm_head(model)
    if device is not None:
        model.to(device)  # the rest of the model, already there unless a layer's turn never came
    tied = {TIED_HEAD: True} if head_was_tied else {}
    mark_quantized(model, {**rotation_recorded(model, config).to_dict(), **tied})
    return model


def check_quantizable(model: nn.Module, config: QuantConfig) -> None:
    """``quantize_model``'s refusals of ``model`` and ``config`` but the calibration's, said before the model is
    touched, so that it stays as it was: another architecture, a quantized model, weights on the meta device, a
    model the rotation cannot take (`rotation.check_rotatable`), skips that leave no linear to quantize, a width the
    group size does not divide, an online Hadamard the mode cannot run, a weight RTN cannot quantize. `nibble report`
    runs them for every config before the first one's work."""
    check_architecture(model)
    check_not_quantized(model)
    check_weights_loaded(model)
    if config.rotation == "hadamard":
        from nibble.models.rotation import check_rotatable
        check_rotatable(model)
    names = linears_to_convert(model, config)
    if not names:  # the model came back marked quantized, 16-bit still, and refused as quantized by a second try
        raise ValueError(f"modules_to_not_convert={list(config.modules_to_not_convert)} leaves none of the model's "
                         f"{len(_candidate_linears(model))} linears to quantize: take out of it the ones to quantize")
    check_widths(model, names, config)
    check_online_hadamards(model, names, config)
    check_weights(model, names, config)


def rotation_recorded(model: nn.Module, config: QuantConfig) -> QuantConfig:
    """``config`` with the rotation ``model`` holds (`rotation.rotation_seed`), as its quantization_config records
    it: a model rotated by `rotate_model`, then quantized with rotation 'none', is a rotated model all the same (its
    checkpoint said rotation 'none', seed 0)."""
    from nibble.models.rotation import rotation_seed
    seed = rotation_seed(model)
    return config if seed is None else dataclasses.replace(config, rotation="hadamard", rotation_seed=seed)


def own_config(model: nn.Module) -> None:
    """Give ``model`` a copy of its config, before nibble writes into it, in every submodule that reads the same
    object: models built from one config object share it, and quantizing one marked the others as quantized (and
    untied their heads in their config alone)."""
    shared, mine = model.config, copy.deepcopy(model.config)
    for module in model.modules():
        if getattr(module, "config", None) is shared:
            module.config = mine


def mark_quantized(model: nn.Module, quantization_config: dict) -> None:
    """Record ``quantization_config`` as the model's, and turn its ``save_pretrained`` into a refusal that names
    `nibble.save_quantized`: transformers wrote the INT4 buffers without the checksums, permutations and online
    Hadamards nibble's loaders need (``from_pretrained`` through `nibble.models.hf_quantizer` too), so
    ``Trainer.save_model`` and ``push_to_hub`` stop here too. Adapters added
    by transformers' ``add_adapter`` still save, alone, as transformers does. A quantized lm_head refuses
    ``resize_token_embeddings`` too, before the embedding is resized. ``num_parameters`` counts the INT4 weights
    (`_num_parameters`), and a cast to a dtype the QuantLinears cannot run in is refused (`_apply_checked`). The model
    is quantized in transformers' eyes too (`hf_quantizer.mark_hf_quantized`), whose ``.half()`` and ``.float()`` of
    a quantized model are refusals: nibble's cast as ``.to(dtype)`` does."""
    from nibble.models.hf_quantizer import mark_hf_quantized  # which imports this module (checkpoint_files, loading)

    own_config(model)
    model.config.quantization_config = quantization_config
    mark_hf_quantized(model, quantization_config)
    model.half, model.float = functools.partial(nn.Module.half, model), functools.partial(nn.Module.float, model)
    refuse_save_pretrained(model, "a nibble-quantized model is saved with nibble.save_quantized(model, directory, "
                           "tokenizer) (format='awq' or 'gptq' for AutoAWQ, transformers and vLLM); save_pretrained "
                           "would write the INT4 buffers without the checksums and settings that nibble's loaders (and "
                           "from_pretrained through them) read")
    if isinstance(model.get_output_embeddings(), QuantLinear):
        model.resize_token_embeddings = _resize_refused  # transformers resized the embedding, then failed on the head
    model.num_parameters = functools.partial(_num_parameters, model)  # a copy's partial holds the copy
    model._apply = functools.partial(_apply_checked, model)


# What `mark_quantized` (and a rotation's `refuse_save_pretrained`) put on a model, over its class's methods
_QUANTIZED_OVERRIDES = ("half", "float", "save_pretrained", "resize_token_embeddings", "num_parameters", "_apply")


@torch.no_grad()
def dequantize_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Replace every quantized linear, and every linear that rotates its input online, by the plain ``nn.Linear`` in
    ``dtype`` that computes what it computes without activation quantization: W from the INT4 codes (q * s + z), an
    online Hadamard folded in (y = (x H^T) W^T = x (W H)^T), an act-order input order undone (y = x[perm] W^T: column
    perm[k] of the new weight is column k). A W4A4 model loses its activation rounding, not its weights' rounding. The
    result is a float transformers model, which ``save_pretrained`` writes and any loader reads: transformers'
    ``model.dequantize()`` runs this (`nibble.models.hf_quantizer`), and drops the quantization_config. A rotated
    model stays rotated: the same function, its residual stream in another basis."""
    from nibble.models.rotation import ROTATION_SEED, UNTIED_HEAD  # which imports this module

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype (torch.bfloat16, ...), got {dtype!r}")
    wrapped = [n for n, m in model.named_modules() if isinstance(getattr(m, "base_layer", None), QuantLinear)]
    if wrapped:  # peft's LoRA layer around a QuantLinear would keep its INT4 frame around a float base
        raise ValueError(f"LoRA adapters wrap {len(wrapped)} quantized linears ({wrapped[0]}, ...): dequantize the "
                         "model before adding adapters, or unload them first (peft's unload())")
    for name, layer in [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear) or
                        getattr(m, "input_hadamard", False) is True]:
        if isinstance(layer, QuantLinear):
            weight = dequantize(layer.qweight, layer.scales, layer.zeros, layer.group_size, torch.float64)
        else:  # HadamardInputLinear: a 16-bit linear of a rotated model
            weight = layer.weight.detach().to(torch.float64)
        if layer.input_hadamard:
            weight = hadamard_transform_reference(weight, inverse=True)
        if isinstance(layer, PermutedInputQuantLinear):
            weight = torch.empty_like(weight).index_copy_(1, layer.input_perm.to(weight.device), weight)
        linear = nn.Linear(layer.in_features, layer.out_features, layer.bias is not None, device="meta")
        linear.weight = nn.Parameter(weight.to(dtype))
        if layer.bias is not None:
            linear.bias = nn.Parameter(layer.bias.detach().to(dtype))
        model.set_submodule(name, linear)
    for attribute in _QUANTIZED_OVERRIDES + (ROTATION_SEED, UNTIED_HEAD):
        model.__dict__.pop(attribute, None)
    if model.dtype != dtype:  # the rest of the model too, which the new linears' inputs come from
        model.to(dtype)
    return model


def _apply_checked(model: nn.Module, fn, recurse: bool = True) -> nn.Module:
    """``Module._apply`` (what ``.to()``, ``.double()``, ``.type()`` run) with a cast the QuantLinears refuse
    (`check_cast`: ``model.to(torch.float64)``) refused before any module is cast: a QuantLinear's own refusal came
    after the embedding, before it in the walk, was cast."""
    check_cast(fn)
    return type(model)._apply(model, fn, recurse)


def _num_parameters(model: nn.Module, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
    """transformers' ``num_parameters`` with each quantized linear's weight counted as its in_features x out_features
    parameters, and its bias: it counts Parameters, and a QuantLinear holds both as buffers, so a W4A16 SmolLM2-135M
    read as its embedding and norms, 28M. Frozen, they are not among the trainable ones."""
    count = type(model).num_parameters(model, only_trainable, exclude_embeddings)
    if only_trainable:
        return count
    return count + sum(m.in_features * m.out_features
                       + (m.bias.numel() if m.bias is not None and not isinstance(m.bias, nn.Parameter) else 0)
                       for _, m in quantized_linears(model))


def _resize_refused(*args, **kwargs):
    raise ValueError("lm_head is quantized (QuantLinear): resize the vocabulary (resize_token_embeddings) of the "
                     "16-bit model, then quantize it")


def refuse_save_pretrained(model: nn.Module, why: str) -> None:
    """Turn ``model.save_pretrained`` into a refusal saying ``why``, for a model whose checkpoint transformers would
    load as another function; adapters added by transformers' ``add_adapter`` still save, alone."""
    model.save_pretrained = functools.partial(_save_pretrained_guarded, model, why)  # a copy's partial holds the copy


def _save_pretrained_guarded(model: nn.Module, why: str, *args, **kwargs):
    if getattr(model, "_hf_peft_config_loaded", False):  # adapters added by transformers' add_adapter: it writes them
        return type(model).save_pretrained(model, *args, **kwargs)  # alone (Trainer's checkpoints of a LoRA run)
    raise ValueError(why)


def check_widths(model: nn.Module, names: list[str], config: QuantConfig) -> None:
    """Refuse a group size (or a width INT4 cannot pack) of any linear in ``names`` before any of them is
    converted: found half-way, it left the model half quantized, and a retry refused as quantized already. The
    error names the group size the CLI picks for the model (`default_group_size`), which divides every width: the
    layer's own choices may not (QuantConfig's default of 128 fails on SmolLM2's 576)."""
    for name in names:
        if error := width_error(model.get_submodule(name).in_features, config.group_size):
            try:
                error += (f"; group_size={default_group_size(model, config)} divides every layer's (what `nibble "
                          "quantize` picks for this model: nibble.models.convert.default_group_size)")
            except ValueError:  # no CUDA-kernel size divides them all: the layer's choices are what there is
                pass
            raise ValueError(f"{name}: {error}")


def check_online_hadamards(model: nn.Module, names: list[str], config: QuantConfig) -> None:
    """Refuse a mode other than w4a4 for a linear of ``names`` that rotates its input online (a rotated model's
    down_proj, `HadamardInputLinear`) before any of them is converted (as `check_widths`): only W4A4's activation
    quantization runs that rotation, and QuantLinear's refusal at the layer's turn left the model half quantized."""
    from nibble.models.rotation import online_hadamard_linears
    rotated = online_hadamard_linears() if config.rotation == "hadamard" else ()  # the rotation quantize_model runs
    rotating = set(online_hadamard_modules(model))  # the rotation the model holds already
    online = [n for n in names if n in rotating or any(_matches(n, linear) for linear in rotated)]
    if online and config.mode != "w4a4":
        # o_proj too after online_o_proj; the user's own entries kept
        kept = list(dict.fromkeys([*config.modules_to_not_convert, "lm_head",
                                   *sorted({n.rpartition(".")[2] for n in online})]))
        raise ValueError(f"{online[0]} rotates its input online in a rotated model (rotate_model, or rotation="
                         "'hadamard'), which only w4a4 runs: "
                         f"quantize the model with mode='w4a4', or keep those layers in 16 bits "
                         f"(modules_to_not_convert={kept})")


def check_weights(model: nn.Module, names: list[str], config: QuantConfig) -> None:
    """Refuse a weight of ``names`` that holds NaN or Inf, or whose RTN scales or zero points float16 cannot hold,
    before any of them is converted (as `check_widths`): found at its layer's turn, it left the model half quantized.
    Each weight is read where it is (a model quantized onto a device from host memory moves nothing for it), one
    min and max each unless a group may overflow (`rtn.check_values`). The scales are checked only for the layers
    RTN quantizes as they are now: GPTQ and AWQ change the weights first, and so does the rotation."""
    by_rtn = set() if config.rotation != "none" else set(names) if config.method == "rtn" else {"lm_head"}
    for name in names:
        weight = model.get_submodule(name).weight
        with naming(name):
            check_values(weight, weight.shape[1] if config.group_size == -1 else config.group_size, config.symmetric,
                         config.zero_point, scales=name in by_rtn)


def check_weights_loaded(model: nn.Module) -> None:
    """Refuse a model whose weights are on the meta device, which hold no values: said before torch's "Tensor.item()
    cannot be called on meta tensors" (quantize_model), before a rotation that had nothing to rotate marked the model
    rotated (rotate_model), before the first token met weights on no real device (Engine). A model accelerate offloads
    (a device_map with "cpu" or "disk" entries) holds its weights there too, as hooks that bring them in at each
    forward: told apart, since it was told to load weights it had loaded."""
    if any(p.is_meta for p in model.parameters()):
        if any(hasattr(m, "_hf_hook") for m in model.modules()):  # accelerate's hooks
            raise ValueError("the model's weights are offloaded (a device_map with 'cpu' or 'disk' entries, or "
                             "accelerate's cpu_offload / disk_offload): they wait on the meta device for hooks to "
                             "bring them in at each forward, and nibble reads and replaces the weights themselves: "
                             "load the model without a device_map, into host memory; quantize_model(model, config, "
                             "device='cuda') then moves it to the GPU one decoder layer at a time")
        raise ValueError("the model's weights are on the meta device (built empty, e.g. under init_empty_weights): "
                         "load its weights first; a saved quantized model loads with nibble.load_quantized")


def check_not_quantized(model: nn.Module, taker: str = "quantize_model") -> None:
    """Refuse a model that is quantized already: quantizing it again would leave its config saying one
    quantization and its layers holding another (or both), which nothing can load back; PE-QAT (``taker``) wraps
    16-bit linears only."""
    done = quantized_linears(model)
    qc = getattr(model.config, "quantization_config", None)
    if done or qc:
        method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
        what = (f"{len(done)} of its linears are QuantLinear ({done[0][0]}, ...)" if done else
                f"its config has a quantization_config (quant_method {method!r})")
        raise ValueError(f"the model is quantized already: {what}; {taker} takes a 16-bit model: load the "
                         "16-bit model again (nibble.models.loading.load_model) and give it that")


def layer_turns(model: nn.Module, config: QuantConfig, names: list[str], device: torch.device | None, rotate_layer):
    """The context manager ``turn(i, layer)`` that ``quantize_model`` walks the decoder layers with, and hands
    the calibrated quantizers as their ``onload``: decoder layer i moved to ``device`` (None: where it is) and
    rotated (``rotate_layer``: `rotation.rotate_all_but_layers`'s, or None), given to the body with a dict for
    what a calibrated quantizer makes of its linears ({full name: Int4Weight}); then its linears in ``names``
    become QuantLinears, from that dict (each result taken out of it: the QuantLinear holds a copy, and the
    quantizer's own dict of every layer's results, filled after the turn, must not keep a second one) or by
    RTN. So one 16-bit layer exists at a time: a model in host memory never has a rotated or calibrated
    16-bit copy written back there, and the device holds the quantized layers and the one at its turn."""
    @contextmanager
    def turn(i: int, layer: nn.Module):
        if device is not None:
            layer.to(device)
        if rotate_layer is not None:
            rotate_layer(layer)
        calibrated = {}
        yield layer, calibrated
        prefix = f"{DECODER_LAYERS}.{i}."
        for name in names:
            if name.startswith(prefix):
                _convert(model, name, config, calibrated.pop(name, None), device)
    return turn


def _convert(model: nn.Module, name: str, config: QuantConfig, weight, device: torch.device | None) -> None:
    """Linear ``name`` replaced by its QuantLinear: of ``weight`` (a calibrated quantizer's Int4Weight), else RTN."""
    module = model.get_submodule(name)
    if weight is not None:
        q = QuantLinear.from_weight(weight, module.bias, config.mode, getattr(module, "input_hadamard", False),
                                    dtype=module.weight.dtype)
    else:
        with naming(name):
            q = QuantLinear.from_linear(module if device is None else module.to(device), config)
    model.set_submodule(name, q)


def move_all_but_layers(model: nn.Module, device: torch.device) -> None:
    """Move everything of ``model`` to ``device`` except its decoder layers (the embeddings, the final norm,
    the rotary tables, lm_head), which stay where they are until each is quantized on its turn."""
    with decoder_layers_replaced(model, nn.ModuleList()):  # out of the tree while model.to walks it
        model.to(device)


def weight_bytes(model: nn.Module) -> dict:
    """Bytes the quantized linears hold (codes + scales + zeros + bias, each in its own dtype: a float32 model keeps
    float32 biases) and what they were in 16 bits (the bias too): a quantized lm_head that was tied to the embedding
    (quantization_config's TIED_HEAD) was 0 bytes there, since the 16-bit model held its table once, as the
    embedding, which keeps it; so "bf16_bytes" - "quantized_bytes" is what these linears save against the 16-bit
    model, less than the other linears saved by the head's quantized bytes (negative where it grew). The baseline
    is 16 bits whatever the model's dtype: a float32 model's biases count 4 bytes against 2, as it holds them, which
    is its dtype's cost, not the quantization's."""
    quant, dense16 = 0, 0
    head_was_tied = (getattr(model.config, "quantization_config", None) or {}).get(TIED_HEAD, False)
    for name, m in quantized_linears(model):
        quant += sum(t.numel() * t.element_size() for t in (m.qweight, m.scales, m.zeros, m.bias) if t is not None)
        if not (head_was_tied and name == "lm_head"):
            dense16 += m.in_features * m.out_features * 2
        if m.bias is not None:
            dense16 += m.bias.numel() * 2
    return {"quantized_bytes": quant, "bf16_bytes": dense16, "ratio": quant / dense16 if dense16 else float("nan")}


@torch.no_grad()
def set_backend(model: nn.Module, backend: str) -> None:
    """Force every QuantLinear onto 'auto' | 'reference' | 'triton' (`nibble.kernels.BACKENDS`). Another name is
    refused here, not at the next forward, which failed far from the call that set it."""
    kernels.check_backend(backend)
    for _, m in quantized_linears(model):
        m.backend = backend


def default_group_size(model: nn.Module, config: QuantConfig | None = None) -> int:
    """The largest of 128 / 64 / 32 that divides the in_features of every linear to convert.

    SmolLM2-135M has hidden 576 = 4.5 * 128, so its default is 64.
    """
    ks = {model.get_submodule(n).in_features for n in linears_to_convert(model, config or QuantConfig())}
    for g in (128, 64, 32):
        if all(k % g == 0 for k in ks):
            return g
    raise ValueError(f"no group size in (128, 64, 32) divides every in_features {sorted(ks)}; use group_size=-1")
