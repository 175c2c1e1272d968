"""Import AutoAWQ / GPTQ checkpoints into nibble, and export nibble W4A16 models to them, losslessly.

``load_hf_quantized(dir)`` reads a local Hugging Face directory (config.json + *.safetensors)
whose ``quantization_config`` (or, without one, the settings file its tool wrote beside it: AutoGPTQ's
quantize_config.json, early AutoAWQ's quant_config.json) is

- AutoAWQ: ``quant_method: awq``, ``version: gemm``, ``bits: 4``, ``zero_point: true``;
- GPTQ (AutoGPTQ, GPTQModel, optimum): ``quant_method: gptq``, ``bits: 4``, symmetric or not,
  ``desc_act`` true or false, ``checkpoint_format`` (or transformers' ``format``) ``gptq`` (v1, the
  default) or ``gptq_v2``, GPTQModel's per-layer ``dynamic`` rules (sym; 4 bits and one group size),

and builds the model with nibble ``QuantLinear`` layers holding exactly the checkpoint's codes,
scales and zero points (no requantization; see nibble.formats.awq / gptq for the layouts). GPTQ
act-order layers whose g_idx is not k // G keep an input permutation (``input_perm``), except
down_proj, whose order moves into gate_proj's and up_proj's output channels
(`fold_mlp_input_orders`): an exported act-order import holds the same model, its MLP tensors in
that order.

``export_awq(model, dir)`` / ``export_gptq(model, dir)`` write a nibble W4A16 model in those
layouts with a matching ``quantization_config``, readable by AutoAWQ / transformers / vLLM.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from nibble.config import (METHODS, QuantConfig, check_finite, checked_cast, default_dtype, recorded_dtype,
                           resolve_device, resolve_dtype)
from nibble.formats import CHECKPOINT_FORMATS
from nibble.formats.awq import awq_dimensions, from_awq, to_awq
from nibble.formats.gptq import act_order_perm, from_gptq, gptq_dimensions, gptq_zero_points, holds_in_v1, to_gptq
from nibble.formats.int4 import is_symmetric
from nibble.formats.zero_points import unpack_along_n, zeros_from_zero_points
from nibble.models.architecture import check_architecture
from nibble.models.checkpoint_files import (CHECKSUM_VERSION, METADATA, QUANT_METHODS, check_checksums,
                                            check_config_digest, checkpoint_dir, load_companions, model_to_save,
                                            tensor_sha256, write_checkpoint)
from nibble.models.convert import (mark_quantized, online_hadamard_modules, quantized_linears,
                                   rebuild_non_persistent_buffers, untie_lm_head)
from nibble.models.loading import (CONFIG, QUANTIZATION_SETTINGS_FILES, WEIGHTS, header_tensor,
                                   quantization_settings_files, read_config, read_json_object)
from nibble.nn.quant_linear import PermutedInputQuantLinear, QuantLinear
from nibble.quantize.rtn import naming
from nibble.warn import warn

SUPPORTED = "AutoAWQ (quant_method='awq', version='gemm', bits=4, zero_point=true) and GPTQ (quant_method='gptq', " \
            f"bits=4, sym or asym, desc_act true/false, checkpoint_format (or format) in {CHECKPOINT_FORMATS})"
QUANTIZED_BY = "quantized_by"  # the key of a nibble export's quantization_config saying how it was made
_REQUIRED_KEYS = ("qweight", "qzeros", "scales")  # every AWQ / GPTQ layer's
_QUANT_KEYS = (*_REQUIRED_KEYS, "g_idx")  # GPTQ's g_idx is optional: without one, groups are k // G


class UnsupportedCheckpointError(ValueError):
    pass


# ---------------------------------------------------------------------------------------------- import

def read_quantization_config(directory) -> dict:
    """The checkpoint's quantization settings, validated: {"method", "group_size", "sym", "desc_act",
    "checkpoint_format", "dynamic", "raw"}: config.json's quantization_config, over those of the settings files
    beside it (`QUANTIZATION_SETTINGS_FILES`). Raises UnsupportedCheckpointError naming what nibble supports."""
    directory = Path(directory)
    raw = read_config(directory / CONFIG)
    qc = dict(raw.get("quantization_config") or {})
    held = quantization_settings_files(directory)
    if not qc and len(held) > 1:  # no quant_method says which tool's settings describe the weights
        raise UnsupportedCheckpointError(
            f"{directory} holds both {held[0]} ({QUANTIZATION_SETTINGS_FILES[held[0]]}'s settings) and {held[1]} "
            f"({QUANTIZATION_SETTINGS_FILES[held[1]]}'s), and its config.json no quantization_config: which of them "
            "describes the weights is unclear; remove the other checkpoint's file")
    for name in held:  # in the tool's own keys (AutoAWQ's w_bit and q_group_size are read as bits, group_size below)
        qc = {"quant_method": QUANTIZATION_SETTINGS_FILES[name], **read_json_object(directory / name), **qc}
    if not qc:
        raise UnsupportedCheckpointError(f"{directory / CONFIG} has no quantization_config (nor is a "
                                         f"{' or '.join(QUANTIZATION_SETTINGS_FILES)} beside it): not a quantized "
                                         f"checkpoint (nibble imports {SUPPORTED}; quantize a float model with nibble "
                                         "instead)")
    method = str(qc.get("quant_method", "")).lower()
    bits = qc.get("bits", qc.get("w_bit"))
    if method not in QUANT_METHODS:
        raise UnsupportedCheckpointError(f"quant_method={qc.get('quant_method')!r} is not supported; nibble imports {SUPPORTED}")
    if bits != 4:
        raise UnsupportedCheckpointError(f"{method} checkpoint with bits={bits!r} is not supported; nibble imports {SUPPORTED}")
    group_size = qc.get("group_size", qc.get("q_group_size", 128))
    if not isinstance(group_size, int) or isinstance(group_size, bool):  # int() read 64.5 as 64, and failed on null
        raise UnsupportedCheckpointError(f"{method} checkpoint with group_size={group_size!r}: it must be an integer "
                                         "(-1 for per channel); the quantization_config is damaged")
    out = {"method": method, "group_size": group_size, "raw": qc, "dynamic": {}}
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise UnsupportedCheckpointError(f"AWQ version={qc.get('version')!r} is not supported (its packing differs "
                                             f"from GEMM's); nibble imports {SUPPORTED}")
        if qc.get("zero_point") is not None and not qc["zero_point"]:  # null: not said, AutoAWQ's default true
            raise UnsupportedCheckpointError(f"AWQ with zero_point=false is not supported; nibble imports {SUPPORTED}")
        out.update(sym=False, desc_act=False, checkpoint_format=None)
    else:
        # transformers' GPTQConfig and GPTQModel name it `format`, AutoGPTQ and optimum `checkpoint_format`
        named = {key: str(qc[key]).lower() for key in ("checkpoint_format", "format") if qc.get(key) is not None}
        if len(set(named.values())) > 1:
            raise UnsupportedCheckpointError(f"the quantization_config says {named}: which zero-point convention its "
                                             "qzeros use is unclear; make the two agree")
        key, fmt = next(iter(named.items()), ("checkpoint_format", "gptq"))
        if fmt not in CHECKPOINT_FORMATS:
            raise UnsupportedCheckpointError(f"GPTQ {key}={fmt!r} is not supported; nibble imports {SUPPORTED}")
        # sym: None where the config does not say (GPTQ's default is symmetric; such files load as their zeros are)
        out.update(sym=None if qc.get("sym") is None else bool(qc["sym"]), desc_act=bool(qc.get("desc_act", False)),
                   checkpoint_format=fmt, dynamic=_checked_dynamic(qc.get("dynamic") or {}))
    return out


def _checked_dynamic(dynamic) -> dict:
    """GPTQModel's per-layer rules, ``{pattern: overrides}``, with patterns that compile (`_layer_info` reads them)."""
    if not isinstance(dynamic, dict) or not all(isinstance(v, dict) for v in dynamic.values()):
        raise UnsupportedCheckpointError(f"the quantization_config's dynamic is {dynamic!r}, not GPTQModel's "
                                         "{pattern: overrides}: the quantization_config is damaged")
    for pattern in dynamic:
        try:
            re.compile(_rule_pattern(pattern))
        except re.error as e:
            raise UnsupportedCheckpointError(f"the quantization_config's dynamic rule '{pattern}' is not a regular "
                                             f"expression ({e}): the quantization_config is damaged") from e
    return dynamic


