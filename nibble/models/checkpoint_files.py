"""A checkpoint's files, whatever its format (nibble's, AutoAWQ's, GPTQ's): what `serialization` (nibble's format,
and the loader of all three) and `hf_import` (the AutoAWQ / GPTQ layouts) both write and check, below both of them.

- the safetensors metadata nibble adds (`METADATA`): each tensor's checksum and the digest of the config.json that
  reads the weights (`config_digest`), and their checks;
- the writes: `atomic_write`, `write_checkpoint` (every format's files, config.json last) and the companions beside
  the weights (tokenizer, generation config);
- the rules of the folder a save writes: `checkpoint_dir`, which refuses one holding a model that is not a quantized
  checkpoint (`check_replaceable`), and `model_to_save`.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from nibble.models.architecture import check_architecture
from nibble.models.loading import (ADDITIONAL_CHAT_TEMPLATES, CONFIG, GENERATION_CONFIG, QUANTIZATION_SETTINGS_FILES,
                                   TOKENIZER_FILES, WEIGHTS, holds_tokenizer, quantization_settings_files,
                                   read_generation_config, read_json_object, read_tokenizer)
from nibble.warn import warn

METADATA = "nibble"  # the safetensors metadata key: checksums, tied aliases, the config's digest
CHECKSUM_VERSION = 2  # 2: the checksums cover each tensor's dtype and shape too (1, or none said: its data alone)
QUANT_METHODS = ("awq", "gptq")  # the quantization_config quant_method values hf_import reads and writes
# config.json fields the config digest leaves out: what the weights compute does not depend on them (provenance, the
# load's default dtype, generation's special tokens, outputs and heads a causal LM does not use, initialisation,
# training-time dropout, the attention backend), so editing them is no reason to refuse the weights
NOT_DIGESTED = ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache", "bos_token_id",
                "eos_token_id", "pad_token_id", "architectures", "auto_map", "custom_pipelines", "id2label",
                "label2id", "problem_type", "finetuning_task", "task_specific_params", "tokenizer_class", "prefix",
                "output_attentions", "output_hidden_states", "return_dict", "torchscript", "chunk_size_feed_forward",
                "is_encoder_decoder", "is_decoder", "initializer_range", "attention_dropout", "attn_implementation",
                "_attn_implementation_autoset")


class CheckpointError(ValueError):
    """A nibble checkpoint that is missing, truncated, edited or not nibble's, or any checkpoint (a GGUF, an AutoAWQ /
    GPTQ one too) that lacks a buffer its model needs (`rebuild_non_persistent_buffers`). A ValueError like every other
    "this file is bad" error nibble raises (an AutoAWQ / GPTQ checkpoint, a GGUF, a float model's weights), so one
    ``except ValueError`` catches them all."""


def tensor_sha256(t: torch.Tensor, typed: bool = True) -> str:
    """The checksum of a tensor's data and, ``typed`` (checkpoints of CHECKSUM_VERSION 2), of its dtype and shape:
    over the data alone, one edited byte of the header ("F16" to "I16") loaded the same bytes as another model."""
    h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode() if typed else b"")
    h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _process_umask() -> int:
    umask = os.umask(0)  # the only way to read it; at import, before a save's threads could create files
    os.umask(umask)
    return umask


_UMASK = _process_umask()


def atomic_write(path: Path, write) -> None:
    """``write(tmp)`` into a temporary beside ``path``, fsynced, then renamed over it: whatever stops it (an error, a
    full disk, Ctrl-C) leaves ``path`` as it was and no temporary."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        # as open() would create it: safetensors creates its file 0600, which other users (a server's) cannot read;
        # best effort, since some filesystems (FUSE, CIFS) refuse a chmod of a file they wrote well
        with contextlib.suppress(OSError):
            os.chmod(tmp, 0o666 & ~_UMASK)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    except BaseException as e:  # Ctrl-C too: the half-written temporary goes with it (a 7B model's is gigabytes)
        tmp.unlink(missing_ok=True)
        if isinstance(e, (SafetensorError, OSError)):  # safetensors' "I/O error: File too large" names no file
            raise OSError(f"cannot write {path} ({e}; a full disk?): what the folder held is unchanged") from e
        raise
    os.replace(tmp, path)


def write_checkpoint(model: nn.Module, directory: Path, tensors: dict, metadata: dict, config: dict,
                     tokenizer=None) -> None:
    """Write a checkpoint's files into ``directory``: the weights, with the digest of ``config`` (and the fields it
    covers) added to ``metadata[METADATA]``, then the companions, then config.json; and remove the other weight files
    and index an earlier checkpoint left there, which the importer, transformers and vLLM would read as this model's
    (an index wins over model.safetensors)."""
    text = json.dumps(config, indent=2, default=str)
    # the digest decides; the fields it covers are kept too, so that a refusal names the ones that changed
    fields = digested_config(json.loads(text))
    metadata = {**metadata, METADATA: json.dumps({**metadata[METADATA], "config": _digest(fields),
                                                   "config_fields": fields}, default=str)}
    # each file replaced atomically, config.json last: the digest of the config that reads the weights goes with
    # them, so a save interrupted before config.json (new weights, and maybe the new tokenizer, beside the old
    # config.json) is refused on load, not run as another model or with another model's tokenizer
    atomic_write(directory / WEIGHTS, lambda p: _save_safetensors(tensors, p, metadata))
    # (an earlier checkpoint's quantize_config.json or quant_config.json too: AutoGPTQ before 0.5 and AutoAWQ read
    # the settings there first)
    stale = [p for p in [*directory.glob("*.safetensors"), directory / f"{WEIGHTS}.index.json",
                         *(directory / name for name in QUANTIZATION_SETTINGS_FILES)]
             if p.name != WEIGHTS and p.exists()]
    if stale:  # said, since a file the user kept there (a backup of the weights) goes too
        warn(f"nibble: removed {', '.join(sorted(p.name for p in stale))} from {directory}: an earlier "
             "checkpoint's weights, which every reader would take for this model's")
    for p in stale:
        p.unlink(missing_ok=True)
    save_companions(model, directory, tokenizer)
    atomic_write(directory / CONFIG, lambda p: p.write_text(text))


def _save_safetensors(tensors: dict, path: Path, metadata: dict) -> None:
    """save_file, its metadata then put in key order: safetensors writes it from a hash map, in another order each
    run, and the AutoAWQ / GPTQ exports need two keys (transformers 4 refuses a file without "format")."""
    save_file(tensors, str(path), metadata=metadata)
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        # the same entries in another order, as compact as safetensors writes them: the same length (were it longer,
        # it would overwrite the tensors; the file is left as written then, valid, its metadata in any order)
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) <= size:
            f.seek(8)
            f.write(text.ljust(size))


