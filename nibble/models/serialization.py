"""save_quantized / load_quantized: safetensors + config.json with a `quantization_config`.

nibble's own format holds every mode and option; AutoAWQ GEMM and GPTQ checkpoints are read and
written too (`format=`, and load_quantized tells them apart by their ``quant_method``; the layouts
are converted losslessly by nibble.models.hf_import).

Writes are atomic (temp file, fsync, rename; `checkpoint_files`, the files every format's save writes), so a crash
never leaves a half-written model that looks whole, and an error or Ctrl-C mid-write leaves no temporary file. Every
tensor's sha256 (of its dtype, shape and data) goes into the safetensors metadata and is checked on load, so a
truncated or edited file is an error, never silently wrong output; so does the digest of the config.json that reads
the weights (every field that changes what they compute), so weights beside another save's config.json are refused;
the AutoAWQ / GPTQ exports carry those checksums and that digest too, which the importer checks (other readers
ignore them). A save owns its directory: the weight files, index, tokenizer files and generation config of an
earlier checkpoint there that it does not write again are removed, since every reader would take them for this
model's.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from nibble.config import (QuantConfig, check_finite, checked_cast, default_dtype, recorded_dtype, resolve_device,
                           resolve_dtype, width_error)
from nibble.formats import EXPORT_FORMATS, SAVE_FORMATS
from nibble.models.checkpoint_files import (CHECKSUM_VERSION, METADATA, CheckpointError, check_checksums,
                                            check_config_digest, checkpoint_dir, imported_checkpoint, load_companions,
                                            model_to_save, tensor_sha256, write_checkpoint)
from nibble.models.convert import mark_quantized, online_hadamard_modules, rebuild_non_persistent_buffers
from nibble.models.gguf import is_gguf
from nibble.models.hf_import import (export_awq, export_gptq, fold_mlp_input_orders, hf_quantized_structure,
                                     input_permuted_modules, load_hf_quantized, meta_model, named_layer)
from nibble.models.hf_quantizer import register as register_hf_quantizer
from nibble.models.loading import (CONFIG, NEVER_DOWNLOADS, WEIGHTS, header_tensor, quantization_settings_files,
                                   read_config)
from nibble.nn.hadamard import HadamardInputLinear
from nibble.nn.quant_linear import PermutedInputQuantLinear, QuantLinear

register_hf_quantizer()  # transformers' from_pretrained reads nibble's format once nibble's loader is imported

# the canonical format's tensors (docs/ARCHITECTURE.md), whatever dtype the model runs in
FORMAT_DTYPES = {"qweight": torch.int32, "scales": torch.float16, "zeros": torch.float16}


def save_quantized(model: nn.Module, directory, tokenizer=None, format: str = "nibble") -> Path:
    """Write ``model`` (converted by quantize_model, or loaded by load_quantized) to ``directory``; the
    tokenizer too if given (a transformers tokenizer, as load_model returns it; a path is refused). ``format``:
    ``"nibble"`` (every mode and option, checksummed), or ``"awq"`` / ``"gptq"`` / ``"gptq_v2"``: an AutoAWQ
    GEMM / GPTQ checkpoint that AutoAWQ, transformers and vLLM read
    (W4A16 models with integer zero points, a 16-bit lm_head and no rotation only: `nibble.models.hf_import.export_awq` /
    `export_gptq` say what they refuse; ``"gptq"`` is v1, or v2 where v1 cannot hold a zero point of 0, said in a
    warning: `nibble.formats.gptq`). A ``directory`` holding a model that is not a quantized checkpoint, the float one
    ``model`` comes from above all, is refused (`nibble.models.checkpoint_files.check_replaceable`)."""
    model = model_to_save(model)
    directory = checkpoint_dir(directory, model, tokenizer)  # before an export converts every layer
    if format == "awq":
        return export_awq(model, directory, tokenizer)
    if format in EXPORT_FORMATS:  # "gptq": v1, or v2 where v1 cannot hold a zero point (said)
        return export_gptq(model, directory, tokenizer, checkpoint_format=None if format == "gptq" else format)
    if format != "nibble":
        raise ValueError(f"format must be one of {SAVE_FORMATS}, got {format!r}")
    qc = getattr(model.config, "quantization_config", None)
    if not qc or qc.get("quant_method") != "nibble":
        raise ValueError("model has no nibble quantization_config: run nibble.quantize_model first")
    directory.mkdir(parents=True, exist_ok=True)
    tensors, seen = {}, {}
    aliases = {}
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), t.shape, t.dtype)
        if t.numel() and key in seen:  # tied weights (e.g. lm_head = embed_tokens) are stored once
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t.detach().contiguous().cpu()
    config = model.config.to_dict()
    # the dtype the float weights have now (a `.to(dtype)` after the model was built left config.dtype behind), as
    # transformers' save_pretrained records it: `load_quantized` loads in it by default
    config.pop("torch_dtype", None)
    config["dtype"] = str(model.get_input_embeddings().weight.dtype).removeprefix("torch.")
    config["quantization_config"] = {**qc, "online_hadamard_modules": online_hadamard_modules(model),
                                     "input_permuted_modules": input_permuted_modules(model)}
    # nibble's key alone: no other reader reads this file, so it needs no "format" (the exports' transformers key)
    metadata = {METADATA: {"checksums": {k: tensor_sha256(v) for k, v in tensors.items()}, "aliases": aliases,
                           "checksum_version": CHECKSUM_VERSION}}
    write_checkpoint(model, directory, tensors, metadata, config, tokenizer)
    return directory


def _read_checked(path: Path, config: dict, data: bool = True) -> tuple[dict, dict]:
    """(the tensors of the nibble weights file ``path``, its aliases: a tied tensor's other names), refused where the
    file is missing, damaged, not nibble's or saved with another config than ``config``. ``data`` False: meta tensors
    of their shapes and dtypes (`header_tensor`), whose names alone are checked (`quantized_structure`)."""
    if not path.exists() and (path.parent / f"{WEIGHTS}.index.json").exists():  # config.json says nibble's
        raise CheckpointError(f"{path.parent} holds shards (model.safetensors.index.json), but a nibble checkpoint is "
                              f"one {WEIGHTS}: merge the shards into one file, or fetch the checkpoint as nibble wrote it")
    if not path.exists():
        raise CheckpointError(f"{path} is missing: not a nibble checkpoint directory")
    if not os.access(path, os.R_OK):  # safetensors says "No such file or directory" of it
        raise PermissionError(f"cannot read {path}: permission denied (the file is there; fix its permissions)")
    try:
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) if data else header_tensor(f, k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is truncated or corrupt ({e}); re-save or re-download it") from e
    if METADATA in metadata:
        ours = json.loads(metadata[METADATA])
    elif "nibble_checksums" in metadata:  # saved before session 56: its keys one by one, no config digest
        ours = {"checksums": json.loads(metadata["nibble_checksums"]),
                "aliases": json.loads(metadata.get("nibble_aliases", "{}"))}
    else:
        raise CheckpointError(f"{path} has no nibble checksums: it was not written by nibble.save_quantized")
    check_checksums(path, tensors, ours, data)
    check_config_digest(path, ours, config)
    return tensors, ours.get("aliases", {})


def load_quantized(directory, device="cpu", dtype: torch.dtype | None = None, tokenizer: bool = True):
    """Rebuild a model written by save_quantized (no float weights are materialised first), or read an
    AutoAWQ GEMM / GPTQ checkpoint as it stands (`nibble.models.hf_import.load_hf_quantized`: its codes,
    scales and zero points, not requantized), as the directory's ``quantization_config`` says.

    ``dtype``: of the activations and the non-quantized weights; by default the dtype the model was saved in, but
    a model saved in float32 (quantized on the CPU) loads in bfloat16 on a GPU (`_saved_dtype`); an AutoAWQ / GPTQ
    checkpoint in float32 on the CPU, and on a GPU in the 16-bit dtype its config.json records, float16 where it
    records none (`nibble.models.hf_import.import_dtype`). A value ``dtype`` cannot hold (a bfloat16 checkpoint's 1e6
    in float16) is refused, naming the tensor, where the cast would have made it Inf.
    Returns ``(model, tokenizer)``; tokenizer is None when none was saved, or with ``tokenizer=False``, which
    reads no tokenizer file.
    """
    directory = Path(directory).expanduser()  # "~/model" as a shell would read it
    # First: "cuda" without a GPU would fail deep in torch, and "gpu" as weights that "do not match".
    device = resolve_device(device)
    dtype = resolve_dtype(dtype)
    raw = _checkpoint_config(directory)
    if imported_checkpoint(directory, raw):
        return load_hf_quantized(directory, device, dtype, tokenizer)
    settings = _nibble_settings(directory, raw)
    tensors, aliases = _read_checked(directory / WEIGHTS, raw)
    model = _build(directory, raw, settings, tensors, aliases, device, dtype or _saved_dtype(raw, device))
    finish_load(model, raw["quantization_config"])
    return model, load_companions(model, directory, tokenizer)


def quantized_structure(directory) -> nn.Module:
    """The model that `load_quantized(directory)` builds on the CPU, on the meta device: its modules, their shapes
    and dtypes, its tied weights and its quantization_config, read from config.json, the quantizer's settings and
    the safetensors headers instead of the weights' data (an AutoAWQ / GPTQ import reads the little its structure
    depends on: `hf_quantized_structure`). What `nibble info` prints, in a moment and in little memory for a
    checkpoint of any size. The checks of the data a load makes (checksums, finite scales) are not made; the
    structure's are (config.json's digest, each layer's shapes, the names of the tensors)."""
    directory = Path(directory).expanduser()
    raw = _checkpoint_config(directory)
    if imported_checkpoint(directory, raw):
        return hf_quantized_structure(directory)
    settings = _nibble_settings(directory, raw)
    tensors, aliases = _read_checked(directory / WEIGHTS, raw, data=False)
    cpu = torch.device("cpu")
    model = _build(directory, raw, settings, tensors, aliases, torch.device("meta"), _saved_dtype(raw, cpu))
    return finish_load(model, raw["quantization_config"])