def _rule_pattern(rule: str) -> str:
    return rule.removeprefix("-:").removeprefix("+:")  # "-:" leaves the layers it matches unquantized


def _layer_info(info: dict, prefix: str) -> dict:
    """``info`` as it holds for the layer ``prefix``: the first of GPTQModel's `dynamic` rules whose pattern re.matches
    the layer's name (as GPTQModel and vLLM read them) sets its sym; other bits than 4, and another group size than
    the config's, are refused by name (a nibble model, and its format, hold one group size)."""
    for rule, overrides in info["dynamic"].items():
        if not re.match(_rule_pattern(rule), prefix):
            continue
        if rule.startswith("-:"):  # a layer left unquantized, that holds a qweight all the same
            return info
        bits = overrides.get("bits", 4)
        if bits != 4:  # else read as a 4-bit layer of bits / 4 times its inputs, refused as a wrong group size
            raise UnsupportedCheckpointError(f"{prefix} has {bits} bits (the quantization_config's dynamic rule "
                                             f"'{rule}'); nibble imports {SUPPORTED}")
        group_size = overrides.get("group_size", info["group_size"])
        if group_size != info["group_size"]:  # else "group_size=32 disagrees with the tensors"
            raise UnsupportedCheckpointError(f"{prefix} has group size {group_size!r} (the quantization_config's "
                                             f"dynamic rule '{rule}'), the other layers {info['group_size']}: a nibble "
                                             "model holds one group size")
        return info if overrides.get("sym") is None else {**info, "sym": bool(overrides["sym"])}
    return info