def save_companions(model: nn.Module, directory: Path, tokenizer=None) -> None:
    """What a checkpoint holds beside its weights and config.json: the generation config (an Instruct model's
    end-of-turn tokens and sampling defaults live there only: Llama-3-Instruct's config.json names
    <|end_of_text|>, its generation_config.json <|eot_id|> too) and the tokenizer, as ``save_pretrained`` writes
    them. Those files of an earlier checkpoint in ``directory`` that this save does not write are removed: loaded
    with this model they were another model's tokenizer, or its chat template on this tokenizer."""
    # a tokenizer of one template reads any left in that folder as its own: the folder is this save's to write
    templates = directory / ADDITIONAL_CHAT_TEMPLATES
    if templates.is_symlink():
        templates.unlink()
    elif templates.is_dir():
        shutil.rmtree(templates)
    written = set() if tokenizer is None else {Path(p).name for p in tokenizer.save_pretrained(directory)}
    for name in TOKENIZER_FILES:
        if name not in written:
            (directory / name).unlink(missing_ok=True)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is None:
        (directory / GENERATION_CONFIG).unlink(missing_ok=True)
    else:
        # as the model holds it: GenerationConfig.save_pretrained refuses flags it calls unused (a temperature
        # without do_sample, as Hub models ship them and transformers loads with a warning), which failed the
        # command after all its work
        atomic_write(directory / GENERATION_CONFIG, lambda p: generation_config.to_json_file(p))


def load_companions(model: nn.Module, directory: Path, tokenizer: bool = True):
    """The tokenizer saved beside a checkpoint (None without one, or when not ``tokenizer``: its files are not read
    then), and its generation config into ``model``: what ``from_pretrained`` reads besides the weights
    (`save_companions`)."""
    generation_config = read_generation_config(directory)
    if generation_config is not None:  # else the one the model was built with, of its config.json
        model.generation_config = generation_config
    if not (tokenizer and holds_tokenizer(directory)):
        return None
    try:
        return read_tokenizer(directory)
    except ValueError as e:  # a CheckpointError, as every other refusal of a checkpoint's files is
        raise CheckpointError(str(e)) from e


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def digested_config(config: dict) -> dict:
    """The fields of config.json (as read from the file) that bind the weights saved with it: those whose value is
    not their config class's default (as transformers writes a config: a file it re-saved, the defaults dropped, is
    the same config), but those that do not change what the weights compute (`NOT_DIGESTED`)."""
    from transformers import AutoConfig
    fields = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "quantization_config"}).to_diff_dict()
    fields["quantization_config"] = config.get("quantization_config")
    return {k: v for k, v in fields.items() if k not in NOT_DIGESTED}