def checked_structure(directory: Path, dtype: torch.dtype) -> nn.Module:
    """`quantized_structure` in ``dtype``, before `finish_load`, with the checkpoint's data checked as a load checks it
    (checksums, values finite and within ``dtype``'s range) but not placed: the frame whose buffers transformers'
    ``from_pretrained`` fills (`nibble.models.hf_quantizer`)."""
    raw = _checkpoint_config(directory)
    tensors, aliases = _read_checked(directory / WEIGHTS, raw)
    return _build(directory, raw, _nibble_settings(directory, raw), tensors, aliases, torch.device("meta"), dtype)


def _checkpoint_config(directory: Path) -> dict:
    """The config.json of the checkpoint ``directory``, a CheckpointError where there is none to read."""
    if not directory.exists():
        raise FileNotFoundError(f"{str(directory)!r} is not a local checkpoint directory. {NEVER_DOWNLOADS}")
    if not directory.is_dir():
        gguf = (" (a GGUF file, a float model: quantize it first, with `nibble quantize --model FILE --out DIR`, or "
                "load_model and quantize_model)") if is_gguf(directory) else ""
        raise CheckpointError(f"{directory} is a file{gguf}: a checkpoint is the directory of its config.json and "
                              "weights")
    if not (directory / CONFIG).exists():
        raise CheckpointError(f"{directory / CONFIG} is missing: not a nibble, AutoAWQ or GPTQ checkpoint directory")
    try:
        raw = read_config(directory / CONFIG)
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    if raw.get("quantization_config") is None and not quantization_settings_files(directory):
        raise CheckpointError(f"{directory / CONFIG} has no quantization_config: not a quantized model (a float "
                              "model loads with nibble.models.loading.load_model, and nibble.quantize_model or `nibble "
                              "quantize --model DIR --out OUT` quantizes it)")
    return raw