def _read_safetensors(directory: Path, read=None) -> tuple[dict, dict]:
    """(every tensor of the checkpoint, each file's (safetensors metadata, tensor names)): the files its index names,
    or without one every *.safetensors in ``directory``. ``read`` (a test of a tensor's name; None: every one): the
    tensors whose data is read, the others meta tensors of their shape and dtype (`header_tensor`)."""
    index, weight_map = directory / f"{WEIGHTS}.index.json", {}
    if index.exists():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map (the file of each tensor): re-download the checkpoint")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in directory.glob("*.bin"))  # early AutoAWQ's and AutoGPTQ's default
        convert = (f"; it holds {', '.join(pickles[:2])}{', ...' if pickles[2:] else ''}, PyTorch pickles: convert each "
                   "to a .safetensors file beside it (safetensors.torch.save_file(torch.load(BIN), SAFETENSORS, "
                   "metadata={'format': 'pt'})), which nibble reads") if pickles else ""
        raise FileNotFoundError(f"no *.safetensors in {directory}: nibble imports safetensors checkpoints only{convert}")
    tensors, held_by, metadata = {}, {}, {}
    for name in files:
        try:
            with safe_open(str(directory / name), "pt") as f:
                metadata[name] = (f.metadata() or {}, list(f.keys()))
                for key in f.keys():
                    if key in held_by:  # the file read last won it: another checkpoint's copy beside this one
                        raise ValueError(f"tensor {key!r} is in both {directory / held_by[key]} and {directory / name}"
                                         ": one of them is not this checkpoint's (a backup or an earlier model's "
                                         "file?); move it out of the folder")
                    tensors[key] = f.get_tensor(key) if read is None or read(key) else header_tensor(f, key)
                    held_by[key] = name
        except (SafetensorError, OSError) as e:  # safetensors' own message names no file
            raise ValueError(f"{directory / name} is missing, truncated or corrupt ({e}); re-download the checkpoint "
                             "or re-save it") from e
    astray = [(key, file) for key, file in weight_map.items() if held_by.get(key) != file]
    if astray:  # else a layer missing a tensor failed as "cannot read its awq tensors ('qzeros')"
        key, file = astray[0]
        raise ValueError(f"{index} names {file} for {key!r} ({len(astray)} such tensor(s)), but that file does not hold "
                         "it: the shards and the index are of different saves; re-download the checkpoint")
    return tensors, metadata


def _convert_layer(info: dict, t: dict, prefix: str):
    """(Int4Weight, perm or None, the zero-point convention read: `_symmetric_zeros_format`) of one quantized
    linear from its checkpoint tensors."""
    try:
        scales = _float16_scales(t["scales"])
        if info["method"] == "awq":
            return from_awq(t["qweight"], t["qzeros"], scales, info["group_size"]), None, None
        fmt = _symmetric_zeros_format(info, t["qzeros"])
        return *from_gptq(t["qweight"], t["qzeros"], scales, t.get("g_idx"), info["group_size"], fmt), fmt
    except ValueError as e:
        raise ValueError(f"{prefix}: cannot read its {info['method']} tensors ({e})") from e


def _float16_scales(scales: torch.Tensor) -> torch.Tensor:
    """``scales`` in float16, the layouts' (and nibble's) dtype. A quantized model cast to bfloat16 (Module.to casts
    its float buffers, the scales among them) and saved again writes bfloat16 scales, which vLLM and transformers
    cast to their own dtype as they load them: each in float16's range is a float16 exactly. One that is not is
    refused, as an import never rounds a weight; NaN and Inf pass, for `check_finite` to name."""
    if not scales.is_floating_point() or scales.dtype == torch.float16:
        return scales  # the converters refuse an integer dtype
    half = scales.half()
    inexact = (half.to(scales.dtype) != scales) & torch.isfinite(scales)
    if bool(inexact.any()):
        raise ValueError(f"scales are {scales.dtype}, and {int(inexact.sum())} of them (e.g. "
                         f"{scales[inexact][0].item():.9g}) are no float16 value, the dtype nibble keeps scales in; "
                         "save the checkpoint with float16 scales, or quantize the model again")
    return half