def config_digest(config: dict) -> str:
    """The digest of config.json's `digested_config` that the weights saved with it carry."""
    return _digest(digested_config(config))


def _flat(fields: dict, prefix: str = "") -> dict:
    """``fields`` with nested dicts spread into dotted keys (quantization_config.group_size), their values as JSON."""
    flat = {}
    for k, v in fields.items():
        if isinstance(v, dict) and v:
            flat.update(_flat(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = json.dumps(v, sort_keys=True, default=str)
    return flat


def config_changes(saved: dict, config: dict, most: int = 5) -> str:
    """The fields of ``config`` (a config.json) that differ from ``saved`` (the `digested_config` the weights were
    saved with), as "rope_theta 10000.0 when saved, 500000.0 now", at most ``most`` of them."""
    before, now = (_flat(json.loads(json.dumps(fields, default=str))) for fields in (saved, digested_config(config)))
    changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
    def shown(value):  # a list of 32 layers' names would drown the rest
        return value if len(value) <= 60 else value[:57] + "..."
    said = [f"{k} {shown(before.get(k, 'absent'))} when saved, {shown(now.get(k, 'absent'))} now"
            for k in changed[:most]]
    return "; ".join(said) + (f" (and {len(changed) - most} more)" if len(changed) > most else "")


def check_config_digest(path: Path, saved_with: dict, config: dict) -> None:
    """Refuse the weights file ``path`` when the digest it carries (``saved_with``: its metadata's) is not that of
    ``config``, the config.json beside it, naming the fields that differ where the file holds the saved ones (saves
    from session 72 on). Checkpoints of sessions 56-57 carry the quantization_config's digest alone."""
    if "config" in saved_with:
        same = saved_with["config"] == config_digest(config)
    elif "quantization_config" in saved_with:
        same = saved_with["quantization_config"] == _digest(config.get("quantization_config"))
    else:  # written before the digest, or by another tool
        return
    if not same:
        fields = saved_with.get("config_fields")
        changes = config_changes(fields, config) if isinstance(fields, dict) else ""
        changes = f" ({changes})" if changes else ""
        raise CheckpointError(f"{path} was saved with another config than {path.parent / CONFIG} holds{changes}: an "
                              "edited config.json (undo the edit), or a save into this directory interrupted between "
                              "the two files (save the model again)")


def check_checksums(path: Path, tensors: dict, ours: dict, data: bool = True) -> None:
    """Refuse the weights file ``path`` whose ``tensors`` do not match the checksum table its metadata holds
    (``ours``: nibble's, or an export's): their names, and their checksums unless not ``data`` (meta tensors of the
    headers)."""
    checksums = ours["checksums"]
    added, removed = sorted(set(tensors) - set(checksums)), sorted(set(checksums) - set(tensors))
    if added or removed:  # named: the refusal said "tensor names do not match the checksum table", and no name
        changes = [f"{what} {len(names)} tensor(s) its checksum table {table}, e.g. {names[:5]}"
                   for what, names, table in (("holds", added, "does not list"), ("lacks", removed, "lists")) if names]
        raise CheckpointError(f"{path} {' and '.join(changes)}: the file was edited after it was saved; save the "
                              "model again")
    if not data:
        return
    typed = ours.get("checksum_version", 1) >= 2
    bad = [k for k, v in tensors.items() if tensor_sha256(v, typed) != checksums[k]]
    if bad:
        raise CheckpointError(f"{path}: checksum mismatch in {len(bad)} tensor(s), e.g. {bad[:3]}; the file is corrupt")


# ------------------------------------------------------------------------------ the folder a save writes

def checkpoint_dir(directory, model: nn.Module, tokenizer=None) -> Path:
    """The folder a save of ``model`` (with ``tokenizer``) writes, refused, before anything is written, where it cannot
    be one: "" wrote the checkpoint into the current folder, a file failed in pathlib's mkdir as a bare
    FileExistsError, and a folder holding a float model, the one ``model`` was loaded from above all, lost it
    (`check_replaceable`); and a ``tokenizer`` the save cannot write (`check_tokenizer`)."""
    check_tokenizer(tokenizer)
    if not str(directory).strip():
        raise ValueError("the directory to save to is empty: give the folder to write the checkpoint to")
    directory = Path(directory).expanduser()
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{directory} is a file: a checkpoint is a folder (its config.json, weights and tokenizer)")
    check_replaceable(directory, model.name_or_path)
    return directory


def check_tokenizer(tokenizer) -> None:
    """Refuse a ``tokenizer`` a save cannot write (it has no ``save_pretrained``): a path failed as "'str' object has
    no attribute 'save_pretrained'" once the weights were written, leaving the folder without its config.json."""
    if tokenizer is None or callable(getattr(tokenizer, "save_pretrained", None)):
        return
    given = f"{type(tokenizer).__name__} {tokenizer!r:.80}"
    load = (f": load it first, with transformers.AutoTokenizer.from_pretrained({os.fspath(tokenizer)!r})"
            if isinstance(tokenizer, (str, os.PathLike)) else "")
    raise TypeError(f"tokenizer must be a transformers tokenizer (what load_model and load_quantized return, written "
                    f"with its save_pretrained) or None, got the {given}{load}")


def check_replaceable(directory: Path, source=None) -> None:
    """Refuse to write a checkpoint into ``directory`` where a model lies that is not a quantized checkpoint: a save
    owns its folder (it replaces config.json and model.safetensors, and removes the other weight and tokenizer files),
    so a float model there was lost without a word, the one being quantized above all: ``source``, the folder it comes
    from (``model.name_or_path``, which every save and load of its quantized model keeps; `nibble quantize`'s
    --model), named as such. A quantized checkpoint there (nibble's, AutoAWQ's or GPTQ's) is one being written again,
    and so are the weights a nibble save interrupted before its config.json (written last) left."""
    if not directory.is_dir() or quantized_checkpoint(directory) or _interrupted_save(directory):
        return
    if not ((directory / CONFIG).exists() or any(directory.glob("*.safetensors"))):
        return  # nothing a save replaces (a folder of the user's other files, or of a GGUF, which it leaves)
    if source and Path(source).expanduser().resolve() == directory.resolve():  # through a link, or spelt otherwise
        raise ValueError(f"{directory} is the folder the model comes from ({source}): writing the checkpoint there "
                         "would replace its float weights; give another folder")
    raise ValueError(f"{directory} holds a model that is not a quantized checkpoint (its config.json or "
                     "*.safetensors): writing the checkpoint there would replace it; give another folder, or empty "
                     "this one")


def quantized_checkpoint(directory) -> bool:
    """Whether ``directory`` is a folder of 4-bit weights that load_quantized reads as they are (nibble's,
    AutoAWQ's or GPTQ's), not a float model to quantize."""
    config = Path(directory) / CONFIG if directory else None
    if not (config and config.exists()):
        return False
    if quantization_settings_files(config.parent):  # AutoGPTQ's or early AutoAWQ's settings, read by load_quantized
        return True
    raw = read_json_object(config)
    qc = raw.get("quantization_config")  # one that is not an object: refused by its loader
    nibble = isinstance(qc, dict) and str(qc.get("quant_method")).lower() == "nibble"
    return nibble or imported_checkpoint(config.parent, raw)


def imported_checkpoint(directory: Path, config: dict) -> bool:
    """Whether the checkpoint in ``directory`` of config.json ``config`` is an AutoAWQ / GPTQ one, which hf_import
    reads: its quantization_config says so, or, without one, the settings file its tool wrote beside it (AutoGPTQ
    before 0.5, early AutoAWQ)."""
    qc = config.get("quantization_config")
    if qc is None:
        return bool(quantization_settings_files(directory))
    return isinstance(qc, dict) and str(qc.get("quant_method")).lower() in QUANT_METHODS  # as read: "AWQ" too


def _interrupted_save(directory: Path) -> bool:
    """Whether ``directory`` holds what a nibble save interrupted before its config.json (written last) leaves:
    weights that carry nibble's metadata, with no config.json. The save run again owns them."""
    if (directory / CONFIG).exists():
        return False
    for file in directory.glob("*.safetensors"):
        try:
            with safe_open(str(file), "pt") as f:
                if METADATA not in (f.metadata() or {}):
                    return False
        except (SafetensorError, OSError):
            return False
    return True


def model_to_save(model) -> nn.Module:
    """The causal LM a save writes: torch.compile's wrapper taken off (its state_dict names every tensor
    "_orig_mod.", which no load places: the save went through and nothing read it back), and anything else than a
    *ForCausalLM refused (its decoder alone saved keys without "model.", an Engine failed on a missing method), as is
    a model holding meta tensors."""
    model = getattr(model, "_orig_mod", model)
    if not isinstance(model, nn.Module):
        raise TypeError(f"a save takes the model (a *ForCausalLM), got {type(model).__name__}")
    # a model wearing peft adapters wrote a checkpoint of wrapped layers that nothing could load back
    if any(hasattr(m, "lora_A") for m in model.modules()):
        raise ValueError("the model holds peft adapters: save the adapter with its save_pretrained, and the quantized "
                         "model without them (peft's unload()) with nibble.save_quantized")
    check_architecture(model)
    if any(t.is_meta for t in model.state_dict().values()):  # copying them out failed as "no data!", after the mkdir
        raise ValueError("the model holds tensors on the meta device (quantized_structure's model, or one moved to "
                         "'meta'), which hold no values to save: load the checkpoint with nibble.load_quantized and "
                         "save that")
    return model