def _nibble_settings(directory: Path, raw: dict) -> tuple[QuantConfig, set, set]:
    """(the QuantConfig, the online-Hadamard modules, the input-permuted modules) of the nibble checkpoint
    ``directory``'s config.json ``raw``, a CheckpointError naming the file where they are not of their types."""
    qc_dict = raw["quantization_config"]
    try:
        qc = QuantConfig.from_dict(qc_dict)
    except ValueError as e:  # its refusal names no file
        raise CheckpointError(f"{directory / CONFIG}: {e}") from e
    for key in ("online_hadamard_modules", "input_permuted_modules"):
        if not isinstance(qc_dict.get(key, []), list):
            raise CheckpointError(f"{directory / CONFIG}: quantization_config.{key} must be a list of module names, "
                                  f"got {qc_dict[key]!r}: the file was edited; save the model again")
    return qc, set(qc_dict.get("online_hadamard_modules", [])), set(qc_dict.get("input_permuted_modules", []))


def _build(directory: Path, raw: dict, settings: tuple, tensors: dict, aliases: dict, device: torch.device,
           dtype: torch.dtype) -> nn.Module:
    """The model of the nibble checkpoint ``directory`` (config.json ``raw``, its `_nibble_settings`) holding
    ``tensors`` (`_read_checked`'s) on ``device`` (meta: `quantized_structure`, and the frame `hf_quantizer` gives
    transformers), its non-quantized weights in ``dtype``; `finish_load` makes it the model a load returns."""
    qc, online_hadamard, permuted = settings
    model = meta_model(raw, dtype)
    for name in {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".qweight")}:
        for part, want in FORMAT_DTYPES.items():  # a checkpoint whose checksums cover its data alone, or a converter's
            held = tensors.get(f"{name}.{part}", torch.empty(0, dtype=want)).dtype  # a missing one: said below
            if held != want:
                raise CheckpointError(f"{directory / WEIGHTS}: {name}.{part} is {held}, where nibble's format holds "
                                      f"{want}: the file was edited or written by another tool; save the model again")
        old = named_layer(model, name, directory)
        check_groups(directory / WEIGHTS, name, tensors, old.in_features, qc.group_size)
        cls = PermutedInputQuantLinear if name in permuted else QuantLinear
        # the architecture's bias, which the checkpoint must hold, and any other it holds: an imported AutoGPTQ model
        # (before 0.5) has one on every linear, and a model given a bias before it was quantized saves it. The
        # checksum table lists it, so only a file edited with its table made anew gets one in (read as it says)
        bias = old.bias is not None or f"{name}.bias" in tensors
        q = cls(old.in_features, old.out_features, bias, qc.group_size, qc.mode, name in online_hadamard, dtype=dtype,
                device="meta")
        model.set_submodule(name, q)
    for name in online_hadamard:  # 16-bit linears that rotate their input (a quantized one was built above)
        old = model.get_submodule(name)
        if not isinstance(old, QuantLinear):
            model.set_submodule(name, HadamardInputLinear(old.in_features, old.out_features, old.bias is not None,
                                                          device="meta", dtype=dtype))
    placed = {k: _place(directory / WEIGHTS, k, v, device, dtype) for k, v in tensors.items()}
    for alias, target in aliases.items():  # one tensor, as saved: placed once, not one copy per name
        placed[alias] = placed[target]
    try:
        missing, unexpected = model.load_state_dict(placed, strict=False, assign=True)
    except RuntimeError as e:  # a tensor of another shape
        raise CheckpointError(f"{directory}: weights do not match the saved architecture ({e})") from e
    # refused, as transformers does not: nibble's format is nibble's alone, so a tensor more or less than the model
    # has is an edit, or another model's weights
    if unexpected:
        raise CheckpointError(f"{directory / WEIGHTS} holds {len(unexpected)} tensor(s) the model of its config.json "
                              f"does not have, e.g. {sorted(unexpected)[:5]}: the file was edited or belongs to "
                              "another model; save the model again")
    if missing:
        raise CheckpointError(f"{directory / WEIGHTS} lacks {len(missing)} of the tensors of the model of its "
                              f"config.json, e.g. {sorted(missing)[:5]}: the file was edited or belongs to another "
                              "model; save the model again")
    if device.type != "meta":  # a structure holds no buffer that is computed, not stored
        rebuild_non_persistent_buffers(model, device)
    if model.config.tie_word_embeddings and "lm_head.weight" not in tensors:  # stored as the embedding's alias, or not
        model.tie_weights()  # one Parameter again, as transformers' from_pretrained leaves it
    return model