def _layout(t: dict, nibble_zeros: bool, layer: nn.Module) -> tuple[str | None, str]:
    """(the tool whose layout a layer's tensors ``t`` are in, what says so), told by their names and qweight's shape;
    (None, "") where they do not tell. A config.json of another format beside them failed on a wrong K or group size
    ("AWQ qweight has K=32 rows ...")."""
    if "qzeros" not in t and nibble_zeros:
        return "nibble", "zeros, not qzeros"
    if "g_idx" in t:
        return "gptq", "a g_idx"
    k, n = layer.in_features, layer.out_features
    shape = tuple(t["qweight"].shape) if "qweight" in t else None
    if shape == (k, n // 8):
        return "awq", f"a {k}x{n // 8} qweight, packed along the outputs"
    if shape == (k // 8, n):
        return "gptq", f"a {k // 8}x{n} qweight, packed along the inputs"
    return None, ""


def _symmetric_zeros_format(info: dict, qzeros: torch.Tensor) -> str:
    """The convention a GPTQ layer's qzeros are read in: the config's, checked against ``sym``, whose zero point is 8
    (v1 stores 7). A v1-labelled symmetric file that stores 8 holds v2 zeros (GPTQModel v5 wrote such files; vLLM
    reads them as v2): read as v2 (the loader says so); read as labelled, every weight was a step off."""
    fmt = info["checkpoint_format"]
    if not info["sym"]:  # False, or not said
        return fmt
    stored = unpack_along_n(qzeros)
    if bool((stored == (7 if fmt == "gptq" else 8)).all()):
        return fmt
    if fmt == "gptq" and bool((stored == 8).all()):
        return "gptq_v2"
    values = sorted(set(stored.flatten().tolist()))[:8]
    raise ValueError(f"quantization_config says sym=true, whose zero points are all 8 (stored as "
                     f"{7 if fmt == 'gptq' else 8} in checkpoint_format={fmt!r}), but qzeros hold {values}: the "
                     "config does not describe the tensors (an asymmetric checkpoint says sym=false)")


def load_hf_quantized(directory, device="cpu", dtype: torch.dtype | None = None, tokenizer: bool = True):
    """Load a local AutoAWQ-GEMM or GPTQ checkpoint into a model of nibble QuantLinears.

    Returns ``(model, tokenizer)`` (tokenizer None when the directory has none, or with ``tokenizer=False``,
    which reads no tokenizer file). ``dtype`` is the activation / non-quantized-weight dtype: by default
    `import_dtype`'s, float32 on the CPU, on a GPU the checkpoint's own.
    The model's ``config.quantization_config`` becomes the nibble one (method awq/gptq), with the
    original under ``"imported_from"``, so ``save_quantized`` can write it in nibble's format.
    """
    directory = Path(directory).expanduser()
    device = resolve_device(device)  # "cuda" without a GPU is refused by name, not deep in torch
    dtype = resolve_dtype(dtype)
    info, raw = _read_settings(directory)
    dtype = dtype or import_dtype(raw, device)
    model = meta_model(raw, dtype)
    tensors, files = _read_safetensors(directory)
    _check_export_metadata(directory, files, raw, tensors)
    prefixes = _quantized_prefixes(directory, raw, info, tensors)
    group_sizes, relabelled, symmetric = set(), [], True  # the zeros' own word where the config says nothing
    for prefix in prefixes:
        t, bias, old, layer_info = _layer_tensors(directory, info, tensors, model, prefix)
        weight, perm, read_as = _convert_layer(layer_info, t, prefix)
        for what, value in (("scales", weight.scales), ("zeros", weight.zeros), ("bias", bias)):
            if value is not None:
                check_finite(value, f"{directory}: {prefix}.{what}")
        if read_as != info["checkpoint_format"]:
            relabelled.append(prefix)
        _check_layer_shapes(directory, prefix, old, weight.in_features, weight.out_features, bias)
        cls = PermutedInputQuantLinear if perm is not None else QuantLinear
        if bias is not None:
            bias = checked_cast(bias, dtype, f"{directory}: {prefix}.bias").to(device)
        layer = cls.from_weight(weight.to(device), bias, "w4a16", dtype=dtype)
        if perm is not None:
            layer.set_input_perm(perm)
        model.set_submodule(prefix, layer)
        group_sizes.add(-1 if weight.group_size == weight.in_features else weight.group_size)
        symmetric &= is_symmetric(weight.scales, weight.zeros) if layer_info["sym"] is None else layer_info["sym"]

    if relabelled:
        warn(f"this GPTQ checkpoint says sym=true and checkpoint_format='gptq' (zero points stored as 7), but "
             f"{len(relabelled)} of its layers ({relabelled[0]}, ...) store 8, the gptq_v2 convention: read "
             "as gptq_v2")
    for k, v in tensors.items():
        if v.is_floating_point():
            check_finite(v, f"{directory}: {k}")
    _place_unquantized(directory, model, tensors, prefixes, device, dtype)
    rebuild_non_persistent_buffers(model, device)
    _mark_imported(model, info, group_sizes, symmetric)
    return model, load_companions(model, directory, tokenizer)


def hf_quantized_structure(directory) -> nn.Module:
    """The model `load_hf_quantized` builds from ``directory`` on the CPU, on the meta device
    (`nibble.models.serialization.quantized_structure` says what for): each layer's shapes come from the
    safetensors headers, and of the data only what the structure depends on is read, a small fraction of the
    file: a GPTQ layer's g_idx (act order: its inputs permuted, or not) and, where the quantization_config does
    not say sym, its qzeros and scales (symmetric: every zero point 8, or not). An AutoAWQ checkpoint's data is
    not read at all."""
    directory = Path(directory).expanduser()
    info, raw = _read_settings(directory)
    dtype = import_dtype(raw, torch.device("cpu"))  # load_hf_quantized's on the CPU
    model = meta_model(raw, dtype)
    unsaid = info["sym"] is None
    tensors, files = _read_safetensors(
        directory, read=lambda key: key.endswith(".g_idx") or unsaid and key.endswith((".qzeros", ".scales")))
    _check_export_metadata(directory, files, raw)
    prefixes = _quantized_prefixes(directory, raw, info, tensors)
    group_sizes, symmetric = set(), True
    for prefix in prefixes:
        t, bias, old, layer_info = _layer_tensors(directory, info, tensors, model, prefix)
        shapes = (t["qweight"].shape, t["qzeros"].shape, t["scales"].shape, info["group_size"])
        try:  # as `_convert_layer` reads them
            if info["method"] == "awq":
                (K, N, G), perm = awq_dimensions(*shapes), None
            else:
                K, N, G = gptq_dimensions(*shapes)
                perm = act_order_perm(t["g_idx"], K, G) if "g_idx" in t else None
        except ValueError as e:
            raise ValueError(f"{prefix}: cannot read its {info['method']} tensors ({e})") from e
        _check_layer_shapes(directory, prefix, old, K, N, bias)
        layer_symmetric = layer_info["sym"]
        if layer_symmetric is None:  # the zeros' own word, as the load reads them (`from_gptq`)
            scales = _float16_scales(t["scales"])
            zero_points = gptq_zero_points(t["qzeros"], info["checkpoint_format"])
            layer_symmetric = is_symmetric(scales, zeros_from_zero_points(zero_points, scales))
        cls = PermutedInputQuantLinear if perm is not None else QuantLinear
        model.set_submodule(prefix, cls(K, N, bias is not None, G, dtype=dtype, device="meta"))
        group_sizes.add(-1 if G == K else G)
        symmetric &= layer_symmetric
    _place_unquantized(directory, model, tensors, prefixes, torch.device("meta"), dtype)
    _mark_imported(model, info, group_sizes, symmetric)
    return model


def _read_settings(directory: Path) -> tuple[dict, dict]:
    """(`read_quantization_config`, config.json) of the checkpoint in ``directory``."""
    if not (directory / CONFIG).exists():
        raise FileNotFoundError(f"{directory / CONFIG} is missing: not a Hugging Face model directory")
    return read_quantization_config(directory), read_config(directory / CONFIG)


def meta_model(config: dict, dtype: torch.dtype) -> nn.Module:
    """The causal LM that ``config`` (a config.json's fields) describes, on the meta device in ``dtype``: the frame
    a checkpoint's weights are placed into (its quantization_config is left out: the frame holds 16-bit linears,
    which the loaders replace)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "quantization_config"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    check_architecture(model)
    return model


def _check_export_metadata(directory: Path, files: dict, config: dict, tensors: dict | None = None) -> None:
    """Refuse a nibble export's weights whose metadata (``files``: `_read_safetensors`') carries the digest of
    another config.json than ``config``, or, given their ``tensors``, checksums they do not match."""
    for name, (meta, keys) in files.items():
        if METADATA in meta:
            ours = json.loads(meta[METADATA])
            if tensors is not None and "checksums" in ours:
                check_checksums(directory / name, {k: tensors[k] for k in keys}, ours)
            check_config_digest(directory / name, ours, config)


def _quantized_prefixes(directory: Path, config: dict, info: dict, tensors: dict) -> list[str]:
    """The names of the checkpoint's quantized linears (those holding a qweight), else a ValueError."""
    prefixes = sorted(k[: -len(".qweight")] for k in tensors if k.endswith(".qweight"))
    if not prefixes:  # a float model's weights: the file that says otherwise is another checkpoint's, or they are
        said = CONFIG if config.get("quantization_config") else quantization_settings_files(directory)[0]
        raise ValueError(f"{directory / said} says {info['method']}, but no tensor of the checkpoint ends in .qweight: "
                         f"its weights are not quantized; {said} or the weights belong to another checkpoint (float "
                         "weights load with load_model once it is moved away)")
    return prefixes


def _layer_tensors(directory: Path, info: dict, tensors: dict, model: nn.Module, prefix: str):
    """(its quantization tensors, its bias or None, the 16-bit layer it replaces, `_layer_info`) of the quantized
    linear ``prefix``, taken out of ``tensors``; a ValueError where they are not the config's format or one lacks."""
    t = {k: tensors.pop(f"{prefix}.{k}") for k in _QUANT_KEYS if f"{prefix}.{k}" in tensors}
    bias = tensors.pop(f"{prefix}.bias", None)
    old = named_layer(model, prefix, directory)
    layout, held = _layout(t, f"{prefix}.zeros" in tensors, old)
    if layout not in (None, info["method"]):
        raise ValueError(f"{directory / CONFIG} says {info['method']}, but {prefix} holds {layout}'s tensors "
                         f"({held}): the config.json belongs to another checkpoint; restore the one written with "
                         "these weights")
    missing = [k for k in _REQUIRED_KEYS if k not in t]
    if missing:  # by name: a KeyError said "cannot read its awq tensors ('qzeros')"
        raise ValueError(f"{directory}: the checkpoint lacks {prefix}.{missing[0]} ({info['method']} layers store "
                         f"{', '.join(_REQUIRED_KEYS)}): a shard or the save is incomplete; re-download the "
                         "checkpoint")
    return t, bias, old, _layer_info(info, prefix)


def _check_layer_shapes(directory: Path, prefix: str, old: nn.Module, in_features: int, out_features: int,
                        bias: torch.Tensor | None) -> None:
    """Refuse a quantized linear whose weight (``in_features`` x ``out_features``) or bias is not of the shape of
    the layer ``old`` it replaces, or that lacks the bias ``old`` has (it loaded as none: a Qwen2 without its q/k/v
    biases, whose nibble save was then refused as lacking them)."""
    if (old.in_features, old.out_features) != (in_features, out_features):
        raise ValueError(f"{prefix}: checkpoint holds a {out_features}x{in_features} weight but the "
                         f"architecture expects {old.out_features}x{old.in_features}")
    if bias is None and old.bias is not None:
        raise ValueError(f"{directory}: the checkpoint lacks {prefix}.bias, which the architecture config.json "
                         "describes has: a shard or the save is incomplete, or the config.json belongs to another "
                         "model; re-download the checkpoint")
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ValueError(f"{directory}: {prefix}.bias has shape {tuple(bias.shape)}, where the layer's "
                         f"{out_features} outputs need ({out_features},): the checkpoint is damaged")


def _place_unquantized(directory: Path, model: nn.Module, tensors: dict, prefixes: list[str], device: torch.device,
                       dtype: torch.dtype) -> None:
    """Place the checkpoint's other ``tensors`` (its embeddings, norms, 16-bit linears) into ``model``, the floats in
    ``dtype``, refusing any the model lacks or leaves without; and tie lm_head as `_tie_lm_head` says."""
    state = {k: (checked_cast(v, dtype, f"{directory}: {k}") if v.is_floating_point() else v).to(device)
             for k, v in tensors.items()}
    try:
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:  # a tensor of another shape than config.json implies
        raise ValueError(f"{directory}: weights do not match the architecture config.json describes ({e})") from e
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")
               and not any(k.startswith(p + ".") for p in prefixes)]
    if missing or unexpected:
        raise ValueError(f"{directory}: checkpoint does not match the architecture (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")
    if tied:
        _tie_lm_head(model, directory, stored="lm_head.weight" in state)


def _mark_imported(model: nn.Module, info: dict, group_sizes: set, symmetric: bool) -> None:
    """Fold the MLPs' input orders and record the model's nibble quantization_config, the checkpoint's under
    "imported_from" (the import's last steps)."""
    fold_mlp_input_orders(model)
    made = info["raw"].get(QUANTIZED_BY) or {}  # a nibble export says how its weights were made
    made = made if made.get("library") == "nibble" and made.get("method") in METHODS else {}
    method = made.get("method", info["method"])
    # RTN's clip search, where RTN made the weights (an export keeps lm_head in 16 bits): a calibrated method's is None
    nibble_qc = QuantConfig(mode="w4a16", group_size=group_sizes.pop() if len(group_sizes) == 1 else info["group_size"],
                            symmetric=symmetric, zero_point="int",
                            clip_search=bool(made.get("clip_search")) if method == "rtn" else None, method=method)
    mark_quantized(model, {**nibble_qc.to_dict(), "imported_from": info["raw"],
                           "input_permuted_modules": input_permuted_modules(model)})
    model.eval()


def import_dtype(config: dict, device: torch.device) -> torch.dtype:
    """The dtype an AutoAWQ / GPTQ checkpoint of config.json ``config`` loads in where none is asked: on the CPU
    float32 (`default_dtype`: its 16-bit matmuls are slow, and float32 holds every float16 and bfloat16 value the
    checkpoint stores exactly); on a GPU the 16-bit dtype config.json records, which the kernels run (a bfloat16
    model's embeddings and norms cast to float16 may overflow, which the load refuses, naming the tensor), float16
    (AutoAWQ's and GPTQ's own) where it records none or float32."""
    if device.type != "cuda":
        return default_dtype(device)
    recorded = recorded_dtype(config)
    return recorded if recorded in (torch.float16, torch.bfloat16) else torch.float16