def finish_load(model: nn.Module, quantization_config: dict) -> nn.Module:
    """What a load does once the weights of a nibble checkpoint with ``quantization_config`` are in ``model``: the
    act-order folds (saves from before the fold listed permuted down_projs), and the model marked quantized."""
    if fold_mlp_input_orders(model):
        quantization_config["input_permuted_modules"] = input_permuted_modules(model)
    mark_quantized(model, quantization_config)
    return model.eval()


def check_groups(path: Path, name: str, tensors: dict, in_features: int, group_size: int) -> None:
    """Refuse layer ``name``'s scales and zeros unless they hold a row for each group ``quantization_config.group_size``
    makes of its inputs: rows that split them otherwise loaded as another group size than the config says, which a
    re-save or an export then wrote beside these scales (and 0 rows was a division by zero). A missing one is left to
    load_state_dict, which names it."""
    unsplit = width_error(in_features, group_size)
    groups = 1 if group_size == -1 else in_features // group_size
    bad = [f"{name}.{part} has shape {tuple(t.shape)}" for part in ("scales", "zeros")
           if (t := tensors.get(f"{name}.{part}")) is not None and (unsplit or t.shape[:1] != (groups,))]
    if bad:
        made = "does not split them into groups" if unsplit else f"makes {groups} of them"
        raise CheckpointError(f"{path}: {' and '.join(bad)}, a row per group of the layer's {in_features} inputs, but "
                              f"quantization_config.group_size {group_size} {made}: the checkpoint was edited or "
                              "written by another tool; save the model again")


def _saved_dtype(config: dict, device: torch.device) -> torch.dtype:
    """The dtype the model was saved in, its activations' and non-quantized weights' default. A model saved in
    float32, or with none recorded (quantized on the CPU, where nibble loads float32, or read from a GGUF), loads
    as `default_dtype` gives for the device: bfloat16 on a GPU, whose kernels compute in 16 bits anyway, so its
    embeddings, norms and attention do not run in float32 at twice the memory."""
    saved = recorded_dtype(config)
    if saved in (None, torch.float32):
        return default_dtype(device)
    return saved


def _place(path: Path, name: str, t: torch.Tensor, device, dtype: torch.dtype) -> torch.Tensor:
    # INT4 codes, scales and zeros keep their format dtypes; everything else follows the model dtype. A NaN scale
    # loaded without a word and the model answered NaN: every float tensor is checked, as an AutoAWQ / GPTQ import's
    if t.is_floating_point() and not t.is_meta:  # meta: `quantized_structure`, from the headers alone
        check_finite(t, f"{path}: {name}")
    if name.endswith((".qweight", ".scales", ".zeros")) or not t.is_floating_point():
        return t.to(device)
    return checked_cast(t, dtype, f"{path}: {name}").to(device)