def named_layer(model: nn.Module, name: str, directory: Path) -> nn.Module:
    """The model's module ``name``, which the checkpoint's weights name: torch's AttributeError ("ModuleList has no
    attribute '1'") said nothing of a config.json with fewer layers than the weights."""
    try:
        return model.get_submodule(name)
    except AttributeError as e:
        raise ValueError(f"{directory}: the weights hold {name}, which the model config.json describes has not "
                         f"({e}; num_hidden_layers {model.config.num_hidden_layers}): the config.json belongs to "
                         "another model") from e


def _tie_lm_head(model: nn.Module, directory: Path, stored: bool) -> None:
    """Tie lm_head to the embedding, as config.json's tie_word_embeddings says, where the checkpoint agrees: a head
    of its own (``stored``) that differs from the embedding (a fine-tune whose config kept its tied base's setting)
    is kept, as transformers keeps it, and a quantized one (GPTQModel's lm_head=True) has no float weight to share;
    tie_weights() replaced the first by the embedding and hung the embedding on the second."""
    head, embed = model.lm_head, model.get_input_embeddings()
    # a structure read from the headers (`hf_quantized_structure`) has no data to compare: a stored head is kept as
    # the file holds it, apart
    unequal = stored and not isinstance(head, QuantLinear) and (
        head.weight.is_meta or not torch.equal(head.weight, embed.weight))
    if unequal and not head.weight.is_meta:
        warn(f"{directory / CONFIG} says tie_word_embeddings, but the checkpoint's lm_head.weight "
             "differs from the embedding: kept untied, as stored (transformers does the same)")
    if isinstance(head, QuantLinear) or unequal:
        untie_lm_head(model)  # the config then says what the model holds
    else:
        model.tie_weights()


@torch.no_grad()
def fold_mlp_input_orders(model: nn.Module) -> list[str]:
    """Take the gather off every MLP's down_proj whose input is permuted (GPTQ act-order), in place.

    down_proj reads SiLU(gate_proj(x)) * up_proj(x), formed channel by channel, so gate_proj's and
    up_proj's output channels permuted by down_proj's input order hand it its input already in that
    order: down_proj becomes a plain QuantLinear and a decode step launches one gather a layer fewer.
    Exact: every output is the same sum as before, stored in another place (the logits equal bit for
    bit, on the reference path and on the GPU). The other orders cannot fold: q/k/v and gate/up read
    the residual stream, whose order every layer shares, and o_proj the attention's heads, which an
    order may cross; they stay on their layers (`nibble.Engine` writes those inputs in order from its
    norm and decode-attention kernels). Returns the names of the down_projs folded.
    """
    folded = []
    for name, mlp in list(model.named_modules()):  # the loop replaces modules
        down = getattr(mlp, "down_proj", None)
        if not isinstance(down, PermutedInputQuantLinear):
            continue
        perm = down.input_perm
        for proj in (mlp.gate_proj, mlp.up_proj):
            if isinstance(proj, QuantLinear):
                proj.permute_outputs(perm)
            else:  # a 16-bit nn.Linear
                proj.weight = nn.Parameter(proj.weight[perm].contiguous(), requires_grad=proj.weight.requires_grad)
                if proj.bias is not None:
                    proj.bias = nn.Parameter(proj.bias[perm].contiguous(), requires_grad=proj.bias.requires_grad)
        mlp.down_proj = down.without_input_perm()
        folded.append(f"{name}.down_proj")
    return folded


def input_permuted_modules(model: nn.Module) -> list[str]:
    """Names of the model's layers that take their inputs permuted (`PermutedInputQuantLinear`): what a
    quantization_config lists as ``input_permuted_modules``."""
    return [name for name, m in quantized_linears(model) if isinstance(m, PermutedInputQuantLinear)]


# ---------------------------------------------------------------------------------------------- export

def _exportable_linears(model: nn.Module, method: str) -> tuple[list, int]:
    """(the QuantLinears, the one group size, -1 for per channel) of a model an AutoAWQ / GPTQ checkpoint can hold,
    else a ValueError saying what it cannot."""
    linears = quantized_linears(model)
    if not linears:
        raise ValueError("model has no QuantLinear layers: quantize it with nibble.quantize_model first")
    for name, m in linears:
        if name == "lm_head":
            raise ValueError(f"lm_head is quantized: {method} checkpoints keep lm_head in 16 bits; quantize with "
                             "modules_to_not_convert=['lm_head'] (the default) to export")
        if m.mode != "w4a16":
            raise ValueError(f"{name} is a {m.mode} layer: only W4A16 models (16-bit activations) can be exported to "
                             f"{method}")
    # a rotated W4A16 model's down_proj kept in 16 bits (HadamardInputLinear): its weight is for a rotated input, and
    # the checkpoint's plain linear ran it on the unrotated one (logits 0.2 apart, read by nibble's importer too)
    online = online_hadamard_modules(model)
    if online:
        raise ValueError(f"{online[0]} rotates its input online (the model was rotated), which the {method} checkpoint's "
                         "plain linear would not: every reader would run another function; save the model in "
                         "nibble's format (save_quantized's default), or quantize a model that was not rotated")
    _check_float16_range(model, method)
    per_channel = {m.group_size == m.in_features for _, m in linears}
    group_sizes = {m.group_size for _, m in linears}
    if len(group_sizes) == 1:
        return linears, group_sizes.pop()
    if per_channel == {True}:
        return linears, -1
    raise ValueError(f"layers use different group sizes {sorted(group_sizes)}; the {method} quantization_config "
                     "holds one")


def _check_float16_range(model: nn.Module, method: str) -> None:
    """Refuse a value beyond float16's range in a tensor the checkpoint keeps in 16 bits (an embedding, a norm,
    lm_head, a bias: `_export` writes them in float16, as AutoAWQ does): it would be written as Inf, which AutoAWQ
    and vLLM would run and nibble's loader calls a corrupt checkpoint. Inf and NaN the model holds itself pass, as
    its own. A value below float16's range passes too: written as a subnormal or 0, float16's ordinary rounding of
    such a norm weight, bias or embedding value. The tensors where 0 would be wrong, the quantization scales, are
    float16 already: the quantizer stored them so, none below 2^-24, and refused a layer they would hold with 2 bits
    or fewer (`nibble.quantize.rtn._check_not_tiny`)."""
    for name, t in model.state_dict().items():
        if not t.is_floating_point() or t.dtype == torch.float16:
            continue
        beyond = torch.isinf(t.detach().half()) & torch.isfinite(t)
        if bool(beyond.any()):
            raise ValueError(f"{name} holds {int(beyond.sum())} value(s) beyond float16's range (e.g. "
                             f"{t[beyond][0].item():.6g}), and {method} checkpoints keep their 16-bit tensors in "
                             "float16, where it would be Inf: save the model in nibble's format (save_quantized's "
                             f"default), which keeps its {t.dtype}")


def _export(model: nn.Module, directory: Path, exportable: tuple[list, int], quantization_config: dict, convert,
            tokenizer=None) -> Path:
    """Write ``model`` into ``directory`` (its exporter's `checkpoint_dir`) as ``quantization_config`` says, each
    QuantLinear's tensors made by ``convert``; ``exportable``: the model's `_exportable_linears`, which its exporter
    has taken (one pass over every tensor, for their float16 range)."""
    linears, group_size = exportable
    tensors, quant_prefixes = {}, {name for name, _ in linears}
    for name, m in linears:
        with naming(name):
            converted = convert(m)
        for k, v in converted.items():
            tensors[f"{name}.{k}"] = v.contiguous().cpu()
        if m.bias is not None:
            tensors[f"{name}.bias"] = m.bias.detach().half().cpu()
    seen = {}
    for k, v in model.state_dict().items():
        if k.rpartition(".")[0] in quant_prefixes:
            continue
        key = (v.data_ptr(), tuple(v.shape))
        if v.numel() and key in seen:  # tied lm_head = embed_tokens: stored once, as HF does
            continue
        seen[key] = k
        tensors[k] = (v.detach().half() if v.is_floating_point() else v.detach()).contiguous().cpu()
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    not_converted = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]  # e.g. lm_head
    # how the weights were made: the layout's name (quant_method) does not say (an RTN model exported as AWQ read
    # back as AWQ-calibrated); AutoAWQ, transformers and vLLM ignore the extra key
    made = getattr(model.config, "quantization_config", None) or {}
    config["quantization_config"] = {**quantization_config, "bits": 4, "group_size": group_size,
                                     "modules_to_not_convert": not_converted or None,
                                     QUANTIZED_BY: {"library": "nibble", "method": made.get("method"),
                                                    "clip_search": made.get("clip_search")}}
    config["torch_dtype"] = config["dtype"] = "float16"
    directory.mkdir(parents=True, exist_ok=True)  # made once every layer converted: a refused one leaves none
    # "format": transformers 4 refuses a file without it; METADATA: nibble's checksums (the layout has none) and the
    # config's digest, which other readers ignore
    ours = {"checksums": {k: tensor_sha256(v) for k, v in tensors.items()}, "checksum_version": CHECKSUM_VERSION}
    write_checkpoint(model, directory, tensors, {"format": "pt", METADATA: ours}, config, tokenizer)
    return directory


def export_awq(model: nn.Module, directory, tokenizer=None) -> Path:
    """Write a nibble W4A16 model as an AutoAWQ GEMM checkpoint (model.safetensors + config.json with
    ``quantization_config: {quant_method: awq, version: gemm, bits: 4, group_size, zero_point: true}``).

    Non-quantized tensors (embeddings, norms, lm_head, biases) are written in float16, as AutoAWQ
    does. Raises ValueError for float zero points, w4a4 layers, permuted (act-order) layers or a 16-bit
    value beyond float16's range.
    """
    model = model_to_save(model)
    directory = checkpoint_dir(directory, model, tokenizer)  # refused before any layer converts

    def convert(m):
        if hasattr(m, "input_perm"):
            raise ValueError("it has an input permutation (GPTQ act-order), which AWQ cannot express; use export_gptq")
        return to_awq(m.weight_int4())
    return _export(model, directory, _exportable_linears(model, "awq"),
                   {"quant_method": "awq", "version": "gemm", "zero_point": True}, convert, tokenizer)


def export_gptq(model: nn.Module, directory, tokenizer=None, checkpoint_format: str | None = None) -> Path:
    """Write a nibble W4A16 model as a GPTQ checkpoint (qweight/qzeros/scales/g_idx + config.json with
    ``quantization_config: {quant_method: gptq, bits: 4, group_size, sym, desc_act, checkpoint_format}``).

    ``checkpoint_format``: ``"gptq"`` (v1), ``"gptq_v2"``, or None: v1, which every reader takes, unless a zero point
    is 0, which v1 cannot hold (`nibble.formats.gptq`): then v2, said in a warning (a refusal would come after the
    whole quantization run)."""
    if checkpoint_format not in (None, *CHECKPOINT_FORMATS):
        raise ValueError(f"checkpoint_format must be one of {CHECKPOINT_FORMATS} or None, got {checkpoint_format!r}")
    model = model_to_save(model)
    directory = checkpoint_dir(directory, model, tokenizer)  # refused before the warning below could say "written"
    qc = getattr(model.config, "quantization_config", None) or {}
    linears, group_size = _exportable_linears(model, "gptq")  # and this model too
    desc_act = any(hasattr(m, "input_perm") for _, m in linears)
    if checkpoint_format is None:
        held = []
        for name, m in linears:
            with naming(name):
                if not holds_in_v1(m.weight_int4()):
                    held.append(name)
        checkpoint_format = "gptq_v2" if held else "gptq"
        if held:
            warn(f"{len(held)} layers ({held[0]}, ...) have groups with zero point 0 (no negative weight), "
                 "which GPTQ's v1 format cannot hold: written as checkpoint_format 'gptq_v2' (GPTQModel, "
                 "transformers and vLLM read it; AutoGPTQ does not)")

    def convert(m):
        return to_gptq(m.weight_int4(), getattr(m, "input_perm", None), checkpoint_format)
    # both names of the zero-point convention: transformers' GPTQConfig and GPTQModel read `format`, AutoGPTQ and
    # optimum `checkpoint_format`
    return _export(model, directory, (linears, group_size),
                   {"quant_method": "gptq", "sym": bool(qc.get("symmetric", False)), "desc_act": desc_act,
                    "checkpoint_format": checkpoint_format, "format": checkpoint_format}, convert, tokenizer)
